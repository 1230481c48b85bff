"""Writing one tar shard: members per sample, with the absolute byte offset of every tensor and file recorded.

A sample becomes `<key>.safetensors` (all its tensors, bf16 native), `<key>.<name>` per file and `<key>.json`
(its meta). Tar member data starts on a 512-byte boundary and safetensors aligns tensor data to 8 bytes, so
every tensor can later be sliced straight out of an mmap of the shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_save

from store.format import fsync_dir


class _HashingFile:
    """File wrapper hashing every byte written (one pass; no re-read of a 256 MB shard to checksum it), and
    separately the bytes of the sample being written (the manifest's per-row checksum)."""

    def __init__(self, path: Path) -> None:
        self._f = open(path, "wb")
        self.sha = hashlib.sha256()
        self.sample_sha = hashlib.sha256()
        self.pos = 0

    def write(self, b: bytes | memoryview) -> None:
        self._f.write(b)
        self.sha.update(b)
        self.sample_sha.update(b)
        self.pos += len(b)

    def close_synced(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


@dataclass
class SampleRecord:
    """Where one sample's bytes lie in its shard (a manifest row, before meta columns are merged in)."""

    key: str
    sample_offset: int
    sample_nbytes: int
    sample_sha256: str
    tensors: list[dict[str, Any]] = field(default_factory=list)  # name, offset, nbytes, dtype, shape
    files: list[dict[str, Any]] = field(default_factory=list)  # name, offset, nbytes


def tensor_dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def encode_tensors(tensors: dict[str, torch.Tensor]) -> tuple[bytes, list[dict[str, Any]]]:
    """safetensors bytes + each tensor's (offset within these bytes, nbytes, dtype, shape)."""
    cpu = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    blob = safetensors_save(cpu)
    (hlen,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + hlen])
    out = []
    for name, t in cpu.items():
        begin, end = header[name]["data_offsets"]
        out.append({
            "name": name, "offset": 8 + hlen + begin, "nbytes": end - begin,
            "dtype": tensor_dtype_name(t), "shape": list(t.shape),
        })
    return blob, out


class ShardBuilder:
    """Appends samples to `<final>.tmp`; `commit()` ends the archive, fsyncs and renames it to its final name.

    Tar is written by hand with `tarfile`'s own header encoder (USTAR: one 512-byte header per member, keys are
    short), so the data offset of each member is simply known, and no pax records appear.
    """

    def __init__(self, final_path: Path) -> None:
        self.final_path = final_path
        self.tmp_path = final_path.with_name(final_path.name + ".tmp")
        self._f = _HashingFile(self.tmp_path)
        self.records: list[SampleRecord] = []

    @property
    def nbytes(self) -> int:
        return self._f.pos

    def _member(self, name: str, data: bytes) -> int:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.mode = 0o644
        info.mtime = 0  # the same content gives the same bytes
        self._f.write(info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict"))
        offset = self._f.pos
        self._f.write(data)
        pad = -len(data) % tarfile.BLOCKSIZE
        if pad:
            self._f.write(b"\0" * pad)
        return offset

    def add(self, key: str, tensors: dict[str, torch.Tensor], files: dict[str, bytes], meta: dict[str, Any]) -> SampleRecord:
        start = self._f.pos
        self._f.sample_sha = hashlib.sha256()
        rec = SampleRecord(key=key, sample_offset=start, sample_nbytes=0, sample_sha256="")
        if tensors:
            blob, layout = encode_tensors(tensors)
            base = self._member(f"{key}.safetensors", blob)
            rec.tensors = [{**t, "offset": base + t["offset"]} for t in layout]
        for name, data in files.items():
            off = self._member(f"{key}.{name}", bytes(data))
            rec.files.append({"name": name, "offset": off, "nbytes": len(data)})
        self._member(f"{key}.json", json.dumps(meta, sort_keys=True).encode())
        rec.sample_nbytes = self._f.pos - start
        rec.sample_sha256 = self._f.sample_sha.hexdigest()
        self.records.append(rec)
        return rec

    def commit(self) -> str:
        """End the archive (two zero blocks, padded to a tar record), fsync, rename; returns the shard's sha256."""
        end = self._f.pos + 2 * tarfile.BLOCKSIZE
        self._f.write(b"\0" * (2 * tarfile.BLOCKSIZE + (-end % tarfile.RECORDSIZE)))
        self._f.close_synced()
        os.replace(self.tmp_path, self.final_path)
        fsync_dir(self.final_path.parent)
        return self._f.sha.hexdigest()

    def abandon(self) -> None:
        self._f._f.close()
        self.tmp_path.unlink(missing_ok=True)
