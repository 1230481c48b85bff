"""The train section checked and resolved for this start: config checks, the run fingerprint, the precision
(`models/precision.py` decides) and the devices (accelerate, `train.device` per rank)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from tqdm.auto import tqdm

from schemas.config import PipelineConfig, SigmaConfig, TrainConfig
from schemas.errors import UserError
from schemas.lineage import hashed_settings, section_fingerprint, settings_hash
from schemas.record_formats import ATTENTION_JSON
from stages.train.launch import launched_world_size, use_cpu

if TYPE_CHECKING:
    import torch

    from models.precision import Precision

# torch is imported where a device is made: `pipeline plan` checks the train section here (check_checkpointing)
# before it reads the model's configs, and a mistyped --model is told without torch's import


# What this code computes for a run's config, tables, model and init LoRA: bump it with a release that changes the
# trained weights for those same inputs (the loss or its weighting, σ / noise sampling, the LoRA's init, the
# optimizer's or the schedule's math, the data order) - not for speed, memory, logging or file layout. Recorded
# in every checkpoint's resume record: a finished run of another revision is trained again (`run all`), and a
# resume of one is refused like a changed config (`--new-run` keeps it and trains afresh). Records from before
# it was recorded: `schemas.up_to_date.UNRECORDED_REVISION`. A run records `training_revision(its config)`: a
# revision changes the weights of some configs only, and a finished run of another config stays current.
TRAINING_REVISION = 4


def zero_token_weights(tc: TrainConfig) -> bool:
    """Whether a masked sample may weigh 0 in every token under `tc` (train.loss.mask_weight with a 0)."""
    return tc.loss.mask_weight.foreground == 0 or tc.loss.mask_weight.background == 0


# Each revision after the first: which configs' trained weights it changes (a predicate of the train section).
REVISION_CHANGES: dict[int, Callable[[TrainConfig], bool]] = {
    # 2: a sample twice in one optimizer step (its accumulation ran on into the next epoch) draws its own σ, noise
    # and dropouts, not the first draw counted twice; a fresh start on several ranks seeds each rank's LoRA
    # dropout RNG of its own (every rank drew the same masks)
    2: lambda tc: tc.grad_accum > 1 or tc.lora.dropout > 0,
    # 3: the EMA warms up (diffusers' EMAModel decay cap, stages/train/ema.py): RUN/lora_ema and the checkpoints'
    # EMA change, the trained adapter does not - but a run is current or not as a whole
    3: lambda tc: tc.ema_decay is not None,
    # 4: a sample whose every token weighs 0 (an empty edit mask with background 0, a full one with foreground 0)
    # is left out of its step's mean, as a damaged one is; it was averaged in as a loss of 0
    4: zero_token_weights,
}


def training_revision(tc: TrainConfig) -> int:
    """The newest revision of the training math that changes what `tc` trains (1: none since the first)."""
    return max([1] + [rev for rev, changes in REVISION_CHANGES.items() if rev <= TRAINING_REVISION and changes(tc)])


def validate_config(cfg: TrainConfig) -> None:
    check_dtype(cfg)
    check_init_lora_kind(cfg)
    if cfg.mixed_precision == "fp16":
        raise UserError("train.mixed_precision 'fp16' is not supported (no loss scaling here); use 'bf16' or 'no'")
    if cfg.warmup_steps > cfg.max_steps:
        raise UserError(f"train.warmup_steps ({cfg.warmup_steps}) exceeds train.max_steps ({cfg.max_steps})")
    check_checkpointing(cfg)


def check_dtype(cfg: TrainConfig) -> None:
    """train.dtype float16 is refused (no loss scaling here): at the start (`validate_config`, also `pipeline run
    all`'s before its first stage) and where the precision is resolved (`train_precision`)."""
    if cfg.dtype == "float16":
        raise UserError("train.dtype float16 is not supported (no loss scaling here); use bfloat16, float32 or auto")


def check_init_lora_kind(cfg: TrainConfig) -> None:
    """train.init_lora starts the adapter from a LoRA file's A/B pairs: a `lora` adapter only (no DoRA magnitude,
    LoHa or LoKr factors there). At train's start (`validate_config`, also `pipeline run all`'s before its first
    stage); before, refused once the transformer had loaded (`models.lora.init_from_lora`)."""
    if cfg.init_lora and cfg.lora.kind != "lora":
        raise UserError(f"train.init_lora {cfg.init_lora}: starting from a file works for train.lora.kind 'lora' "
                        f"only, not {cfg.lora.kind!r}; set train.lora.kind: lora, or drop train.init_lora")


def check_control_dropout(cfg: TrainConfig, has_nocontrol_embeds: bool, text_table: str) -> None:
    """`train.control_dropout` trains a drawn sample on its instruction without the control images, which the text
    table holds only when encoded with `encode_text.no_control_embeds` (`nocontrol_embeds`). Train asks of the
    table it opened, before the model loads (`start.open_tables`; models/randomness.py keeps the check for a
    sample whose row lacks it); `pipeline run all` of the table its encode-text makes, before its first stage
    (before, both encoders ran, hours at scale, and then train refused). `text_table`: which table lacks them, as
    the line names it ("... which TEXT_TABLE without")."""
    if cfg.control_dropout > 0 and not has_nocontrol_embeds:
        raise UserError(f"train.control_dropout {cfg.control_dropout} needs the text table's nocontrol_embeds, which "
                        f"{text_table} without: set encode_text.no_control_embeds: true and re-run encode-text (a "
                        "new text version: each sample's stored embeddings are carried and only its instruction "
                        "without the control images is encoded; the vae table is kept), or set "
                        "train.control_dropout: 0")


def check_checkpointing(cfg: TrainConfig) -> None:
    """train.uncheckpointed_blocks only with checkpointing on (offload turns it on), and within the blocks offload
    keeps on the device: an offloaded block left un-checkpointed would keep its device weight copy until the
    backward (models/checkpointing.py). Also `pipeline plan`'s check."""
    n = cfg.uncheckpointed_blocks
    if n and not cfg.gradient_checkpointing and cfg.offload == "none":
        raise UserError(f"train.uncheckpointed_blocks ({n}) leaves blocks out of gradient checkpointing, which is "
                        "off: set train.gradient_checkpointing true, or uncheckpointed_blocks 0")
    if n > cfg.offload_blocks_on_device and cfg.offload == "blocks":
        raise UserError(f"train.uncheckpointed_blocks ({n}) exceeds train.offload_blocks_on_device "
                        f"({cfg.offload_blocks_on_device}): an offloaded block must be checkpointed (else it keeps its "
                        "device weights until the backward); raise offload_blocks_on_device or lower "
                        "uncheckpointed_blocks")


def config_fingerprint(cfg: TrainConfig) -> str:
    """What determines the trained weights, as declared in schemas/config.py (a resume may change the rest)."""
    return section_fingerprint(cfg)


def weighed(cfg: TrainConfig, masked: bool) -> TrainConfig:
    """`cfg` as its run's fingerprint names it: with no masked sample in the vae table (`masked` False: neither
    split, so the validation's weighted losses neither) every token weighs 1 whatever `loss.mask_weight` is, so the
    weights are named as their default (a change to them retrains nothing there)."""
    from schemas.config import MaskWeight

    if masked or cfg.loss.mask_weight == MaskWeight():
        return cfg
    return cfg.model_copy(update={"loss": cfg.loss.model_copy(update={"mask_weight": MaskWeight()})})


def has_masks(tables: Any) -> bool:
    """Whether the joined vae table (every split) holds a masked sample; True where it does not say (no
    `has_mask` column: no other table lets the weights go)."""
    reader = getattr(tables, "readers", {}).get("vae")
    if reader is None or not reader.view.has_column("has_mask"):
        return True
    import pyarrow.compute as pc

    return bool(pc.any(reader.view.column("has_mask").fill_null(True)).as_py())


def name_tables(cfg: TrainConfig, tables: Any) -> None:
    """Where the mask weighs nothing in this run (weights 1 / 1, or no masked sample: `weighed`), the run names its
    vae table by each sample's latents alone (`JoinedTables.stand_in`): an edited mask (its weights rewritten, the
    latents kept: stages/encode/mask_only.py) keeps the run current. Before the first `content_ids`."""
    from schemas.config import MaskWeight
    from schemas.table import VAE_LATENTS_COLUMN

    if weighed(cfg, has_masks(tables)).loss.mask_weight == MaskWeight():
        tables.stand_in("vae", VAE_LATENTS_COLUMN)


def masks_came(record_fingerprint: str, cfg: TrainConfig, masked: bool) -> str | None:
    """Why a run's record is not this config's when no setting changed: it was made on tables without a masked
    sample (its fingerprint names `cfg`'s mask weights as their default, `weighed`) and the tables hold one now,
    which weights other than 1 / 1 weigh. None otherwise."""
    w = cfg.loss.mask_weight
    if not masked or weighed(cfg, False) is cfg or record_fingerprint != config_fingerprint(weighed(cfg, False)):
        return None
    return (f"the vae table now holds masked samples, which train.loss.mask_weight (foreground {w.foreground}, "
            f"background {w.background}) weighs; the run was trained on tables without any, where they weighed "
            "nothing")


def run_fingerprint(cfg: TrainConfig, tables: Any) -> str:
    """The fingerprint a run of `cfg` on `tables` records: `config_fingerprint` of `weighed`."""
    return config_fingerprint(weighed(cfg, has_masks(tables)))


# Memory settings the fingerprint held before they were declared throughput (the same weights): a run made then
# resumes and stays current whatever they were, as the OOM advice asks a resume to change them.
_MEMORY_AS_BEFORE = tuple((gc, off) for gc in (False, True) for off in ("none", "blocks"))


def earlier_config_fingerprints(cfg: TrainConfig, backend: str | None = None) -> tuple[str, ...]:
    """`config_fingerprint` as written before the memory settings left it (with any of their values; the blocks
    kept on the device as configured now, or 0), before batch_size left it under a token budget (only with the
    batch_size they were made with, as before), and before init_lora's path left it (only with the path configured
    now: its bytes were recorded beside it, or taken as the file there), and with lora.target_modules in the order set
    (before they were hashed in one order), and with the σ parameters `sigma.sampling` does not read and the Adam ones
    Adafactor does not read as set (before an unread one was hashed as its default): runs made then resume and stay
    current. Each also as hashed before the backend was recorded resolved: the name unset, as configured, or as
    `backend` (the one this run resolves to: a run made with `native` spelled out resumes unset on the CPU);
    which backend such a record's run used is `recorded_backend`'s to say, and compared there."""
    now = hashed_settings(cfg)
    names = dict.fromkeys([None, cfg.attention_backend, backend])
    budget = [{}] if cfg.max_tokens_per_batch is None else [{}, {"batch_size": cfg.batch_size}]
    path = {} if cfg.init_lora is None else {"init_lora": cfg.init_lora}  # hashed in every earlier spelling
    lora = [{}, {"lora": hashed_settings(cfg.lora, as_set=True)}]  # target_modules in the order set
    as_set = hashed_settings(cfg, as_set=True)
    unread = [{}, {k: as_set[k] for k in ("sigma", "adam_betas", "adam_eps")}]  # unread σ / Adam parameters as set
    memory = ({"gradient_checkpointing": gc, "offload": off, "offload_blocks_on_device": n}
              for gc, off in _MEMORY_AS_BEFORE for n in {cfg.offload_blocks_on_device, 0})
    spellings = ({**now, "attention_backend": n, **b, **path, **m, **t, **s} for n in names for m in [{}, *memory]
                 for b in budget for t in lora for s in unread)
    return tuple(dict.fromkeys(settings_hash(s) for s in spellings))


def run_backend(cfg: TrainConfig, model: str, device: torch.device, world: int = 1) -> str:
    """The attention backend a run of `cfg` (its precision resolved) uses on `device`: the configured one, or the
    device's default (models/attention.py `agreed_backend`; several ranks: a collective)."""
    from models.attention import agreed_backend
    from models.loading import model_variant
    from models.precision import resolve_dtype

    return agreed_backend(cfg.attention_backend, "train.attention_backend", device, resolve_dtype(cfg.dtype, device),
                          world, qwen21=model_variant(model) == "qwen-image-2.1")


def recorded_backend(record_backend: str | None, record_fingerprint: str, cfg: TrainConfig, run_dir: Path,
                     now: str) -> str | None:
    """The attention backend the run of a checkpoint record trained with: its own record; for a record written
    before it held one, the name its fingerprint hashed when one was set (`earlier_config_fingerprints`: the
    configured name or `now`, used as named), else RUN/attention.json (the run's latest start; unset, the record hashed
    none); with neither, `now` when unset now too (such records were always taken as this run's), else None (not
    known to be `now`'s: not reused)."""
    if record_backend is not None:
        return record_backend
    unset = earlier_config_fingerprints(cfg.model_copy(update={"attention_backend": None}))
    for name in dict.fromkeys(n for n in (cfg.attention_backend, now) if n is not None):
        if record_fingerprint not in unset and \
                record_fingerprint in earlier_config_fingerprints(cfg.model_copy(update={"attention_backend": name})):
            return name  # the name hashed then, used as named
    try:
        import json

        used = json.loads((Path(run_dir) / ATTENTION_JSON).read_text()).get("backend")
    except (OSError, ValueError, AttributeError):
        used = None
    if isinstance(used, str):
        return used
    return now if cfg.attention_backend is None else None


def known_fingerprint(record_fingerprint: str, cfg: TrainConfig, backend: str | None = None,
                      masked: bool = True) -> str:
    """The record's fingerprint, read as this config's (`weighed` by `masked`) when it is one of its earlier
    spellings (`backend`: the one this run resolves to), or, its mask weights named by the data (`weighed`), one
    with the weights as set (a run recorded before they were)."""
    now = weighed(cfg, masked)
    spellings = set(earlier_config_fingerprints(now, backend))
    if now is not cfg:
        spellings |= {config_fingerprint(cfg), *earlier_config_fingerprints(cfg, backend)}
    return config_fingerprint(now) if record_fingerprint in spellings else record_fingerprint


def init_lora_sha256(cfg: TrainConfig) -> str | None:
    """sha256 of train.init_lora's weight file (None without one): the run's starting weights, which its path in
    the config fingerprint does not name (a file rewritten there makes another run)."""
    from models.lora import lora_sha256

    if not cfg.init_lora:
        return None
    try:
        return lora_sha256(cfg.init_lora)
    except UserError as e:  # a missing file: the line names the setting (also `run all`'s, before its first stage)
        raise UserError(f"train.init_lora: {e}") from None


def make_accelerator(cfg: TrainConfig):
    from accelerate import Accelerator

    from models.collective import close_at_exit
    from models.launch_devices import check_devices
    from models.precision import first_device

    launched = launched_world_size()
    if cfg.device is not None:  # a requested GPU that is not there is an error (on every rank), not a CPU run
        check_devices(cfg.device, "train.device", launched)
    # Mixed precision is applied with torch.autocast below, not by accelerate, so that several runs in one
    # process (tests, notebooks) never fight over accelerate's process-wide state.
    accelerator = Accelerator(cpu=use_cpu(first_device(cfg.device)))
    close_at_exit()  # its process group, before the interpreter's finalization
    if accelerator.num_processes != launched:  # never N independent single-process runs into one folder
        raise UserError(
            f"launched as {launched} processes but accelerate set up {accelerator.num_processes} "
            f"({accelerator.distributed_type}); set train.device (e.g. --device cpu) or fix the launch"
        )
    if cfg.device is None and launched > 1 and accelerator.device.type == "cpu" and accelerator.is_main_process:
        tqdm.write(f"no GPU: the {launched} processes train on the CPU (gloo); set train.device to choose")
    return accelerator


def train_device(cfg: TrainConfig, local_rank: int, world_size: int) -> torch.device | None:
    """This rank's device from `train.device` (cuda:N, a per-rank list, or cuda = cuda:LOCAL_RANK); None =
    accelerate's choice. A set GPU index becomes the current CUDA device, so NCCL and `cuda` tensors use it
    (accelerate alone would put a single process on cuda:0 whatever was asked)."""
    import torch

    from models.loading import check_device
    from models.precision import device_for_rank

    if cfg.device is None:
        return None
    dev = check_device(device_for_rank(cfg.device, local_rank, world_size, "train.device"), "train.device")
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)
    return dev


