"""RUN/damaged_samples.jsonl: the samples a run left out as damaged (train.on_damaged=skip), one JSON line per
sample ({"sample": key, "problem": text, "step": the optimizer step that first left it out}), appended by every rank
that meets one. The step says which checkpoints left it out: a start killed past its last checkpoint, or a run
continued from a checkpoint below a lower max_steps (`shorter`), lists samples the steps up to that checkpoint never
met (`read(up_to=)`; a line written before steps were recorded counts at every step).

Append-only, so recording costs the bytes of the new lines (a read-merge-rewrite of one JSON object was
quadratic: ~10k rewrites of up to ~1 MB at 1M samples with a 1% limit). Kill-safe: a line is written whole by one
`write` and fsynced before the step goes on; a kill in the middle of a write leaves at most a torn last line,
which readers skip and the next writer cuts off before it appends (under the file's lock, so two ranks never
interleave). A resume reads the list back (`read`) and appends only samples not listed yet."""

from __future__ import annotations

import json
import os
from pathlib import Path

from store import format as fmt

NAME = "damaged_samples.jsonl"
_OLD_NAME = "damaged_samples.json"  # one JSON object {"skipped", "samples"}, written by earlier versions
_LOCK = ".damaged_samples.lock"


def path_of(run_dir: Path) -> Path:
    return run_dir / NAME


def read(run_dir: Path, up_to: int | None = None) -> dict[str, str]:
    """Every listed sample key -> its problem (a torn or unreadable line skipped: its sample is listed again
    when a resume meets it); with `up_to`, only those left out at optimizer steps up to it (a checkpoint's
    step: what the run it holds left out)."""
    out: dict[str, str] = {}
    try:  # a run folder written by an earlier version: its list goes on
        out.update(json.loads((run_dir / _OLD_NAME).read_text()).get("samples", {}))
    except (FileNotFoundError, ValueError, AttributeError):
        pass
    try:
        data = path_of(run_dir).read_bytes()
    except FileNotFoundError:
        return out
    out.update(_parsed(data, up_to))
    return out


def _parsed(data: bytes, up_to: int | None = None) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in data.splitlines():
        try:
            rec = json.loads(line)
            if up_to is not None and _past(rec, up_to):
                continue
            out[str(rec["sample"])] = str(rec["problem"])
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return out


def listed_since(run_dir: Path, since: int) -> tuple[set[str], int]:
    """(the samples the list's whole lines from byte `since` on name, the offset after the last of them): what
    the other ranks listed since a rank last looked, each byte read once. A rank that meets a sample another rank
    met in another epoch then lists and names it no second time."""
    try:
        with open(path_of(run_dir), "rb") as f:
            f.seek(since)
            data = f.read()
    except FileNotFoundError:
        return set(), since
    end = data.rfind(b"\n") + 1  # a line being written (or torn) is read from its start next time
    return set(_parsed(data[:end])), since + end


def forget(run_dir: Path) -> None:
    """A fresh start's list begins empty: what a start killed before its first checkpoint listed was left out of
    no run that goes on (kept, it made the fresh run stale and unresumable under on_damaged stop)."""
    for name in (NAME, _OLD_NAME):
        (run_dir / name).unlink(missing_ok=True)


def _cut_torn_tail(fd: int) -> int:
    """Cut a last line a killed writer left without its newline; returns the file's size after."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return size
    end, block = size, 1 << 16
    while end > 0:  # back to the last newline: only the torn line's bytes are read
        start = max(0, end - block)
        nl = os.pread(fd, end - start, start).rfind(b"\n")
        if nl >= 0:
            end = start + nl + 1
            break
        end = start
    os.ftruncate(fd, end)
    return end


def append(run_dir: Path, damaged: dict[str, str], step: int | None = None) -> Path:
    """Add these samples (key -> problem), left out at optimizer step `step`, to the run's list; on a failed
    write (full disk) the file is cut back to what it held, so it never ends in a partial line of ours."""
    path = path_of(run_dir)
    at = {} if step is None else {"step": int(step)}
    data = "".join(json.dumps({"sample": k, "problem": p, **at}, ensure_ascii=False) + "\n"
                   for k, p in sorted(damaged.items())).encode()
    with fmt.flock(run_dir / _LOCK):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            size = _cut_torn_tail(fd)
            try:
                written = os.write(fd, data)
                while written < len(data):  # a short write (rare: signals, quotas) goes on where it stopped
                    written += os.write(fd, data[written:])
                os.fsync(fd)
            except BaseException:
                os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)
    return path


def copy_up_to(kept: Path, run_dir: Path, step: int) -> None:
    """The list of the run in `kept` as its steps up to `step` left it (`read(up_to=)`) into `run_dir`, durable (a
    run continued from `kept`'s checkpoint at or below `step`: `stages/train/shorter.py`). A torn line is dropped."""
    try:
        lines = path_of(kept).read_bytes().splitlines()
    except FileNotFoundError:
        lines = []
    kept_lines = [line for line in lines if _left_out_by(line, step)]
    if kept_lines:
        fmt.atomic_write_bytes(path_of(run_dir), b"".join(line + b"\n" for line in kept_lines))
    if (kept / _OLD_NAME).is_file():  # an earlier version's list (no steps): as it is
        fmt.atomic_write_bytes(run_dir / _OLD_NAME, (kept / _OLD_NAME).read_bytes())


def _left_out_by(line: bytes, step: int) -> bool:
    """Whether a whole line records a sample left out at or before `step` (one without a step: at any)."""
    try:
        rec = json.loads(line)
        return "sample" in rec and not _past(rec, step)
    except (ValueError, TypeError, AttributeError):
        return False


def _past(rec: dict, step: int) -> bool:
    """A line's sample was first left out after optimizer step `step` (a line without a step: never)."""
    return isinstance(rec.get("step"), int) and rec["step"] > step
