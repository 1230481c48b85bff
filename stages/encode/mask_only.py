"""encode-vae: a sample whose edit mask alone changed keeps its stored latents; only its `mask_weight` (and the
mask columns) is computed from the mask now. Without this a mask edit sent the sample's target and every control
through the VAE again for the same latents.

Same latents: an earlier vae row under the same key (the key hashes the target and control bytes and the caption,
never the mask) of a feature lineage carried by key (the render settings the VAE reads, the VAE files, the code:
`store.reuse.reusable`, fixes included; a row a fix changed the mask of alone, `Fixes.mask_only`, is taken here,
never carried whole). Under those the same source bytes render the same pixels, whatever the
mask is (resize-bucket fits the mask onto the target, never the target to the mask). The sample is written as a
fresh encode writes it - the same tensors in the same order, the same meta - from the stored latents' checked
bytes and the `images` mask now. Anything a fresh encode would refuse or could read otherwise (a mask that does not
decode or is not the target's size, an `images` or stored sample found damaged, a stored row of other tensors)
is left to the full encode, which says it."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING:
    from stages.encode.job import EncodeJob


def recompute_masks(job: EncodeJob, keys: list[str], found: dict[int, pa.Table]) -> set[str]:
    """Write each key of `keys` (not carried whole: its mask changed) from its stored latents and its mask now;
    returns the keys so written. `found`: `store.reuse.reusable`'s rows for this job's lineages and fixes over
    `keys` and more (each key in one version at most); those of `keys` are rewritten."""
    if not keys or not job.images.has_column("mask_sha256"):
        return set()
    wanted, done = pa.array(sorted(keys), pa.string()), set()
    for version, rows in found.items():
        rows = rows.filter(pc.is_in(rows.column("key"), value_set=wanted))
        if rows.num_rows:
            done |= _rewrite(job, version, rows.column("key").to_pylist())
    return done


# keys whose `images` files are held at once: `files_of` reads every picture of a sample (checked whole), and a
# dataset whose masks were all redone would hold a rank's whole share of targets and controls in memory
STEP = 64


def _rewrite(job: EncodeJob, version: int, keys: list[str]) -> set[str]:
    """The `keys` stored in `version` written with the mask weights of the `images` mask now (see the module): a
    completion (`output.completing`: the stored latents carried, the mask columns computed), STEP at a time."""
    from stages.encode.output import completing

    return completing(job, version, keys, STEP, lambda reader, part: _rewrite_some(job, reader, part))


def _rewrite_some(job: EncodeJob, reader: Any, keys: list[str]) -> set[str]:
    """`_rewrite` of a few keys, their `images` files read together."""
    from store.integrity import DamagedData

    damaged: dict[str, str] = {}
    files = job.images.files_of(keys, damaged)
    written = set()
    for key in keys:
        if key in damaged or (weight := _weight_now(files.pop(key, None) or {})) is False:
            continue
        try:
            stored = reader.get(key)
        except DamagedData:
            continue
        if _write(job, key, stored, weight):
            written.add(key)
    return written


def _weight_now(files: dict[str, bytes]) -> Any:
    """The sample's mask weights from its `images` files as encode-vae computes them (None: no mask); False where
    a fresh encode would refuse the mask or read a picture otherwise (left to it)."""
    from PIL import Image

    from features.pictures import open_png
    from stages.encode.vae import mask_weight

    if "target.png" not in files:
        return False
    if "mask.png" not in files:
        return None
    try:
        with Image.open(io.BytesIO(files["target.png"])) as target:
            size = target.size
        mask = open_png(files["mask.png"], mode="L")
    except (OSError, ValueError):
        return False
    if mask.size != size:
        return False
    return mask_weight(mask, size[1], size[0])


def _write(job: EncodeJob, key: str, stored: dict[str, Any], weight: Any) -> bool:
    """Add the sample as `stages.encode.vae._write` adds a fresh one; False (nothing added) where the stored row
    is not one of its latents."""
    from stages.encode.vae import LATENTS_COLUMN, latents_sha256

    tensors, meta = stored["tensors"], stored["meta"]
    names = ["target"] + [f"control_{i}" for i in range(int(meta.get("num_controls", -1)))]
    if set(tensors) - {"mask_weight"} != set(names):
        return False
    now = job.images.cells(key, ("split", "img_shapes", "mask_sha256"))
    out = {n: tensors[n].contiguous() for n in names}
    if weight is not None:
        out["mask_weight"] = weight
    job.writer.add(key, tensors=out, meta={
        "split": now.get("split", "train"),
        "img_shapes": now["img_shapes"],
        "num_controls": len(names) - 1,
        "latent_shapes": [list(out[n].shape) for n in names],
        "has_mask": weight is not None,
        "mask_sha256": now.get("mask_sha256") or "",
        LATENTS_COLUMN: latents_sha256(out, names),
    })
    return True