def planned_device(cfg: TrainConfig) -> torch.device:
    """The device this rank would train on, without starting accelerate (for up-to-date checks): train.device
    for this rank, else this rank's GPU (cuda:LOCAL_RANK under a launcher) or the CPU."""
    import torch

    from models.precision import device_for_rank

    spec = cfg.device if cfg.device is not None else "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device_for_rank(spec, what="train.device"))


def train_precision(cfg: TrainConfig, device: torch.device | Callable[[], torch.device],
                    world: int = 1) -> Precision:
    """The precision `models.precision.resolve_precision` decides for `device`; with several ranks (`world`) one
    decision of all (`agreed_precision`, a collective: every rank calls it): the widest every rank can run.
    `device` may be a function: resolved inside the agreement, so a rank that cannot (e.g. no such GPU here)
    stops every rank with its line instead of leaving them in the gather."""
    from models.precision import agreed_precision, resolve_precision as resolve

    def own():
        check_dtype(cfg)
        return resolve(cfg.dtype, device() if callable(device) else device, cfg.mixed_precision, what="train.dtype")

    return agreed_precision(own, world, "train.dtype")


def resolve_precision(cfg: TrainConfig, device: torch.device | Callable[[], torch.device], world: int = 1,
                      precision: Precision | None = None) -> TrainConfig:
    """The config with its precision (`train_precision`, or `precision` when decided already): `train.dtype`
    is the frozen base's dtype (what loads and is recorded), `mixed_precision` the autocast around it."""
    precision = precision or train_precision(cfg, device, world)
    update: dict[str, Any] = {"dtype": precision.weights, "mixed_precision": "bf16" if precision.autocast_bf16 else "no"}
    if cfg.offload == "blocks" and not cfg.gradient_checkpointing:
        # Offloaded weights are fetched again for the backward's recompute; without checkpointing autograd
        # would hold every block's device copy until the backward (no memory saved).
        tqdm.write("train.offload blocks: gradient checkpointing turned on")
        update["gradient_checkpointing"] = True
    return cfg.model_copy(update=update)


