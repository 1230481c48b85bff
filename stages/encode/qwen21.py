"""encode-text and encode-vae for Qwen-Image-2.1 models (`stages/encode/text.py` / `vae.py` branch here).

The `images` table is the same one the Edit variants read: `control_{i}.png` is each reference, resized once to
the reference area keeping its aspect (resize-bucket with `multiple: 32`; configs/qwen-image-2.1.yaml). The same
pixels go to the VLM (composited over white, by the stock pipeline code) and to the VAE (RGBA, 4 channels); the
`control_{i}_vl.png` views are not read (with resize.vl_views: false, the 2.1 config's, not written).

text table (per sample, unpadded): `prompt_embeds` [L, D] and `slot_mask` [L] (True at the VLM image slots: the
layout record the transformer needs, with the references' latent shapes from the vae table), the same for the
empty prompt (caption dropout) with the same references, and with `encode_text.no_control_embeds` the
instruction alone in the text-to-image template (`nocontrol_embeds`, for reference dropout). vae table: as for the Edit variants, 64-channel
latents [64, 1, H/16, W/16] of the RGBA target and references, normalised as `_encode_vae_image` does.

A sample with more than 10 references, a reference side not a multiple of 32, a reference the VLM processor would
not read as it is (outside its min..max pixels, or over its 200:1: asked before the encoder, `_vlm_rejection`), or
a VLM grid that differs from the VAE grid is quarantined with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from schemas.config import PipelineConfig
from schemas.errors import Rejected, UserError
from schemas.fixes import alpha_flattened, mask_was_turned, prompt_was_emptied, took_transparent_colour
from schemas.pictures_lineage import TEXT_UNREAD
from schemas.table import FieldSpec, TableSchema
from stages.encode.common import (
    MemoryBoundForward,
    Ranks,
    Summary,
    config_hash,
    nonfinite_rejection,
    settings_record,
    open_job,
    open_png,
    placed,
    placeholder_rejection,
    caption_hopeless,
    prefetched,
    serving_config_hashes,
    with_overrides,
)
from stages.encode.other_images import say_other_images
from stages.encode.plan import Fixes

MAX_REFERENCES = 10
PIXELS_PER_SIDE = 32  # one VLM slot = 32 x 32 pixels = 2 x 2 latent tokens
TEXT_REVISION = "text21.2"
# the 2.1 latents have always been hashed as encode-vae's "vae.1" (their model fingerprint tells them apart);
# the RGBA fix of the Edit encoders (vae.2) does not concern them, the images' EXIF mask fix does (a copy the
# images' revision 3 keeps instead: its mask compared, as encode-vae's FIXES says)
VAE_REVISION = "vae.1"
# and its revision 4 (a picture's one transparent colour taken as alpha: such a sample's pictures changed); a
# turned mask keeps the latents, its mask columns computed again (`mask_only`, as encode-vae's FIXES)
_MASK_TURNED = lambda meta, row: mask_was_turned(meta)  # noqa: E731 - named: `mask_only` holds this very rule
VAE_FIXES = Fixes(by_images=((1, _MASK_TURNED), (3, lambda meta, row: took_transparent_colour(meta))),
                  reads=("conversions",), mask_only=(_MASK_TURNED,))


def _caption_now_too_long(meta: dict[str, Any], row: dict[str, Any]) -> bool:
    """A text21.1 sample the caption-length quarantine (dca6a4d, 8f164a3) now rejects, from its stored length."""
    length = row.get("length")  # (no key: the rule is asked once per distinct length and shapes, Fixes.reads)
    return length is None or caption_length_rejection_21("", int(length), meta.get("img_shapes")) is not None


# text21.1 encoded prompts past the transformer's frame positions (now quarantined): only those are redone
# and a copy the images' revision 3 kept instead of its rejected first copy (stored with caption '' before)
# and a sample whose pictures revision 4 changed (a transparent colour taken as alpha: the VLM sees them)
TEXT_FIXES = Fixes(own=((1, _caption_now_too_long),),
                   by_images=((2, prompt_was_emptied), (3, lambda meta, row: took_transparent_colour(meta))),
                   reads=("img_shapes", "conversions"))


ALPHA_NOTE = "alpha-flattened"  # the count of an `images` version's flattened samples (store/version_notes.py)


def say_alpha_flattened(job, cfg: PipelineConfig, model: str) -> None:
    """One line (rank 0) where the `images` table composited pictures' transparency over white (resize.keep_alpha
    off) and the config leaves keep_alpha unset: the 2.1 VAE reads RGBA, so those cut-outs train as opaque, which
    only resize-bucket's `converted:` line hinted at. Set to false (flattened on purpose): nothing said."""
    explicit_false = "keep_alpha" in cfg.resize.model_fields_set and not cfg.resize.keep_alpha
    images = job.images
    if job.ranks.rank != 0 or explicit_false or not images.has_column("conversions") \
            or (images.schema.attrs.get("resize") or {}).get("keep_alpha"):
        return
    n = alpha_flattened_count(job.store, images, job.images_id)
    if n:
        tqdm.write(f"{job.summary.stage}: {n} of {len(images)} sample(s) of images v{images.version} have pictures "
                   f"whose transparency resize-bucket composited over white (rendered with resize.keep_alpha false); "
                   f"{model} (Qwen-Image-2.1) reads RGBA, so they train as opaque: set resize.keep_alpha: true and "
                   "rerun resize-bucket to keep their alpha, or set resize.keep_alpha: false to flatten them on purpose")


