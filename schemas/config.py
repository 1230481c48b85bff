"""Typed pipeline configuration as pure data: a section per stage (parsing files and flags is `pipeline.config`).

Unknown keys and wrong types are rejected by pydantic with the dotted key named (`extra="forbid"`).
Each stage reads only its own section (plus `paths`). Every field declares once, as an `Annotated` lineage
`Role` (schemas/lineage.py), whether it changes features, identity or only throughput; every settings hash (table
lineage, per-sample feature lineage, the train run fingerprint, evaluate's inputs) is derived from that.
"""

from __future__ import annotations

import difflib
import struct
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, WrapValidator, field_validator, model_validator
from pydantic_core import PydanticCustomError

from schemas.lineage import FEATURES, IDENTITY, THROUGHPUT, WHILE_TRAINING, Role, added_later, adds_columns, section_fingerprint


class Section(BaseModel):
    # allow_inf_nan=False: `.inf` / `.nan` (valid YAML floats) are refused for every float setting with its key
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: Any) -> Any:
        """YAML reads `yes` / `on` / `true` as a boolean, and pydantic takes a boolean for a number (1 / 0): `max_steps:
        yes` trained one step, unsaid. A number setting refuses one, in a list too."""
        if (isinstance(value, bool) or isinstance(value, list) and any(isinstance(v, bool) for v in value)) \
                and _takes_only_numbers(cls.model_fields[info.field_name].annotation):
            raise ValueError("a boolean (YAML reads yes / no / on / off / true / false as one) is no number")
        if isinstance(value, bool) and (words := _boolean_words(cls.model_fields[info.field_name].annotation)):
            # `mixed_precision: no` is a YAML boolean: pydantic's "should be 'no' ... (got False)" reads as nonsense
            raise ValueError(f"YAML reads an unquoted {' / '.join(words)} as a boolean ({value}): write the word "
                             f"in quotes, e.g. '{words[0]}'")
        return value

    def fingerprint(self) -> str:
        """Stable hash of the settings that change what this section's stage produces (features + identity)."""
        return section_fingerprint(self)


def _takes_only_numbers(annotation: Any) -> bool:
    """Is a field a number (int / float, a list of them, or None), where pydantic reads a boolean as 1 / 0? A
    choice of words (Literal) refuses a boolean itself, listing the words; bool, Any and sections take one."""
    from typing import get_args, get_origin

    def kinds(a: Any) -> set:  # the types a value may take: int | None -> {int, NoneType}, list[float] -> {float}
        if get_origin(a) is Annotated:
            return kinds(get_args(a)[0])
        args = get_args(a)
        if not args or any(not isinstance(x, type) and not get_args(x) for x in args):  # Literal: values
            return {a}
        return set().union(*(kinds(x) for x in args))

    found = kinds(annotation) - {type(None)}
    return bool(found) and found <= {int, float}


#: the words of a choice that YAML 1.1 (PyYAML) reads unquoted as a boolean
_YAML_BOOLEANS = {"yes", "no", "on", "off", "true", "false", "y", "n"}


def _boolean_words(annotation: Any) -> list[str]:
    """The words of a choice (Literal, in an Annotated or a union too) that YAML reads unquoted as a boolean."""
    from typing import get_args, get_origin

    if get_origin(annotation) is Literal:
        return [w for w in get_args(annotation) if isinstance(w, str) and w.lower() in _YAML_BOOLEANS]
    return [w for a in get_args(annotation) for w in _boolean_words(a)]


class IntRange:
    """The range `lo .. hi` of an integer setting, checked at config load (a pydantic wrap validator): every int
    setting is one of the `Annotated` families below, so none reaches a stage past what fits an int64 or what a
    real run could use (tests/schemas/test_int_ranges.py walks the schema). Unbounded, `train.batch_size 1e20`
    stopped train with an OverflowError after setup, `train.lora.rank 1e12` failed allocating and
    `train.grad_accum 1e23` made a step that never ended. An integral float beyond it (YAML `1.0e+23`) is
    refused with the range too, before pydantic's int conversion says only "exceeded maximum size"."""

    def __init__(self, lo: int, hi: int, what: str) -> None:
        self.lo, self.hi, self.what = lo, hi, what

    def __call__(self, value: Any, handler: Any) -> Any:
        if isinstance(value, float) and value.is_integer() and not self.lo <= value <= self.hi:
            raise self._refused()
        value = handler(value)
        if not self.lo <= value <= self.hi:
            raise self._refused()
        return value

    def __get_pydantic_json_schema__(self, schema: Any, handler: Any) -> dict[str, Any]:
        # a wrap validator's bounds are invisible to pydantic: the JSON schema a user's editor reads shows them
        return {**handler(schema), "minimum": self.lo, "maximum": self.hi}

    def _refused(self) -> PydanticCustomError:
        # one line with the key and the value (pipeline/config.py `_format_errors` adds both)
        return PydanticCustomError("int_range", "should be {lo} .. {hi}, {what}",
                                   {"lo": self.lo, "hi": self.hi, "what": self.what})


def _ints(lo: int, hi: int, what: str) -> Any:
    """An integer setting of range lo .. hi (`IntRange`: the check, and the range in the JSON schema)."""
    rule = IntRange(lo, hi, what)
    return Annotated[int, WrapValidator(rule), rule]


