"""evaluate (one LoRA and --all-checkpoints): the base column's images (LoRA off) kept in OUT/base-images/ and
reused by a rerun whose every input of them is unchanged. Only the LoRA (or best and last) can change between
reruns (a retrained LoRA, a training adding checkpoints), while regenerating the base costs as much as a column.

Each image is kept under its own inputs: the group key (`group_key`) holds everything the base images are made
from but which samples are pictured and the extra prompts: every file of the model (text encoder, processor and
scheduler too), the text / vae tables read, by content (the stored features; `loss_fingerprint.read_tables`), every
hashed evaluate setting but `num_samples` and the extra prompts' own (seed, steps, true CFG, dtype, attention
backend, quantisation; not the LoRA's scale, nor on_damaged: a damaged sample skipped changes the samples read,
which the tables' content and the sample keys name, nor the held-out loss's seeds / σ grid, `GRID_SETTINGS`),
the device (and the GPU's name), the versions of the libraries
that compute them and the source of this project's packages that do (`SOURCE_PACKAGES`); within a group an image
is named by its item (`item_ids`): the val sample's key, or a hash of the extra prompt's own inputs (its settings,
its control images' bytes, the negative prompt as read). A sample's picture depends on no other sample (the same
seed for every one, one denoising run each) nor on the extra prompts or the negative prompt (the stored empty
prompt is its negative), and an extra prompt's on no other row: more or fewer `num_samples`, or another extra
prompt added, changed or moved, generate only the images not kept yet. Any other change: another group,
regenerated. The PNGs are checked against their recorded sha256 on reuse (a damaged or missing one: regenerated).
Single-LoRA evaluate keeps its LoRA column the same way in OUT/lora-images/ (`lora_group_key`: these inputs, the
LoRA's bytes and scale), so a rerun for the loss grid alone generates no image; --all-checkpoints its best's there
and its last's in OUT/last-images/ (`checkpoint_report.generated_rows`).

Any change to the source of models/, features/, schemas/ or stages/evaluate/ (`SOURCE_PACKAGES`), or to the
libraries' versions, regenerates the base images (and the base losses, `base_losses`, keyed the same way). There
is no fallback for an index whose keys were spelled otherwise: a change to their spelling is itself a change to
that source, so an index recorded before it holds another source digest and no earlier spelling could match."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from PIL import Image

from schemas.file_digest import file_sha256
from schemas.lineage import settings_digest
from store.loss_array import GRID

FOLDER = "base-images"
LORA_FOLDER = "lora-images"  # single-LoRA evaluate's LoRA column (--all-checkpoints: the best's), kept alike
LAST_FOLDER = "last-images"  # --all-checkpoints: the last checkpoint's column, kept alike (`lora_group_key`)
INDEX = "index.json"
#: this project's packages whose code turns those inputs into the base images: the source of every module in them
#: enters the key (an upgrade changing how they generate regenerates them). Whole packages, not a list of modules:
#: generation runs through many (multires' forward and packing, the attention backend, quantisation, the stored
#: features' decoding, the patch size), and a hand-kept list missed those. store/ is left out: the bytes it reads
#: are checked against their CRC32C and named by the table versions in the key.
SOURCE_PACKAGES = ("models", "features", "schemas", "stages/evaluate")
SOURCE_ROOT = Path(__file__).resolve().parents[2]


def losses_key(cfg, features: dict, sample_keys: list[str], ranks_machines: list[dict] = ()) -> str:
    """Hash of every input of the base's held-out losses over `sample_keys` (single-LoRA evaluate's cache,
    `base_losses`). features: `loss_fingerprint.loss_fingerprint`'s settings (the store's text / vae tables read, the
    model's fingerprint); sample_keys: the val samples, in order. Of the evaluate settings, only those the losses
    depend on (`loss_fingerprint.LOSS_SETTINGS`), none that change only the pictures (seed, num_samples, steps,
    guidance, the extra prompts), which made a rerun with more pictures recompute them. `ranks_machines`: a
    launched run's every rank's device and libraries (`loss_groups.on_every_rank`; each computes its share of the
    rows): in the key where one is not this process's (rank 0's), which the key alone named; ranks alike (and one
    process) keep the one-process key, so their files serve each other and those written before stay readable."""
    from stages.evaluate.loss_fingerprint import LOSS_SETTINGS

    # max_loss_samples as set is no input: `features` spell it as the samples it reads, `sample_keys` name them
    # (256 then null on a split 256 covered computed the same base losses again)
    inputs = _inputs(cfg, features, lambda k: k in LOSS_SETTINGS and k != "max_loss_samples")
    own = {"device": inputs["device"], "libraries": inputs["libraries"]}
    ranks = {"computed_on": list(ranks_machines)} if any(m != own for m in ranks_machines) else {}
    return _digest({**inputs, **ranks, "samples": list(sample_keys)})


#: the settings only the extra prompts' images are made from (`schemas.config`: the val samples' negative is their
#: stored empty prompt): in each extra prompt's item (`item_ids`), not the group, so adding or changing one extra
#: prompt (or the negative) regenerates that prompt's image alone, no val sample's nor another prompt's
EXTRA_SETTINGS = ("extra_prompts", "negative_prompt")


#: the held-out loss's seed / σ grid (`store.loss_array.GRID`): no input of any picture (generation draws its own
#: noise from `seed`), so another grid keeps the images (a single-LoRA report regenerated both columns for it)
GRID_SETTINGS = GRID


def group_key(cfg, features: dict) -> str:
    """Hash of every input of the base images but which val samples are pictured (`num_samples`), the extra
    prompts' own (`EXTRA_SETTINGS`, their images' bytes) and the loss grid (`GRID_SETTINGS`): each image is kept
    under it and its item (`item_ids`)."""
    features = {**features, "evaluate": {k: v for k, v in features.get("evaluate", {}).items()
                                         if k not in GRID_SETTINGS}}
    return _digest(_inputs(cfg, features, lambda k: k not in ("num_samples", *EXTRA_SETTINGS, *GRID_SETTINGS)))


def lora_group_key(cfg, features: dict, lora_sha256: str) -> str:
    """The key of single-LoRA evaluate's LoRA images (kept in OUT/`LORA_FOLDER`, the same mechanism): the base
    images' inputs, the LoRA's bytes and its scale."""
    return _digest({"base": group_key(cfg, features), "lora_sha256": lora_sha256, "lora_scale": cfg.lora_scale})


def item_ids(cfg, sample_keys: list[str]) -> list[str]:
    """The name of each base image within its group: the pictured val samples' keys, then each extra prompt's
    inputs' hash (`extra_id`)."""
    return [f"sample:{k}" for k in sample_keys] + [extra_id(cfg, e) for e in cfg.extra_prompts]


