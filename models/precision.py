"""Device-aware precision and device choice shared by every stage.

`dtype: auto` means bfloat16 on a CUDA device that supports it and float32 everywhere else: on a CPU without bf16
instructions bf16 is emulated and slower (one 512x512 VAE encode: 3.0 s float32, 18.4 s bf16, machine not
recorded), though on this project's avx512_bf16 CPU bf16 was faster (38.4 s vs 51.6 s float32; docs/train.md
'Precision'): float32 is never the emulated, several-times-slower one, and full precision. On a GPU bf16 halves the
memory of a 20B-parameter transformer. Stages resolve `auto` once, print
what they picked and record the concrete name (lineage config, run records), so a table or run says which
precision produced it.

Under a launcher each rank resolves `auto` for its own device, then all ranks take one decision together
(`agreed_precision`, models/agreement.py): the widest precision every rank can run (float32 where one rank's GPU
has no native bf16), so one DDP model, or one loss grid summed over ranks, never mixes precisions silently. A
rank that cannot run an explicit setting stops every rank with one line naming it. The reason (each rank's own
resolution when they differed) is printed with the precision line and kept in the run's records.

`device` settings may be one name (`cpu`, `cuda`, `cuda:1`) or a per-rank list (`[cuda:0, cuda:1]`); `cuda`
under a multi-process launch means this rank's own GPU (`cuda:LOCAL_RANK`).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Sequence

import torch

from schemas.errors import UserError

DeviceSpec = str | list[str]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def bf16_supported(device: str | torch.device) -> bool:
    dev = torch.device(resolve_auto(device) if isinstance(device, str) else device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return False
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    major, _ = torch.cuda.get_device_capability(index)
    return major >= 8 and torch.cuda.is_bf16_supported()  # Ampere and newer run bf16 natively


def bf16_usable(device: str | torch.device) -> bool:
    """bf16 runs here at all (emulated on a CPU, `torch.cuda.is_bf16_supported` on CUDA): what an explicit
    bfloat16 or train's bf16 autocast needs. `bf16_supported` is the narrower "native, so `auto` picks it"."""
    dev = torch.device(resolve_auto(device) if isinstance(device, str) else device)
    return dev.type == "cpu" or (dev.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported())


def resolve_dtype(name: str, device: str | torch.device) -> torch.dtype:
    """`auto` -> bf16 on a bf16-capable CUDA device, else float32; explicit names as given."""
    if name == "auto":
        return torch.bfloat16 if bf16_supported(device) else torch.float32
    try:
        return _DTYPES[name]
    except KeyError:
        raise UserError(f"unknown dtype {name!r}: use auto, float32, bfloat16 or float16") from None


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in _DTYPES.items()}[dtype]


def resolved_name(name: str, device: str | torch.device) -> str:
    return dtype_name(resolve_dtype(name, device))


def local_rank() -> tuple[int, int]:
    """(local rank, world size) from the launcher's environment (accelerate / torchrun); (0, 1) otherwise."""
    return int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def resolve_auto(spec: DeviceSpec) -> DeviceSpec:
    """`auto` (the stages' default device, each entry of a per-rank list alike) -> `cuda` where CUDA is available,
    else `cpu`; any other spelling as given. The one place `auto` is decided: `device_for_rank`, `first_device` and
    `models.launch_devices.check_devices` read a setting through it (a GPU machine then encodes and evaluates on
    its GPU unless told otherwise, as train does with train.device unset)."""
    if isinstance(spec, (list, tuple)):
        return [resolve_auto(d) for d in spec]
    if spec != "auto":
        return spec
    return "cuda" if torch.cuda.is_available() else "cpu"


def holds_auto(spec: DeviceSpec | None) -> bool:
    """Whether a device setting is `auto` or lists `auto` for some rank: the one test of it (`auto_note`,
    `models.launch_devices.check_devices`)."""
    return spec == "auto" or (isinstance(spec, (list, tuple)) and "auto" in spec)


def auto_note(*specs: DeviceSpec | None) -> str:
    """', device auto (CUDA)' / ', device auto (no CUDA)' for a stage's first line when one of its device settings
    was `auto`, else '': the line then says the device was chosen, and why there."""
    if not any(holds_auto(s) for s in specs):
        return ""
    return ", device auto (" + ("CUDA" if resolve_auto("auto") == "cuda" else "no CUDA") + ")"