#: generous but finite bounds: a product of a few of them (steps x batch x accumulation) still fits an int64
_STEPS, _SAMPLES, _PER_BATCH, _AREA = 10**9, 1 << 32, 1 << 16, 1 << 40
# a seed torch's generators take (torch.Generator.manual_seed: -2**63 .. 2**64 - 1): a larger one stopped train,
# evaluate or predict with an OverflowError traceback after the model had loaded
Seed = _ints(-(1 << 63), (1 << 64) - 1, "torch's generator range")
BatchSize = _ints(1, _PER_BATCH, "samples per batch")
Accumulation = _ints(1, _PER_BATCH, "micro-batches per optimizer step")
# static: above the model's smallest adapted width it is refused once the model is known (models/lora.py `add_lora`)
Rank = _ints(1, 1 << 16, "an adapter rank")
Steps = _ints(1, _STEPS, "optimizer steps")
StepsOrZero = _ints(0, _STEPS, "optimizer steps")
DenoisingSteps = _ints(1, 10_000, "denoising steps")
Samples = _ints(1, _SAMPLES, "samples")
SamplesOrZero = _ints(0, _SAMPLES, "samples")
Workers = _ints(0, 1024, "workers / threads / batches ahead")
Blocks = _ints(0, 1024, "transformer blocks")
Controls = _ints(0, 1024, "control images")
Side = _ints(1, 1 << 20, "pixels of a side")
Area = _ints(1, _AREA, "pixels")
Frames = _ints(1, 1 << 31, "frames")
FileBytes = _ints(1, 1 << 62, "bytes")
OpenFiles = _ints(1, 1 << 20, "files / batches kept")
Tokens = _ints(1, 1 << 40, "tokens")
TokensOrZero = _ints(0, 1 << 40, "tokens")


class Paths(Section):
    source: Annotated[str | None, IDENTITY] = None
    store: Annotated[str | None, IDENTITY] = None
    model: Annotated[str | None, IDENTITY] = None
    run: Annotated[str | None, IDENTITY] = None
    report: Annotated[str | None, IDENTITY] = None


class ParquetColumns(Section):
    """resize.columns: which parquet column holds what (a parquet source, docs/resize-bucket.md). Image columns
    hold bytes: a binary column or a HF datasets `{bytes, path}` struct; `references` names one list column or
    several single-image columns (controls in that order); [] for samples without controls."""

    target: Annotated[str, IDENTITY] = Field("target", description="column of the target (edited) image")
    references: Annotated[list[str], IDENTITY] = Field(
        default_factory=lambda: ["controls"], description="control image column(s): one list column, or one column per control")
    instruction: Annotated[str, IDENTITY] = Field("caption", description="column of the edit instruction (string)")
    mask: Annotated[str | None, IDENTITY] = Field(
        None, description="column of the optional edit mask; None (unset) = the column `mask` where a file has one "
        "as image bytes, '' = no masks")


