"""`store verify`'s reading of a version's manifest (store/verify.py), streamed so that its memory does not grow
with the whole manifest: at 1M samples the manifest parsed whole (every column, then taken in shard order) was
most of verify's ~2.6 GB peak.

Two kinds of pass over manifest.parquet, a column and a row group at a time (`row_group_columns`: pyarrow decodes
a row group's column whole; manifests are written in groups of `fmt.ROW_GROUP_ROWS` rows, those of older code in
one group of up to 1M rows, read the same way at a column's cost):
- one over every column (`read_manifest_pass`): each row group of each column decoded, so a damaged page anywhere
  is still found, but only the keys (their checks) and a shard number per row are kept;
- then one per group of shards (`ShardParts`), shards in name order, each group of at most `ROWS_PER_PASS` rows
  (one whole shard at least): only the columns the checks read (`checked_columns`: not the meta columns a
  caption or a source path fill), only that group's rows kept. A shard's rows are always in one group, so every
  per-shard check sees all of them, in manifest order, as when the manifest was read whole.
The manifest is sorted by key, and a shard's rows are spread over all of it: a group's pass decodes each checked
column's row groups and keeps its rows. Up to `ROWS_PER_PASS` rows that is one pass; 1M samples take ~5 passes
over the checked columns, seconds next to verify's minutes of reading samples. Peak RSS of `store verify` at 300k
samples 1102 -> 888 MB (its part above the ~690 MB of imports about halved; bench/meta_memory.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from schemas.errors import UserError
from schemas.newer import WrittenByNewer
from store import format as fmt
from store import integrity, version_counts
from store.arrow_columns import release_memory
from store.checksum import file_crc
from store.manifest import CHECKSUM_COLUMNS, LOCATING_COLUMNS
from store.integrity import DamagedData
from store.manifest_files import ManifestGroups, read_schema

#: the most rows of one group of shards held at once (a shard larger than this is a group alone); two groups may
#: be held (`ShardParts`): ~2 x 80 MB of checked columns of an `images` table
ROWS_PER_PASS = 200_000
#: the columns, besides the locating and checksum ones, that verify's row checks read (store/verify.py
#: `_check_columns`: img_shapes, or a v1 row's pixel sizes)
ROW_CHECK_COLUMNS = ("img_shapes", "height", "width")


class ShardPart:
    """One shard's manifest rows, as Arrow until they are checked: 1M rows as Python dicts held ~2.7 GB at once
    (and ~35 s) for a table's verify; one shard's at a time hold a few MB. `rows`: a zero-copy slice of its
    group's rows taken in shard order."""

    def __init__(self, rows: Any, schema_version: int) -> None:
        self.rows, self.schema_version = rows, schema_version

    def __len__(self) -> int:
        return self.rows.num_rows


def checked_columns(names: list[str]) -> list[str]:
    """The manifest columns (of `names`, in their order) that verify's checks read."""
    wanted = LOCATING_COLUMNS | CHECKSUM_COLUMNS | set(ROW_CHECK_COLUMNS)
    return [c for c in names if c in wanted]


