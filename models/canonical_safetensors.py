"""safetensors files whose bytes are a function of what they hold (tensors and metadata), whichever process writes
them: `canonicalize` rewrites the header a safetensors writer left into one spelling.

Why: safetensors' writer (Rust; 0.8.0, which has no option for it) keeps `__metadata__` in a HashMap and writes
it in that map's iteration order, seeded anew per process (PYTHONHASHSEED does not reach it). The same LoRA
saved by two processes had other bytes, so another sha256, and that sha256 is what names a weights file: evaluate
--all-checkpoints took a deterministic retrain of a step for new weights and evaluated every step again, a
single-LoRA report and train's `init_lora` record compare it too (docs/evaluate.md, "Checkpoint identity").

How: the header JSON is parsed and written again with `__metadata__` first, its keys sorted, then the tensors in
the writer's order (the order of their data: safetensors sorts them by dtype, then name), compact separators and
space padding to 8 bytes, as the writer spells it; the data section is copied unchanged. Its offsets count from
the end of the header, so the header's length could change freely (it does not: the spelling is the writer's).
Readers take the file as any other: `safe_open`, `load_file`, diffusers' and ComfyUI's loaders (which use those).

Why canonical bytes and not a content digest that ignores the header's order: a step evaluated (or a run
started from an init LoRA) before this is recorded under the sha256 of its file's bytes; those files keep their
bytes and so their identity, where a new kind of identity would have taken every one of them for other weights.
What neither can do: tell that a file written before this (its order drawn at random) and one written again
now hold the same weights - only the old bytes' hash is recorded. Such a step is evaluated once more.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from schemas import atomic_write

_ALIGN = 8  # the writer pads the header with spaces so the data starts 8-byte aligned
_MAX_HEADER = 100_000_000  # safetensors' own limit on a header's size


def spelled(header: dict) -> bytes:
    """The 8-byte length and the header JSON of a parsed safetensors header (`__metadata__` and the tensors'
    entries), in the one spelling: metadata keys sorted, tensors in the given (data) order."""
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    meta = header.get("__metadata__")
    ordered = {"__metadata__": dict(sorted(meta.items())), **tensors} if meta else tensors
    text = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % _ALIGN)
    return len(text).to_bytes(8, "little") + text


def read_header(f, path: Path) -> dict:
    """The parsed header of the safetensors file open as `f`, left positioned at its data."""
    size = int.from_bytes(f.read(8), "little")
    if not 0 < size <= _MAX_HEADER:
        raise ValueError(f"{path}: not a safetensors file (header size {size})")
    return json.loads(f.read(size))


def canonicalize(path: str | Path, extra: dict[str, str] | None = None) -> None:
    """Rewrite the safetensors file at PATH (just written by the library) with its header `spelled`, `extra`'s
    keys added to its metadata; atomically (a temp file beside it, renamed over it)."""
    path = Path(path)
    with open(path, "rb") as src:
        header = read_header(src, path)
        if extra:
            header["__metadata__"] = {**(header.get("__metadata__") or {}), **extra}
        # the one atomic write (a temp name within the limit on a name's length where `path`'s is, fsync, rename,
        # the folder fsynced): a power loss leaves the old file or this one, and a saved LoRA keeps its name
        with atomic_write.atomic_file(path) as dst:
            dst.write(spelled(header))
            shutil.copyfileobj(src, dst, 8 * 1024 * 1024)