def alpha_flattened_count(store, images, images_id: str) -> int:
    """How many samples of this `images` version (its `Store.version_id`: `images_id`) had a picture flattened over
    white: counted from its whole `conversions` column once, then read from a note beside the version
    (store/version_notes.py, tied to its manifest's bytes). Counted on every run, it was a second per run at 1M
    rows (bench/alpha_flattened.py), up-to-date runs included."""
    import pyarrow as pa

    from store.row_rule import RowRule
    from store.version_notes import read_note, write_note

    n = read_note(store, "images", images.version, ALPHA_NOTE, images_id)
    if isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= len(images):
        return n
    rule = RowRule(lambda row: alpha_flattened(row), ("conversions",))
    n = int(rule(pa.table({"conversions": images.column("conversions")})).sum())
    write_note(store, "images", images.version, ALPHA_NOTE, n, images_id)
    return n


def reference_rejection(key: str, meta: dict[str, Any]) -> Rejected | None:
    n = int(meta.get("num_controls", 0))
    if n > MAX_REFERENCES:
        return Rejected("qwen-image-2.1 takes at most 10 references",
                        f"sample has {n}; split it or drop references", key=key)
    return None


def references_rule(num_controls: int, key: str) -> Rejected | None:
    """`reference_rejection` on the control count alone (stages/encode/intake.py `rejected_by_controls`)."""
    return reference_rejection(key, {"num_controls": num_controls})


def _side_rejection(key: str, name: str, im) -> Rejected | None:
    if im.width % PIXELS_PER_SIDE or im.height % PIXELS_PER_SIDE:
        return Rejected(f"{name} size is not a multiple of {PIXELS_PER_SIDE}",
                        f"{im.width}x{im.height}; rerun resize-bucket with resize.multiple: 32", key=key)
    return None


def _vlm_rejection(key: str, name: str, im, processor) -> Rejected | None:
    """A reference the VLM processor would not read as it is, quarantined before the encoder: too elongated (its
    ValueError stopped the whole stage, with resize.max_aspect above 200), or outside its min..max pixels (it would
    resize it: the slots would not be the VAE's grid, found only after the forward)."""
    from models.control_shapes import MAX_VL_ASPECT
    from models.qwen21_predict import processor_keeps, processor_pixel_bounds

    ip = processor.image_processor
    if processor_keeps(ip, im.height, im.width):
        return None
    if max(im.size) > MAX_VL_ASPECT * min(im.size):
        return Rejected("reference too elongated for the VLM", f"{name} {im.width}x{im.height} px: the VLM processor "
                        f"reads at most {MAX_VL_ASPECT}:1; rerun resize-bucket with resize.max_aspect <= {MAX_VL_ASPECT}",
                        key=key)
    low, high = processor_pixel_bounds(ip)
    return Rejected("VLM grid differs from the VAE grid", f"{name} {im.width}x{im.height} px is outside the VLM "
                    f"processor's {low}..{high} px, which would resize it; rerun resize-bucket with "
                    "resize.control_vae_area within them", key=key)


