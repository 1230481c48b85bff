"""What a resumed resize-bucket already holds, by source: source -> key of every sample in the committed shards of
the unfinished version it resumes (their indexes' `key` and `source` columns).

The writer resumes only a version of the same lineage, whose source listing hash covers the source's bytes (or,
at URLs, its shards' metadata): a sample found under the same source name has the same bytes, so its key, and the
readers (sources.py) skip reading it (a tar at a URL is still streamed: only the member bytes are not kept) and the
stage skips hashing it. Without this a resumed run re-read and re-hashed every finished sample to find its key.

Held as sorted arrays, not a dict of str: a source name is looked up by a 128-bit BLAKE2b digest of it (the
width of the sample keys themselves, which the store already trusts to be collision-free), so a sample costs
16 B + its key's bytes + a bucket start (~52 B) instead of ~206 B (bench/resumed_sources.py: 1M samples held
206 MB, now 50 MB; a lookup costs a digest, ~10 us under load, the dict's was ~0.1 us).

Also key -> recorded mask (`resumed_masks`), read only when a copy of a key the version holds is met under
another source name: a first copy whose key the interrupted run kept under a later copy (a revival, render_loop.py).
And the rows of one parquet file the version holds (`held_rows`), for a read error that keeps a range of rows
from being read: those written before are kept, not counted as unread (parquet_source._unread_rows).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from store.writer_open import index_paths


def _digest(source: str) -> bytes:
    return hashlib.blake2b(source.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class ResumedSources:
    """source -> key, read-only (`get`, `len`): the digests sorted, back to back in one bytes, the keys (ASCII,
    a numpy bytes array) in the same order, and where each bucket of leading digest bits starts (about one
    entry per bucket): a lookup compares a slice or two (numpy's searchsorted per call cost ~40 us)."""

    def __init__(self, parts: Iterable[tuple[list[str], list[str]]], vdir: Path | None = None):
        """`parts`: (sources, keys) per index file, in order, each turned into arrays at once (a million str
        held at a time would be the dict's peak again). `vdir`: the version they are read from (`held_rows`)."""
        self.vdir = vdir
        halves, keys = [], []
        for sources, k in parts:
            halves.append(np.frombuffer(b"".join(_digest(s) for s in sources), dtype=">u8").reshape(-1, 2))
            keys.append(np.array(k, dtype=np.bytes_) if k else np.zeros(0, dtype="S1"))
        both = np.concatenate(halves) if halves else np.zeros((0, 2), dtype=">u8")
        del halves
        # by digest (big-endian halves: the bytes' order); lexsort is stable: of a source listed twice the last
        # one is kept (as dict.update did)
        order = np.lexsort((both[:, 1], both[:, 0]))
        both = both[order]
        last = np.ones(len(order), dtype=bool)
        last[:-1] = (both[1:] != both[:-1]).any(axis=1)
        both, order = both[last], order[last]
        self._shift = 64 - max(len(both) - 1, 1).bit_length()  # 2**(64 - shift) buckets >= entries
        firsts = np.arange(2 ** (64 - self._shift), dtype=np.uint64) << np.uint64(self._shift)
        self._starts = array("I", np.append(np.searchsorted(both[:, 0], firsts), len(both)).astype(np.uint32))
        self._digests = both.astype(">u8", copy=False).tobytes()  # concatenate may have made it native-endian
        del both, firsts
        held = np.concatenate(keys) if keys else np.zeros(0, dtype="S1")
        del keys
        self._keys = held[order]  # an item reads back without its padding NULs (ASCII keys hold none)

    def get(self, source: str) -> str | None:
        d = _digest(source)
        bucket = int.from_bytes(d[:8], "big") >> self._shift
        for i in range(self._starts[bucket], self._starts[bucket + 1]):
            if self._digests[16 * i:16 * i + 16] == d:
                return self._keys[i].decode("ascii")
        return None

    def __len__(self) -> int:
        return len(self._digests) // 16


def resumed_sources(vdir: Path) -> ResumedSources:
    """source -> key of the committed shards in `vdir` (the writer read the same indexes' keys: they are readable)."""
    return ResumedSources(_index_columns(vdir), vdir)


def held_rows(done: object, prefix: str, first: int, end: int) -> tuple[np.ndarray, list[str]]:
    """(row numbers, keys) of the samples named `prefix` + row number (a parquet file's rows, `PATH:NO`) with
    first <= NO < end that the resumed version `done` (ResumedSources) holds, by row; none without one. One pass
    of pyarrow over its indexes' `source` columns, not a lookup per row (a million-row file's range)."""
    vdir = getattr(done, "vdir", None)
    if vdir is None:
        return np.zeros(0, np.int64), []
    rows, keys = [], []
    for p in index_paths(vdir):
        t = pq.read_table(p, columns=["key", "source"])
        t = t.filter(pc.starts_with(t.column("source"), prefix))
        tail = pc.utf8_slice_codeunits(t.column("source"), len(prefix))  # (by code points, as len() counts)
        digits = pc.match_substring_regex(tail, r"^[0-9]+$")
        t, tail = t.filter(digits), tail.filter(digits)
        no = pc.cast(tail, pa.int64()).to_numpy(zero_copy_only=False)
        inside = (no >= first) & (no < end)
        rows.append(no[inside])
        keys.append(t.column("key").to_numpy(zero_copy_only=False)[inside])
    no, key = (np.concatenate(rows), np.concatenate(keys)) if rows else (np.zeros(0, np.int64), [])
    if not len(no):  # none held in the range (the mask below would be one entry long)
        return np.zeros(0, np.int64), []
    # by row; a row listed twice (a shard written again): the last one, as the lookup keeps
    order = np.argsort(no, kind="stable")
    no, key = no[order], key[order]
    last = np.append(no[1:] != no[:-1], True)
    return no[last], key[last].tolist()


def _index_columns(vdir: Path) -> Iterator[tuple[list[str], list[str]]]:
    for p in index_paths(vdir):
        t = pq.read_table(p, columns=["key", "source"])
        yield t.column("source").to_pylist(), t.column("key").to_pylist()


class ResumedMasks:
    """key -> the first 64 bits of the recorded mask_sha256 of each sample the resumed version holds (0: no mask;
    None: not recorded, or a key it does not hold), for telling the copy the table holds from another copy of
    the same key (same target, controls and caption, another mask). Sorted key and bit arrays (40 B a sample),
    built only when a resumed run meets such a copy."""

    def __init__(self, parts: Iterable[tuple[list[str], list[str | None]]]):
        keys, bits, known = [], [], []
        for k, masks in parts:
            keys.append(np.array(k, dtype=np.bytes_) if k else np.zeros(0, dtype="S1"))
            bits.append(np.array([_bits(m) for m in masks], dtype=np.uint64))
            known.append(np.array([m is not None for m in masks], dtype=bool))
        held = np.concatenate(keys) if keys else np.zeros(0, dtype="S1")
        order = np.argsort(held, kind="stable")
        self._keys = held[order]
        self._bits = (np.concatenate(bits) if bits else np.zeros(0, dtype=np.uint64))[order]
        self._known = (np.concatenate(known) if known else np.zeros(0, dtype=bool))[order]

    def get(self, key: str) -> int | None:
        k = key.encode("ascii")
        i = int(np.searchsorted(self._keys, k))
        if i < len(self._keys) and self._keys[i] == k and self._known[i]:
            return int(self._bits[i])
        return None


def _bits(mask_sha256: str | None) -> int:
    """As images_table.mask_bits of the mask's bytes: 64 bits of its hash, 0 for none ("")."""
    return int(mask_sha256[:16], 16) if mask_sha256 else 0


def resumed_masks(vdir: Path) -> ResumedMasks:
    """key -> recorded mask bits of the committed shards in `vdir` (an index of an older version without the
    column: not recorded)."""
    def parts() -> Iterator[tuple[list[str], list[str | None]]]:
        for p in index_paths(vdir):
            recorded = "mask_sha256" in pq.read_schema(p).names
            t = pq.read_table(p, columns=["key", "mask_sha256"] if recorded else ["key"])
            masks = t.column("mask_sha256").to_pylist() if recorded else [None] * t.num_rows
            yield t.column("key").to_pylist(), masks

    return ResumedMasks(parts())