def device_for_rank(spec: DeviceSpec, rank: int | None = None, world_size: int | None = None,
                    what: str = "device") -> str:
    """This rank's device: a list gives one entry per local rank; `cuda` with several ranks is cuda:LOCAL_RANK;
    `auto` is `cuda` with CUDA, else `cpu` (`resolve_auto`)."""
    spec = resolve_auto(spec)
    env_rank, env_world = local_rank()
    rank = env_rank if rank is None else rank
    world_size = env_world if world_size is None else world_size
    if isinstance(spec, (list, tuple)):
        if not spec:
            raise UserError(f"{what}: an empty device list; give one device per rank, e.g. [cuda:0, cuda:1]")
        # Judged by the node's process count (the launcher's LOCAL_WORLD_SIZE), not by this rank's index: then
        # every rank refuses alike, before any collective, instead of one rank leaving the others waiting for it.
        local_world = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), rank + 1)
        if local_world > len(spec):
            raise UserError(f"{what}: {len(spec)} device(s) listed ({list(spec)}) for {local_world} processes on "
                            "this node: list one device per process")
        return str(spec[rank])
    if spec == "cuda" and world_size > 1:
        return f"cuda:{rank}"
    return spec


def first_device(spec: DeviceSpec | None) -> str | None:
    """The device a single-process caller would use (for messages and device-type checks); `auto` resolved."""
    spec = resolve_auto(spec) if spec is not None else None
    if isinstance(spec, Sequence) and not isinstance(spec, str):
        return str(spec[0]) if spec else None
    return spec


@dataclass(frozen=True)
class Precision:
    """A stage's precision, resolved once: the dtype its frozen weights load in (the name it records) and
    whether it computes under bf16 autocast (train's `mixed_precision: bf16`; the LoRA weights stay float32).
    `reason` and `ranks` say why (the record; not compared)."""

    weights: str  # float32 | bfloat16 | float16: loaded, recorded, and checked after loading
    autocast_bf16: bool = False
    requested: str = "auto"
    reason: str = field(default="", compare=False)
    ranks: list[dict] | None = field(default=None, compare=False)  # several ranks: each one's {rank, dtype, reason}

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.weights]

    @property
    def name(self) -> str:
        """What a rank resolved, as one word to compare: the weights, and train's autocast of a float32 base."""
        return self.weights + (" + bf16 autocast" if self.autocast_bf16 and self.weights != "bfloat16" else "")

    def describe(self, stage: str, device: str | torch.device, more: str = "") -> str:
        """The stage's precision line (`more`: the stage's own additions, before the ranks' agreement)."""
        how = "auto" if self.requested == "auto" else "set"
        return f"{stage}: {self.weights} on {device} ({how})" + (", bf16 autocast" if self.autocast_bf16 and
                                                                self.weights != "bfloat16" else "") + more + self.agreement

    @property
    def agreement(self) -> str:
        """'; <why>' when the ranks resolved differently (what every rank runs instead, and why), else ''."""
        from models.agreement import differed

        return f"; {self.reason}" if differed(self.ranks, "dtype") else ""


def resolve_precision(requested: str, device: str | torch.device, mixed_precision: str | None = None,
                      what: str = "dtype") -> Precision:
    """The one precision resolver of every stage (encode, train, evaluate, predict, lora merge).

    Without `mixed_precision` (every stage but train) the weights are the compute dtype: `auto` -> bf16 on a
    bf16-native CUDA device, else float32. Train (`mixed_precision` given): `dtype` is the frozen base's dtype
    and is honoured as set - float32 under `mixed_precision: bf16` is a float32 base computing under bf16
    autocast; `auto` follows mixed_precision (bf16 -> a bf16 base) or else the device; a bf16 base always
    computes under bf16 autocast (its float32 LoRA needs it). bf16 where it cannot run falls back to float32
    with a line saying so (mixed precision) or is refused (an explicit bfloat16)."""
    if mixed_precision is None:
        return Precision(dtype_name(resolve_dtype(requested, device)), requested=requested,
                         reason=_why(requested, device, what))
    autocast = mixed_precision == "bf16"
    if autocast and not bf16_usable(device):
        from tqdm.auto import tqdm

        tqdm.write(f"bf16 is not supported on {device}: training in float32")
        return Precision("float32", requested=requested,
                         reason=f"mixed_precision bf16, but {device} has no bf16 support: float32")
    if requested == "auto":
        name = "bfloat16" if autocast else resolved_name("auto", device)
    else:
        name = dtype_name(resolve_dtype(requested, device))
    if name == "bfloat16" and not bf16_usable(device):
        raise UserError(f"{what} bfloat16: {device} has no bf16 support; use float32 or auto")
    why = "auto under mixed_precision bf16: bfloat16" if requested == "auto" and autocast else _why(requested, device, what)
    return Precision(name, autocast_bf16=autocast or name == "bfloat16", requested=requested, reason=why)


