"""Train checkpoints: written atomically, found again on `--resume`, checked against the config and store.

`RUN/checkpoints/step-N/` holds
    lora/pytorch_lora_weights.safetensors   the adapter, diffusers format (loadable like RUN/lora)
    optimizer.safetensors + optimizer.json  optimizer state tensors / other state + param groups (no pickle)
    scheduler.json                          LR scheduler state
    rng-rankNN.safetensors                  each rank's torch RNG states (restored on the same process count)
    resume.json                             `ResumeRecord` + size and CRC32C of every other file, sealed
                                            with its own CRC32C (store/checksum.py), written last
Everything is written into `.step-N.tmp/`, fsynced, then renamed to `step-N` (the commit, `store.format.atomic_dir`):
a process killed mid-write leaves only a `.tmp` folder, which `latest_checkpoint` ignores and the next run removes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from schemas import up_to_date
from schemas.errors import UserError
from schemas.newer import refuse_newer
from schemas.record_formats import RESUME_FORMAT, RESUME_JSON  # store.checksum reads resume.json too
from schemas.up_to_date import compared_tables, known_init_lora  # the resume rule (evaluate's "one training" too)

# torch is imported by the functions that write and read the state files: `--resume`'s checks at a command's
# start (stages/train/resume.py) read records only, and a mistyped --model after them is told without it
if TYPE_CHECKING:
    import torch

# ResumeRecord.extra key: the optimizer steps train.on_nonfinite=skip_step left without an update, up to the record's
# step, every start's (on_nonfinite is in no fingerprint: a run that skipped some is current under skip_step only)
NONFINITE_SKIPPED = "nonfinite_skipped_steps"
# ResumeRecord.extra keys of what the trackers log across a resume (absent in older records: counted from the resume):
# the step losses since the last train.log_every point (train/loss there is their mean; null: a non-finite one), and
# the current epoch's [valid, computed] tokens so far (epoch/padding_efficiency when it ends), and each of the last
# steps' [valid, computed] tokens, as many as the losses (train/padding_efficiency: the log point's window)
LOSSES_SINCE_LOG = "losses_since_log"  # the last step losses (the name of when only those since the log point were)
# How many step losses a checkpoint keeps at least: a resume with another train.log_every up to this logs the
# straight run's first train/loss (its window may begin before the old cadence's last point: 2 -> 4 at step 6)
KEPT_LOSSES = 1000
EPOCH_TOKENS = "epoch_tokens"
STEP_TOKENS = "step_tokens"
# ... and train.on_damaged=skip's [damaged, read] sample counts so far: max_damaged_fraction is a limit of the run,
# not of one start (absent: counted from the resume, as before)
DAMAGED_READS = "damaged_reads"
_PREFIX = "step-"


class ResumeMismatch(UserError):
    """The run folder's checkpoints were made with other settings, data or model."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message  # what differs, without the advice (the line a keep prints)


class PastMaxSteps(ResumeMismatch):
    """The run's newest checkpoint is past train.max_steps, and nothing else differs (`start._check_resumable`).
    `point`: its checkpoint a start to this max_steps continues from (`stages/train/shorter.py`), or None."""

    def __init__(self, message: str, reason: str = "", point: Path | None = None) -> None:
        super().__init__(message, reason)
        self.point = point


class CheckpointDamaged(UserError):
    """A checkpoint file that does not match the checksum recorded when it was written. `intact_left`: whether an
    earlier intact checkpoint is left to continue from (the line offers it); else only a fresh start is."""

    def __init__(self, message: str, intact_left: bool = True) -> None:
        super().__init__(message)
        self.intact_left = intact_left


def _intact(folder: Path) -> bool:
    try:
        ResumeRecord.read(folder / RESUME_JSON)
        return True
    except UserError:
        return False


