"""One sample rendered (in a render worker: stages/resize/render_pool.py): every image decoded and sanitised, the
target, each control's views and the mask resized to their buckets and encoded as PNG, with the row's columns and
the notes of what was converted."""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import Any

from PIL import Image

from features.decode import Decoded, ImageRejected, decode_image, decode_keeping_alpha, decode_mask, oriented_as
from schemas.config import ResizeConfig
from schemas.errors import Rejected
from schemas.img_shapes import img_shapes_from_pixels
from stages.resize.bucketing import BucketRule, bucket_size, crop_box_for_aspect, same_aspect
from stages.resize.caption_text import CONTROLS_REMOVED, had_controls
from stages.resize.images_table import mask_hash
from stages.resize.sources import SourceSample
from stages.resize.split_rule import pictures_id, split_for


PNG_COMPRESS_LEVEL = 3  # lossless either way; 3 is ~3x faster than the default 6 for a few % more bytes


def render_item(item: tuple[SourceSample, str, str], rc: ResizeConfig,
                rules: dict[str, BucketRule]) -> Rendered | Rejected:
    """`render` of a (sample, key, caption) item: what the render workers are handed, by name."""
    rec, key, caption = item
    return render(rec, key, caption, rc, rules)


def bucket_rules(rc: ResizeConfig) -> dict[str, BucketRule]:
    """The bucket rule of the target and of each control view (vae, vl) under `rc`."""
    def rule(area: int) -> BucketRule:
        return BucketRule(area=area, multiple=rc.multiple, max_aspect=rc.max_aspect, min_side=rc.min_side)

    return {"target": rule(rc.target_area), "vae": rule(rc.control_vae_area), "vl": rule(rc.control_vl_area)}


@dataclass
class Rendered:
    files: dict[str, bytes]
    meta: dict[str, Any]
    notes: list[str]


def render(rec: SourceSample, key: str, caption: str, rc: ResizeConfig, rules: dict[str, BucketRule]) -> Rendered | Rejected:
    """Decode every image of the sample, resize each view to its bucket, encode PNGs (runs in a worker)."""
    try:
        return _render(rec, key, caption, rc, rules)
    except Rejected as r:
        return r


def _render(rec: SourceSample, key: str, caption: str, rc: ResizeConfig, rules: dict[str, BucketRule]) -> Rendered:
    assert rec.target is not None
    notes: list[str] = [CONTROLS_REMOVED] if had_controls(rec.caption) else []
    decoded = _decode(rec.target, "target", rec, key, 0, rc, notes)
    target = decoded.image
    tw, th = target.size
    bh, bw = bucket_size(tw, th, rules["target"])
    files = {"target.png": _png(_fit(target, bh, bw, rc.max_aspect, Image.Resampling.LANCZOS))}
    _note_upscale(notes, "target", target, bh, bw, rc.max_aspect)
    _note_crop(notes, "target", target, rc.max_aspect)
    vae_sizes, vl_sizes = [], []
    for i, data in enumerate(rec.controls):
        ctrl = _decode(data, f"control {i}", rec, key, 1 + i, rc, notes).image
        cw, ch = ctrl.size
        views = (("vae", vae_sizes, f"control_{i}.png"), ("vl", vl_sizes, f"control_{i}_vl.png"))
        for view, sizes, name in views if rc.vl_views else views[:1]:  # 2.1 reads no VL view
            h, w = bucket_size(cw, ch, rules[view])
            files[name] = _png(_fit(ctrl, h, w, rc.max_aspect, Image.Resampling.LANCZOS))
            sizes.append([h, w])
            if view == "vae":
                _note_upscale(notes, "control", ctrl, h, w, rc.max_aspect)
                _note_crop(notes, "control", ctrl, rc.max_aspect)
    if rec.mask is not None:
        try:
            dm = decode_mask(rec.mask, rc.max_image_pixels, rc.max_image_frames)
        except ImageRejected as e:
            raise Rejected("bad-mask", f"mask{_where(rec, 1 + len(rec.controls))}: {e}", key=key) from None
        notes.extend(dm.notes)  # its own conversions (grayscale, 16 bits, EXIF), as `_decode` keeps the images'
        mask = dm.image
        if _drawn_on_stored_pixels(mask, dm.orientation, target, decoded.orientation):
            mask = oriented_as(mask, decoded.orientation)
            notes.append(f"mask turned as its target (EXIF orientation {decoded.orientation})")
        if mask.size != target.size:  # resized with its target: first onto the target's pixel grid
            _check_mask_aspect(mask, target, rec, key)
            mask = mask.resize(target.size, Image.Resampling.BILINEAR)
            notes.append("mask resized to its target")
        # bilinear keeps partial coverage at the edges as grey (a fractional weight), never rings like Lanczos
        files["mask.png"] = _png(_fit(mask, bh, bw, rc.max_aspect, Image.Resampling.BILINEAR))
    hashes = [hashlib.sha256(b).hexdigest() for b in (rec.target, *rec.controls)]
    meta = {
        "caption": caption,
        "split": split_for(key, pictures_id(hashes), rc.val_fraction, rc.split_by),
        "img_shapes": [list(img_shapes_from_pixels(bh, bw))] + [list(img_shapes_from_pixels(h, w)) for h, w in vae_sizes],
        "bucket": [bh, bw],
        "control_sizes": vae_sizes,
        "control_vl_sizes": vl_sizes,
        "num_controls": len(rec.controls),
        "source": rec.source,
        "source_hashes": hashes,
        "source_size": [th, tw],
        "has_mask": rec.mask is not None,
        "mask_sha256": mask_hash(rec.mask),
        "conversions": sorted(set(notes)),
    }
    return Rendered(files, meta, notes)


