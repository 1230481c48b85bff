"""encode-text: `images` table -> `text` table (Qwen2.5-VL prompt embeds of instruction + control image(s)).

Each sample is encoded exactly as diffusers' `QwenImageEditPipeline.encode_prompt` (Edit: one control, the
VAE-view image, the template holds the one image slot) or `QwenImageEditPlusPipeline.encode_prompt` (Edit-Plus:
"Picture i: " + image slot per VL-view control, 0..N controls) does for that sample alone: same template, same
processor inputs, last hidden state, the template's first `start_idx` tokens dropped. Only valid tokens are stored
(no padding), bf16, plus the empty-prompt embeds with the same control images (caption dropout).

Batching (`encode_text.batching`, part of the lineage):
- "exact" (default): batches hold only requests with identical input shapes (token count and image grids):
  padding or mixed image sizes change float32 rounding (~1e-7); identical shapes are bit-exact (but see
  MIN_BATCH_ROWS), so the table does not depend on the batch size (tested against the unmodified pipeline on
  CPU; GPU BLAS libraries give no such guarantee across batch sizes). On mixed data batches stay small.
- "padded": any requests share a batch (sorted by token count within a window, the text right-padded, the
  images of all of them through the vision tower at once); each request's valid tokens equal its alone result
  within float32 rounding (~2e-7 relative, tested), and batches are full.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from schemas.config import EncodeTextConfig, PipelineConfig
from schemas.errors import UserError
from schemas.table import FieldSpec, TableSchema
from schemas.errors import Rejected
from stages.encode.common import (
    EncodeJob,
    MemoryBoundForward,
    Ranks,
    Summary,
    batches_by_shape,
    settings_record,
    config_hash,
    earlier_config_hashes,
    control_count_rejection,
    nonfinite_rejection,
    open_job,
    open_png,
    placed,
    placeholder_rejection,
    caption_hopeless,
    prefetched,
    serving_config_hashes,
    with_overrides,
)

from schemas.fixes import has_alpha_picture, prompt_was_emptied, took_transparent_colour
from schemas.pictures_lineage import TEXT_UNREAD
from stages.encode.other_images import say_other_images
from stages.encode.output import PART_LINEAGES_ATTR
from stages.encode.plan import Fixes

STAGE = "encode-text"
TABLE = "text"
FEATURE_REVISION = "text.2"
# text.1 read an RGBA picture (resize.keep_alpha) as black where transparent (f6aa89f): its tables stay current,
# and their samples are carried forward, except those with such a picture (re-encoded over white). Of the
# images' fixes, the masks (revisions 2, 3) are not read here; a copy revision 3 kept instead of its rejected
# first copy was stored with caption '' before: its instruction changed (not a copy of a key whose first copy
# revision 2 kept: the same caption and pictures). Revision 4 takes a picture's one transparent colour as alpha: the
# VLM's view of such a sample changed.
FIXES = Fixes(own=((1, lambda meta, row: has_alpha_picture(meta)),),
              by_images=((2, prompt_was_emptied), (3, lambda meta, row: took_transparent_colour(meta))),
              reads=("conversions",))
COMPONENTS = ("text_encoder", "processor", "tokenizer")  # what the features depend on (per-sample reuse)
# diffusers builds the Edit-Plus image prompt inline in `_get_qwen_prompt_embeds`; mirrored here, and recorded
# in the lineage so a change of it means a new table version.
VISION_START = "<|vision_start|>"
PLUS_IMAGE_PROMPT = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
KINDS = ("prompt", "empty")  # the instruction, and "" for caption dropout, both with the sample's images
# with encode_text.no_control_embeds: the instruction without the control images (train.control_dropout)
NOCONTROL = "nocontrol"
# what the rows of a version with no_control_embeds may hold of a sample stored without it (`PART_LINEAGES_ATTR`)
CARRIED_PART = ("prompt_embeds", "empty_embeds", "length", "empty_length", "num_controls")
VISION_SLOT = "<|vision_start|><|image_pad|><|vision_end|>"
PADDED_WINDOW = 8  # padded batching: this many batches' worth of requests are sorted by length together
# Even same-shape batches are not bit-exact when a matmul has few rows: MKL's sgemm takes another kernel for
# M < 12 (and, split over 16 threads, up to M = 27), so a row's value depends on M. The smallest matmuls are
# the vision merger's, one row per merged image token (patches / 2x2): an image with fewer merged tokens than
# this is encoded alone. (Real VL views have ~190 or more; the LLM's rows, >= 64 template tokens, are safe.)
MIN_BATCH_ROWS = 32
MERGE_AREA = 4  # Qwen2.5-VL merges 2x2 patches into one token


@dataclass(frozen=True)
class PromptFormat:
    variant: str  # "edit" | "edit-plus"
    template: str
    start_idx: int  # leading template tokens dropped from the hidden states

    def text(self, instruction: str, num_images: int) -> str:
        if self.variant == "edit-plus":
            images = "".join(PLUS_IMAGE_PROMPT.format(i + 1) for i in range(num_images))
            return self.template.format(images + instruction)
        return self.template.format(instruction)

    def text_without_images(self, instruction: str) -> str:
        """The prompt with no control image: Edit-Plus as its pipeline builds it for image=None; Edit with its
        template's one vision slot removed."""
        if self.variant == "edit-plus":
            return self.template.format(instruction)
        return self.template.replace(VISION_SLOT, "").format(instruction)

    def lineage_record(self) -> dict[str, Any]:
        return {"variant": self.variant, "template": self.template, "start_idx": self.start_idx,
                "plus_image_prompt": PLUS_IMAGE_PROMPT if self.variant == "edit-plus" else None}