def damaged(folder: Path, what: str) -> CheckpointDamaged:
    """Names the damaged file and offers the newest intact earlier checkpoint (kept checkpoints exist for this);
    with none left, the two ways on: keep the run aside (`--new-run`) or a new --out."""
    earlier = [p for step, p in complete_checkpoints(folder.parent) if p != folder and step < step_of(folder)]
    intact = next((p for p in reversed(earlier) if _intact(p)), None)
    if intact is not None:
        return CheckpointDamaged(f"checkpoint {folder}: {what}; the previous checkpoint {intact.name} is intact: move "
                                 f"{folder} out of {folder.parent} and rerun with --resume to continue from it")
    from stages.train.previous import previous_root  # it imports this module

    run_dir = folder.parent.parent
    return CheckpointDamaged(f"checkpoint {folder}: {what}; no intact earlier checkpoint is left to continue from: "
                             f"add --new-run to keep this run (moved to {previous_root(run_dir)}/N-TIME, nothing "
                             "deleted) and train afresh, or use a new --out", intact_left=False)


def step_of(folder: Path) -> int:
    """The optimizer step a checkpoint folder `step-N` holds."""
    tail = folder.name[len(_PREFIX):]
    return int(tail) if tail.isdigit() else 1 << 62


def file_checksums(folder: Path) -> dict[str, dict[str, Any]]:
    from store.checksum import folder_checksums

    return folder_checksums(folder, (RESUME_JSON,))


# the most bytes a resume's check keeps for the load, per rank: the kept files are held while the base model
# loads (every rank of a node at once), and a large LoRA's checkpoint reaches GBs (float32 LoRA + Adam's two
# states + EMA: rank 128 on the 60 blocks' attention and MLP linears, ~14 GB); the files past it are checked
# as streamed and read again by the load (the default, rank 16 on to_q/k/v/out: ~380 MB with EMA, fits)
KEEP_MAX_BYTES = 1 << 30


def check_files(folder: Path, files: dict[str, dict[str, Any]], keep: dict[str, bytes] | None = None) -> None:
    """Every file against its recorded size and CRC32C. `keep`: filled with each file's bytes, checked as read
    and kept for the load (a resume then reads each file once, not once to check and again to load), up to
    `KEEP_MAX_BYTES` in all (by the recorded sizes); the others are streamed (not kept)."""
    from store.checksum import crc_hex, file_mismatch

    room = KEEP_MAX_BYTES
    for name, entry in sorted(files.items()):
        size = entry.get("nbytes")
        if keep is None or not isinstance(size, int) or size > room:
            problem = file_mismatch(folder, name, entry)
        else:
            try:
                data = (folder / name).read_bytes()
            except FileNotFoundError:
                data, problem = None, f"{name} is missing"
            else:
                problem = file_mismatch(folder, name, entry, (crc_hex(data), len(data)))
            if data is not None and not problem:
                keep[name] = data
                room -= len(data)
        if problem:
            raise damaged(folder, problem)


_INPUT_LABEL = {"config_fingerprint": "train config fingerprint", "tables": "store tables",
                "model_fingerprint": "model fingerprint", "init_lora_sha256": "train.init_lora weights (sha256)",
                "training_revision": "training revision", "attention_backend": "attention backend (as resolved)"}


