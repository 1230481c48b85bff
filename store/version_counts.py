"""What `pipeline store inspect` shows of a complete version - samples, shards, bytes, splits, target and control
buckets - counted from its manifest rows once, when the version is sealed, and recorded in its `checksums.json`
(`counts`: sealed with the files' checksums, so a flipped bit there is damage like any other).

Inspect then reads a few numbers per version instead of its manifest's columns (decoded for every version, every
time: at 1M samples and several versions, seconds and hundreds of MB; bench/inspect_counts.py). Versions sealed
before the record (and any whose record does not read as this code writes it) are counted from their columns by the
same `Tally`, so both ways show the same numbers in the same order.

The record keeps order in lists (checksums.json is canonical JSON: its keys are sorted):
`{"samples": N, "shards": S, "bytes": B, "splits": [[split, n], ...] (in order of first appearance in key order;
absent without a split column), "buckets": [[h, w, n], ...] (target sizes in pixels, by (h, w)),
"control_buckets": [[h, w, n], ...] (the controls' VAE views; absent without a control_sizes column)}`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from store.arrow_columns import size_counts

# the manifest columns the counts read (those a version has); the rest (nested tensor / file lists) stay unread
COUNTED = ("shard", "shard_nbytes", "split", "bucket", "img_shapes", "height", "width", "control_sizes")


class Tally:
    """The counts of manifest rows given a part at a time, in manifest (key) order: a commit's row groups as it
    writes them, or a whole manifest's counted columns at once."""

    def __init__(self) -> None:
        self.samples = 0
        self.splits: dict[Any, int] | None = None  # None: no split column
        self.buckets: Counter[tuple[int, int]] = Counter()
        self.controls: Counter[tuple[int, int]] | None = None  # None: no control_sizes column
        self._shards: list[pa.Table] = []  # per part: each shard's size (a shard's rows span parts)

    def add(self, rows: pa.Table) -> None:
        cols = rows.column_names
        self.samples += rows.num_rows
        if "shard" in cols and "shard_nbytes" in cols:
            self._shards.append(_shard_sizes(rows))
        if "split" in cols:
            self.splits = {} if self.splits is None else self.splits
            counted = pc.value_counts(rows.column("split").combine_chunks())  # in order of first appearance
            for value, n in zip(counted.field("values").to_pylist(), counted.field("counts").to_pylist()):
                self.splits[value] = self.splits.get(value, 0) + n
        self.buckets.update(_target_sizes(rows))
        if "control_sizes" in cols:  # images tables: the controls' VAE views too, not only targets
            self.controls = Counter() if self.controls is None else self.controls
            self.controls.update(size_counts(pc.list_flatten(rows.column("control_sizes").combine_chunks()), 2))

    def record(self) -> dict[str, Any]:
        """The record for checksums.json."""
        shards = _shard_sizes(pa.concat_tables(self._shards)) if self._shards else None
        nbytes = 0 if shards is None else int(pc.sum(shards.column("shard_nbytes")).as_py() or 0)
        out: dict[str, Any] = {"samples": self.samples, "shards": 0 if shards is None else shards.num_rows,
                               "bytes": nbytes, "buckets": [[h, w, n] for (h, w), n in sorted(self.buckets.items())]}
        if self.splits is not None:
            out["splits"] = [[s, n] for s, n in self.splits.items()]
        if self.controls is not None:
            out["control_buckets"] = [[h, w, n] for (h, w), n in sorted(self.controls.items())]
        return out


def counted(manifest: pa.Table) -> dict[str, Any]:
    """The record of a whole manifest (or its `COUNTED` columns)."""
    tally = Tally()
    tally.add(manifest)
    return tally.record()


def differences(recorded: dict[str, Any], counted: dict[str, Any]) -> list[str]:
    """What differs between two `shown` counts, one phrase per count ("samples 93 recorded, 23 counted")."""
    return [f"{k} {recorded.get(k)} recorded, {counted.get(k)} counted" for k in sorted(set(recorded) | set(counted))
            if recorded.get(k) != counted.get(k)]


def shown(record: Any) -> dict[str, Any] | None:
    """A record as inspect shows it (samples, shards, bytes, splits {split: n}, buckets / control_buckets
    {"HxW": n}); None when `record` is absent or not as `Tally.record` writes it (then the columns are counted)."""
    if not isinstance(record, dict):
        return None
    try:
        out: dict[str, Any] = {k: _count(record[k]) for k in ("samples", "shards", "bytes")}
        if "splits" in record:
            out["splits"] = {_split(s): _count(n) for s, n in record["splits"]}
        out["buckets"] = _sizes(record["buckets"])
        if "control_buckets" in record:
            out["control_buckets"] = _sizes(record["control_buckets"])
    except (KeyError, TypeError, ValueError):
        return None
    return out


def _shard_sizes(rows: pa.Table) -> pa.Table:
    """(shard, shard_nbytes) once per shard of `rows` (each of a shard's rows records its size)."""
    sizes = rows.select(["shard", "shard_nbytes"]).group_by("shard").aggregate([("shard_nbytes", "max")])
    return sizes.select(["shard", "shard_nbytes_max"]).rename_columns(["shard", "shard_nbytes"])


def _target_sizes(rows: pa.Table) -> dict[tuple[int, int], int]:
    """Target sizes in pixels: the `bucket` column, else img_shapes (x16), else v1 height/width."""
    cols = rows.column_names
    if "bucket" in cols:
        return size_counts(rows.column("bucket"), 2)
    if "img_shapes" in cols:  # the target's [1, h, w] in patches of 16 px
        return size_counts(pc.list_element(rows.column("img_shapes").combine_chunks(), 0), 3, scale=16)
    if "height" in cols and "width" in cols:
        return dict(Counter(zip(rows.column("height").to_pylist(), rows.column("width").to_pylist())))
    return {}


def _count(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"not a count: {n!r}")
    return int(n)


def _split(s: Any) -> Any:
    if isinstance(s, (list, dict)):  # a split is a column value: a string (train/val), any JSON scalar read alike
        raise ValueError(f"not a split: {s!r}")
    return s


def _sizes(entries: Any) -> dict[str, int]:
    out = {}
    for h, w, n in entries:
        out[f"{_count(h)}x{_count(w)}"] = _count(n)
    return out