class ResizeConfig(Section):
    """resize-bucket: how targets and controls are sized (Edit-Plus rules by default).

    `area: A` (flag `--area`) is the one switch for small-scale runs: it sets target_area and control_vae_area
    (the two sizes Edit-Plus keeps equal, ~1024²) to A. It is consumed on load, so configs, lineage and
    `config show` hold the two resulting keys; control_vl_area (the text encoder's view, 384² in Edit-Plus)
    stays as set.
    """

    @model_validator(mode="before")
    @classmethod
    def _area_sets_target_and_control(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("area") is None:
            if isinstance(data, dict) and "area" in data:
                data = {k: v for k, v in data.items() if k != "area"}
            return data
        data = dict(data)
        area = data.pop("area")
        if not isinstance(area, int) or isinstance(area, bool) or area <= 0:
            raise ValueError(f"resize.area must be a positive integer (pixels), got {area!r}")
        clash = [k for k in ("target_area", "control_vae_area") if data.get(k) not in (None, area)]
        if clash:  # (the flags --area, --target-area, --control-vae-area are these keys: one rule for both)
            raise ValueError(f"resize.area = {area} sets target_area and control_vae_area, but "
                             f"{' and '.join(f'{k} is {data[k]!r}' for k in clash)}: set area alone, or "
                             f"{' and '.join(clash)} without area")
        data["target_area"] = data["control_vae_area"] = area
        return data

    target_area: Annotated[Area, FEATURES] = Field(1024 * 1024, description="target pixel area of a bucket")
    multiple: Annotated[Side, FEATURES] = Field(32, description="bucket sides are multiples of this")
    min_side: Annotated[Side, FEATURES] = 32
    max_aspect: Annotated[float, FEATURES] = Field(4.0, gt=1.0, description="buckets are clamped to this aspect ratio")
    # read only while VL views are rendered (`vl_views`, stages/resize/rendering.py `_render`): under false it enters
    # every hash as its default (changing it there re-rendered every picture into the same bytes)
    control_vl_area: Annotated[Area, Role("features", read_if=lambda rc: rc.vl_views)] = Field(
        384 * 384, description="VL view of each control (Edit-Plus CONDITION_IMAGE_SIZE)")
    control_vae_area: Annotated[Area, FEATURES] = Field(1024 * 1024, description="VAE view of each control (Edit-Plus VAE_IMAGE_SIZE)")
    max_controls: Annotated[Controls, IDENTITY] = 3
    min_controls: Annotated[Controls, IDENTITY] = 0
    max_image_pixels: Annotated[Area, IDENTITY] = Field(64 * 1024 * 1024, description="larger images are rejected (decompression bombs)")
    max_image_frames: Annotated[Frames, added_later("identity")] = Field(
        10_000, description="animated GIFs / multi-page TIFFs of more frames are rejected (counting them walks "
        "every frame: a hostile file of millions held a worker for half an hour)")
    max_file_bytes: Annotated[FileBytes, added_later("identity")] = Field(
        1 << 30, description="larger source files are quarantined unread (only regular files are read at all)")
    # identity: which samples a table holds. Added later: the default is hashed as unset, so a store made before keeps
    # its fingerprint (a caption over it there is refused when its source is read again, docs/resize-bucket.md)
    max_caption_bytes: Annotated[FileBytes, added_later("identity")] = Field(
        64 * 1024, description="a sample whose caption (file, tar member, JSONL field or parquet cell) is larger, "
        "in UTF-8 bytes as read, is quarantined as caption-too-long, a file or tar member unread. The transformer "
        "holds at most 4096 text tokens (less next to large images): ~16 KB of English, far below the default")
    keep_alpha: Annotated[bool, added_later()] = Field(
        False, description="store images with transparency as RGBA instead of composited over white (Qwen-Image-2.1: "
        "its VAE reads the alpha channel)")
    vl_views: Annotated[bool, added_later()] = Field(
        True, description="write each control's VL view control_{i}_vl.png (area control_vl_area), which Edit-Plus "
        "reads; Qwen-Image-2.1 does not (its VLM reads control_{i}.png): false skips rendering and storing them")
    val_fraction: Annotated[float, IDENTITY] = Field(0.1, ge=0.0, lt=1.0)
    # identity (which split a sample is in, not its pixels: the encoders carry every sample across a change). Added
    # later: "key" hashes as unset, so a store split by key before the rule was recorded stays up to date
    split_by: Annotated[Literal["pictures", "key"] | None, Role("identity", hashed_unless_default=True,
                                                             hashed_as=lambda rule: None if rule == "key" else rule)] = Field(
        None, description="what the train/val hash reads: pictures = target + controls (every caption of a pair in "
        "one split), key = target + controls + caption (stores made before this setting); None = the store's "
        "recorded rule, pictures for a new store (stages/resize/split_rule.py)")
    shard_size_mb: Annotated[float, THROUGHPUT] = Field(256, gt=0, description="images table shard size (fractions allowed, e.g. for tests)")
    workers: Annotated[Workers, THROUGHPUT] = Field(0, description="processes decoding/resizing/encoding PNGs (0 = in the main process)")
    # which bytes are the target, controls, caption: changes which samples a table holds (keys are content hashes)
    columns: Annotated[ParquetColumns, added_later("identity")] = Field(
        ParquetColumns(), description="parquet sources: the column mapping")


Sigma = Annotated[float, Field(gt=0.0, le=1.0)]  # a noise level σ of the flow: 0 (clean) excluded, 1 = pure noise


def _each_once(values: list) -> list:
    """A noise seed or σ listed twice is every loss of that row computed twice and counted twice in the mean (the
    summary saying "x 2 seeds"). σ are compared as the float32 the loss is computed at
    (stages/evaluate/loss_section.py)."""
    seen: dict = {}
    for v in values:
        same = struct.unpack("f", struct.pack("f", v))[0] if isinstance(v, float) else v
        if same in seen:
            twice = f"{v!r} (the same float32 σ as {seen[same]!r})" if seen[same] != v else repr(v)
            raise ValueError(f"{twice} is listed twice: each value is one row of the loss; list it once")
        seen[same] = v
    return values


Sigmas = Annotated[list[Sigma], AfterValidator(_each_once)]  # a σ grid of a held-out loss: each σ once
# a held-out loss's noise draws: each seed once, within int64 (the losses file stores them as int64,
# store/loss_array.py: 2**63 passed torch's range and stopped the first validation with an OverflowError)
NoiseSeeds = Annotated[list[_ints(-(1 << 63), (1 << 63) - 1, "int64, as the losses file stores seeds")],
                       AfterValidator(_each_once)]
DType = Literal["auto", "float32", "bfloat16", "float16"]
_DTYPE_HELP = "auto = bfloat16 on a CUDA device that supports it, float32 on the CPU (models/precision.py)"


def _on_damaged(what: str, otherwise: str):
    """`on_damaged` of a section that reads store samples (train, evaluate, the encoders): the same choice
    everywhere, described for what that section reads."""
    return Field("stop", description=f"a damaged {what} (checksum mismatch, missing/short shard): stop with an "
                 f"error naming it, or {otherwise}")


def _max_damaged_fraction(of: str):
    return Field(0.01, ge=0.0, le=1.0, description=f"on_damaged=skip: stop anyway when more than this fraction of "
                 f"{of} is damaged")
_DEVICE_HELP = ("auto (CUDA when there is one, else the CPU), cpu, cuda, cuda:N, or one device per local rank "
                "([cuda:0, cuda:1]); cuda = cuda:LOCAL_RANK")


class EncodeTextConfig(Section):
    device: Annotated[str | list[str], THROUGHPUT] = Field("auto", description=_DEVICE_HELP)
    dtype: Annotated[DType, FEATURES] = Field("auto", description=_DTYPE_HELP)
    batch_size: Annotated[BatchSize, THROUGHPUT] = 8
    prompt_template: Annotated[str | None, FEATURES] = Field(None, description="None = the model's own diffusers template")
    prompt_template_start_idx: Annotated[TokensOrZero | None, FEATURES] = None
    batching: Annotated[Literal["exact", "padded"], FEATURES] = Field(
        "exact", description="exact: batch only identical input shapes (bit-exact, small batches on mixed data); "
        "padded: any requests per batch, text right-padded (float32 within ~1e-6 of exact; full batches, use on GPUs)")
    shard_size_mb: Annotated[float, THROUGHPUT] = Field(256, gt=0, description="shard file size target (fractions allowed)")
    num_workers: Annotated[Workers, THROUGHPUT] = Field(2, description="threads decoding + preprocessing ahead of the forward (0 = inline)")
    # true only adds `nocontrol_embeds`: a table encoded with it serves a run with it false (nothing re-encoded).
    # The other embeddings are bit for bit the same under `exact` batching (a request's result does not depend on
    # what else its batch holds); under `padded` the extra requests change the batches, which moves them by
    # float32 rounding only, as a batch size change does (not hashed either)
    no_control_embeds: Annotated[bool, adds_columns()] = Field(False, description="also store the instruction encoded without its control "
                                    "images (`nocontrol_embeds`, for train.control_dropout); a table encoded with "
                                    "it stays up to date when it is turned off, and turned on over a table "
                                    "without it only those embeddings are computed (the rest carried)")
    on_damaged: Annotated[Literal["stop", "skip"], THROUGHPUT] = _on_damaged(
        "`images` sample", "skip it (quarantined as damaged-input, named in the summary)")
    max_damaged_fraction: Annotated[float, THROUGHPUT] = _max_damaged_fraction("the samples")


class EncodeVaeConfig(Section):
    device: Annotated[str | list[str], THROUGHPUT] = Field("auto", description=_DEVICE_HELP)
    dtype: Annotated[DType, FEATURES] = Field("auto", description=_DTYPE_HELP)
    batch_size: Annotated[BatchSize, THROUGHPUT] = 8
    shard_size_mb: Annotated[float, THROUGHPUT] = Field(256, gt=0, description="shard file size target (fractions allowed)")
    num_workers: Annotated[Workers, THROUGHPUT] = Field(2, description="threads decoding + preprocessing ahead of the forward (0 = inline)")
    on_damaged: Annotated[Literal["stop", "skip"], THROUGHPUT] = _on_damaged(
        "`images` sample", "skip it (quarantined as damaged-input, named in the summary)")
    max_damaged_fraction: Annotated[float, THROUGHPUT] = _max_damaged_fraction("the samples")


# train.lora.target_modules: peft matches each layer against the set of names, and the LoRA file records them sorted,
# so their order (or a name twice) is no setting: hashed in one order, the default's names first as there, then the
# others sorted - a list already in that order (the default) keeps its fingerprint. A reordered list was another run
# (a resume refused, `run all` trained afresh from step 0). Records made in another order are read as set
# (stages/train/settings.py `earlier_config_fingerprints`).
_DEFAULT_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
_A_SET_OF_LAYERS = Role("features", hashed_as=lambda names: sorted(
    dict.fromkeys(names), key=lambda n: (_DEFAULT_TARGETS.index(n) if n in _DEFAULT_TARGETS else len(_DEFAULT_TARGETS), n)))


class LoraConfig(Section):
    rank: Annotated[Rank, FEATURES] = 16
    alpha: Annotated[float | None, FEATURES] = Field(None, gt=0, description="None = rank")
    dropout: Annotated[float, FEATURES] = Field(0.0, ge=0.0, lt=1.0)
    target_modules: Annotated[list[str], _A_SET_OF_LAYERS] = list(_DEFAULT_TARGETS)
    init_weights: Annotated[Literal["gaussian", "default"], FEATURES] = "gaussian"
    kind: Annotated[Literal["lora", "dora", "loha", "lokr"], added_later()] = Field(
        "lora", description="peft adapter: lora | dora (LoRA + magnitude) | loha (Hadamard) | lokr (Kronecker); "
        "only lora loads in diffusers' Qwen-Image pipelines (docs/train.md)")


def _read_under(sampling: str) -> Role:
    """A σ distribution's parameter: `models.flow.sample_sigmas` reads it under that `sampling` only, else it
    enters the run fingerprint as its default. Before: always hashed, so `sigma.shift` edited under logit_normal
    refused the resume and `run all` trained the same weights again from step 0 (runs fingerprinted with such a
    value as set resume: stages/train/settings.py `earlier_config_fingerprints`)."""
    return Role("features", read_if=lambda sigma: sigma.sampling == sampling)


class SigmaConfig(Section):
    sampling: Annotated[Literal["uniform", "logit_normal", "shift", "dynamic_shift"], FEATURES] = "logit_normal"
    logit_mean: Annotated[float, _read_under("logit_normal")] = 0.0
    logit_std: Annotated[float, _read_under("logit_normal")] = Field(1.0, gt=0)
    shift: Annotated[float, _read_under("shift")] = Field(3.0, gt=0)
    base_shift: Annotated[float, _read_under("dynamic_shift")] = 0.5
    max_shift: Annotated[float, _read_under("dynamic_shift")] = 0.9
    base_image_seq_len: Annotated[TokensOrZero, _read_under("dynamic_shift")] = 256
    max_image_seq_len: Annotated[TokensOrZero, _read_under("dynamic_shift")] = 8192

    @model_validator(mode="after")
    def _a_sequence_range(self) -> SigmaConfig:
        # calculate_shift's slope divides by max_image_seq_len - base_image_seq_len: equal ones stopped train's first
        # step on a ZeroDivisionError. Left unset, one is the model's scheduler's (stages/train/settings.py
        # `sigma_for_model` checks the numbers resolved there with this section)
        lens = ("base_image_seq_len", "max_image_seq_len")
        if self.sampling == "dynamic_shift" and set(lens) <= self.model_fields_set \
                and self.base_image_seq_len == self.max_image_seq_len:
            raise ValueError(f"base_image_seq_len and max_image_seq_len are both {self.max_image_seq_len}: "
                             "dynamic_shift's calculate_shift divides by their difference; make them differ "
                             "(the Edit models: 256 and 8192)")
        return self


class MaskWeight(Section):
    foreground: Annotated[float, FEATURES] = Field(1.0, ge=0.0)
    background: Annotated[float, FEATURES] = Field(1.0, ge=0.0)

    @model_validator(mode="after")
    def _some_weight(self) -> MaskWeight:
        # every masked sample's loss would be 0 (each is normalised by its total weight): a run that learns nothing
        # from them, its loss printed as 0.0000
        if self.foreground == 0 and self.background == 0:
            raise ValueError("foreground and background are both 0: a masked sample's loss would weigh nothing and "
                             "train nothing; give the edited region a weight above 0 (e.g. foreground: 1)")
        return self


class LossConfig(Section):
    mask_weight: Annotated[MaskWeight, FEATURES] = MaskWeight()


def _quantize_alias(value: Any) -> Any:
    """`int8_weight_only` (the first name of the int8 option) still reads, as `int8`."""
    return "int8" if value == "int8_weight_only" else value


Quantize = Annotated[Literal["none", "int8", "fp8", "nf4"], BeforeValidator(_quantize_alias)]
_QUANTIZE_HELP = ("frozen transformer base, quantised while it loads: none | int8 | fp8 (torchao weight-only) | nf4 "
                  "(bitsandbytes 4-bit); int8_weight_only is read as int8")


def lycoris_on_nf4(what: str) -> str:
    """The one line refusing a LoHa / LoKr adapter (`what`) on an NF4 base: said by TrainConfig's validation at
    startup and by models/lora.py `refuse_lycoris_on_nf4` once a model has loaded (a LoRA file's own kind)."""
    return (f"{what} on an NF4 base (quantize_base nf4): peft's LoHa / LoKr read the base weight's shape, an NF4 "
            "weight's is its packed codes; use quantize_base int8, fp8 or none, or a lora / dora adapter")
# The denoising steps' lower bound is the model's: checked where it is known (models.loading.check_sampling_steps).
ONE_STEP = ("1 samples Qwen-Image-2.1; the Edit models refuse it (their scheduler's shift_terminal stretch divides "
            "0 by 0 at one step)")


# The LR schedule decays towards max_steps: then it changes the weights; under a constant LR a resume may raise it.
_DECAYING_LR_ONLY = Role("throughput", features_if=lambda train: train.lr_schedule != "constant")
# Fixed-size batches: batch_size decides every step's samples; under a token budget (max_tokens_per_batch) the
# sampler and an elastic resume ignore it (held-out rows per forward only): a resume may change it there.
_FIXED_BATCHES_ONLY = Role("features", features_if=lambda train: train.max_tokens_per_batch is None)


# train.init_lora: whether one is set, not where: its weight file's bytes are the resume record's init_lora_sha256
# (stages/train/state.py), so the same file moved or mounted elsewhere is the same run (runs fingerprinted with its
# path: `earlier_config_fingerprints`)
_BYTES_RECORDED = Role("features", hashed_unless_default=True, hashed_as=lambda path: "weights: init_lora_sha256")

# train.adam_betas / adam_eps: Adafactor takes neither (stages/train/optimizers.py): under it they enter the run
# fingerprint as their defaults, as the σ parameters `sigma.sampling` does not read (`_read_under`)
_ADAM_ONLY = Role("features", read_if=lambda train: train.optimizer != "adafactor")


# evaluate.on_damaged changes no number unless a sample is damaged, and then the samples read differ: their keys
# are the loss array's sample axis and in the base caches' keys, and a report that left one out is current under
# "skip" only (stages/evaluate). Hashed as its default, "stop" (what every record of it held), so switching it
# recomputes nothing; records made with "skip" are accepted as set (`hashed_settings(..., as_set=True)`).
_SAMPLES_RECORDED = Role("identity", hashed_as=lambda value: "stop")
# evaluate.on_nonfinite, likewise: a report made under "stop" has no non-finite sample (one stops evaluate), and one that
# left such samples out (metrics.json loss.nonfinite_samples) is current under "skip" only (stages/evaluate
# `nonfinite_current`); the loss array holds the numbers as computed. Hashed as its default (left out, as added
# later), so switching it recomputes nothing; records made with "skip" are accepted as set.
_NONFINITE_RECORDED = Role("identity", hashed_unless_default=True, hashed_as=lambda value: "stop")
# evaluate.negative_prompt: read only for the extra prompts, under true CFG (models/edit.py `prepare`,
# stages/evaluate/qwen21.py); else hashed as its default (the val samples use the stored empty prompt)
_EXTRA_PROMPTS_ONLY = Role("features", read_if=lambda ev: bool(ev.extra_prompts) and ev.true_cfg_scale > 1)


# evaluate.noise_seeds / timesteps: each (seed, σ) row's loss is its own (noise drawn from the seed and sample key),
# and every number is a mean over rows, so their order is no setting: hashed sorted, and evaluate computes and
# records the rows in that order (`EvaluateConfig.loss_axes`). [0.7, 0.3] after [0.3, 0.7] evaluated every
# checkpoint again. Records made in another order are accepted as set (`hashed_settings(..., as_set=True)`).
_A_SET_OF_ROWS = Role("features", hashed_as=sorted)


def held_out_axes(noise_seeds: list[int], timesteps: list[float]) -> tuple[list[int], list[float]]:
    """(noise seeds, σ grid) of a held-out loss in the one order its grids are computed, recorded and hashed in:
    sorted (their order is no setting, see `_A_SET_OF_ROWS`); evaluate's (`EvaluateConfig.loss_axes`) and train's
    validation curve's (`TrainConfig.validate_axes`)."""
    return sorted(noise_seeds), sorted(float(t) for t in timesteps)


# train.attention_backend: the configured name is not hashed; the backend the run resolved it to (unset: the
# device's default) is recorded beside the fingerprint (stages/train/state.py `ResumeRecord.attention_backend`) and
# compared there, so `native` spelled out after an unset CPU run is that run, and a name that resolves to another
# backend is not. Hashed as None: every run made unset keeps its fingerprint; one made with a name set is read
# through its spelling as set (stages/train/settings.py `earlier_config_fingerprints`).
_BACKEND_RECORDED = Role("features", hashed_as=lambda name: None)


class TrainConfig(Section):
    device: Annotated[str | list[str] | None, THROUGHPUT] = Field(None, description="None = accelerate's choice; else " + _DEVICE_HELP)
    dtype: Annotated[DType, FEATURES] = Field("auto", description="frozen base weights; " + _DTYPE_HELP + " (auto: "
                                              "bf16 under mixed_precision bf16; float32 stays float32 under bf16 autocast)")
    seed: Annotated[Seed, FEATURES] = 0
    batch_size: Annotated[BatchSize, _FIXED_BATCHES_ONLY] = 4
    grad_accum: Annotated[Accumulation, FEATURES] = 1
    max_steps: Annotated[Steps, _DECAYING_LR_ONLY] = 100
    learning_rate: Annotated[float, FEATURES] = Field(1e-4, gt=0)
    weight_decay: Annotated[float, FEATURES] = Field(0.0, ge=0)
    adam_betas: Annotated[tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]], _ADAM_ONLY] = (0.9, 0.999)
    adam_eps: Annotated[float, _ADAM_ONLY] = Field(1e-8, gt=0)
    warmup_steps: Annotated[StepsOrZero, FEATURES] = 0
    lr_schedule: Annotated[Literal["constant", "cosine", "linear"], FEATURES] = "constant"
    max_grad_norm: Annotated[float | None, FEATURES] = Field(1.0, gt=0)
    mixed_precision: Annotated[Literal["no", "bf16", "fp16"], FEATURES] = "no"
    # memory settings: the same weights (tests/stages/test_train.py, test_qwen21_stages.py), so a resume may change
    # them (OOM advice); runs fingerprinted with them resume (stages/train/settings.py `earlier_config_fingerprints`)
    gradient_checkpointing: Annotated[bool, THROUGHPUT] = False
    uncheckpointed_blocks: Annotated[Blocks, THROUGHPUT] = Field(
        0, description="with gradient checkpointing (or offload): the first N transformer blocks keep their "
        "activations instead (not run again in the backward: N/blocks less recompute, N blocks' activations more "
        "memory; `pipeline plan --gpu-memory G` prints the largest N that fits); 0 = every block checkpointed")
    quantize_base: Annotated[Quantize, FEATURES] = Field("none", description=_QUANTIZE_HELP)
    offload: Annotated[Literal["none", "blocks"], THROUGHPUT] = Field(
        "none", description="blocks: frozen transformer blocks live in (pinned) host memory and stream to the device")
    offload_blocks_on_device: Annotated[Blocks, THROUGHPUT] = Field(0, description="offload=blocks: leading blocks kept on the device")
    caption_dropout: Annotated[float, FEATURES] = Field(0.0, ge=0.0, le=1.0)
    checkpoint_every: Annotated[Steps, WHILE_TRAINING] = 50
    keep_checkpoints: Annotated[OpenFiles, WHILE_TRAINING] = 3
    log_every: Annotated[Steps, WHILE_TRAINING] = Field(1, description="tracker scalars every N steps (train/loss: the mean of those N steps)")
    log_with: Annotated[list[str], WHILE_TRAINING] = Field(["tensorboard"], description="metric trackers (accelerate's): tensorboard, wandb, "
                                "mlflow, comet_ml, aim, clearml, dvclive, swanlab, trackio; all but tensorboard are "
                                "optional packages")
    profile: Annotated[StepsOrZero, WHILE_TRAINING] = Field(0, description="record the first N optimizer steps of a start with torch.profiler -> "
                         "RUN/profile/trace-rank{R}.json (Chrome trace); 0 = off")
    sampler_window: Annotated[OpenFiles, FEATURES] = Field(64, description="length-aware sampler: batches per sorting window")
    on_damaged: Annotated[Literal["stop", "skip"], THROUGHPUT] = _on_damaged(
        "store sample", "leave it out of its batch where it is read (no pass before step 0), listed in "
        "RUN/damaged_samples.jsonl (one JSON line per sample)")
    max_damaged_fraction: Annotated[float, THROUGHPUT] = _max_damaged_fraction("the training samples")
    on_nonfinite: Annotated[Literal["stop", "skip_step"], THROUGHPUT] = Field(
        "stop", description="a non-finite loss or gradient: stop naming the step and samples, or skip that "
        "optimizer step (no update, logged)")
    lora: Annotated[LoraConfig, FEATURES] = LoraConfig()
    sigma: Annotated[SigmaConfig, FEATURES] = SigmaConfig()
    loss: Annotated[LossConfig, FEATURES] = LossConfig()
    max_dropped_fraction: Annotated[float, THROUGHPUT] = Field(0.05, ge=0.0, le=1.0, description="train/evaluate use the samples both the "
                                        "text and vae tables hold; fail when more than this share of the split is "
                                        "missing from either (reasons in STORE/quarantine.parquet)")
    max_open_shards: Annotated[OpenFiles, THROUGHPUT] = Field(256, description="shard files kept open per table (LRU; descriptors for "
                                 "random reads, maps for scans)")
    init_lora: Annotated[str | None, _BYTES_RECORDED] = Field(None, description="start from this LoRA (diffusers, kohya lora_unet_*, ComfyUI "
                                  "diffusion_model.*); rank and targets must match train.lora")
    optimizer: Annotated[Literal["adamw", "adamw8bit", "adafactor", "prodigy"], added_later()] = Field(
        "adamw", description="adamw (torch) | adamw8bit (bitsandbytes) | adafactor (transformers) | prodigy "
        "(prodigyopt; set learning_rate ~1.0)")
    ema_decay: Annotated[float | None, added_later()] = Field(None, gt=0.0, lt=1.0, description="EMA of the adapter -> RUN/lora_ema (None = off); "
                                   "warmed up as diffusers' EMAModel: decay min(d, n / (n + 9)) at step n")
    control_dropout: Annotated[float, added_later()] = Field(0.0, ge=0.0, le=1.0, description="per-sample probability of training on the "
                                   "instruction encoded without its control images (needs encode_text.no_control_embeds)")
    validate_every: Annotated[Steps | None, WHILE_TRAINING] = Field(None, description="held-out loss on the val split every N steps")
    validate_max_samples: Annotated[Samples, WHILE_TRAINING] = Field(8, description="validation: first N val samples (by key)")
    validate_timesteps: Annotated[Sigmas, WHILE_TRAINING] = Field([0.25, 0.5, 0.75], min_length=1, description="validation σ grid")
    validate_noise_seeds: Annotated[NoiseSeeds, WHILE_TRAINING] = Field([0], min_length=1, description="validation noise seeds")
    sample_every: Annotated[Steps | None, WHILE_TRAINING] = Field(None, description="generate val samples every N steps -> RUN/samples")
    sample_count: Annotated[Samples, WHILE_TRAINING] = Field(2, description="val samples per sample grid")
    sample_steps: Annotated[DenoisingSteps, WHILE_TRAINING] = Field(4, description="denoising steps of the sample grid; " + ONE_STEP)
    max_tokens_per_batch: Annotated[Tokens | None, FEATURES] = Field(
        None, description="None = fixed batch_size batches; else each batch holds as many samples as fit in "
        "this many computed tokens (batch size x longest sequence), see stages/train/budget.py")
    prefetch: Annotated[Workers, THROUGHPUT] = Field(0, description="micro-batches read, drawn and copied to the device ahead by a "
                          "background thread (0 = inline)")
    attention_backend: Annotated[str | None, _BACKEND_RECORDED] = Field(
        None, description="diffusers attention backend for padded batches (models/attention.py); None = the "
        "fastest correct one available (CUDA) / native (CPU)")
    compile: Annotated[bool, THROUGHPUT] = Field(False, description="torch.compile each transformer block (regional compilation)")
    check_ahead: Annotated[SamplesOrZero, THROUGHPUT] = Field(32, description="samples whose checksums a background thread verifies ahead of "
                             "the reads, in the sampler's order (0 = check each sample inline on its first read)")

    @model_validator(mode="after")
    def _no_lycoris_on_nf4(self) -> TrainConfig:
        # refused where train/run all/plan read the config: models/lora.py said it only once the model had loaded
        # (minutes for the 20B transformer), which stays as the guard
        if self.quantize_base == "nf4" and self.lora.kind in ("loha", "lokr"):
            raise ValueError(lycoris_on_nf4(f"train.lora.kind {self.lora.kind}"))
        return self

    @property
    def validate_axes(self) -> tuple[list[int], list[float]]:
        """(validate_noise_seeds, validate_timesteps) in the order the validation curve computes, records and hashes
        them: sorted, as evaluate's (`held_out_axes`), so the same grid reordered on a resume continues the curve."""
        return held_out_axes(self.validate_noise_seeds, self.validate_timesteps)