@dataclass(frozen=True)
class ResumeRecord:
    """Where training stopped and what it was trained on; a resume with anything else different fails."""

    step: int  # optimizer steps done
    epoch: int  # data position: the next micro-batch is batch `batch_in_epoch` of epoch `epoch`
    batch_in_epoch: int
    config_fingerprint: str
    tables: dict[str, str]  # table -> identity of the version trained on (Store.version_id)
    store: str
    model_fingerprint: str
    world_size: int  # processes of the start that wrote it (a resume may use another count: stages/train/elastic.py)
    format: int = RESUME_FORMAT
    extra: dict[str, Any] = field(default_factory=dict)
    # processes the sample order is planned for: the run's first world size (None: checkpoints written before
    # elastic resume, whose order was planned for their `world_size`)
    canonical_world_size: int | None = None
    # sha256 of train.init_lora's weight file (None: no init_lora, or a record written before it was recorded,
    # `known_init_lora`): the config fingerprint holds only its path, and a file rewritten there with other
    # weights makes another run (its step 0 is other weights), so a resume or the up-to-date check compares it.
    # A field of its own, not in the fingerprint: runs without init_lora keep their fingerprints.
    init_lora_sha256: str | None = None
    # the code's `settings.training_revision(config)` the weights were trained under (a record written before it was
    # recorded: the revision that code computed, `UNRECORDED_REVISION`)
    training_revision: int = up_to_date.UNRECORDED_REVISION
    # table -> content identity of what the run reads from it (`JoinedTables.content_ids`; None: a record written
    # before they were recorded, or tables that have none). A version carried forward whole into a new number (an
    # `images` rerun that changed no sample) has other `tables` ids but the same content: the same run
    # (`compared_tables`). A field of its own: records without it compare `tables` as before.
    table_contents: dict[str, str] | None = None
    # the attention backend the run trained with (`settings.run_backend`: train.attention_backend as resolved on its
    # device; None: a record written before it was recorded, `settings.recorded_backend`). A field of its own: the
    # fingerprint hashes no backend name, so an unset backend and the name it resolves to are one run.
    attention_backend: str | None = None
    # how the run's epoch plans shuffle and where a short tail goes (stages/train/budget.py `PLAN_SHUFFLE`), fixed at
    # its first start so every resume sees its order (None: a record written before it was recorded, whose run drew
    # Python's shuffles)
    plan_shuffle: int | None = None

    @property
    def canonical(self) -> int:
        return self.canonical_world_size or self.world_size

    @property
    def shuffle(self) -> int:
        from stages.train.budget import PYTHON_SHUFFLE

        return self.plan_shuffle or PYTHON_SHUFFLE

    @classmethod
    def read(cls, path: Path, keep: dict[str, bytes] | None = None, files: bool = True) -> "ResumeRecord":
        """The record of a checkpoint whose every file matches the sizes and CRC32Cs recorded at commit
        (checkpoints written before checksums carry none and are read as they are; `files` False: the record
        alone, its files' check left to another rank, whose answer the ranks share). `keep`: filled with the
        checked files' bytes (relative path -> bytes) for the load (`check_files`)."""
        from store.checksum import SealError, is_sealed, unseal

        try:
            data = path.read_bytes()
            sealed = is_sealed(data)
            d = unseal(data) if sealed else json.loads(data)
            if not isinstance(d, dict):
                raise TypeError(f"a JSON {type(d).__name__}, not an object")
            # intact, but not this code's to read: a damaged verdict would have the user delete a good run (unknown
            # fields count too: releases so far added fields with defaults under format 1)
            refuse_newer(f"{path}: this run", d, RESUME_FORMAT, intact=sealed, then=", or start a new --out",
                         known={f.name for f in fields(ResumeRecord)} | {"files"})
            if d.get("format") != RESUME_FORMAT:
                raise UserError(f"{path}: resume format {d.get('format')!r}, this code reads {RESUME_FORMAT}")
            recorded = d.pop("files", None)
            record = cls(**d)
        except (OSError, json.JSONDecodeError, UnicodeDecodeError, TypeError, SealError) as e:
            raise damaged(path.parent, f"{path.name} is damaged or unreadable ({e})") from None
        if recorded is not None and files:
            check_files(path.parent, recorded, keep)
        return record

    def inputs(self) -> dict[str, Any]:
        """What the weights were trained from (`schemas.up_to_date`: a resume and the up-to-date check compare it)."""
        return {"config_fingerprint": self.config_fingerprint, "tables": self.tables,
                "model_fingerprint": self.model_fingerprint, "init_lora_sha256": self.init_lora_sha256,
                "training_revision": self.training_revision, "attention_backend": self.attention_backend}

    def check_matches(self, now: "ResumeRecord", where: Path,
                      contents: Callable[[], dict[str, str] | None] | None = None) -> None:
        """Fail loudly when the config, the store tables (their contents where both sides have them,
        `compared_tables`), the model, the init LoRA's bytes or the code's training revision changed (the process
        count may change: the sample order is planned for the record's canonical world size,
        stages/train/elastic.py). `contents`: this start's `JoinedTables.content_ids`, called only when the
        version ids differ (`now` has none)."""
        before, after = self.inputs(), now.inputs()
        compared = compared_tables(self.tables, self.table_contents, now.tables,
                                   (lambda: now.table_contents) if now.table_contents else contents)
        stale = up_to_date.stale_inputs({**before, "tables": compared[0]}, {**after, "tables": compared[1]})
        if "config_fingerprint" in stale and "training_revision" in stale:
            # a run records its config's revision (`settings.training_revision`: e.g. grad_accum 1 -> 2 is revision
            # 1 -> 2 under one release): with the config changed too, the revision is no release's doing to name
            # (said as one, the line sent the user after the release that started the run); set back, the config's
            # revision is the record's again, or this refusal names the release then
            stale.remove("training_revision")
        # named by their version ids (the tables compared by content, `compared_tables`)
        problems = up_to_date.stale_named({k: before[k] for k in stale}, {k: after[k] for k in stale}, _INPUT_LABEL)
        if not problems:
            return
        advice = "Resume with the same config and store, or start a new run with a different --out"
        if "training_revision" in stale:
            # no setting of the user's to put back: the release that made the checkpoints is what differs, and
            # steps of both in one LoRA would be neither run
            problems[stale.index("training_revision")] += (
                " (this release trains differently from the one that wrote these checkpoints)")
            same = " and the same config and store" if len(stale) > 1 else ""
            advice = (f"Finish this run with the release that started it (training revision "
                      f"{before['training_revision']}){same}, or train it afresh under this one: a new --out")
        raise ResumeMismatch(f"cannot resume from {where}: {'; '.join(problems)}. {advice}",
                             reason="; ".join(problems))


