"""Typed pipeline configuration as pure data: a section per stage (parsing files and flags is `pipeline.config`).

Unknown keys and wrong types are rejected by pydantic with the dotted key named (`extra="forbid"`).
Each stage reads only its own section (plus `paths`); the section's JSON dump is what goes into the
table lineage hash, so a changed setting means a new table version.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def fingerprint(self) -> str:
        """Stable hash of the effective settings (what lineage records)."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


class Paths(Section):
    source: str | None = None
    store: str | None = None
    model: str | None = None
    run: str | None = None
    report: str | None = None


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
        if clash:
            raise ValueError(f"resize.area = {area} sets {' and '.join(clash)}; drop {', '.join(clash)} or area")
        data["target_area"] = data["control_vae_area"] = area
        return data

    target_area: int = Field(1024 * 1024, gt=0, description="target pixel area of a bucket")
    multiple: int = Field(32, gt=0, description="bucket sides are multiples of this")
    min_side: int = Field(32, gt=0)
    max_aspect: float = Field(4.0, gt=1.0, description="buckets are clamped to this aspect ratio")
    control_vl_area: int = Field(384 * 384, gt=0, description="VL view of each control (Edit-Plus CONDITION_IMAGE_SIZE)")
    control_vae_area: int = Field(1024 * 1024, gt=0, description="VAE view of each control (Edit-Plus VAE_IMAGE_SIZE)")
    max_controls: int = Field(3, ge=0)
    min_controls: int = Field(0, ge=0)
    max_image_pixels: int = Field(64 * 1024 * 1024, gt=0, description="larger images are rejected (decompression bombs)")
    keep_alpha: bool = Field(False, description="store images with transparency as RGBA instead of composited over "
                             "white (Qwen-Image-2.1: its VAE reads the alpha channel)")
    val_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    shard_size_mb: float = Field(256, gt=0, description="images table shard size (fractions allowed, e.g. for tests)")
    workers: int = Field(0, ge=0, description="processes decoding/resizing/encoding PNGs (0 = in the main process)")

    def unset_switches(self) -> set[str]:
        """Switches added later, left out of fingerprints while off, so earlier tables keep their lineage."""
        return set() if self.keep_alpha else {"keep_alpha"}

    def fingerprint(self) -> str:
        """Like every section's, but without the settings that say how the work is done, not what it produces
        (shard size, workers): changing those reuses an existing version instead of rebuilding it."""
        operational = {"shard_size_mb", "workers"} | self.unset_switches()
        blob = json.dumps(self.model_dump(mode="json", exclude=operational), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


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
_DEVICE_HELP = "cpu, cuda, cuda:N, or one device per local rank ([cuda:0, cuda:1]); cuda = cuda:LOCAL_RANK"


class EncodeTextConfig(Section):
    device: str | list[str] = Field("cpu", description=_DEVICE_HELP)
    dtype: DType = Field("auto", description=_DTYPE_HELP)
    batch_size: int = Field(8, gt=0)
    prompt_template: str | None = Field(None, description="None = the model's own diffusers template")
    prompt_template_start_idx: int | None = None
    batching: Literal["exact", "padded"] = Field(
        "exact", description="exact: batch only identical input shapes (bit-exact, small batches on mixed data); "
        "padded: any requests per batch, text right-padded (float32 within ~1e-6 of exact; full batches, use on GPUs)")
    shard_size_mb: float = Field(256, gt=0, description="shard file size target (fractions allowed)")
    num_workers: int = Field(2, ge=0, description="threads decoding + preprocessing ahead of the forward (0 = inline)")
    no_control_embeds: bool = Field(False, description="also store the instruction encoded without its control "
                                    "images (`nocontrol_embeds`, for train.control_dropout)")
    on_damaged: Literal["stop", "skip"] = _on_damaged(
        "`images` sample", "skip it (quarantined as damaged-input, named in the summary)")
    max_damaged_fraction: float = _max_damaged_fraction("the samples")


class EncodeVaeConfig(Section):
    device: str | list[str] = Field("cpu", description=_DEVICE_HELP)
    dtype: DType = Field("auto", description=_DTYPE_HELP)
    batch_size: int = Field(8, gt=0)
    shard_size_mb: float = Field(256, gt=0, description="shard file size target (fractions allowed)")
    num_workers: int = Field(2, ge=0, description="threads decoding + preprocessing ahead of the forward (0 = inline)")
    on_damaged: Literal["stop", "skip"] = _on_damaged(
        "`images` sample", "skip it (quarantined as damaged-input, named in the summary)")
    max_damaged_fraction: float = _max_damaged_fraction("the samples")


class LoraConfig(Section):
    rank: int = Field(16, gt=0)
    alpha: float | None = Field(None, description="None = rank")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = ["to_q", "to_k", "to_v", "to_out.0"]
    init_weights: Literal["gaussian", "default"] = "gaussian"
    kind: Literal["lora", "dora", "loha", "lokr"] = Field(
        "lora", description="peft adapter: lora | dora (LoRA + magnitude) | loha (Hadamard) | lokr (Kronecker); "
        "only lora loads in diffusers' Qwen-Image pipelines (docs/train.md)")


class SigmaConfig(Section):
    sampling: Literal["uniform", "logit_normal", "shift", "dynamic_shift"] = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float = Field(3.0, gt=0)
    base_shift: float = 0.5
    max_shift: float = 0.9
    base_image_seq_len: int = 256
    max_image_seq_len: int = 8192


class MaskWeight(Section):
    foreground: float = Field(1.0, ge=0.0)
    background: float = Field(1.0, ge=0.0)


class LossConfig(Section):
    mask_weight: MaskWeight = MaskWeight()


def _quantize_alias(value: Any) -> Any:
    """`int8_weight_only` (the first name of the int8 option) still reads, as `int8`."""
    return "int8" if value == "int8_weight_only" else value


Quantize = Annotated[Literal["none", "int8", "fp8", "nf4"], BeforeValidator(_quantize_alias)]
_QUANTIZE_HELP = ("frozen transformer base, quantised while it loads: none | int8 | fp8 (torchao weight-only) | nf4 "
                  "(bitsandbytes 4-bit); int8_weight_only is read as int8")


class TrainConfig(Section):
    device: str | list[str] | None = Field(None, description="None = accelerate's choice; else " + _DEVICE_HELP)
    dtype: DType = Field("auto", description="frozen base weights; " + _DTYPE_HELP +
                         " (bf16 when mixed_precision is bf16)")
    seed: int = 0
    batch_size: int = Field(4, gt=0)
    grad_accum: int = Field(1, gt=0)
    max_steps: int = Field(100, gt=0)
    learning_rate: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    max_grad_norm: float | None = 1.0
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    gradient_checkpointing: bool = False
    quantize_base: Quantize = Field("none", description=_QUANTIZE_HELP)
    offload: Literal["none", "blocks"] = Field(
        "none", description="blocks: frozen transformer blocks live in (pinned) host memory and stream to the device")
    offload_blocks_on_device: int = Field(0, ge=0, description="offload=blocks: leading blocks kept on the device")
    caption_dropout: float = Field(0.0, ge=0.0, le=1.0)
    checkpoint_every: int = Field(50, gt=0)
    keep_checkpoints: int = Field(3, gt=0)
    log_every: int = Field(1, gt=0)
    sampler_window: int = Field(64, gt=0, description="length-aware sampler: batches per sorting window")
    on_damaged: Literal["stop", "skip"] = _on_damaged(
        "store sample", "leave it out (all are found before step 0, listed in RUN/damaged_samples.json)")
    max_damaged_fraction: float = _max_damaged_fraction("the training samples")
    on_nonfinite: Literal["stop", "skip_step"] = Field(
        "stop", description="a non-finite loss or gradient: stop naming the step and samples, or skip that "
        "optimizer step (no update, logged)")
    lora: LoraConfig = LoraConfig()
    sigma: SigmaConfig = SigmaConfig()
    loss: LossConfig = LossConfig()
    max_dropped_fraction: float = Field(0.05, ge=0.0, le=1.0, description="train/evaluate use the samples both the "
                                        "text and vae tables hold; fail when more than this share of the split is "
                                        "missing from either (reasons in STORE/quarantine.parquet)")
    max_open_shards: int = Field(256, gt=0, description="shard files kept open per table (LRU; descriptors for "
                                 "random reads, maps for scans)")
    init_lora: str | None = Field(None, description="start from this LoRA (diffusers, kohya lora_unet_*, ComfyUI "
                                  "diffusion_model.*); rank and targets must match train.lora")
    optimizer: Literal["adamw", "adamw8bit", "adafactor", "prodigy"] = Field(
        "adamw", description="adamw (torch) | adamw8bit (bitsandbytes) | adafactor (transformers) | prodigy "
        "(prodigyopt; set learning_rate ~1.0)")
    ema_decay: float | None = Field(None, gt=0.0, lt=1.0, description="EMA of the adapter -> RUN/lora_ema (None = off)")
    control_dropout: float = Field(0.0, ge=0.0, le=1.0, description="per-sample probability of training on the "
                                   "instruction encoded without its control images (needs encode_text.no_control_embeds)")
    validate_every: int | None = Field(None, gt=0, description="held-out loss on the val split every N steps")
    validate_max_samples: int = Field(8, gt=0, description="validation: first N val samples (by key)")
    validate_timesteps: list[float] = Field([0.25, 0.5, 0.75], min_length=1, description="validation σ grid")
    validate_noise_seeds: list[int] = Field([0], min_length=1, description="validation noise seeds")
    sample_every: int | None = Field(None, gt=0, description="generate val samples every N steps -> RUN/samples")
    sample_count: int = Field(2, gt=0, description="val samples per sample grid")
    sample_steps: int = Field(4, ge=2, description="denoising steps of the sample grid")
    max_tokens_per_batch: int | None = Field(
        None, gt=0, description="None = fixed batch_size batches; else each batch holds as many samples as fit in "
        "this many computed tokens (batch size x longest sequence), see stages/train/budget.py")
    prefetch: int = Field(0, ge=0, description="micro-batches read, drawn and copied to the device ahead by a "
                          "background thread (0 = inline)")
    attention_backend: str | None = Field(
        None, description="diffusers attention backend for padded batches (models/attention.py); None = the "
        "fastest correct one available (CUDA) / native (CPU)")
    compile: bool = Field(False, description="torch.compile each transformer block (regional compilation)")
    check_ahead: int = Field(32, ge=0, description="samples whose checksums a background thread verifies ahead of "
                             "the reads, in the sampler's order (0 = check each sample inline on its first read)")


class ExtraPrompt(Section):
    """An evaluate sample that is not in the store: control image file(s), an instruction, optional target."""

    prompt: str
    images: list[str] = Field(..., min_length=1, description="control image files (several for Edit-Plus)")
    target: str | None = Field(None, description="reference image file for PSNR/SSIM (optional)")
    height: int | None = Field(None, gt=0, description="output size; default: the stock pipeline's ~1024² choice")
    width: int | None = Field(None, gt=0)


class EvaluateConfig(Section):
    device: str | list[str] = Field("cpu", description=_DEVICE_HELP)
    dtype: DType = Field("auto", description=_DTYPE_HELP)
    quantize_base: Quantize = Field("none", description=_QUANTIZE_HELP)
    seed: int = Field(1234, description="generation seed (the same for base and LoRA, for every sample)")
    timesteps: list[float] = Field([0.1, 0.3, 0.5, 0.7, 0.9], min_length=1, description="sigma grid of the held-out loss")
    noise_seeds: list[int] = Field([0, 1], min_length=1, description="fixed noise draws of the held-out loss")
    batch_size: int = Field(8, gt=0, description="held-out loss: (sample, seed, sigma) rows per forward")
    max_loss_samples: int | None = Field(256, gt=0, description="cap on val samples for the held-out loss (the "
                                         "first N keys of the val split, a content hash: a fixed, unbiased subset; "
                                         "None = all, which for a 5% val split of 1M samples is 50k x seeds x σ "
                                         "forwards per model)")
    num_samples: int = Field(4, ge=0, description="val samples to generate images for")
    num_inference_steps: int = Field(8, ge=2, description="1 step divides 0/0 in the scheduler's terminal stretch")
    true_cfg_scale: float = 4.0
    negative_prompt: str = Field(" ", description="extra prompts' negative; val samples use the stored empty prompt")
    lora_scale: float = 1.0
    extra_prompts: list[ExtraPrompt] = []
    attention_backend: str | None = Field(
        None, description="attention backend of the held-out loss's padded batches (see train.attention_backend)")
    on_damaged: Literal["stop", "skip"] = _on_damaged(
        "val sample in text/vae", "leave it out (named in the summary and metrics.json)")
    max_damaged_fraction: float = _max_damaged_fraction("the val samples")


class PredictConfig(Section):
    devices: dict[str, str] = {"transformer": "cpu", "text_encoder": "cpu", "vae": "cpu"}
    dtype: DType = Field("auto", description=_DTYPE_HELP + " (decided by the transformer's device)")
    quantize_base: Quantize = Field("none", description=_QUANTIZE_HELP)
    steps: int = Field(20, ge=2, description="1 step divides 0/0 in the scheduler's terminal stretch")
    true_cfg_scale: float = 4.0
    negative_prompt: str = " "
    seed: int = 0


class PipelineConfig(Section):
    paths: Paths = Paths()
    resize: ResizeConfig = ResizeConfig()
    encode_text: EncodeTextConfig = EncodeTextConfig()
    encode_vae: EncodeVaeConfig = EncodeVaeConfig()
    train: TrainConfig = TrainConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    predict: PredictConfig = PredictConfig()


def dump_config(cfg: PipelineConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