def resolved_config(cfg: PipelineConfig, device: torch.device, main: bool,
                    world: int = 1) -> tuple[PipelineConfig, Precision]:
    """(the config with the train section's precision resolved for `device`, agreed by all `world` ranks; the
    precision with its reason). train_config.yaml records the resolved dtype; the main process prints what loads
    and how (and, where the ranks resolved differently, what all of them run and why)."""
    precision = train_precision(cfg.train, device, world)
    tc = resolve_precision(cfg.train, device, precision=precision)
    if main:
        tqdm.write(precision.describe("train (frozen base)", device,
                                      f", quantize_base {tc.quantize_base}" if tc.quantize_base != "none" else ""))
    return cfg.model_copy(update={"train": tc}), precision


# The settings of `dynamic_shift` that the pipelines read from the model's scheduler config (`calculate_shift`).
SHIFT_SETTINGS = ("base_shift", "max_shift", "base_image_seq_len", "max_image_seq_len")


def scheduler_config(model: str) -> Callable[[], Any]:
    """The model's scheduler config, read at the first call and kept: train's start asks it for `sigma_for_model`
    and `say_other_shift`, one read for both (each read builds the diffusers scheduler)."""
    kept: list = []

    def read():
        if not kept:
            from models.loading import load_component

            kept.append(load_component(model, "scheduler").config)
        return kept[0]

    return read


