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
from typing import TYPE_CHECKING, Any

from store.checksum import RunningCrc

if TYPE_CHECKING:  # torch is imported where tensors are encoded: the store's commands that read no tensor
    import torch  # (inspect, gc, push) start without it (bench/cold_start.py)


class _HashingFile:
    """File wrapper hashing every byte written (one pass; no re-read of a 256 MB shard to checksum it), and
    separately the bytes of the sample being written (the manifest's per-row checksum)."""

    def __init__(self, path: Path) -> None:
        self._f = open(path, "wb")
        self.sha = hashlib.sha256()
        self.sample_sha = hashlib.sha256()
        self.crc = RunningCrc()  # whole file (checksums.json) and sample (manifest `sample_crc32c`, checked on read)
        self.sample_crc = RunningCrc()
        self.pos = 0

    def write(self, b: bytes | memoryview) -> None:
        self._f.write(b)
        self.sha.update(b)
        self.sample_sha.update(b)
        self.crc.update(b)
        self.sample_crc.update(b)
        self.pos += len(b)

    def discard(self) -> None:
        try:
            self._f.close()
        except OSError:  # the flush of a failed (e.g. full-disk) write fails again: the file is dropped anyway
            pass

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
    sample_crc32c: str = ""
    tensors: list[dict[str, Any]] = field(default_factory=list)  # name, offset, nbytes, dtype, shape
    files: list[dict[str, Any]] = field(default_factory=list)  # name, offset, nbytes


def tensor_dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


# torch dtype name (tensor_dtype_name) -> safetensors dtype code
SAFETENSORS_DTYPES = {
    "bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64", "int64": "I64",
    "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}
SAFETENSORS_NAMES = {code: name for name, code in SAFETENSORS_DTYPES.items()}
# bytes per element of each safetensors dtype code (what `store verify` checks sizes with, no torch needed)
SAFETENSORS_ITEMSIZES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                         "BOOL": 1}


def encode_tensors(tensors: dict[str, torch.Tensor]) -> tuple[list[memoryview | bytes], list[dict[str, Any]]]:
    """A safetensors file as chunks (header, then each tensor's raw bytes: no copy of contiguous CPU tensors),
    plus each tensor's (offset within the file, nbytes, dtype, shape).

    Written here rather than with `safetensors.torch.save` so views of a larger batch tensor need no clone and
    nothing is assembled in memory; the result is a standard safetensors file (the tests load it with the library).
    """
    import torch

    cpu = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    header: dict[str, Any] = {}
    pos = 0
    for name, t in cpu.items():
        if tensor_dtype_name(t) not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} cannot be stored")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensor_dtype_name(t)], "shape": list(t.shape),
                        "data_offsets": [pos, pos + n]}
        pos += n
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)  # tensor data 8-byte aligned, as the safetensors spec asks
    chunks: list[memoryview | bytes] = [struct.pack("<Q", len(hbytes)) + hbytes]
    layout = []
    for name, t in cpu.items():
        begin, end = header[name]["data_offsets"]
        layout.append({"name": name, "offset": 8 + len(hbytes) + begin, "nbytes": end - begin,
                       "dtype": tensor_dtype_name(t), "shape": list(t.shape)})
        if end > begin:
            chunks.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return chunks, layout


class ShardBuilder:
    """Appends samples to a temp file; `seal()` ends the archive and fsyncs it, and the caller names it (the name
    it gets is chosen only then: store/writer_shards.py never replaces a file of that name).

    Tar is written by hand with `tarfile`'s own header encoder (USTAR: one 512-byte header per member, keys are
    short), so the data offset of each member is simply known, and no pax records appear.
    """

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self._f = _HashingFile(self.tmp_path)
        self.records: list[SampleRecord] = []

    @property
    def nbytes(self) -> int:
        return self._f.pos

    def _member(self, name: str, chunks: list[bytes | memoryview]) -> int:
        size = sum(len(c) for c in chunks)
        info = tarfile.TarInfo(name)
        info.size = size
        info.mode = 0o644
        info.mtime = 0  # the same content gives the same bytes
        self._f.write(info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict"))
        offset = self._f.pos
        for c in chunks:
            self._f.write(c)
        pad = -size % tarfile.BLOCKSIZE
        if pad:
            self._f.write(b"\0" * pad)
        return offset

    def add(self, key: str, tensors: dict[str, torch.Tensor], files: dict[str, bytes], meta: dict[str, Any]) -> SampleRecord:
        start = self._f.pos
        self._f.sample_sha = hashlib.sha256()
        self._f.sample_crc = RunningCrc()
        rec = SampleRecord(key=key, sample_offset=start, sample_nbytes=0, sample_sha256="")
        if tensors:
            chunks, layout = encode_tensors(tensors)
            base = self._member(f"{key}.safetensors", chunks)
            rec.tensors = [{**t, "offset": base + t["offset"]} for t in layout]
        for name, data in files.items():
            off = self._member(f"{key}.{name}", [bytes(data)])
            rec.files.append({"name": name, "offset": off, "nbytes": len(data)})
        self._member(f"{key}.json", [json.dumps(meta, sort_keys=True).encode()])
        rec.sample_nbytes = self._f.pos - start
        rec.sample_sha256 = self._f.sample_sha.hexdigest()
        rec.sample_crc32c = self._f.sample_crc.hex()
        self.records.append(rec)
        return rec

    def seal(self) -> str:
        """End the archive (two zero blocks, padded to a tar record) and fsync it; returns the shard's sha256."""
        end = self._f.pos + 2 * tarfile.BLOCKSIZE
        self._f.write(b"\0" * (2 * tarfile.BLOCKSIZE + (-end % tarfile.RECORDSIZE)))
        self._f.close_synced()
        return self._f.sha.hexdigest()

    @property
    def crc32c(self) -> str:
        """The whole shard file's CRC32C (valid after `seal`)."""
        return self._f.crc.hex()

    def abandon(self) -> None:
        self._f.discard()
        self.tmp_path.unlink(missing_ok=True)
