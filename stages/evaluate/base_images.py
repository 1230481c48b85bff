"""evaluate (one LoRA and --all-checkpoints): the base column's images (LoRA off) kept in OUT/base-images/ and
reused by a rerun whose every input of them is unchanged. Only the LoRA (or best and last) can change between
reruns (a retrained LoRA, a training adding checkpoints), while regenerating the base costs as much as a column.

Each image is kept under its own inputs: the group key (`group_key`) holds everything the base images are made
from but which samples are pictured and the extra prompts: every file of the model (text encoder, processor and
scheduler too), the text / vae tables read, by content (the stored features; `checkpoints.read_tables`), every
hashed evaluate setting but `num_samples` and the extra prompts' own (seed, steps, true CFG, dtype, attention
backend, quantisation; not the LoRA's scale, nor on_damaged: a damaged sample skipped changes the samples read,
which the tables' content and the sample keys name), the device (and the GPU's name), the versions of the libraries
that compute them and the source of this project's packages that do (`SOURCE_PACKAGES`); within a group an image
is named by its item (`item_ids`): the val sample's key, or a hash of the extra prompt's own inputs (its settings,
its control images' bytes, the negative prompt as read). A sample's picture depends on no other sample (the same
seed for every one, one denoising run each) nor on the extra prompts or the negative prompt (the stored empty
prompt is its negative), and an extra prompt's on no other row: more or fewer `num_samples`, or another extra
prompt added, changed or moved, generate only the images not kept yet. Any other change: another group,
regenerated. The PNGs are checked against their recorded sha256 on reuse (a damaged or missing one: regenerated).
An index recorded before (one group over every extra prompt, `group_spellings`; one key over the set of samples
pictured, `base_key`) is read and recorded again per item, its images reused."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from PIL import Image

FOLDER = "base-images"
INDEX = "index.json"
#: this project's packages whose code turns those inputs into the base images: the source of every module in them
#: enters the key (an upgrade changing how they generate regenerates them). Whole packages, not a list of modules:
#: generation runs through many (multires' forward and packing, the attention backend, quantisation, the stored
#: features' decoding, the patch size), and a hand-kept list missed those. store/ is left out: the bytes it reads
#: are checked against their CRC32C and named by the table versions in the key.
SOURCE_PACKAGES = ("models", "features", "schemas", "stages/evaluate")
SOURCE_ROOT = Path(__file__).resolve().parents[2]


def base_key(cfg, features: dict, sample_keys: list[str], losses_only: bool = False, as_set: bool = False) -> str:
    """Hash of every input of the base's held-out losses over `sample_keys` (`losses_only`: single-LoRA evaluate's
    cache, `base_losses`), or of a set of base images as an index recorded before per-item keys named them.
    features: `checkpoints.loss_fingerprint`'s settings (the store's text / vae tables read, the model's
    fingerprint); sample_keys: the val samples, in order. `losses_only`: only the settings the losses depend on
    (`checkpoints.LOSS_SETTINGS`), none that change only the pictures (seed, num_samples, steps, guidance, the
    extra prompts), which made a rerun with more pictures recompute them. `as_set`: the evaluate settings as set
    (`schemas.lineage.hashed_settings`): the key of caches recorded before on_damaged and an unread negative prompt
    were hashed as their defaults (`spellings`)."""
    return _digest({**_inputs(cfg, features, losses_only, as_set), "samples": list(sample_keys)})


#: the settings only the extra prompts' images are made from (`schemas.config`: the val samples' negative is their
#: stored empty prompt): in each extra prompt's item (`item_ids`), not the group, so adding or changing one extra
#: prompt (or the negative) regenerates that prompt's image alone, no val sample's nor another prompt's
EXTRA_SETTINGS = ("extra_prompts", "negative_prompt")


def group_key(cfg, features: dict, as_set: bool = False) -> str:
    """Hash of every input of the base images but which val samples are pictured (`num_samples`) and the extra
    prompts' own (`EXTRA_SETTINGS`, their images' bytes): each image is kept under it and its item (`item_ids`).
    As `base_key` of the images, the sample list, `num_samples` and those out."""
    inputs = _inputs(cfg, features, False, as_set, extras=False)
    for name in ("num_samples", *EXTRA_SETTINGS):
        inputs["settings"].pop(name, None)
    return _digest({**inputs, "per_item": 2})  # never equal to a whole-set key nor an earlier group's


def _whole_extras_group_key(cfg, features: dict, as_set: bool) -> str:
    """The group key of the release before: every extra prompt (and its images' bytes) and the negative prompt in
    it, its extra prompts' items named by their place (`extra:<i>`). Kept as it was: an index recorded under it
    is still recognised (`group_spellings`)."""
    inputs = _inputs(cfg, features, False, as_set)
    inputs["settings"].pop("num_samples", None)
    return _digest({**inputs, "per_item": 1})


def group_spellings(cfg, features: list[dict]) -> list[str]:
    """`group_key` of `features` (the present spelling first, then its earlier ones: `checkpoints.earlier_settings`),
    then the group keys an index recorded by the release before may be under (`_whole_extras_group_key`), each
    with the evaluate settings as hashed now and as set, once each."""
    keys = (key(cfg, f, as_set) for key in (group_key, _whole_extras_group_key) for as_set in (False, True)
            for f in features)
    return list(dict.fromkeys(keys))


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


def _inputs(cfg, features: dict, losses_only: bool, as_set: bool, extras: bool = True) -> dict:
    import diffusers
    import peft
    import torch
    import transformers

    from schemas.lineage import hashed_settings

    from stages.evaluate.checkpoints import LOSS_SETTINGS

    extras = [[_file_sha256(p) for p in e.images] for e in cfg.extra_prompts] if extras and not losses_only else []
    settings = {k: v for k, v in hashed_settings(cfg, as_set=as_set).items() if k != "lora_scale"}
    if losses_only:
        settings = {k: v for k, v in settings.items() if k in LOSS_SETTINGS}
    # the LoRA's scale is no input of the base images (LoRA off): another scale reuses them
    features = {**features, "evaluate": {k: v for k, v in features.get("evaluate", {}).items() if k != "lora_scale"}}
    return {
        "features": features,
        "settings": settings,
        "device": [str(cfg.device), _device_names(cfg.device)],
        "extra_image_bytes": extras,
        "libraries": {m.__name__: m.__version__ for m in (torch, diffusers, transformers, peft)},
        "sources": _sources_digest(),
    }


def _digest(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


def spellings(cfg, features: list[dict], sample_keys: list[str], losses_only: bool = False) -> list[str]:
    """`base_key` of `features` (the present spelling first, then its earlier ones: `checkpoints.earlier_settings`),
    each with the evaluate settings as hashed now and as set, once each: the present key, then those a cache
    recorded before may be under."""
    keys = (base_key(cfg, f, sample_keys, losses_only, as_set) for as_set in (False, True) for f in features)
    return list(dict.fromkeys(keys))


def extra_prompt_bytes(cfg) -> list[dict]:
    """sha256 of each extra prompt's control images and target (None: none set, or unreadable): what a report's
    up-to-date check compares, as the config holds only their paths (a file replaced there is another report)."""
    return [{"images": [_file_sha256(p) for p in e.images], "target": e.target and _file_sha256(e.target)}
            for e in cfg.extra_prompts]


def _file_sha256(path) -> str | None:
    """None for a file that cannot be read: its generation then stops with the decoder's one line naming it."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def _sources_digest() -> str:
    """sha256 over the path and bytes of every .py file of `SOURCE_PACKAGES` (~100 small files: milliseconds)."""
    h = hashlib.sha256()
    for package in SOURCE_PACKAGES:
        for f in sorted((SOURCE_ROOT / package).rglob("*.py")):
            h.update(f"{f.relative_to(SOURCE_ROOT).as_posix()}\0".encode())
            h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def _device_names(device) -> list[str]:
    """The accelerators' names (another GPU model rounds otherwise); "" for the CPU."""
    import torch

    names = []
    for d in device if isinstance(device, list) else [device]:
        d = torch.device(d)
        names.append(torch.cuda.get_device_name(d) if d.type == "cuda" and torch.cuda.is_available() else "")
    return names


def read(folder: Path, groups: list[str], ids: list[str], legacy=None) -> list[Image.Image | None]:
    """Each item's image (`item_ids`) recorded under the group key `groups[0]` or one the release before recorded
    (`groups[1:]`: `group_spellings`), None for one not recorded there or whose file is missing or damaged
    (regenerated alone). `legacy(n_files)`: the whole-set keys (`base_key`) an index recorded before per-item keys
    may hold, as (its spellings, the item ids of its files in order) pairs. An index found under an earlier group
    or key is recorded again per item under `groups[0]` (the next rerun finds it so; nothing regenerated on an
    upgrade)."""
    try:
        index = json.loads((folder / INDEX).read_text())
        entries = _entries(index, groups, ids, legacy)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return [None] * len(ids)
    if entries is None:
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
    if index.get("group") != groups[0]:
        from store.format import atomic_write_bytes

        try:
            atomic_write_bytes(folder / INDEX, _index(groups[0], entries))
        except OSError:
            pass  # read-only: served now, recognised again next time
    return images


def _entries(index: dict, groups: list[str], ids: list[str], legacy) -> dict | None:
    """The index's item -> [file, sha256] when it is of these inputs, else None; the extra prompts of a group
    recorded by the release before (named by their place, `extra:<i>`: its group held every extra prompt, so
    these are the present ones in their order) by their present item (`extra_id`: a hash, never a place)."""
    if "group" in index:
        if index["group"] not in groups:
            return None
        place = {f"extra:{n}": item for n, item in enumerate(i for i in ids if i.startswith("extra:"))}
        return {place.get(k, k): list(v) for k, v in index["items"].items()}
    files = index["files"]  # an index recorded before per-item keys: one key over the samples pictured
    for keys, items in (legacy(len(files)) if legacy else ()):
        if index["key"] in keys and len(items) == len(files):
            return {item: list(f) for item, f in zip(items, files)}
    return None


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

    with writing("the base images of the evaluate report", folder):  # full disk / read-only: one line
        folder.mkdir(parents=True, exist_ok=True)
        try:
            index = json.loads((folder / INDEX).read_text())
            entries = {k: list(v) for k, v in index["items"].items()} if index.get("group") == group else {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            entries = {}  # none, another group's, an earlier format's or damaged: this group starts afresh
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