class ShardParts(Mapping[str, ShardPart]):
    """{shard: its manifest rows}, shard names in order, each group of shards read from the manifest when one of
    its shards is first asked for. The two groups asked for last are kept: the remote verify asks from several
    threads (`each_at_once`, in name order), so a group's last shards may be asked for after the next group's
    first. A group asked for again after that is read again (correct, only slower)."""

    def __init__(self, path: Path, names: list[str], codes: np.ndarray, schema_version: int,
                 columns: list[str]) -> None:
        """`names`: the shard names, sorted; `codes`: each manifest row's index into `names`."""
        self.path, self.names, self.schema_version, self.columns = path, names, schema_version, columns
        self._codes = codes
        counts = np.bincount(codes, minlength=len(names))
        group, held, self._group_of_code = 0, 0, np.zeros(len(names), np.int32)
        for i, n in enumerate(counts.tolist()):
            if held and held + n > ROWS_PER_PASS:
                group, held = group + 1, 0
            self._group_of_code[i], held = group, held + n
        self._group_of_row = self._group_of_code[codes]
        self._index = {n: i for i, n in enumerate(names)}
        self._held: OrderedDict[int, dict[str, ShardPart]] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def passes(self) -> int:
        """How many group passes a walk over every shard makes."""
        return int(self._group_of_code.max()) + 1 if len(self.names) else 0

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __getitem__(self, name: str) -> ShardPart:
        group = int(self._group_of_code[self._index[name]])  # KeyError for a shard the manifest does not name
        with self._lock:
            if group not in self._held:
                self._held[group] = self._read_group(group)
                while len(self._held) > 2:
                    self._held.popitem(last=False)
                release_memory()
            self._held.move_to_end(group)
            return self._held[group][name]

    def _read_group(self, group: int) -> dict[str, ShardPart]:
        """One pass over the checked columns, keeping the rows of `group`'s shards, taken in shard order."""
        mine = self._group_of_row == group
        codes = self._codes[mine]
        order = pa.array(np.argsort(codes, kind="stable"))  # by shard name, manifest order within one
        codes = codes[order.to_numpy()]
        taken: list[pa.Array] = []
        groups = ManifestGroups(self.path, self.path.parent)
        with groups.file as f:
            starts = groups.starts
            holding = [g for g in range(len(starts) - 1) if mine[starts[g]:starts[g + 1]].any()]
            for c in self.columns:
                pieces = []
                for g, column in row_group_columns(f, c, holding):
                    pieces += pc.filter(column, pa.array(mine[starts[g]:starts[g + 1]])).chunks
                    del column
                # each column joined and taken in shard order alone: a take of the whole chunked table joined
                # every column's pieces at once first (~+20 MB at 100k samples over whole-column reads)
                taken.append(pa.chunked_array(pieces, f.schema_arrow.field(c).type).combine_chunks().take(order))
                del pieces
        rows = pa.table(taken, names=self.columns)
        starts = [0, *(np.flatnonzero(np.diff(codes)) + 1).tolist()]
        return {self.names[codes[a]]: ShardPart(rows.slice(a, b - a), self.schema_version)
                for a, b in zip(starts, [*starts[1:], len(codes)]) if b > a}


def row_group_columns(f: pq.ParquetFile, name: str, groups: list[int] | None = None
                      ) -> Iterator[tuple[int, pa.ChunkedArray]]:
    """(row group, column `name` of its rows) for each of `groups` (all by default), each decoded whole, the
    scratch of the one before given back first: pyarrow decodes a row group's column whole whatever batch size is
    asked, so one group of one column at a time is what bounds a pass's memory (a manifest of older code, one group
    of up to 1M rows, costs its largest column)."""
    for g in range(f.metadata.num_row_groups) if groups is None else groups:
        release_memory()
        yield g, f.read_row_group(g, columns=[name], use_threads=False).column(name)


def read_manifest_pass(vdir: Path, name: str, sums: dict[str, dict[str, Any]] | None, counts: Any = None
                       ) -> tuple[list[str], Mapping[str, ShardPart]]:
    """(problems of the schema, manifest, keys and recorded `counts` (checksums.json's), {shard: its manifest
    rows}; empty when unreadable): the pass over every column."""
    problems: list[str] = []
    try:
        schema = read_schema(vdir, intact=_intact(vdir, fmt.SCHEMA_JSON, sums))
    except WrittenByNewer:
        raise
    except UserError as e:
        return problems + [f"{name}: {e}"], {}
    path = vdir / fmt.MANIFEST
    try:
        groups = ManifestGroups(path, vdir)  # the store's one line for a footer or schema that does not read
    except DamagedData as e:
        return problems + [f"{name}/{fmt.MANIFEST}: unreadable ({e})"], {}
    with groups.file as f:
        names = groups.names
        missing = sorted(LOCATING_COLUMNS - set(names))
        if missing:
            return problems + [f"{name}/{fmt.MANIFEST}: missing columns {missing}"], {}
        if sums is None and CHECKSUM_COLUMNS & set(names) and not (vdir / fmt.CHECKSUMS).exists():
            problems.append(f"{name}: {fmt.CHECKSUMS} is missing (the manifest has checksum columns)")
        try:
            keys, shard_names, codes = _keys_and_shards(f)
            key_problems = _key_problems(name, keys) + _count_problems(vdir, name, f, counts)
        except Exception as e:  # noqa: BLE001
            return problems + [f"{name}/{fmt.MANIFEST}: undecodable ({type(e).__name__}: {e})"], {}
    del keys
    release_memory()
    order = sorted(range(len(shard_names)), key=shard_names.__getitem__)
    rank = np.empty(len(order), np.int32)
    rank[order] = np.arange(len(order), dtype=np.int32)
    parts = ShardParts(path, [shard_names[i] for i in order], rank[codes] if len(codes) else codes,
                       schema.schema_version, checked_columns(names))
    return problems + key_problems, parts


