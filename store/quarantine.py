"""`STORE/quarantine.parquet`: rejected inputs, one row each (key, source, stage, reason, detail, ...).

Appends are read-modify-write under the store lock and land via temp + rename: never a torn file. Copies of a
store (a URL and its caches, several nodes) merge their rows by the same rule (`merged_rows`): rows only add up.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

import crc32c
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from schemas import atomic_write
from schemas.errors import UserError
from store import format as fmt

REQUIRED = ("source", "stage", "reason")
BASE_COLUMNS = ("key", "source", "stage", "reason", "detail", "time")
# Optional: how many rejected inputs one row stands for (e.g. a range of rows a read error kept unread); absent or
# null is 1. Counts users see are of inputs (`samples_by_reason`), not rows. A row of n > 1 whose source is
# `<name>:<a>-<b>` (b - a + 1 = n) stands for the inputs `<name>:<a>` ... `<name>:<b>`.
SAMPLES = "samples"
# Columns a function of the row's key (resize-bucket's `pictures`: its target's and controls' identity), so no part
# of what makes a row new: a rerun after an upgrade adds them to a rejected sample's row recorded without, and that
# sample was counted twice by `store inspect` (the first copy kept, as for every equal row).
DERIVED = ("pictures",)
# The file's seal: in its parquet key-value metadata, {column: crc32c of its values} (`_column_crc`), checked on
# every read of that column. Over the decoded values rather than pyarrow's page CRCs (`write_page_checksum`): those
# cover data pages only, and a flipped byte in the footer renamed a column (`samples` -> `sampHes`: every range's
# inputs counted as one) and still read; the values, names included, are what a reader uses. A flip that leaves the
# values as written (a statistic, an unused header field) is harmless and passes. A file written before the seal has
# none and reads as before; its next append seals it.
SEAL = b"pipeline.quarantine.crc32c"
# How many rows the seal covers: a release before the seal appends by reading the table, its metadata (the seal)
# included, and writing it back with its rows after the old ones; the rows past this count read unchecked, as a
# file written before the seal does, and the next append seals them. A flip to a smaller count fails the seal.
SEALED_ROWS = b"pipeline.quarantine.rows"


def samples_by_reason(table: pa.Table) -> dict[str, int]:
    """reason -> rejected inputs, each row counting its `samples` (1 where absent). The ranges of one name and
    reason count their union, the one-input rows inside it none more: each rerun of a flaky disk records another
    range of the same file (10-59, then 20-59), and a store written before ranges holds a row per input."""
    reasons = table.column("reason").to_pylist() if table.num_rows else []
    counts = table.column(SAMPLES).to_pylist() if SAMPLES in table.column_names else [None] * len(reasons)
    sources = table.column("source").to_pylist() if reasons else []
    out: dict[str, int] = {}
    spans: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for reason, n, source in zip(reasons, counts, sources):
        n = int(n) if n else 1
        if (span := _span(source, n)) is not None:
            spans.setdefault((reason, span[0]), []).append(span[1:])
        else:
            out[reason] = out.get(reason, 0) + n
    if not spans:
        return out
    merged = {k: _union(v) for k, v in spans.items()}
    for (reason, name), parts in merged.items():
        out[reason] = out.get(reason, 0) + sum(end - first for first, end in parts)
    for reason, n, source in zip(reasons, counts, sources):  # one-input rows a range already counts
        name, _, no = (source or "").rpartition(":")
        if (not n or int(n) == 1) and no.isdigit() and (parts := merged.get((reason, name))) is not None \
                and any(first <= int(no) < end for first, end in parts):
            out[reason] -= 1
    return out


def _span(source: str | None, n: int) -> tuple[str, int, int] | None:
    """(name, first, end) of a row standing for the inputs `name:first` .. `name:end-1`, else None."""
    if n <= 1 or not source:
        return None
    name, _, rows = source.rpartition(":")
    first, _, last = rows.partition("-")
    if not (name and first.isdigit() and last.isdigit() and int(last) - int(first) + 1 == n):
        return None
    return name, int(first), int(last) + 1


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for first, end in sorted(spans):
        if out and first <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((first, end))
    return out


def _as_text(v: Any) -> str | None:
    if v is None or isinstance(v, str):
        return v
    return json.dumps(v, sort_keys=True, default=str)


def add_rows(root: Path, rows: Iterable[dict[str, Any]]) -> int:
    """Append rows; a row equal in every column but `time` to one already recorded (an interrupted run that
    retried the sample, a rerun over an older version) is not repeated. Returns how many were added."""
    rows = list(rows)
    if not rows:
        return 0
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    cols: dict[str, None] = dict.fromkeys(BASE_COLUMNS)
    for i, r in enumerate(rows):
        missing = [c for c in REQUIRED if not r.get(c)]
        if missing:
            raise UserError(f"quarantine row {i} lacks {missing}: {r!r}")
        cols.update(dict.fromkeys(r))
    table = pa.table({c: text_column([r.get(c, now if c == "time" else None) for r in rows]) for c in cols})
    return merge_into(root, table)


def text_column(values: list[Any]) -> pa.Array:
    """Values as a quarantine column: every column is text (a number or a list as JSON), so appends from
    different stages never clash on types."""
    return pa.array([_as_text(v) for v in values], pa.string())


def add_table(root: Path, table: pa.Table) -> int:
    """`add_rows` for rows already as text columns (`text_column`; resize-bucket's, held as such until its commit):
    the columns in the same order, `time` now where the table has none."""
    if not table.num_rows:
        return 0
    for c in REQUIRED:  # as add_rows: null or ''
        values = table.column(c) if c in table.column_names else pa.nulls(table.num_rows, pa.string())
        lacking = pc.equal(pc.fill_null(values, ""), "").to_numpy(zero_copy_only=False)
        if lacking.any():
            i = int(np.flatnonzero(lacking)[0])
            raise UserError(f"quarantine row {i} lacks [{c!r}]: {table.slice(i, 1).to_pylist()[0]!r}")
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    n = table.num_rows
    lacking = {"time": pa.array([now] * n, pa.string())}  # a base column the rows lack: null, `time` now
    return merge_into(root, pa.table({
        c: table.column(c) if c in table.column_names else lacking.get(c, pa.nulls(n, pa.string()))
        for c in dict.fromkeys([*BASE_COLUMNS, *table.column_names])}))


def merge_into(root: Path, rows: pa.Table) -> int:
    """Add `rows` (a quarantine table: another copy's, e.g. a store URL's) to this store's, under the store lock;
    how many were new."""
    path = root / fmt.QUARANTINE
    with fmt.flock(root / fmt.STORE_LOCK):
        old = _read(path) if path.is_file() else None
        merged, added = merged_rows(old, rows)
        if added:
            fmt.atomic_write_bytes(path, to_bytes(merged))
    return added


def merged_rows(old: pa.Table | None, rows: pa.Table) -> tuple[pa.Table, int]:
    """`old` plus the rows of `rows` it does not hold yet (the one de-duplication rule: equal in every column but
    `time` and the `DERIVED` ones), and how many those are. Pure: a local append, push and pull all merge by it."""
    if old is None or not old.num_rows:
        old = None
    # the incoming rows' columns, as an append compares
    identity = [c for c in rows.column_names if c != "time" and c not in DERIVED]
    if not identity:  # every row is equal: the first is new only to an empty file
        keep = np.arange(min(rows.num_rows, 1 if old is None else 0))
    else:
        keep = _first_unseen(old, rows, identity)
    if not len(keep):
        return (old if old is not None else rows.slice(0, 0)), 0
    # every row new (a batch of fresh rejects): the rows as they are, no copy of them
    fresh = rows if len(keep) == rows.num_rows else rows.take(pa.array(keep, pa.int64()))
    return (fresh if old is None else pa.concat_tables([old, fresh], promote_options="permissive")), len(keep)


def _first_unseen(old: pa.Table | None, rows: pa.Table, identity: list[str]) -> np.ndarray:
    """Row numbers of `rows` equal (on `identity`; a column `old` lacks is null there, and null equals null) to no
    row of `old` and to no earlier row of `rows`. Column by column, each column's values coded (equal values one
    code, null one of them: the first column hashed, the others ranked by `pc.rank`, which copies no text) and
    folded into one int64 code a row: one column at a time and no copy of the new rows' texts (a group_by over every
    column at once holds ~1 KB a row: ~1 GB at a commit of 1M rejects, a source's bad batch). Of `old` (every
    version's rejects, ~1M rows) only the rows that share the first column's value with a new row take part, and
    fewer after each column."""
    n = rows.num_rows
    if not n:
        return np.zeros(0, np.int64)
    at, code = _first_column(old, rows, identity[0])  # at: the old rows that may equal a new one, coded first
    bound = n  # code < bound
    for c in identity[1:]:
        values = _text(rows, c)
        if len(at):
            values = pa.chunked_array(_text(old, c).take(pa.array(at)).chunks + values.chunks)
        rank = pc.rank(values, tiebreaker="dense").to_numpy().astype(np.int64)  # 1..distinct
        rank -= 1
        card = int(rank.max()) + 1
        if bound * card >= _CODE_LIMIT:  # the fold would overflow int64: renumber the codes 0..distinct-1 first
            distinct, code = np.unique(code, return_inverse=True)
            bound = len(distinct)
        code, bound = code * card + rank, bound * card
        if len(at) and not (held := _among(code[:len(at)], code[len(at):])).all():  # equal to no new row so far
            at, code = at[held], np.concatenate([code[:len(at)][held], code[len(at):]])
    codes, first = np.unique(code[len(at):], return_index=True)  # first: each distinct row's first new one
    return np.sort(first[~_among(codes, code[:len(at)])])


_CODE_LIMIT = 2 ** 62  # folded codes stay below it: int64


def _text(t: pa.Table, c: str) -> pa.ChunkedArray:
    """Column `c` of `t` as text (every column is, `add_rows`); null where `t` lacks it."""
    values = t.column(c) if c in t.column_names else pa.chunked_array([pa.nulls(t.num_rows)])
    return values.cast(pa.string())


def _among(values: np.ndarray, of: np.ndarray) -> np.ndarray:
    """Whether each of `values` is one of `of` (hashed: np.isin sorts both)."""
    return pc.is_in(pa.array(values), value_set=pa.array(of)).to_numpy(zero_copy_only=False)


def _first_column(old: pa.Table | None, rows: pa.Table, c: str) -> tuple[np.ndarray, np.ndarray]:
    """(Row numbers of `old` whose `c` a row of `rows` has too (null: a null); the codes of those rows, then of
    `rows`): a value's code is the row number of its first new row. Hashed, not ranked: the first column is the key,
    random hex a sort is slowest on, and only hashing finds the few old rows that can match among ~1M."""
    values = _text(rows, c)
    code = _index_in(values, values)
    if old is None:
        return np.zeros(0, np.int64), code.to_numpy().astype(np.int64)
    found = _index_in(_text(old, c), values)
    at = np.flatnonzero(found.is_valid().to_numpy(zero_copy_only=False))
    return at, np.concatenate([found.drop_null().to_numpy(), code.to_numpy()]).astype(np.int64)


def _index_in(values: pa.ChunkedArray, among: pa.ChunkedArray) -> pa.Array:
    """Each value's position in `among` (its first; null where none; null finds null), as one int32 array."""
    return pc.index_in(values, value_set=among, skip_nulls=False).combine_chunks()