def prompt_format(variant: str, template: str | None, start_idx: int | None) -> PromptFormat:
    """The config's template, else the one the model's diffusers pipeline class sets in its __init__ (read from an
    instance with no components, so nothing is loaded)."""
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline

    if template is not None:
        slots = template.count("<|image_pad|>")
        if slots != (1 if variant == "edit" else 0):
            raise UserError(f"encode_text.prompt_template has {slots} '<|image_pad|>' slot(s); an {variant} model's "
                            "template needs " + ("exactly one" if variant == "edit" else "none (Edit-Plus adds "
                                                 "'Picture i: ' slots itself)"))
        if start_idx is None:
            raise UserError("encode_text.prompt_template is set but encode_text.prompt_template_start_idx is not: "
                            "set how many leading template tokens to drop (diffusers uses 64)")
        _check_instruction_slot(template)
        return PromptFormat(variant, template, start_idx)
    cls = QwenImageEditPlusPipeline if variant == "edit-plus" else QwenImageEditPipeline
    ref = cls(scheduler=None, vae=None, text_encoder=None, tokenizer=None, processor=None, transformer=None)
    return PromptFormat(variant, ref.prompt_template_encode,
                        ref.prompt_template_encode_start_idx if start_idx is None else start_idx)


def template_spellings(section: EncodeTextConfig, fmt: PromptFormat
                       ) -> tuple[EncodeTextConfig, tuple[EncodeTextConfig, ...]]:
    """(the section as hashed, the other spellings of it that earlier runs hashed). The model's own template
    spelled out (`prompt_template_start_idx: 64`, or the template too) gives its features bit for bit, so it is
    hashed as unset: before, it made a new version, every sample through the VL encoder again (hours at 1M
    samples) and a new `text` version for train to train on afresh."""
    unset = {"prompt_template": None, "prompt_template_start_idx": None}
    if fmt != prompt_format(fmt.variant, None, None):
        return section, ()
    spelled = ({"prompt_template_start_idx": fmt.start_idx},
               {"prompt_template": fmt.template, "prompt_template_start_idx": fmt.start_idx})
    return section.model_copy(update=unset), tuple(section.model_copy(update={**unset, **s}) for s in spelled)


