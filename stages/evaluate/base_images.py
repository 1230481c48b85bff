"""evaluate (one LoRA and --all-checkpoints): the base column's images (LoRA off) kept in OUT/base-images/ and
reused by a rerun whose every input of them is unchanged. Only the LoRA (or best and last) can change between
reruns (a retrained LoRA, a training adding checkpoints), while regenerating the base costs as much as a column.

The key (`base_key`) holds everything the base images are made from: every file of the model (text encoder,
processor and scheduler too), the text / vae tables read, by content (the stored features; `checkpoints.read_tables`), the picked val
samples, every hashed evaluate setting (seed, steps, true CFG, negative prompt when extra prompts read it, dtype,
attention backend, quantisation, extra prompts with their sizes; not the LoRA's scale, nor on_damaged: a damaged
sample skipped changes the samples read, which are in the key) and the bytes of each extra prompt's image files, the device (and
the GPU's name), the versions of the libraries that compute them and the source of this project's packages
that do (`SOURCE_PACKAGES`). Any change: regenerated. The PNGs are checked against their
recorded sha256 on reuse (a damaged or missing one: regenerated)."""

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
    """Hash of every input of the base images. features: `checkpoints.loss_fingerprint`'s settings (the store's
    text / vae tables read, the model's fingerprint); sample_keys: the val samples pictured, in order.
    `losses_only`: of the base's held-out losses instead (single-LoRA evaluate's cache, `base_losses`): only the
    settings their numbers depend on (`checkpoints.LOSS_SETTINGS`), none that change only the pictures (seed,
    num_samples, steps, guidance, the extra prompts), which made a rerun with more pictures recompute them.
    `as_set`: the evaluate settings as set (`schemas.lineage.hashed_settings`): the key of caches recorded before
    on_damaged and an unread negative prompt were hashed as their defaults (`spellings`)."""
    import diffusers
    import peft
    import torch
    import transformers

    from schemas.lineage import hashed_settings

    from stages.evaluate.checkpoints import LOSS_SETTINGS

    extras = [] if losses_only else [[_file_sha256(p) for p in e.images] for e in cfg.extra_prompts]
    settings = {k: v for k, v in hashed_settings(cfg, as_set=as_set).items() if k != "lora_scale"}
    if losses_only:
        settings = {k: v for k, v in settings.items() if k in LOSS_SETTINGS}
    # the LoRA's scale is no input of the base images (LoRA off): another scale reuses them
    features = {**features, "evaluate": {k: v for k, v in features.get("evaluate", {}).items() if k != "lora_scale"}}
    inputs = {
        "features": features,
        "samples": list(sample_keys),
        "settings": settings,
        "device": [str(cfg.device), _device_names(cfg.device)],
        "extra_image_bytes": extras,
        "libraries": {m.__name__: m.__version__ for m in (torch, diffusers, transformers, peft)},
        "sources": _sources_digest(),
    }
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


def read(folder: Path, key: str, n: int, earlier: list[str] = ()) -> list[Image.Image] | None:
    """The n base images recorded under `key`, or None (none recorded, another key, a file missing or damaged).
    `earlier`: the same inputs' keys as spelled before (the tables named by version ids, not content): images
    recorded under one are these, and their index is recorded under `key` (the next rerun finds them so)."""
    try:
        index = json.loads((folder / INDEX).read_text())
        if index.get("key") not in (key, *earlier) or len(index.get("files", [])) != n:
            return None
        images = []
        for name, sha in index["files"]:
            data = (folder / name).read_bytes()
            if hashlib.sha256(data).hexdigest() != sha:
                return None
            images.append(_png(data))
        if index["key"] != key:
            from store.format import atomic_write_bytes

            atomic_write_bytes(folder / INDEX, json.dumps({**index, "key": key}, indent=1).encode())
        return images
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write(folder: Path, key: str, images: list[Image.Image]) -> None:
    """The images as PNGs (lossless: the reused image is the generated one), then the index naming them and
    their sha256 (written last: a killed write leaves no index of the new key)."""
    import io

    from store.format import atomic_write_bytes
    from store.io_errors import writing

    with writing("the base images of the evaluate report", folder):  # full disk / read-only: one line
        folder.mkdir(parents=True, exist_ok=True)
        (folder / INDEX).unlink(missing_ok=True)
        files = []
        for i, img in enumerate(images):
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            name = f"{i:05d}.png"
            atomic_write_bytes(folder / name, buf.getvalue())
            files.append((name, hashlib.sha256(buf.getvalue()).hexdigest()))
        for old in folder.glob("*.png"):  # a longer earlier list
            if old.name not in {name for name, _ in files}:
                old.unlink(missing_ok=True)
        atomic_write_bytes(folder / INDEX, json.dumps({"key": key, "files": files}, indent=1).encode())


def _png(data: bytes) -> Image.Image:
    import io

    img = Image.open(io.BytesIO(data))
    img.load()
    return img