def to_bytes(table: pa.Table) -> bytes:
    """The file's bytes for `table`, sealed (`SEAL`): the one writer of a local and a remote quarantine.parquet."""
    seal = {c: _column_crc(table.column(c)) for c in table.column_names}
    meta = {SEAL: json.dumps(seal).encode(), SEALED_ROWS: str(table.num_rows).encode()}
    return fmt.parquet_bytes(table.replace_schema_metadata(meta))


def _sealed_part(table: pa.Table, meta: dict[bytes, bytes] | None) -> pa.Table:
    """The rows of `table` its seal covers (`SEALED_ROWS`): all, where it does not count them."""
    rows = (meta or {}).get(SEALED_ROWS, b"")
    return table.slice(0, int(rows)) if rows.isdigit() and table.num_rows > int(rows) else table


def _column_crc(col: pa.ChunkedArray) -> str:
    """crc32c of a column's values, the same however written or read (chunks, string or large_string): each
    value's length (-1: null) as little-endian int64, then the values' UTF-8 bytes end to end."""
    a = col.combine_chunks()
    if not pa.types.is_large_string(a.type):
        a = a.cast(pa.string())
    nulls = a.is_null().to_numpy(zero_copy_only=False) if a.null_count else None
    if nulls is not None:
        a = pc.fill_null(a, "")  # a null's slot may hold bytes: none counted
    width = np.dtype("<i8" if pa.types.is_large_string(a.type) else "<i4")
    offsets = np.zeros(1, width) if not len(a) else \
        np.frombuffer(a.buffers()[1], width, len(a) + 1, a.offset * width.itemsize)
    lengths = np.diff(offsets).astype("<i8")
    if nulls is not None:
        lengths[nulls] = -1
    data = memoryview(a.buffers()[2] or b"")[int(offsets[0]):int(offsets[-1])]
    return f"{crc32c.crc32c(data, crc32c.crc32c(lengths.tobytes())):08x}"