class ExtraPrompt(Section):
    """An evaluate sample that is not in the store: control image file(s), an instruction, optional target."""

    prompt: Annotated[str, FEATURES]
    # none: Qwen-Image-2.1's text-to-image (the Edit models refuse it: stages/evaluate/settings.py check_settings)
    images: Annotated[list[str], FEATURES] = Field(..., description="control image files (several for Edit-Plus; none for a Qwen-Image-2.1 text-to-image prompt)")
    target: Annotated[str | None, FEATURES] = Field(None, description="reference image file for PSNR/SSIM (optional)")
    height: Annotated[Side | None, FEATURES] = Field(None, description="output size; default: the stock pipeline's ~1024² choice")
    width: Annotated[Side | None, FEATURES] = None


class EvaluateConfig(Section):
    device: Annotated[str | list[str], THROUGHPUT] = Field("auto", description=_DEVICE_HELP)
    dtype: Annotated[DType, FEATURES] = Field("auto", description=_DTYPE_HELP)
    quantize_base: Annotated[Quantize, FEATURES] = Field("none", description=_QUANTIZE_HELP)
    seed: Annotated[Seed, FEATURES] = Field(1234, description="generation seed (the same for base and LoRA, for every sample)")
    timesteps: Annotated[Sigmas, _A_SET_OF_ROWS] = Field([0.1, 0.3, 0.5, 0.7, 0.9], min_length=1, description="sigma grid of the held-out loss")
    noise_seeds: Annotated[NoiseSeeds, _A_SET_OF_ROWS] = Field([0, 1], min_length=1, description="fixed noise draws of the held-out loss")
    batch_size: Annotated[BatchSize, THROUGHPUT] = Field(8, description="held-out loss: val samples per forward, at one (seed, sigma) each")
    max_loss_samples: Annotated[Samples | None, FEATURES] = Field(256, description="cap on val samples for the held-out loss (the "
                                         "first N keys of the val split, a content hash: a fixed, unbiased subset; "
                                         "None = all, which for a 5% val split of 1M samples is 50k x seeds x σ "
                                         "forwards per model)")
    num_samples: Annotated[SamplesOrZero, FEATURES] = Field(4, description="val samples to generate images for")
    num_inference_steps: Annotated[DenoisingSteps, FEATURES] = Field(8, description=ONE_STEP)
    true_cfg_scale: Annotated[float, FEATURES] = Field(4.0, description="true CFG scale (<= 1: none); left unset, 1.0 on Qwen-Image-2.1 (its pipeline's default)")
    negative_prompt: Annotated[str, _EXTRA_PROMPTS_ONLY] = Field(" ", description="extra prompts' negative; val samples use the stored empty prompt")
    lora_scale: Annotated[float, FEATURES] = 1.0
    extra_prompts: Annotated[list[ExtraPrompt], FEATURES] = []
    # hashed as resolved: `stages.evaluate.settings.agreed_config` sets the backend the run uses (unset: the device's
    # default) before anything is fingerprinted, so `native` spelled out after an unset CPU run is that run's
    # report, and reports recorded unset are read through `stages.evaluate.backend` (docs/evaluate.md)
    attention_backend: Annotated[str | None, FEATURES] = Field(
        None, description="attention backend of the held-out loss's padded batches (see train.attention_backend)")
    on_damaged: Annotated[Literal["stop", "skip"], _SAMPLES_RECORDED] = _on_damaged(
        "val sample in text/vae", "leave it out (named in the summary and metrics.json)")
    max_damaged_fraction: Annotated[float, THROUGHPUT] = _max_damaged_fraction("the val samples")
    # the attention backend's choice `agreed_config` made (with its reason, for the run record), set on the model as
    # it is (`load_transformer`): not a setting, never hashed
    _attention_choice: Any = PrivateAttr(None)
    on_nonfinite: Annotated[Literal["stop", "skip"], _NONFINITE_RECORDED] = Field(
        "stop", description="a val sample whose held-out loss is NaN/inf (base or LoRA): stop naming the samples, "
        "or leave it out of every mean (counted and named in the summary and metrics.json)")
    max_dropped_fraction: Annotated[float, THROUGHPUT] = Field(
        0.05, ge=0.0, le=1.0, description="fail when more than this share of the val split is missing from the "
        "text or vae table (as train.max_dropped_fraction for the train split)")
    max_open_shards: Annotated[OpenFiles, THROUGHPUT] = Field(256, description="shard files kept open per table "
                                                        "(as train.max_open_shards)")
    # on by default: a run trained with train.ema_decay asks whether its EMA is the better LoRA; hashed only when
    # off (added later: the reports made before stay current)
    score_ema: Annotated[bool, added_later()] = Field(
        True, description="--all-checkpoints of a run trained with train.ema_decay: also score each checkpoint's "
        "EMA (ema.safetensors) on the same val samples, noise and sigma, and pick the best of both (one more loss "
        "pass per checkpoint); false: the raw LoRA only")

    @property
    def loss_axes(self) -> tuple[list[int], list[float]]:
        """(noise seeds, σ grid) of the held-out loss in the order every grid of it is computed and recorded in:
        sorted, as they are hashed (`_A_SET_OF_ROWS`), so a grid cached under a key is in the key's order."""
        return held_out_axes(self.noise_seeds, self.timesteps)