def extra_id(cfg, extra) -> str:
    """An extra prompt's item: a hash of what its image is made from beside the group's inputs: its hashed settings
    (prompt, size; any added later too) but the image paths and the target (no input of the image: PSNR/SSIM are
    scored afresh), its control images' bytes, and the negative prompt as read (`hashed_settings`: its default
    without true CFG). Not its place nor the other prompts: one added, removed or moved regenerates no other."""
    from schemas.lineage import hashed_settings

    own = {k: v for k, v in hashed_settings(extra).items() if k not in ("images", "target")}
    inputs = {"extra": own, "image_bytes": [_file_sha256(p) for p in extra.images],
              "negative_prompt": hashed_settings(cfg)["negative_prompt"]}
    return "extra:" + _digest(inputs)


def _inputs(cfg, features: dict, hashed) -> dict:
    """What both keys hold: the features read, the hashed evaluate settings named by `hashed` (never the LoRA's
    scale), the device, the libraries' versions and this project's source (`machine`)."""
    from schemas.lineage import hashed_settings

    # the LoRA's scale is no input of the base images nor losses (LoRA off): another scale reuses them
    settings = {k: v for k, v in hashed_settings(cfg).items() if k != "lora_scale" and hashed(k)}
    features = {**features, "evaluate": {k: v for k, v in features.get("evaluate", {}).items() if k != "lora_scale"}}
    return {"features": features, "settings": settings, **machine(cfg)}