UPSCALE_NOTED = 4  # per side: a thumbnail or icon stretched this much carries little detail; the summary says so


def _note_upscale(notes: list[str], what: str, im: Image.Image, h: int, w: int, max_aspect: float) -> None:
    """Tiny pictures are used (deliberately: a dataset's small images are still pairs), but a stretch of more
    than UPSCALE_NOTED x per side is counted in the summary's `converted:` line and the sample's conversions."""
    left, top, right, bottom = crop_box_for_aspect(im.width, im.height, max_aspect)
    if (h * w / ((right - left) * (bottom - top))) ** 0.5 > UPSCALE_NOTED:
        notes.append(f"{what} upscaled more than {UPSCALE_NOTED}x per side (a small source image)")


def _note_crop(notes: list[str], what: str, im: Image.Image, max_aspect: float) -> None:
    """An image beyond the aspect clamp loses its sides to the centre crop (a 6:1 panorama a third of its width,
    an edit near its edge all of it): counted in the summary's `converted:` line, as a stretch is, not unsaid."""
    if crop_box_for_aspect(im.width, im.height, max_aspect) != (0, 0, im.width, im.height):
        notes.append(f"{what} centre-cropped to resize.max_aspect {max_aspect:g} (its sides beyond it dropped)")


MASK_ASPECT_TOLERANCE = 0.05  # relative, beyond the rounding of its sides (bucketing.same_aspect): a few pixels
# cropped or padded are a small shift; 4:3 for 16:9 (33%), a square for 3:2 (50%), a transposed mask are not


def _check_mask_aspect(mask: Image.Image, target: Image.Image, rec: SourceSample, key: str) -> None:
    """A mask of another size than its target is resized onto it: normal at the target's aspect (a mask saved at
    half size), but one of another aspect (10x300 for a 300x10 target, a square for a 3:2 photo) was made for
    another picture, a crop or a rotation of it: stretched, its edit region lay over the wrong pixels, unsaid.
    Rejected as a bad mask (its sample quarantined; a duplicate with another mask is rendered instead)."""
    if not same_aspect(mask.size, target.size, MASK_ASPECT_TOLERANCE):
        (mw, mh), (tw, th) = mask.size, target.size
        raise Rejected("bad-mask", f"mask{_where(rec, 1 + len(rec.controls))} is {mw}x{mh}, its target {tw}x{th} "
                       f"(as shown): another aspect ratio ({mw / mh:.3g} vs {tw / th:.3g}), a mask of another picture "
                       "or of a crop or rotation of it, which stretched onto the target would mark the wrong pixels; "
                       "make the mask from the target's pixels (any size of the target's aspect is resized onto it)",
                       key=key)


def _drawn_on_stored_pixels(mask: Image.Image, mask_orientation: int, target: Image.Image,
                            target_orientation: int) -> bool:
    """A mask without an orientation of its own, the size of its target as stored (before its EXIF rotation) and
    not as shown: made from the stored pixels (e.g. by a tool that read the image with PIL, which ignores EXIF),
    so it turns with its target; resizing it instead would stretch it across the other axis."""
    return (mask_orientation == 1 and target_orientation in (5, 6, 7, 8) and target.width != target.height
            and mask.size == (target.height, target.width))


def _where(rec: SourceSample, file_index: int) -> str:
    return f" ({rec.files[file_index]})" if file_index < len(rec.files) else ""


def _decode(
    data: bytes, what: str, rec: SourceSample, key: str, file_index: int, rc: ResizeConfig, notes: list[str]
) -> Decoded:
    try:
        # Qwen-Image-2.1 (keep_alpha): RGBA kept for its VAE
        d = (decode_keeping_alpha if rc.keep_alpha else decode_image)(data, rc.max_image_pixels, rc.max_image_frames)
    except ImageRejected as e:
        raise Rejected(e.kind, f"{what}{_where(rec, file_index)}: {e}", key=key) from None
    notes.extend(d.notes)
    return d


def _fit(im: Image.Image, h: int, w: int, max_aspect: float, resample: Image.Resampling) -> Image.Image:
    """Centre-crop into the aspect clamp (a no-op inside it), then resize to exactly h x w."""
    box = crop_box_for_aspect(im.width, im.height, max_aspect)
    if box == (0, 0, im.width, im.height) and im.size == (w, h):
        return im
    return im.resize((w, h), resample=resample, box=box)


def _png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return buf.getvalue()
