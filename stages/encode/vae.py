"""encode-vae: `images` table -> `vae` table (target and every control latent, bf16, normalised).

Each image is encoded as the diffusers edit pipelines encode their condition image: `VaeImageProcessor`
(scale 16 = VAE 8 x patch 2) preprocess to [-1, 1] at the stored size, `vae.encode(...).latent_dist.mode()`
("argmax"), then (z - latents_mean) / latents_std per channel (`_encode_vae_image`); latents_mean/std are
recorded in the schema attrs. Batches hold only images of one size (no padding, no resize).

An edit mask (images table `mask.png`, white = edited) becomes `mask_weight`: one float32 per packed latent
token (a 2x2 latent patch = 16x16 pixels), row-major over (h/2, w/2) like `_pack_latents`, holding the mean of
mask/255 over the token's pixels, i.e. the fraction of edited pixels. Samples without a mask have none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from schemas.config import PipelineConfig
from schemas.img_shapes import PIXELS_PER_PATCH
from schemas.pictures_lineage import VAE_UNREAD
from schemas.table import VAE_LATENTS_COLUMN, FieldSpec, TableSchema
from schemas.errors import Rejected
from stages.encode.common import (
    EncodeJob,
    MemoryBoundForward,
    Ranks,
    Summary,
    batches_by_shape,
    settings_record,
    earlier_config_hashes,
    control_count_rejection,
    nonfinite_rejection,
    open_job,
    open_png,
    placed,
    prefetched,
    with_overrides,
)

from schemas.fixes import has_alpha_picture, mask_was_turned, took_transparent_colour
from stages.encode.other_images import say_other_images
from stages.encode.plan import Fixes

STAGE = "encode-vae"
TABLE = "vae"
FEATURE_REVISION = "vae.2"
# vae.1 read an RGBA picture (resize.keep_alpha) as black where transparent (f6aa89f): its tables stay current,
# and their samples are carried forward, except those with such a picture; and those whose mask the images'
# revision 2 turned (EXIF mask fix): their mask weights changed. A copy revision 3 keeps instead of one with a mask
# of another aspect (once stretched) has another mask: its `mask_sha256` differs (`match_columns`), so it is
# encoded again; one kept instead before too (caption '' then, which the VAE never reads) is carried.
# Revision 4 takes a picture's one transparent colour as alpha: those samples' pictures changed.
# Qwen-Image-2.1 (RGBA read as RGBA) has its own. A turned mask changed the mask alone (its target rendered the
# same): such a row keeps its latents, its mask columns computed again (`mask_only`, stages/encode/mask_only.py).
_MASK_TURNED = lambda meta, row: mask_was_turned(meta)  # noqa: E731 - named: `mask_only` holds this very rule
FIXES = Fixes(own=((1, lambda meta, row: has_alpha_picture(meta)),),
              by_images=((1, _MASK_TURNED), (3, lambda meta, row: took_transparent_colour(meta))),
              reads=("conversions",), mask_only=(_MASK_TURNED,))
LATENTS_COLUMN = VAE_LATENTS_COLUMN  # `latents_sha256` of each sample
COMPONENTS = ("vae",)  # what the latents depend on: another model with the same VAE files reuses them


@dataclass
class Request:
    key: str
    name: str  # "target" or "control_{i}"
    pixels: torch.Tensor  # [1, 3, 1, H, W] in [-1, 1]
    sample: "Prepared" = field(repr=False, compare=False)  # the sample this image belongs to

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.pixels.shape[-2:])  # type: ignore[return-value]


@dataclass
class Prepared:
    key: str
    names: list[str]  # "target", "control_0", ... in order
    mask_weight: torch.Tensor | None
    requests: list[Request] = field(default_factory=list)


def latents_sha256(latents: dict[str, torch.Tensor], names: list[str]) -> str:
    """sha256 of the sample's latents alone (each name, dtype, shape and bytes, in order): its stored bytes without
    the mask weights, which train names its tables by where the mask weighs nothing (`store.join`'s stand-ins)."""
    import hashlib

    h = hashlib.sha256(b"vae-latents-1")
    for n in names:
        t = latents[n].contiguous().cpu()
        h.update(f"\0{n}\0{t.dtype}\0{list(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def mask_weight(mask, height: int, width: int) -> torch.Tensor:
    """[H, W] mask (PIL L) -> float32 [(H/16) * (W/16)]: fraction of edited pixels per packed token."""
    m = torch.frombuffer(bytearray(mask.tobytes()), dtype=torch.uint8).view(height, width).to(torch.float64) / 255.0
    t = PIXELS_PER_PATCH
    return m.view(height // t, t, width // t, t).mean(dim=(1, 3)).flatten().to(torch.float32)


def prepare(key: str, sample: dict[str, Any], image_processor, variant: str = "edit-plus") -> Prepared | Rejected:
    files, meta = sample["files"], sample["meta"]
    if (rejected := control_count_rejection(variant, int(meta.get("num_controls", 0)), key)) is not None:
        return rejected
    names = ["target"] + [f"control_{i}" for i in range(int(meta.get("num_controls", 0)))]
    try:
        images = {n: open_png(files[f"{n}.png"]) for n in names}
        mask = open_png(files["mask.png"], mode="L") if "mask.png" in files else None
    except (KeyError, OSError, ValueError) as e:
        return Rejected("image unreadable", f"{type(e).__name__}: {e}", key=key)
    for n, im in images.items():
        if im.width % PIXELS_PER_PATCH or im.height % PIXELS_PER_PATCH:
            return Rejected(f"{n} size is not a multiple of {PIXELS_PER_PATCH}",
                            f"{im.width}x{im.height}; rerun resize-bucket with a bucket multiple of 16 or 32", key=key)
    target = images["target"]
    if mask is not None and mask.size != target.size:
        return Rejected("mask size differs from the target", f"mask {mask.size}, target {target.size}", key=key)
    weight = mask_weight(mask, target.height, target.width) if mask is not None else None
    prepared = Prepared(key, names, weight)
    prepared.requests = [Request(key, n, image_processor.preprocess(im, im.height, im.width).unsqueeze(2), prepared)
                         for n, im in images.items()]
    return prepared


@torch.no_grad()
def encode_batch(vae, requests: list[Request], latents_mean: torch.Tensor, latents_std: torch.Tensor) -> torch.Tensor:
    """Same-size images -> normalised latents [B, C, 1, h, w], as the pipelines' `_encode_vae_image`."""
    pixels = torch.cat([r.pixels for r in requests]).to(vae.device, vae.dtype)
    z = vae.encode(pixels).latent_dist.mode()
    return (z - latents_mean.to(z.device, z.dtype)) / latents_std.to(z.device, z.dtype)


def vae_schema(job: EncodeJob, vae, dtype: str) -> TableSchema:
    return TableSchema(
        name=TABLE,
        lineage=job.lineage,
        fields=[
            FieldSpec("target", "bfloat16", rank=4),
            FieldSpec("control_{i}", "bfloat16", rank=4),
            FieldSpec("mask_weight", "float32", rank=1, optional=True),
            FieldSpec("num_controls", "int64", kind="column"),
            FieldSpec("latent_shapes", "json", kind="column"),
            FieldSpec("has_mask", "bool", kind="column"),
            FieldSpec("mask_sha256", "string", kind="column", optional=True),
            FieldSpec(LATENTS_COLUMN, "string", kind="column", optional=True),
        ],
        attrs={
            "latents_mean": list(vae.config.latents_mean),
            "latents_std": list(vae.config.latents_std),
            "z_dim": vae.config.z_dim,
            "vae_scale_factor": 2 ** len(vae.temperal_downsample),
            "normalisation": "stored = (latent_dist.mode() - latents_mean) / latents_std, per channel",
            "latent_layout": "[C, 1, h, w] with h = H/f, w = W/f of the stored image (f = vae_scale_factor)",
            "mask_weight": "float32 [(h/2) * (w/2)], row-major over packed 2x2-latent tokens (16x16 px each), "
                           "fraction of edited pixels (mean of mask/255); absent when the sample has no mask",
            "encoder_dtype": dtype,
        },
    )


# ---------------------------------------------------------------- the stage


def run(
    cfg: PipelineConfig,
    store: str | Path,
    model: str,
    device: str | None = None,
    batch_size: int | None = None,
    ranks: Ranks | None = None,
) -> Summary:
    from models.loading import load_component, model_variant, parse_dtype
    from models.precision import check_loaded_dtype

    section = with_overrides(cfg.encode_vae, device=device, batch_size=batch_size)
    section, ranks, target = placed(section, STAGE, ranks)
    variant = model_variant(model)
    revision, fixes = _revision_and_fixes(variant)
    image_processor, prep, rule = _preparation(variant)
    job = open_job(store, STAGE, TABLE, settings_record(section), model, revision, ranks, components=COMPONENTS,
                   on_damaged=section.on_damaged, max_damaged_fraction=section.max_damaged_fraction,
                   earlier_hashes=earlier_config_hashes(section), fixes=fixes, unread=VAE_UNREAD, by_controls=rule)
    job.match_columns = ("mask_sha256",)
    job.mask_only_carry = True  # the mask is not in the key, nor in the latents: an edited mask keeps them
    job.same_inputs_carry = True  # the caption is in the key, never in the latents: a recaption carries them
    say_other_images(job, cfg)
    if variant == "qwen-image-2.1":  # its VAE reads RGBA: pictures flattened over white are said
        from stages.encode.qwen21 import say_alpha_flattened

        say_alpha_flattened(job, cfg, model)
    if job.up_to_date:
        return job.summary

    with job.working():  # from the model load on (a load that fails closes the job too)
        # Only the VAE (never the VL model or the transformer).
        vae = load_component(model, "vae", dtype=parse_dtype(section.dtype), device=target)
        check_loaded_dtype(vae, section.dtype, "encode_vae.dtype")
        channels = vae.config.z_dim
        latents_mean = torch.tensor(vae.config.latents_mean).view(1, channels, 1, 1, 1)
        latents_std = torch.tensor(vae.config.latents_std).view(1, channels, 1, 1, 1)
        todo = job.open_writer(vae_schema(job, vae, section.dtype), section.shard_size_mb)
        samples = prefetched(job.read_inputs(todo, rule),
                             job.unless_rejected(lambda item: prep(*item, image_processor, variant)), workers=section.num_workers)
        done: dict[str, dict[str, torch.Tensor]] = {}  # key -> image name -> latent, until the sample is complete
        forward = MemoryBoundForward(lambda part: encode_batch(vae, part, latents_mean, latents_std), STAGE,
                                     lambda r: f"sample {r.key}'s {r.name} ({r.shape[1]}x{r.shape[0]} pixels)",
                                     target, "encode_vae.batch_size")
        with job.progress(len(todo)) as bar:
            requests = (r for prepared in job.accepted(samples, bar) for r in prepared.requests)
            for batch in batches_by_shape(requests, lambda r: r.shape, section.batch_size):
                with job.timed_forward(len(batch), forward):
                    latents = forward(batch)
                for req, lat in zip(batch, latents):
                    parts = done.setdefault(req.key, {})
                    parts[req.name] = lat.to("cpu", torch.bfloat16)
                    bar.encoded(len(req.sample.names))
                    if len(parts) == len(req.sample.names):
                        _write(job, req.sample, done.pop(req.key), f"encode_vae.dtype {section.dtype}")
        return job.finish()


def _revision_and_fixes(variant: str) -> tuple[str, Fixes]:
    """The feature revision and fixes of the model family's latents (Qwen-Image-2.1 has its own)."""
    if variant == "qwen-image-2.1":
        from stages.encode.qwen21 import VAE_FIXES, VAE_REVISION

        return VAE_REVISION, VAE_FIXES
    return FEATURE_REVISION, FIXES


def _preparation(variant: str) -> tuple[Any, Callable, Callable]:
    """(image processor, prepare, the control-count rule asked before a sample is read) of the model family."""
    if variant == "qwen-image-2.1":  # RGBA in, 64 channels, 16x (stages/encode/qwen21.py)
        from stages.encode.qwen21 import image_processor_21, prepare_vae, references_rule

        return (image_processor_21(), lambda key, sample, processor, _variant: prepare_vae(key, sample, processor),
                references_rule)
    from diffusers.image_processor import VaeImageProcessor

    return (VaeImageProcessor(vae_scale_factor=PIXELS_PER_PATCH),  # what the edit pipelines build
            prepare, lambda n, key: control_count_rejection(variant, n, key))


def _write(job: EncodeJob, prepared: Prepared, latents: dict[str, torch.Tensor], dtype_setting: str) -> None:
    if (rejected := nonfinite_rejection(prepared.key, latents, dtype_setting)) is not None:
        job.quarantine(prepared.key, rejected.reason, rejected.detail)
        return
    meta = job.images.cells(prepared.key, ("split", "img_shapes", "mask_sha256"))
    names = prepared.names  # target first, then control_0, control_1, ...
    tensors = {n: latents[n].contiguous() for n in names}
    if prepared.mask_weight is not None:
        tensors["mask_weight"] = prepared.mask_weight
    job.writer.add(
        prepared.key,
        tensors=tensors,
        meta={
            "split": meta.get("split", "train"),
            "img_shapes": meta["img_shapes"],
            "num_controls": len(names) - 1,
            "latent_shapes": [list(latents[n].shape) for n in names],
            "has_mask": prepared.mask_weight is not None,
            "mask_sha256": meta.get("mask_sha256") or "",  # reuse compares it: the mask is not in the key
            LATENTS_COLUMN: latents_sha256(tensors, names),
        },
    )
    job.summary.encoded += 1