def caption_length_rejection_21(key: str, text_tokens: int, img_shapes) -> Rejected | None:
    """Quarantine a prompt whose target block would sit past the transformer's frame positions
    (`models.qwen21_text.target_frame_position`; img_shapes: the images table's, target first). Past them the
    stock RoPE reads its negative positions (silently wrong) and then fails. Not truncated, as for the Edit models."""
    from models.qwen21_text import frame_positions, target_frame_position

    target_at = target_frame_position(text_tokens, [(h, w) for _, h, w in list(img_shapes or ())[1:]])
    limit = frame_positions()
    if target_at < limit:
        return None
    return Rejected("caption too long", f"the prompt is {text_tokens} text tokens; with this sample's references "
                    f"its target sits at frame position {target_at}, past the transformer's {limit} frame positions "
                    "(its RoPE table); shorten the caption", key=key)


@dataclass
class TextItem:
    key: str
    caption: str
    references: list  # PIL RGBA, in order


def prepare_text(key: str, sample: dict[str, Any], processor) -> TextItem | Rejected:
    meta, files = sample["meta"], sample["files"]
    if (r := reference_rejection(key, meta)) is not None:
        return r
    if (r := placeholder_rejection(str(meta.get("caption") or ""), processor, key)) is not None:
        return r
    try:
        refs = [open_png(files[f"control_{i}.png"], "RGBA") for i in range(int(meta.get("num_controls", 0)))]
    except (KeyError, OSError, ValueError) as e:
        return Rejected("control image unreadable", f"{type(e).__name__}: {e}", key=key)
    for i, im in enumerate(refs):
        if (r := _side_rejection(key, f"control_{i}", im) or _vlm_rejection(key, f"control_{i}", im, processor)):
            return r
    return TextItem(key, str(meta.get("caption") or ""), refs)


def prompt_format_record() -> dict[str, Any]:
    """What decides the features besides the model files: the stock encoder code (diffusers' version)."""
    import diffusers

    return {"variant": "qwen-image-2.1", "encoder": "QwenImage21Pipeline._get_qwen_prompt_embeds",
            "diffusers": diffusers.__version__}


# every field but nocontrol_embeds: what a row completed from a table without it holds of the stored sample
CARRIED_PART = (
    FieldSpec("prompt_embeds", "bfloat16", rank=2),
    FieldSpec("empty_embeds", "bfloat16", rank=2),
    FieldSpec("slot_mask", "bool", rank=1),
    FieldSpec("empty_slot_mask", "bool", rank=1),
    FieldSpec("length", "int64", kind="column"),
    FieldSpec("empty_length", "int64", kind="column"),
    FieldSpec("num_controls", "int64", kind="column"),
)


def text_schema(job, hidden_size: int, dtype: str, nocontrol: bool = False) -> TableSchema:
    from stages.encode.output import PART_LINEAGES_ATTR

    return TableSchema(
        name="text",
        lineage=job.lineage,
        fields=[*CARRIED_PART] + ([FieldSpec("nocontrol_embeds", "bfloat16", rank=2)] if nocontrol else []),
        attrs={
            "prompt_format": prompt_format_record(),
            "hidden_size": hidden_size,
            "encoder_dtype": dtype,
            "embeds": "Qwen3-VL last decoder layer (before the final norm), system tokens dropped, valid tokens "
                      "only, [length, hidden_size] bf16; slot_mask [length] bool marks the image slots (each 2x2 "
                      "latent tokens of its reference, in order)",
            "length": "text tokens of the joint sequence (prompt rows minus image slots): with the image tokens "
                      "of img_shapes, the sample's exact joint sequence length",
            # rows may hold the stored part of a sample encoded under these settings (`_complete_nocontrol`)
            **({PART_LINEAGES_ATTR: {"columns": [f.name for f in CARRIED_PART], "feature_lineages":
                                     list(job.part_record)}} if nocontrol and job.partial_lineages else {}),
        },
    )