def curve_state(losses_since_log: list[float], epoch_tokens: list[int],
                step_tokens: list[tuple[int, int]]) -> dict[str, Any]:
    """The `extra` entries a checkpoint records so a resumed start logs the straight run's curve."""
    return {LOSSES_SINCE_LOG: [v if v == v and abs(v) != float("inf") else None for v in losses_since_log],
            EPOCH_TOKENS: [int(t) for t in epoch_tokens],
            STEP_TOKENS: [[int(v), int(c)] for v, c in step_tokens]}


def resumed_curve(record: ResumeRecord) -> tuple[list[float], list[int], list[tuple[int, int]]]:
    """(the last step losses up to `record`: those since its log point at least, the epoch's [valid, computed]
    tokens so far, the last steps' [valid, computed] tokens); nothing for a record written before they were kept."""
    losses = [float("nan") if v is None else float(v) for v in record.extra.get(LOSSES_SINCE_LOG, ())]
    tokens = [int(t) for t in record.extra.get(EPOCH_TOKENS, (0, 0))]
    steps = [(int(v), int(c)) for v, c in record.extra.get(STEP_TOKENS, ())]
    return losses, tokens if len(tokens) == 2 else [0, 0], steps


def damaged_reads(record: ResumeRecord) -> tuple[int, int]:
    """(damaged, read) sample counts of train.on_damaged=skip up to `record`; (0, 0) for a record without them."""
    counts = record.extra.get(DAMAGED_READS, (0, 0))
    return (int(counts[0]), int(counts[1])) if len(counts) == 2 else (0, 0)


def nonfinite_skipped(record: ResumeRecord) -> list[int]:
    """The steps the run up to `record` skipped for a non-finite loss or gradient (train.on_nonfinite=skip_step)."""
    return [int(s) for s in record.extra.get(NONFINITE_SKIPPED, ()) if int(s) <= record.step]


# ---------------------------------------------------------------------------------------------- locating


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"{_PREFIX}{step}"