def sigma_for_model(cfg: PipelineConfig, model: str, scheduler: Callable[[], Any] | None = None) -> PipelineConfig:
    """`train.sigma.sampling: dynamic_shift` with any of its shift settings unset: the model's scheduler's value,
    as its pipeline's `calculate_shift` reads it (Qwen-Image-2.1: 0.5 at 256 tokens to 1.15 at 4096; the Edit
    models: 0.5 to 0.9 at 8192, the section's defaults). Before, the defaults (the Edit models') trained a 2.1
    model without a word. Resolved before anything is fingerprinted, so the run records the numbers it used.
    `scheduler`: the config's reader (`scheduler_config`), where the caller reads it for another use too."""
    sigma = cfg.train.sigma
    unset = [name for name in SHIFT_SETTINGS if name not in sigma.model_fields_set]
    if sigma.sampling != "dynamic_shift" or not unset:
        return cfg
    scheduler = (scheduler or scheduler_config(model))()
    update = {name: scheduler[name] for name in unset if scheduler.get(name) is not None}
    resolved = sigma.model_copy(update=update)
    _check_resolved_sigma(resolved, update, model)
    tc = cfg.train.model_copy(update={"sigma": resolved})
    return cfg.model_copy(update={"train": tc})


def say_other_shift(sigma: SigmaConfig, model: str, scheduler: Callable[[], Any] | None = None) -> None:
    """A note where dynamic_shift's shift settings set in the config differ from the model's scheduler's, which its
    pipeline samples with: an Edit config's 0.5..0.9 at 256..8192 tokens carried to a Qwen-Image-2.1 model (its
    0.5..1.15 at 256..4096: μ 0.69 instead of 1.15 at a 1024² target), or the reverse, trained at the other
    family's shift without a word. Set on purpose they stay in force: the note only says so. `scheduler`: as
    `sigma_for_model`'s."""
    if sigma.sampling != "dynamic_shift":
        return
    scheduler = (scheduler or scheduler_config(model))()
    differ = [name for name in SHIFT_SETTINGS if name in sigma.model_fields_set
              and scheduler.get(name) is not None and float(getattr(sigma, name)) != float(scheduler[name])]
    if differ:
        from tqdm.auto import tqdm

        ours = ", ".join(f"{name} {getattr(sigma, name)}" for name in differ)
        theirs = ", ".join(f"{name} {scheduler[name]}" for name in differ)
        tqdm.write(f"note: train.sigma (dynamic_shift) {ours}, as set, differ from {model}'s scheduler ({theirs}), "
                   f"which its pipeline samples with; unset train.sigma.{' / '.join(differ)} to train at the model's")


def _check_resolved_sigma(sigma: SigmaConfig, read: dict[str, Any], model: str) -> None:
    """The σ section's own checks (`SigmaConfig`'s validators) on the numbers `sigma_for_model` resolved, as every
    one spelled out in the config is checked: before, a scheduler config with base_image_seq_len ==
    max_image_seq_len stopped train's first step on a ZeroDivisionError in calculate_shift."""
    from pydantic import ValidationError

    try:
        SigmaConfig.model_validate(sigma.model_dump())  # every number set, as they train
    except ValidationError as e:
        from models.loading import resolve_model

        where = resolve_model(model) / "scheduler" / "scheduler_config.json"
        why = e.errors()[0]["msg"].removeprefix("Value error, ")
        numbers = ", ".join(f"{name} {value}" for name, value in read.items())
        raise UserError(f"train.sigma (dynamic_shift): {numbers} read from {where} (the settings left unset): {why}; "
                        f"set train.sigma.{' / '.join(read)} in the config") from None