def machine(cfg) -> dict:
    """What computes the numbers beside the settings: the device, the libraries' versions and this project's
    source (another GPU model or library rounds otherwise)."""
    import diffusers
    import peft
    import torch
    import transformers

    from models.precision import resolve_auto

    device = resolve_auto(cfg.device)  # a resolved config's already; `auto` keyed as what it runs on, not its spelling
    return {
        "device": [str(device), _device_names(device)],
        "libraries": {m.__name__: m.__version__ for m in (torch, diffusers, transformers, peft)},
        "sources": _sources_digest(),
    }


def _digest(inputs: dict) -> str:
    return settings_digest(inputs, default=str)


def extra_prompt_bytes(cfg) -> list[dict]:
    """sha256 of each extra prompt's control images and target (None: none set, or unreadable): what a report's
    up-to-date check compares, as the config holds only their paths (a file replaced there is another report)."""
    return [{"images": [_file_sha256(p) for p in e.images], "target": e.target and _file_sha256(e.target)}
            for e in cfg.extra_prompts]


def _file_sha256(path) -> str | None:
    """None for a file that cannot be read: its generation then stops with the decoder's one line naming it."""
    try:
        return file_sha256(path)
    except OSError:
        return None


def _sources_digest() -> str:
    """sha256 over the path and bytes of every .py file of `SOURCE_PACKAGES` (~100 small files: milliseconds)."""
    h = hashlib.sha256()
    for package in SOURCE_PACKAGES:
        for f in sorted((SOURCE_ROOT / package).rglob("*.py")):
            h.update(f"{f.relative_to(SOURCE_ROOT).as_posix()}\0".encode())
            h.update(bytes.fromhex(file_sha256(f)))
    return h.hexdigest()


def _device_names(device) -> list[str]:
    """The accelerators' names (another GPU model rounds otherwise); "" for the CPU."""
    import torch

    names = []
    for d in device if isinstance(device, list) else [device]:
        d = torch.device(d)
        names.append(torch.cuda.get_device_name(d) if d.type == "cuda" and torch.cuda.is_available() else "")
    return names


def read(folder: Path, group: str, ids: list[str]) -> list[Image.Image | None]:
    """Each item's image (`item_ids`) recorded under the group key `group`, None for one not recorded there or
    whose file is missing or damaged (regenerated alone). An index of another group (another input, or recorded
    by another release: another source digest) serves nothing."""
    try:
        index = json.loads((folder / INDEX).read_text())
        if index.get("group") != group:
            return [None] * len(ids)
        entries = dict(index["items"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return [None] * len(ids)
    images: list[Image.Image | None] = []
    for item in ids:
        images.append(None)
        try:
            name, sha = entries[item]
            data = (folder / name).read_bytes()
            if hashlib.sha256(data).hexdigest() == sha:
                images[-1] = _png(data)
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return images


def _index(group: str, entries: dict) -> bytes:
    return json.dumps({"group": group, "items": entries}, indent=1, sort_keys=True).encode()


def write(folder: Path, group: str, images: dict[str, Image.Image]) -> None:
    """The images (item -> image) as PNGs named by their sha256 (lossless: the reused image is the generated one),
    then the index naming them, kept beside the group's other items (a later rerun picturing fewer or more samples
    finds them), then the PNGs no item names any more. Index written last and atomically: a kill leaves the
    earlier index whole (its files untouched), a new PNG named by none is removed by the next write."""
    import io

    from store.format import atomic_write_bytes
    from store.io_errors import writing

    with writing(f"the kept images ({folder.name}) of the evaluate report", folder):  # full disk / read-only: one line
        folder.mkdir(parents=True, exist_ok=True)
        try:
            index = json.loads((folder / INDEX).read_text())
            entries = {k: list(v) for k, v in index["items"].items()} if index.get("group") == group else {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            entries = {}  # none, another group's (another release's too) or damaged: this group starts afresh
        for item, img in images.items():
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            sha = hashlib.sha256(buf.getvalue()).hexdigest()
            atomic_write_bytes(folder / f"{sha}.png", buf.getvalue())
            entries[item] = [f"{sha}.png", sha]
        atomic_write_bytes(folder / INDEX, _index(group, entries))
        named = {name for name, _ in entries.values()}
        for old in folder.glob("*.png"):  # another group's, or an earlier index's
            if old.name not in named:
                old.unlink(missing_ok=True)


def _png(data: bytes) -> Image.Image:
    import io

    img = Image.open(io.BytesIO(data))
    img.load()
    return img
