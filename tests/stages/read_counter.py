"""Counts the bytes read from LoRA weight files: through Python's `open` (the checksum, hash and load passes)
and through safetensors' own mmap reader (`models.lora.load_file`, counted as the whole file per call)."""

from __future__ import annotations

import builtins
import io
from collections import Counter
from pathlib import Path

WEIGHTS = "pytorch_lora_weights.safetensors"


class _Counting(io.RawIOBase):
    def __init__(self, raw, key: str, counts: Counter):
        self.raw, self.key, self.counts = raw, key, counts

    def readinto(self, b) -> int:
        n = self.raw.readinto(b)
        self.counts[self.key] += n or 0
        return n

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:  # tarfile's header walk seeks header to header
        return self.raw.seekable()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        self.raw.close()
        super().close()


def count_lora_reads(monkeypatch) -> Counter:
    """{weight file path: bytes read} from now on (monkeypatch undoes it)."""
    import models.lora

    counts: Counter = Counter()
    real_open, real_load_file = builtins.open, models.lora.load_file

    def counting_open(file, mode="r", buffering=-1, *a, **k):
        if isinstance(file, (str, Path)) and Path(file).name == WEIGHTS and "r" in mode and "b" in mode:
            raw = _Counting(real_open(file, mode, buffering=0), str(Path(file).resolve()), counts)
            return raw if buffering == 0 else io.BufferedReader(raw)
        return real_open(file, mode, buffering, *a, **k)

    def counting_load_file(path, *a, **k):
        counts[str(Path(path).resolve())] += Path(path).stat().st_size
        return real_load_file(path, *a, **k)

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(models.lora, "load_file", counting_load_file)
    return counts


def count_reads_under(monkeypatch, folder: Path, loaders: tuple[str, ...] = ()) -> Counter:
    """{path relative to `folder`: bytes read} of the files under `folder` from now on: through Python's `open`
    (`io.open` too: pathlib's reads) and through safetensors' `load_file` where the modules named in `loaders`
    import it (mmap: counted as the whole file per call)."""
    import importlib

    counts: Counter = Counter()
    root = folder.resolve()
    real_open = builtins.open

    def under(file) -> str | None:
        if not isinstance(file, (str, Path)):
            return None
        p = Path(file).resolve()
        return p.relative_to(root).as_posix() if p.is_relative_to(root) else None

    def counting_open(file, mode="r", buffering=-1, *a, **k):
        key = under(file)
        if key is None or "r" not in mode:
            return real_open(file, mode, buffering, *a, **k)
        raw = _Counting(real_open(file, "rb", buffering=0), key, counts)
        if "b" in mode:
            return raw if buffering == 0 else io.BufferedReader(raw)
        return io.TextIOWrapper(io.BufferedReader(raw), *a, **k)

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(io, "open", counting_open)
    for name in loaders:
        module = importlib.import_module(name)
        real_load_file = getattr(module, "load_file", None)
        if real_load_file is None:
            continue

        def counting_load_file(path, *a, _real=real_load_file, **k):
            if (key := under(path)) is not None:
                counts[key] += Path(path).stat().st_size
            return _real(path, *a, **k)

        monkeypatch.setattr(module, "load_file", counting_load_file)
    return counts