def feature_hashes(section: EncodeTextConfig, fmt: PromptFormat) -> tuple[dict[str, Any], tuple[str, ...],
                                                                           tuple[str, ...]]:
    """`open_job`'s settings record, earlier hashes and serving hashes: the template as `template_spellings`
    hashes it, each other spelling among the earlier hashes (a table hashed with one stays current, its samples
    carried), with the hashes from before the declared scheme of each."""
    hashed, spellings = template_spellings(section, fmt)
    record = fmt.lineage_record()
    earlier = [config_hash(s, prompt_format=record) for s in spellings]
    earlier += [h for s in (hashed, *spellings) for h in earlier_config_hashes(s, prompt_format=record)]
    serving = [h for s in (hashed, *spellings) for h in serving_config_hashes(s, earlier=True, prompt_format=record)]
    return (settings_record(hashed, prompt_format=record), tuple(dict.fromkeys(earlier)),
            tuple(dict.fromkeys(serving)))


def without_nocontrol_hashes(section: EncodeTextConfig, fmt: PromptFormat) -> tuple[str, ...]:
    """With no_control_embeds on: the feature hashes (`feature_hashes`: the settings' and the earlier ones) of the
    same settings with it off, whose tables hold every column but `nocontrol_embeds`, bit for bit as this run
    encodes them (the prompt and empty requests do not depend on it: `prepare`); else none."""
    from schemas.lineage import settings_hash

    if not section.no_control_embeds:
        return ()
    record, earlier, _ = feature_hashes(section.model_copy(update={"no_control_embeds": False}), fmt)
    return (settings_hash(record), *earlier)


def _check_instruction_slot(template: str) -> None:
    """The template's one replacement field is a bare '{}' (the instruction goes there) and any other brace is
    doubled, as `str.format` reads it. Checked before the model loads: a '{style}' or a lone '}' failed in the first
    sample's preparation, a KeyError / ValueError with a traceback after the VL model had loaded (minutes)."""
    from string import Formatter

    try:
        fields = [(name, spec, conv) for _, name, spec, conv in Formatter().parse(template) if name is not None]
    except ValueError as e:
        fields = [str(e)]
    if fields != [("", "", None)]:
        found = ", ".join("{" + f[0] + (f"!{f[2]}" if f[2] else "") + (f":{f[1]}" if f[1] else "") + "}"
                          if isinstance(f, tuple) else f for f in fields) or "none"
        raise UserError(f"encode_text.prompt_template must hold exactly one '{{}}' where the instruction goes and "
                        f"every other brace doubled ('{{{{', '}}}}'); found: {found}")


def check_start_idx(fmt: PromptFormat, tokenizer) -> None:
    """`start_idx` drops at most the template's own tokens before the first sample's own ones (its images or its
    instruction): past them it cuts every sample's prompt, and from its length on stores an empty [0, D] embedding.
    Before, `prompt_template_start_idx: 200` stored every sample's prompt_embeds empty, nothing said."""
    # the template's text before the instruction, as formatted (a doubled brace is one: '{{}}' is text, not the slot)
    prefix = fmt.template.format("\0").split("\0")[0].split(VISION_START)[0]
    fixed = len(tokenizer(prefix)["input_ids"])
    if fmt.start_idx > fixed:
        raise UserError(f"encode_text.prompt_template_start_idx is {fmt.start_idx}, past the {fixed} tokens of the "
                        "template before each sample's images and instruction: it would cut every sample's own "
                        f"tokens (all of a short prompt); set it to at most {fixed} (diffusers drops 64)")


# ---------------------------------------------------------------- per-sample preparation (runs in a thread)


