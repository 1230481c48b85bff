"""Damage for the integrity tests: one flipped bit in a file, or in a given byte of a stored sample."""

from __future__ import annotations

from pathlib import Path

from store import Store

HEADER = "<header>"  # `member` naming the sample's tar header (its first bytes) rather than a tensor or file


def flip_bit(path: Path, pos: int, bit: int) -> bytes:
    """Flip bit `bit` of byte `pos` of the file; returns the file's clean bytes."""
    clean = path.read_bytes()
    bad = bytearray(clean)
    bad[pos] ^= 1 << bit
    path.write_bytes(bytes(bad))
    return clean


def sample_byte(root: Path, table: str, key: str, member: str | None = None, offset: int | None = None,
                version: int | None = None) -> tuple[Path, int]:
    """(shard, position) of a byte of sample `key`: `offset` bytes into its tensor or file `member` (None: its
    first tensor; HEADER: its tar header), by default the member's middle byte."""
    r = Store(root, create=False).reader(table, version)
    row = r.manifest.to_pylist()[r.keys().index(key)]
    shard = r.dir / row["shard"]
    r.close()
    if member == HEADER:
        return shard, row["sample_offset"] + (offset or 0)
    entries = row["tensors"] + row["files"]
    entry = entries[0] if member is None else next(x for x in entries if x["name"] == member)
    return shard, entry["offset"] + (entry["nbytes"] // 2 if offset is None else offset)


def key_at(root: Path, table: str, index: int) -> str:
    """The `index`-th key of the table in key order."""
    r = Store(root, create=False).reader(table)
    key = sorted(r.keys())[index]
    r.close()
    return key