class SampleEncodings:
    """A sample's prompt, empty prompt and (`nocontrol`) instruction alone, each encoding computed once: the empty
    prompt without references is the same for every sample that has none (once per run, not per sample: a
    text-to-image dataset re-encoded it for each of its samples), and a call that repeats one already made for
    the sample (an empty caption: its empty prompt; no references: its prompt alone) reuses that one. The same
    call gives the same values (`tests/stages/test_encode_21_empty_once.py`)."""

    def __init__(self, encoder):
        self.encoder = encoder
        self.empty_alone: tuple | None = None  # (embeds, slot mask) of "" with no references

    def _encode(self, caption: str, references: list) -> tuple:
        from models.qwen21_text import encode_prompt

        return encode_prompt(self.encoder, caption, references)

    def _empty_alone(self) -> tuple:
        if self.empty_alone is None:
            self.empty_alone = self._encode("", [])
        return self.empty_alone

    def of(self, item: TextItem, nocontrol: bool) -> tuple:
        """(prompt, slot mask, empty prompt, its slot mask, instruction alone or None)."""
        caption, refs = item.caption, item.references
        prompt, slots = self._empty_alone() if not caption and not refs else self._encode(caption, refs)
        if not caption:
            empty, empty_slots = prompt, slots
        else:
            empty, empty_slots = self._empty_alone() if not refs else self._encode("", refs)
        alone = (prompt if not refs else self.alone(caption)) if nocontrol else None
        return prompt, slots, empty, empty_slots, alone

    def alone(self, caption: str) -> torch.Tensor:
        """The instruction without the references of a sample that has some (one without: its prompt)."""
        return self._empty_alone()[0] if not caption else self._encode(caption, [])[0]


def run_text(cfg: PipelineConfig, store: str | Path, model: str, device: str | None = None,
             batch_size: int | None = None, ranks: Ranks | None = None) -> Summary:
    from models.loading import load_component, parse_dtype
    from models.qwen21_text import prompt_encoder

    section = with_overrides(cfg.encode_text, device=device, batch_size=batch_size)
    section, ranks, target = placed(section, "encode-text", ranks)
    if section.prompt_template is not None or section.prompt_template_start_idx is not None:
        raise UserError("encode_text.prompt_template / prompt_template_start_idx are not used by a Qwen-Image-2.1 "
                        f"model ({model}: the stock QwenImage21Pipeline template, with its image slots, is); unset them")
    # One sample per forward whatever `batching` says: it changes no feature, so it is hashed as its default
    # (switching it must not re-encode the table to identical values).
    section = section.model_copy(update={"batching": "exact"})
    record = prompt_format_record()
    job = open_job(store, "encode-text", "text", settings_record(section, prompt_format=record), model, TEXT_REVISION,
                   ranks, components=("text_encoder", "processor", "tokenizer"),
                   on_damaged=section.on_damaged, max_damaged_fraction=section.max_damaged_fraction, fixes=TEXT_FIXES,
                   serving_hashes=serving_config_hashes(section, prompt_format=record),
                   unread=TEXT_UNREAD["qwen-image-2.1"], by_controls=references_rule,
                   # a table of these settings without no_control_embeds: its samples completed, not encoded again
                   partial_hashes=(config_hash(section.model_copy(update={"no_control_embeds": False}),
                                               prompt_format=record),) if section.no_control_embeds else ())
    job.prompt_fits = lambda tokens, shapes: caption_length_rejection_21("", tokens, shapes) is None
    say_alpha_flattened(job, cfg, model)
    say_other_images(job, cfg)
    if job.up_to_date:
        return job.summary
    with job.working():  # from the model load on, as encode-text/-vae (a load that fails closes the job too)
        processor = load_component(model, "processor")
        text_encoder = load_component(model, "text_encoder", dtype=parse_dtype(section.dtype), device=target)
        encoder = prompt_encoder(text_encoder, processor)
        nocontrol = section.no_control_embeds  # reference dropout: the text-to-image prompt, no references
        schema = text_schema(job, text_encoder.config.text_config.hidden_size, section.dtype, nocontrol)
        encodings = SampleEncodings(encoder)
        forward = MemoryBoundForward(lambda items: [encodings.of(items[0], nocontrol)], "encode-text",
                                     lambda item: f"sample {item.key}", target, "encode_text.batch_size")
        if nocontrol:
            _complete_nocontrol(job, encodings, target, section.dtype)
        todo = job.open_writer(schema, section.shard_size_mb)
        samples = prefetched(job.read_inputs(todo, references_rule),
                             job.unless_rejected(lambda item: prepare_text(*item, processor)),
                             workers=section.num_workers)
        with job.progress(len(todo)) as bar:
            for item in job.accepted(samples, bar):
                _encode_text(job, item, processor, forward, nocontrol, bar)
        return job.finish()