@dataclass
class Request:
    key: str
    kind: str  # one of KINDS
    inputs: dict[str, torch.Tensor]  # the processor's output for this request alone (batch dim 1)

    @property
    def num_tokens(self) -> int:
        return self.inputs["input_ids"].shape[1]

    @property
    def grids(self) -> tuple[tuple[int, int, int], ...]:
        """The images' (t, h, w) patch grids: the vision tower's input shape (never padded)."""
        grid = self.inputs.get("image_grid_thw")
        return tuple(map(tuple, grid.tolist())) if grid is not None else ()

    @property
    def shape(self) -> tuple | None:
        """Exact batch key: token count + image grids; None = run alone (an image too small to batch exactly)."""
        if any(t * h * w // MERGE_AREA < MIN_BATCH_ROWS for t, h, w in self.grids):
            return None
        return (self.num_tokens, self.grids)


def control_images(files: dict[str, bytes], variant: str, num_controls: int) -> list:
    """Edit: the VAE-view control (what the pipeline resizes to its ~1024² bucket and gives the VL model);
    Edit-Plus: each control's VL view, in order."""
    names = [f"control_{i}.png" if variant == "edit" else f"control_{i}_vl.png" for i in range(num_controls)]
    return [open_png(files[n]) for n in names]


def prepare(key: str, sample: dict[str, Any], fmt: PromptFormat, processor,
            lock: threading.Lock, nocontrol: bool = False) -> list[Request] | Rejected:
    """The processor's inputs for the prompt and the empty prompt. Same result as `processor(text=[t],
    images=images)` for each (the equivalence test checks), but the images are preprocessed once, not twice:
    the image processor is the costliest step outside the forward."""
    meta = sample["meta"]
    n = int(meta.get("num_controls", 0))
    if (rejected := control_count_rejection(fmt.variant, n, key)) is not None:
        return rejected
    if (rejected := placeholder_rejection(str(meta.get("caption") or ""), processor, key)) is not None:
        return rejected
    # the lock only for the tokenizer's first vocabulary read (not while another thread's call holds it)
    rejected = caption_hopeless(key, str(meta.get("caption") or ""), processor.tokenizer,
                                lambda least: caption_length_rejection(key, least - fmt.start_idx, meta), lock)
    if rejected is not None:
        return rejected
    try:
        images = control_images(sample["files"], fmt.variant, n)
    except (KeyError, OSError, ValueError) as e:
        return Rejected("control image unreadable", f"{type(e).__name__}: {e}", key=key)
    try:  # the processor rejects an image (size, aspect ratio, ...): quarantine, go on
        vision = processor.image_processor(images, return_tensors="pt") if images else {}
    except Exception as e:  # noqa: BLE001 - any rejection by the upstream processor is this sample's problem
        return Rejected("processor rejected the sample", f"{type(e).__name__}: {e}", key=key)
    slots = [processor.replace_image_token(vision, i) for i in range(n)]
    requests = []
    for kind, instruction in zip(KINDS, (str(meta.get("caption") or ""), "")):
        try:  # e.g. a caption that contains the image placeholder token itself: this sample's problem
            text = fill_image_slots(fmt.text(instruction, n), processor.image_token, slots)
        except UserError as e:
            return Rejected("prompt does not fit the template", str(e), key=key)
        with lock:  # the fast tokenizer is not safe to call from two threads at once
            tokens = processor.tokenizer([text], return_tensors="pt")
        inputs = {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"]}
        inputs.update({k: vision[k] for k in ("pixel_values", "image_grid_thw") if k in vision})
        requests.append(Request(key, kind, inputs))
        if (too_long := caption_length_rejection(key, requests[-1].num_tokens - fmt.start_idx, meta)) is not None:
            return too_long
    if nocontrol:  # the instruction alone, no pixels
        requests.append(Request(key, NOCONTROL, _nocontrol_inputs(fmt, processor, lock, str(meta.get("caption") or ""))))
    return requests


def _nocontrol_inputs(fmt: PromptFormat, processor, lock: threading.Lock, caption: str) -> dict[str, torch.Tensor]:
    """The processor's inputs for the instruction without the control images (no pixels)."""
    with lock:  # the fast tokenizer is not safe to call from two threads at once
        tokens = processor.tokenizer([fmt.text_without_images(caption)], return_tensors="pt")
    return {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"]}


def caption_length_rejection(key: str, text_tokens: int, meta: dict[str, Any]) -> Rejected | None:
    """Quarantine a prompt with more tokens than the transformer has text positions next to the sample's images
    (`models.multires.text_positions_left`). Not truncated: the stock edit pipelines neither truncate nor check
    (their `max_sequence_length` is never applied), so a truncated embedding is one no stock pipeline makes and a
    silently shortened instruction; the stored text stays exactly what the stock pipeline would encode."""
    from models.multires import text_positions_left

    left = text_positions_left(meta.get("img_shapes"))
    if text_tokens <= left:
        return None
    return Rejected("caption too long", f"the prompt is {text_tokens} tokens (caption, template and image tokens), "
                    f"the transformer has {left} text positions next to this sample's images (its RoPE table); "
                    "shorten the caption", key=key)


def prompt_fits(text_tokens: int, img_shapes: list) -> bool:
    """A stored prompt of `text_tokens` (its `length`: the count `prepare` checks) still fits next to these images
    (`caption_length_rejection`): a row carried to another target size is kept only then."""
    return caption_length_rejection("", text_tokens, {"img_shapes": img_shapes}) is None


def fill_image_slots(text: str, image_token: str, slots: list[str]) -> str:
    """Each image placeholder replaced by that image's run of tokens, as the processor does."""
    parts = text.split(image_token)
    if len(parts) - 1 != len(slots):
        raise UserError(f"the prompt has {len(parts) - 1} image slot(s) for {len(slots)} image(s); "
                        "check encode_text.prompt_template")
    return parts[0] + "".join(slot + part for slot, part in zip(slots, parts[1:]))


# ---------------------------------------------------------------- batching and the batched forward


def batches(requests: Iterable[Request], mode: str, batch_size: int) -> Iterator[list[Request]]:
    """exact: identical shapes only. padded: windows of PADDED_WINDOW batches' worth of requests, each sorted by
    token count and cut into full batches, so a batch holds similar lengths (little padding)."""
    if mode == "exact":
        yield from batches_by_shape(requests, lambda r: r.shape, batch_size)
        return
    stream = iter(requests)  # windows are read as they come (waiting requests hold their pixels)
    while window := sorted(islice(stream, PADDED_WINDOW * batch_size), key=lambda r: r.num_tokens):
        yield from (window[i : i + batch_size] for i in range(0, len(window), batch_size))


def right_padded(requests: list[Request], pad_token_id: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask of the batch, each text right-padded to the longest (mask 0 at pads).

    Right, as diffusers' `processor(..., padding=True)` pads with the Qwen2 tokenizer's default padding_side,
    and always right: the model gets no position ids (diffusers passes no mm_token_type_ids), so positions are
    0..L-1 by index; right padding keeps a request's positions and (causal attention) its valid tokens' context
    exactly as alone (left padding would shift positions: RoPE makes that invariant only up to rounding).
    """
    length = max(r.num_tokens for r in requests)
    if pad_token_id is None and any(r.num_tokens != length for r in requests):
        raise ValueError("requests of different lengths need a pad_token_id")
    ids = torch.full((len(requests), length), pad_token_id or 0, dtype=requests[0].inputs["input_ids"].dtype)
    mask = torch.zeros((len(requests), length), dtype=requests[0].inputs["attention_mask"].dtype)
    for i, r in enumerate(requests):
        ids[i, : r.num_tokens] = r.inputs["input_ids"][0]
        mask[i, : r.num_tokens] = r.inputs["attention_mask"][0]
    return ids, mask


@torch.no_grad()
def encode_batch(text_encoder, requests: list[Request], start_idx: int,
                 pad_token_id: int | None = None) -> list[torch.Tensor]:
    """One forward over the requests; per request the last hidden states of its valid tokens minus the template
    prefix, as diffusers' `_extract_masked_hidden` + `[drop_idx:]` (same-shape requests: every token valid).

    Calls the model with exactly the arguments diffusers' `_get_qwen_prompt_embeds` passes (no
    mm_token_type_ids, so the same position ids), via the base model: same hidden states, no lm_head.
    """
    device = text_encoder.device
    ids, mask = (t.to(device) for t in right_padded(requests, pad_token_id))
    # Every request's images in batch order: the model fills the batch's image tokens with them in that order.
    vision = {k: torch.cat([r.inputs[k] for r in requests if k in r.inputs]).to(device)
              for k in ("pixel_values", "image_grid_thw") if any(k in r.inputs for r in requests)}
    hidden = text_encoder.model(
        input_ids=ids, attention_mask=mask,
        pixel_values=vision.get("pixel_values"), image_grid_thw=vision.get("image_grid_thw"),
    ).last_hidden_state
    return [h[m.bool()][start_idx:] for h, m in zip(hidden, mask)]


def text_schema(job: EncodeJob, fmt: PromptFormat, hidden_size: int, dtype: str, nocontrol: bool = False) -> TableSchema:
    return TableSchema(
        name=TABLE,
        lineage=job.lineage,
        fields=[
            FieldSpec("prompt_embeds", "bfloat16", rank=2),
            FieldSpec("empty_embeds", "bfloat16", rank=2),
            FieldSpec("length", "int64", kind="column"),
            FieldSpec("empty_length", "int64", kind="column"),
            FieldSpec("num_controls", "int64", kind="column"),
        ] + ([FieldSpec("nocontrol_embeds", "bfloat16", rank=2)] if nocontrol else []),
        attrs={
            "prompt_format": fmt.lineage_record(),
            "hidden_size": hidden_size,
            "encoder_dtype": dtype,
            "embeds": "Qwen2.5-VL last hidden state, valid tokens only, [length, hidden_size] bf16",
            # rows may hold the stored part of a sample encoded under these settings (`_complete_nocontrol`)
            **({PART_LINEAGES_ATTR: {"columns": list(CARRIED_PART), "feature_lineages": list(job.part_record)}}
               if nocontrol and job.partial_lineages else {}),
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
    from models.loading import model_variant, pipeline_family

    if model_variant(model) == "qwen-image-2.1":  # Qwen3-VL, 0..10 references, slot masks
        from stages.encode.qwen21 import run_text

        return run_text(cfg, store, model, device, batch_size, ranks)
    section = with_overrides(cfg.encode_text, device=device, batch_size=batch_size)
    fmt = prompt_format(pipeline_family(model_variant(model)), section.prompt_template, section.prompt_template_start_idx)
    section, ranks, target = placed(section, STAGE, ranks)

    def by_controls(n: int, key: str) -> Rejected | None:  # asked of the manifest's column: refused ones unread
        return control_count_rejection(fmt.variant, n, key)

    settings, earlier, serving = feature_hashes(section, fmt)
    job = open_job(store, STAGE, TABLE, settings, model, FEATURE_REVISION, ranks, components=COMPONENTS,
                   on_damaged=section.on_damaged, max_damaged_fraction=section.max_damaged_fraction,
                   earlier_hashes=earlier, fixes=FIXES, serving_hashes=serving,
                   unread=TEXT_UNREAD[fmt.variant], by_controls=by_controls,
                   partial_hashes=without_nocontrol_hashes(section, fmt))
    job.prompt_fits = prompt_fits
    say_other_images(job, cfg)
    if job.up_to_date:
        return job.summary
    if fmt.variant != "edit" and not job.images.schema.attrs.get("resize", {}).get("vl_views", True):
        job.close()  # every rank reads the same table: all stop here, before loading the encoder
        raise UserError(f"store {store}: its images table was made with resize.vl_views: false (for Qwen-Image-2.1), "
                        f"so it has no control_{{i}}_vl.png, which {model}'s text encoder reads; rerun resize-bucket "
                        "with resize.vl_views: true")

    with job.working():  # from the model load on (a load that fails closes the job too)
        return _encode(job, section, fmt, model, target, by_controls)


def _encode(job, section, fmt, model: str, target, by_controls) -> Summary:
    """`run`'s work from the model load on: the VL model and its processor (never the transformer or the VAE),
    the table's writer, every sample's prompt and no-control embeddings written as both kinds are in."""
    from models.loading import load_component, parse_dtype
    from models.precision import check_loaded_dtype

    processor = load_component(model, "processor")
    check_start_idx(fmt, processor.tokenizer)  # before the VL model loads
    text_encoder = load_component(model, "text_encoder", dtype=parse_dtype(section.dtype),
                                  device=target)
    check_loaded_dtype(text_encoder, section.dtype, "encode_text.dtype")
    nocontrol = section.no_control_embeds
    kinds = KINDS + ((NOCONTROL,) if nocontrol else ())
    schema = text_schema(job, fmt, text_encoder.config.text_config.hidden_size, section.dtype, nocontrol)
    lock = threading.Lock()
    forward = MemoryBoundForward(
        lambda part: encode_batch(text_encoder, part, fmt.start_idx, processor.tokenizer.pad_token_id), STAGE,
        lambda r: f"sample {r.key} ({r.num_tokens} tokens)", target, "encode_text.batch_size")
    if nocontrol:  # a sample a table without them holds: only its nocontrol_embeds computed
        job.complete_rows = lambda version, rows: _complete_nocontrol(
            job, version, rows, lambda caption: _nocontrol_inputs(fmt, processor, lock, caption), forward, section)
    todo = job.open_writer(schema, section.shard_size_mb)
    samples = prefetched(job.read_inputs(todo, by_controls),
                         job.unless_rejected(lambda item: prepare(*item, fmt, processor, lock, nocontrol)),
                         workers=section.num_workers)
    done: dict[str, dict[str, torch.Tensor]] = {}  # key -> kind -> embeds, until both kinds are in
    with job.progress(len(todo)) as bar:
        requests = (r for pair in job.accepted(samples, bar) for r in pair)
        for batch in batches(requests, section.batching, section.batch_size):
            with job.timed_forward(len(batch), forward):
                embeds = forward(batch)
            for req, emb in zip(batch, embeds):
                parts = done.setdefault(req.key, {})
                parts[req.kind] = emb.to("cpu", torch.bfloat16)
                bar.encoded(len(kinds))
                if len(parts) == len(kinds):
                    job.summary.encoded += _write(job, req.key, done.pop(req.key), f"encode_text.dtype {section.dtype}")
    return job.finish()


def _complete_nocontrol(job: EncodeJob, version: int, rows, inputs, forward, section: EncodeTextConfig) -> set[str]:
    """The samples of `rows` (stored rows of `version`, a table encoded without no_control_embeds) written with
    their stored prompt and empty embeddings and their nocontrol ones computed now (`inputs`: caption -> the
    processor's inputs; the forward and batching a full encode uses, so the table is the one it makes). Returns
    the keys done (written, or quarantined as a full encode quarantines them); a stored sample found damaged is
    left out (encoded whole)."""
    from stages.encode.output import completing

    return completing(job, version, rows.column("key").to_pylist(), PADDED_WINDOW * section.batch_size,
                      lambda reader, keys: _complete_some(job, reader, keys, inputs, forward, section))


def _complete_some(job: EncodeJob, reader, keys: list[str], inputs, forward, section: EncodeTextConfig) -> set[str]:
    """`_complete_nocontrol` for a few `keys` of `reader`'s version."""
    from store.integrity import DamagedData

    stored: dict[str, dict[str, torch.Tensor]] = {}
    for key in keys:
        try:
            stored[key] = reader.tensors(key)
        except DamagedData:  # encoded whole instead
            continue
    requests = [Request(k, NOCONTROL, inputs(str(job.images.cells(k, ("caption",)).get("caption") or "")))
                for k in stored]
    for batch in batches(requests, section.batching, section.batch_size):
        with job.timed_forward(len(batch), forward):
            embeds = forward(batch)
        for req, emb in zip(batch, embeds):
            parts = {"prompt": stored[req.key]["prompt_embeds"], "empty": stored[req.key]["empty_embeds"],
                     NOCONTROL: emb.to("cpu", torch.bfloat16)}
            job.summary.completed += _write(job, req.key, parts, f"encode_text.dtype {section.dtype}")
    return set(stored)


def _write(job: EncodeJob, key: str, parts: dict[str, torch.Tensor], dtype_setting: str) -> bool:
    """Add the sample (True), or quarantine it for a non-finite embedding (False)."""
    if (rejected := nonfinite_rejection(key, {f"{k}_embeds": t for k, t in parts.items()}, dtype_setting)):
        job.quarantine(key, rejected.reason, rejected.detail)
        return False
    meta = job.images.cells(key, ("split", "img_shapes", "num_controls"))
    job.writer.add(
        key,
        tensors={"prompt_embeds": parts["prompt"].contiguous(), "empty_embeds": parts["empty"].contiguous(),
                 **({"nocontrol_embeds": parts[NOCONTROL].contiguous()} if NOCONTROL in parts else {})},
        meta={
            "split": meta.get("split", "train"),
            "img_shapes": meta["img_shapes"],
            "length": parts["prompt"].shape[0],
            "empty_length": parts["empty"].shape[0],
            "num_controls": int(meta.get("num_controls", 0)),
        },
    )
    return True