def _seal_problem(table: pa.Table, meta: dict[bytes, bytes] | None, whole: bool) -> str:
    """What about `table`'s columns (all of the file's when `whole`) its seal does not match; '' when none, or
    when the file has no seal (written before it)."""
    if not meta or SEAL not in meta:
        return ""
    try:
        seal = json.loads(meta[SEAL])
    except ValueError:
        return "its crc32c seal is not valid JSON"
    if unsealed := [c for c in table.column_names if c not in seal]:
        return f"column {unsealed[0]!r} is not in its crc32c seal {sorted(seal)}"
    if whole and (lost := sorted(set(seal) - set(table.column_names))):
        return f"sealed column {lost[0]!r} is missing"
    for c in table.column_names:
        if not pa.types.is_string(table.column(c).type):  # every column is text: the same bytes as binary are not
            return f"column {c!r} reads as {table.column(c).type}, not text"
        if (got := _column_crc(table.column(c))) != seal[c]:
            return f"column {c!r} has crc32c {got}, sealed {seal[c]}"
    return ""


def empty() -> pa.Table:
    """No rows (a store without quarantine.parquet)."""
    return pa.table({c: pa.array([], pa.string()) for c in BASE_COLUMNS})


def read(root: Path, columns: Iterable[str] | None = None) -> pa.Table:
    """The file's rows; `columns`: only those (the ones the file has), e.g. the key, stage and reason a check at
    every rank's start compares, without the long `source` and `detail` texts (~2/3 of the ~200 MB a 1M-row file
    parses to, in each of 64 ranks)."""
    path = root / fmt.QUARANTINE
    if not path.is_file():
        return empty() if columns is None else empty().select([c for c in columns if c in BASE_COLUMNS])
    return _read(path, columns)