PREDICT_COMPONENTS = ("transformer", "text_encoder", "vae")


class PredictConfig(Section):
    devices: Annotated[dict[str, str], THROUGHPUT] = {"transformer": "auto", "text_encoder": "auto", "vae": "auto"}
    dtype: Annotated[DType, FEATURES] = Field("auto", description=_DTYPE_HELP + " (decided by the transformer's device)")
    quantize_base: Annotated[Quantize, FEATURES] = Field("none", description=_QUANTIZE_HELP)
    steps: Annotated[DenoisingSteps, FEATURES] = Field(20, description=ONE_STEP)
    true_cfg_scale: Annotated[float, FEATURES] = Field(4.0, description="true CFG scale (<= 1: none); left unset, 1.0 on Qwen-Image-2.1 (its pipeline's default)")
    negative_prompt: Annotated[str, FEATURES] = " "
    seed: Annotated[Seed, FEATURES] = 0

    @field_validator("devices")
    @classmethod
    def _known_components(cls, devices: dict[str, str]) -> dict[str, str]:
        # a dict, so extra="forbid" does not reach its keys: a misspelt component would be read as absent (auto)
        for name in devices:
            if name not in PREDICT_COMPONENTS:
                close = difflib.get_close_matches(name, PREDICT_COMPONENTS, n=1)
                raise ValueError(f"unknown component {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                                 + f"; the components are {', '.join(PREDICT_COMPONENTS)}")
        return devices


class PipelineConfig(Section):
    paths: Annotated[Paths, IDENTITY] = Paths()
    resize: Annotated[ResizeConfig, FEATURES] = ResizeConfig()
    encode_text: Annotated[EncodeTextConfig, FEATURES] = EncodeTextConfig()
    encode_vae: Annotated[EncodeVaeConfig, FEATURES] = EncodeVaeConfig()
    train: Annotated[TrainConfig, FEATURES] = TrainConfig()
    evaluate: Annotated[EvaluateConfig, FEATURES] = EvaluateConfig()
    predict: Annotated[PredictConfig, FEATURES] = PredictConfig()


def dump_config(cfg: PipelineConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