def temp_dir(root: Path, step: int) -> Path:
    return root / f".{_PREFIX}{step}.tmp"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every committed checkpoint, oldest first."""
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX) :].isdigit() and (p / RESUME_JSON).is_file():
            out.append((int(p.name[len(_PREFIX) :]), p))
    return sorted(out)


def latest_checkpoint(root: Path) -> Path | None:
    done = complete_checkpoints(root)
    return done[-1][1] if done else None


def unrecorded_checkpoints(root: Path, newer_than: int = -1) -> list[Path]:
    """The `step-N/` folders past step `newer_than` without their resume.json: damaged (renamed in whole, a
    committed one always holds it: a partial copy of the run, a deleted file), yet part of the run, never to be
    trained over or deleted (`previous.holds_trained_run`)."""
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)
            and p.name[len(_PREFIX):].isdigit() and step_of(p) > newer_than and not (p / RESUME_JSON).is_file()]


def check_no_unrecorded(root: Path, latest: Path | None) -> None:
    """A committed `step-N/` newer than `latest` without its resume.json (`unrecorded_checkpoints`) is named, as a
    damaged file is, instead of a start from an earlier checkpoint (or step 0) that overwrites it."""
    lost = unrecorded_checkpoints(root, -1 if latest is None else step_of(latest))
    if lost:
        raise damaged(max(lost, key=step_of), f"{RESUME_JSON} is missing")


def remove_stale(root: Path) -> None:
    """Delete leftovers of killed writes/prunes (`.step-N.tmp`, `.step-N.deleting`)."""
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(f".{_PREFIX}") and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)


def prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints; older ones are renamed away first, so a kill never leaves half of one."""
    for _, p in complete_checkpoints(root)[:-keep]:
        doomed = p.with_name(f".{p.name}.deleting")
        os.rename(p, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- the record


def write_record(folder: Path, record: ResumeRecord) -> None:
    """The resume record with every other file's size and CRC32C, sealed, written last into the checkpoint's temp
    folder (committed by `store.format.atomic_dir`). The RNG files are checksummed by name, one per rank of
    `record.world_size`, not as the folder's listing shows them: on a shared file system (NFS, several nodes) rank
    0's listing can be stale and miss another node's file, which then went into no checksum and was read on resume
    unchecked. One absent (after the barrier every rank wrote it before) is refused, naming it."""
    from store.checksum import file_crc, seal

    files = {name: entry for name, entry in file_checksums(folder).items() if not _RNG_NAME.fullmatch(name)}
    for rank in range(record.world_size):
        path = _rng_file(folder, rank)
        try:
            crc, n = file_crc(path)
        except FileNotFoundError:
            raise UserError(f"{path} (rank {rank}'s RNG state) is not there after every rank wrote it: the ranks "
                            "must share one run folder that every node sees (--out on a shared file system, not a "
                            "node-local path); fix that and rerun with --resume to continue from the last committed "
                            "checkpoint") from None
        files[path.name] = {"nbytes": n, "crc32c": crc}
    (folder / RESUME_JSON).write_bytes(seal({**asdict(record), "files": dict(sorted(files.items()))}))


# ---------------------------------------------------------------------------------------------- state files


def _flatten(value: Any, key: str, tensors: dict[str, torch.Tensor], seen: dict[tuple, str]) -> Any:
    """JSON layout of one optimizer state entry; tensors go to `tensors` under `key` (nested dicts recurse:
    bitsandbytes keeps its quantisation state in one). A tensor shared between params (bitsandbytes' qmaps) is
    written once and referenced by its first key."""
    import torch

    if isinstance(value, torch.Tensor):
        ident = (value.data_ptr(), tuple(value.shape), tuple(value.stride()), value.dtype)
        if value.numel() and ident in seen:
            return {"tensor": seen[ident]}
        seen[ident] = key
        tensors[key] = value.detach().cpu().contiguous()
        return {"tensor": key}
    if isinstance(value, dict):
        return {"dict": {k: _flatten(v, f"{key}.{k}", tensors, seen) for k, v in value.items()}}
    return {"value": value}


def _unflatten(layout: dict, tensors: dict[str, torch.Tensor]) -> Any:
    if "tensor" in layout:
        return tensors[layout["tensor"]]
    if "dict" in layout:
        return {k: _unflatten(v, tensors) for k, v in layout["dict"].items()}
    return layout["value"]


def save_optimizer(optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Any torch-style optimizer (AdamW, bitsandbytes 8-bit, Adafactor, Prodigy): state tensors in safetensors,
    everything else (ints, floats, the param groups) in JSON; no pickle."""
    from safetensors.torch import save_file

    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}
    layout = {str(idx): {name: _flatten(v, f"{idx}.{name}", tensors, seen) for name, v in st.items()}
              for idx, st in sd["state"].items()}
    save_file(tensors, folder / "optimizer.safetensors")
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    (folder / "optimizer.json").write_text(json.dumps({"param_groups": groups, "state": layout}, indent=2) + "\n")


def kept_bytes(folder: Path, name: str, kept: dict[str, bytes] | None) -> bytes:
    """A checkpoint file's bytes: those its check read (`ResumeRecord.read(keep=...)`, handed over and dropped
    here), else read now (a checkpoint written before checksums)."""
    data = kept.pop(name, None) if kept is not None else None
    return data if data is not None else (folder / name).read_bytes()


def load_optimizer(optimizer: torch.optim.Optimizer, folder: Path, kept: dict[str, bytes] | None = None) -> None:
    from safetensors.torch import load as load_bytes

    flat = load_bytes(kept_bytes(folder, "optimizer.safetensors", kept))
    saved = json.loads(kept_bytes(folder, "optimizer.json", kept))
    groups = saved["param_groups"]
    for g, now in zip(groups, optimizer.param_groups):
        for k, v in now.items():  # JSON has no tuples: give back the optimizer's own types (betas, eps, ...)
            if isinstance(v, tuple) and isinstance(g.get(k), list):
                g[k] = tuple(g[k])
    state = {int(idx): {name: _unflatten(v, flat) for name, v in st.items()} for idx, st in saved["state"].items()}
    n_params = sum(len(g["params"]) for g in optimizer.param_groups)
    if sum(len(g["params"]) for g in groups) != n_params:
        raise UserError(f"{folder}: optimizer state is for a different number of LoRA parameters")
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def save_scheduler(scheduler: torch.optim.lr_scheduler.LRScheduler, folder: Path) -> None:
    sd = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    (folder / "scheduler.json").write_text(json.dumps(sd, indent=2) + "\n")


def load_scheduler(scheduler: torch.optim.lr_scheduler.LRScheduler, folder: Path,
                   kept: dict[str, bytes] | None = None) -> None:
    sd = json.loads(kept_bytes(folder, "scheduler.json", kept))
    sd["lr_lambdas"] = [None] * len(sd.get("base_lrs", []))  # the lambdas are rebuilt from the config
    scheduler.load_state_dict(sd)


def _rng_file(folder: Path, rank: int) -> Path:
    return folder / f"rng-rank{rank:02d}.safetensors"


_RNG_NAME = re.compile(r"rng-rank\d+\.safetensors")  # `_rng_file`'s names


def rng_states(cuda: bool) -> dict:
    """The torch RNG states LoRA dropout draws from: the CPU generator's, and each CUDA device's only when
    training on CUDA (`cuda`): reading them initializes CUDA, which a run with train.device=cpu on a GPU host
    (its GPUs busy or failing) must leave alone."""
    import torch

    states = {"cpu": torch.get_rng_state()}
    if cuda:
        states.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return states


def set_rng_states(states: dict, cuda: bool) -> None:
    """`rng_states`' states put back; the CUDA ones only when training on CUDA (a checkpoint of a CUDA run
    resumed with train.device=cpu leaves CUDA alone)."""
    import torch

    torch.set_rng_state(states["cpu"])
    devices = [states[f"cuda{i}"] for i in range(sum(k.startswith("cuda") for k in states))]
    if cuda and devices:
        torch.cuda.set_rng_state_all(devices)


def save_rng(folder: Path, rank: int, cuda: bool) -> None:
    """This rank's RNG states (`rng_states`) into a checkpoint's folder."""
    from safetensors.torch import save_file

    save_file(rng_states(cuda), _rng_file(folder, rank))


def load_rng(folder: Path, rank: int, cuda: bool, kept: dict[str, bytes] | None = None) -> None:
    path = _rng_file(folder, rank)
    if not (kept and path.name in kept) and not path.is_file():
        raise UserError(f"{folder} has no RNG state for rank {rank}: the checkpoint is incomplete")
    from safetensors.torch import load as load_bytes

    set_rng_states(load_bytes(kept_bytes(folder, path.name, kept)), cuda)