def _complete_nocontrol(job, encodings: SampleEncodings, target, dtype: str) -> None:
    """`job.complete_rows` for a table encoded without no_control_embeds: each stored sample written with its
    stored embeddings and slot masks, its instruction without the references encoded now (one with none: its
    prompt, as a full encode stores it), bit for bit a full encode's row (one sample per forward either way)."""
    from stages.encode.output import completing

    forward = MemoryBoundForward(lambda captions: [encodings.alone(captions[0])], "encode-text",
                                 lambda caption: "a caption alone", target, "encode_text.batch_size")

    def some(reader, keys: list[str]) -> set[str]:
        from store.integrity import DamagedData

        done = set()
        for key in keys:
            try:
                stored = reader.tensors(key)
            except DamagedData:  # encoded whole instead
                continue
            row = reader.cells(key, ("length", "empty_length", "num_controls"))
            if row["num_controls"]:
                with job.timed_forward(1):
                    alone = forward([str(job.images.cells(key, ("caption",)).get("caption") or "")])[0]
            else:
                alone = stored["prompt_embeds"]
            _add_completed(job, key, stored, alone.to("cpu", torch.bfloat16).contiguous(), row, dtype)
            done.add(key)
        return done

    job.complete_rows = lambda version, rows: completing(job, version, rows.column("key").to_pylist(), 64, some)


def _add_completed(job, key: str, stored: dict[str, torch.Tensor], alone: torch.Tensor, row: dict[str, Any],
                   dtype: str) -> None:
    """A completed sample added (or quarantined for a non-finite embedding, as a full encode does)."""
    embeds = {"prompt_embeds": stored["prompt_embeds"], "empty_embeds": stored["empty_embeds"],
              "nocontrol_embeds": alone}
    if (bad := nonfinite_rejection(key, embeds, f"encode_text.dtype {dtype}")) is not None:
        job.quarantine(key, bad.reason, bad.detail)
        return
    meta = job.images.cells(key, ("split", "img_shapes"))
    job.writer.add(key, tensors={**{n: t.contiguous() for n, t in embeds.items()},
                                 "slot_mask": stored["slot_mask"].contiguous(),
                                 "empty_slot_mask": stored["empty_slot_mask"].contiguous()},
                   meta={"split": meta.get("split", "train"), "img_shapes": meta["img_shapes"], "length": row["length"],
                         "empty_length": row["empty_length"], "num_controls": row["num_controls"]})
    job.summary.completed += 1


# ---------------------------------------------------------------- encode-vae