def _keys_and_shards(f: pq.ParquetFile) -> tuple[pa.ChunkedArray, list[str], np.ndarray]:
    """(the key column, the shard names in first-seen order, each row's index into them), from one pass over
    every column (each decoded: a damaged page anywhere is an error here), a column of a row group at a time
    (`row_group_columns`); only the keys are kept whole."""
    keys, codes, index = [], [], {}
    for name in f.schema_arrow.names:
        for _, column in row_group_columns(f, name):
            if name == "key":
                keys += column.chunks
            elif name == "shard":
                for chunk in column.chunks:
                    shard = pc.dictionary_encode(chunk)
                    local = [index.setdefault(str(s), len(index)) for s in shard.dictionary.to_pylist()]
                    if shard.indices.null_count:  # rows of no shard: one group, named as str(None) names it
                        local.append(index.setdefault(str(None), len(index)))
                    codes.append(np.asarray(local, np.int32)[pc.fill_null(shard.indices, len(local) - 1).to_numpy()]
                                 if len(local) else np.zeros(0, np.int32))
            del column
    keys = pa.chunked_array(keys, f.schema_arrow.field("key").type)  # LOCATING_COLUMNS were checked present
    return keys, list(index), np.concatenate(codes) if codes else np.zeros(0, np.int32)


def _key_problems(name: str, keys: pa.ChunkedArray) -> list[str]:
    """Each repeat of an earlier key (in manifest order) a duplicate, any other key that is no valid key name
    invalid: found by a sort, the keys turned into Python strs a row group at a time (a set of 1M strs was ~150 MB)."""
    again = np.zeros(len(keys), bool)
    if len(keys) > 1:
        order = pc.sort_indices(keys).to_numpy()  # stable: a key's first row comes first
        ordered = keys.take(pa.array(order))
        same = pc.fill_null(pc.equal(ordered.slice(1), ordered.slice(0, len(keys) - 1)), False)
        again[order[1:][same.to_numpy(zero_copy_only=False)]] = True
        nulls = np.flatnonzero(pc.is_null(keys).to_numpy(zero_copy_only=False))
        again[nulls[1:]] = True  # a null key again is a repeat of the first
    problems: list[str] = []
    start = 0
    for chunk in keys.chunks:  # a row group's keys at a time as Python strs
        for i, k in enumerate(chunk.to_pylist(), start):
            if again[i]:
                problems.append(f"{name}: duplicate key {k}")
            elif not isinstance(k, str) or not fmt.KEY_RE.fullmatch(k):
                problems.append(f"{name}: invalid key {k!r}")
        start += len(chunk)
    return problems


def _count_problems(vdir: Path, name: str, f: pq.ParquetFile, counts: Any) -> list[str]:
    """The counts sealed in checksums.json (what `store inspect` shows, `store.version_counts`) against the manifest's
    rows, counted a row group at a time: a seal holds bytes, not that the numbers are the manifest's (a writer's
    bug, another tool's record). None to judge in a record without counts."""
    recorded = version_counts.shown(counts)
    if recorded is None:
        return []
    columns = [c for c in version_counts.COUNTED if c in f.schema_arrow.names]
    tally = version_counts.Tally()
    for g in range(f.metadata.num_row_groups):
        tally.add(f.read_row_group(g, columns=columns, use_threads=False))
    differ = version_counts.differences(recorded, version_counts.shown(tally.record()) or {})
    if not differ:
        return []
    # repair's advice, which works everywhere: at a URL verify records no damage, so the stage's rerun finds the
    # version up to date, and the version pushed again from the store it came from has the same counts
    return [f"{name}/{fmt.CHECKSUMS}: its counts are not its manifest's ({'; '.join(differ)}), so `store inspect` "
            f"shows them wrong; {integrity.repair_hint(vdir)}: it writes the version again (its shards carried, "
            "nothing recomputed), counted from its rows"]


def _intact(vdir: Path, name: str, sums: dict[str, dict[str, Any]] | None) -> bool:
    """Does `name` match its checksums.json entry? (Not when there is none: a later schema version claimed by a
    damaged or unchecked schema.json is damage, which its own file check names.)"""
    if sums is None or name not in sums:
        return False
    crc, size = file_crc(vdir / name) if (vdir / name).is_file() else (None, None)
    return (size, crc) == (sums[name]["nbytes"], sums[name]["crc32c"])