def _why(requested: str, device: str | torch.device, what: str) -> str:
    """Why `requested` resolved as it did on `device` (a rank's own reason in the record)."""
    if requested != "auto":
        return f"set ({what} {requested})"
    if bf16_supported(device):
        return f"auto: bfloat16, native on {device}"
    return f"auto: float32, {device} has no native bf16" + (" (emulated on a CPU)" if torch.device(device).type
                                                           == "cpu" else "")


# `agreed_precision`'s choices, widest last: a rank that can run one can run every later one (float32 runs
# wherever bf16 does, with or without autocast), so the last of the ranks' picks is what every rank can run.
PREFERENCE = ("bfloat16", "float32 + bf16 autocast", "float32")


def agreed_precision(resolve: Callable[[], Precision], world: int, key: str) -> Precision:
    """`resolve()` (this rank's own precision) on every rank, then one decision of all ranks (a collective: every
    rank calls it; models/agreement.py): the widest precision every rank can run, the reason naming the ranks
    that held it down, each rank's own under `ranks`. A rank whose `resolve` fails (an explicit bfloat16 its GPU
    lacks) stops every rank with its line, naming the ranks. One process: `resolve()` as it is."""
    if world <= 1:
        return resolve()
    from models.agreement import agree_on

    error = None
    try:
        own = resolve()
        mine = {"dtype": own.name, "reason": own.reason, "weights": own.weights, "autocast_bf16": own.autocast_bf16}
    except Exception as e:  # noqa: BLE001 - told to every rank first: none is left waiting in the agreement
        error = e
        text = str(e) if isinstance(e, UserError) else f"{key}: {type(e).__name__}: {e}"
        mine = {"error": " ".join(text.splitlines())}
    try:
        agreed, reason, ranks = agree_on(world, mine, "dtype", PREFERENCE, key, "precision")
    except UserError:
        if error is not None and not isinstance(error, UserError):
            raise error  # a bug: its traceback on the rank where it happened (the others raise its line)
        raise
    return replace(own, weights=agreed["weights"], autocast_bf16=agreed["autocast_bf16"], reason=reason,
                   ranks=[{k: r[k] for k in ("rank", "dtype", "reason")} for r in ranks])


def precision_record(precision: Precision) -> dict:
    """The precision as a run records it (train's RUN/precision.json, evaluate --all-checkpoints' run.precision):
    what loads and computes, as requested, why, and under several ranks each rank's own resolution."""
    return asdict(precision)


def check_loaded_dtype(module: torch.nn.Module, recorded: str, what: str) -> None:
    """Post-load invariant (torchtune's `validate_expected_param_dtype`): every frozen floating-point parameter
    of `module` is in the dtype the stage records, so the record says what was loaded. Quantised weights
    (their own storage) and adapters (trainable or `lora_*`: float32 LoRA weights) are not the base and are skipped."""
    from models.quantize import is_quantized

    expected = _DTYPES[recorded]
    keep = set(getattr(module, "_keep_in_fp32_modules", None) or ())
    for name, p in module.named_parameters():
        if p.requires_grad or "lora_" in name or not p.is_floating_point() or is_quantized(p) or keep & set(name.split(".")):
            continue
        if p.dtype != expected:
            raise UserError(f"{what}: {name} was loaded as {dtype_name(p.dtype)} but {recorded} is recorded; "
                            "this is a bug in the stage's loading, please report it")