def _encode_text(job, item, processor, forward: MemoryBoundForward, nocontrol: bool, bar) -> None:
    """One sample: quarantined (its caption too long for the transformer's frames, before or after the encoder;
    a VLM grid other than the VAE's) or encoded and added."""
    from models.qwen21_text import grid_mismatch

    meta = job.images.cells(item.key, ("split", "img_shapes"))
    shapes = meta.get("img_shapes")
    # the caption's own tokens are a lower bound: a hopeless one never reaches the encoder (nor, when its length
    # alone tells, the tokenizer)
    too_long = caption_hopeless(item.key, item.caption, processor.tokenizer,
                                lambda least: caption_length_rejection_21(item.key, least, shapes))
    if too_long is None:
        caption_tokens = len(processor.tokenizer(item.caption)["input_ids"])
        too_long = caption_length_rejection_21(item.key, caption_tokens, shapes)
    if too_long is not None:
        job.quarantine(item.key, too_long.reason, too_long.detail)
        bar.skipped()
        return
    # One sample per forward: the stock encoder takes one reference set per call.
    with job.timed_forward(3 if nocontrol else 2):
        prompt, slots, empty, empty_slots, alone = forward([item])[0]  # SampleEncodings.of, one line on OOM
    problem = grid_mismatch(slots, [(im.height, im.width) for im in item.references])
    if problem is not None:
        job.quarantine(item.key, "VLM grid differs from the VAE grid", problem)
        bar.skipped()
        return
    if (too_long := caption_length_rejection_21(item.key, int((~slots).sum()), shapes)) is not None:
        job.quarantine(item.key, too_long.reason, too_long.detail)
        bar.skipped()
        return
    embeds = {"prompt_embeds": prompt, "empty_embeds": empty, **({"nocontrol_embeds": alone} if nocontrol else {})}
    embeds = {name: e.to("cpu", torch.bfloat16).contiguous() for name, e in embeds.items()}
    bar.encoded(1)
    if (bad := nonfinite_rejection(item.key, embeds, f"encode_text.dtype {str(prompt.dtype)[6:]}")) is not None:
        job.quarantine(item.key, bad.reason, bad.detail)
        return
    job.writer.add(item.key, tensors={
        **embeds, "slot_mask": slots.cpu().contiguous(), "empty_slot_mask": empty_slots.cpu().contiguous(),
    }, meta={"split": meta.get("split", "train"), "img_shapes": meta["img_shapes"],
             # text tokens of the joint sequence: + the image tokens (img_shapes) = its exact length,
             # which the join hands the length-aware sampler
             "length": int((~slots).sum()), "empty_length": int((~empty_slots).sum()),
             "num_controls": len(item.references)})
    job.summary.encoded += 1


def preprocess_rgba(image_processor, im) -> torch.Tensor:
    """[1, 4, 1, H, W] in [-1, 1]: the pipeline's `image_processor.preprocess(img.convert('RGBA'), ...)`."""
    return image_processor.preprocess(im, height=im.height, width=im.width).unsqueeze(2)


def image_processor_21():
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor(vae_scale_factor=16, vae_latent_channels=64)  # what QwenImage21Pipeline builds


def prepare_vae(key: str, sample: dict[str, Any], image_processor):
    """The vae stage's `Prepared` (stages/encode/vae.py) for a 2.1 sample: RGBA target and references."""
    from stages.encode.vae import Prepared, Request, mask_weight

    files, meta = sample["files"], sample["meta"]
    if (r := reference_rejection(key, meta)) is not None:
        return r
    names = ["target"] + [f"control_{i}" for i in range(int(meta.get("num_controls", 0)))]
    try:
        images = {n: open_png(files[f"{n}.png"], "RGBA") for n in names}
        mask = open_png(files["mask.png"], mode="L") if "mask.png" in files else None
    except (KeyError, OSError, ValueError) as e:
        return Rejected("image unreadable", f"{type(e).__name__}: {e}", key=key)
    for n, im in images.items():
        if (r := _side_rejection(key, n, im)) is not None:
            return r
    target = images["target"]
    if mask is not None and mask.size != target.size:
        return Rejected("mask size differs from the target", f"mask {mask.size}, target {target.size}", key=key)
    # one 2.1 latent token = 16 x 16 pixels, the same grid as an Edit packed token
    weight = mask_weight(mask, target.height, target.width) if mask is not None else None
    prepared = Prepared(key, names, weight)
    prepared.requests = [Request(key, n, preprocess_rgba(image_processor, im), prepared) for n, im in images.items()]
    return prepared