def _read(path: Path, columns: Iterable[str] | None = None) -> pa.Table:
    """The file's rows; a damaged file is one line naming the fix (every append would otherwise end in pyarrow's
    traceback: an encode that rejected a sample could never commit)."""
    table, why = _load(path, columns)
    if table is None:
        raise UserError(f"{path} is damaged ({why}); run `pipeline store repair {path.parent}` (it sets the file "
                        "aside), then rerun")
    return table


def parsed(data: bytes) -> tuple[pa.Table | None, str]:
    """A quarantine.parquet's bytes (a store URL's copy) as a table, or (None, what is wrong): as a local file."""
    # Arrow's own buffer: through a Python file object Arrow's I/O threads would call back into Python, which at
    # interpreter exit ends the process from C++ (`terminate called without an active exception`)
    return _load(pa.BufferReader(data))


def _load(path: Path | pa.BufferReader, columns: Iterable[str] | None = None) -> tuple[pa.Table | None, str]:
    try:
        if columns is None:
            table = pq.read_table(path)
        else:
            with pq.ParquetFile(path) as f:
                names = f.schema_arrow.names
                if missing := sorted({"key", *REQUIRED} - set(names)):
                    return None, f"missing columns {missing}"
                table = f.read([c for c in dict.fromkeys(columns) if c in names], use_threads=False)
                if lost := _sealed_missing(f.schema_arrow.metadata, names, columns):
                    return None, lost
        meta = table.schema.metadata
        table = table.replace_schema_metadata(
            {k: v for k, v in (meta or {}).items() if k not in (SEAL, SEALED_ROWS)} or None)
        if why := _seal_problem(_sealed_part(table, meta), meta, whole=columns is None):
            return None, why
    except (pa.ArrowException, OSError, ValueError) as e:
        return None, " ".join(str(e).splitlines()) or type(e).__name__
    missing = sorted({"key", *REQUIRED} - set(table.column_names)) if columns is None else []
    return (table, "") if not missing else (None, f"missing columns {missing}")


def _sealed_missing(meta: dict[bytes, bytes] | None, names: list[str], columns: Iterable[str]) -> str:
    """A column asked for that the seal names and the file lacks (a damaged name), as a problem; else ''."""
    try:
        seal = json.loads(meta[SEAL]) if meta and SEAL in meta else {}
    except ValueError:
        return "its crc32c seal is not valid JSON"
    lost = [c for c in columns if c in seal and c not in names]
    return f"sealed column {lost[0]!r} is missing" if lost else ""


def problem(root: Path) -> str | None:
    """What is wrong with STORE/quarantine.parquet (unreadable, required columns missing), or None."""
    path = root / fmt.QUARANTINE
    return None if not path.is_file() else _load(path)[1] or None


def set_aside(root: Path) -> Path:
    """Move a damaged quarantine.parquet out of the way (kept for inspection as `quarantine.parquet.damaged[-N]`):
    the stages append to a fresh one. Under the store lock, as every append."""
    with fmt.flock(root / fmt.STORE_LOCK):
        n, aside = 1, root / f"{fmt.QUARANTINE}.damaged"
        while aside.exists():
            n += 1
            aside = root / f"{fmt.QUARANTINE}.damaged-{n}"
        os.replace(root / fmt.QUARANTINE, aside)
        atomic_write.fsync_dir(root)
    return aside
