"""The one join of tables by sample key: train and evaluate read `text` + `vae` as one sample through it.

`JoinedTables` is an inner join on key (optionally of one split); keys missing from some table are counted in
`unmatched` and logged, never silently lost. Sequence lengths come from the manifests alone (Arrow compute, no
per-row Python objects). Which tables a stage joins, and what it checks on them, is `features/open.py`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from math import prod
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.errors import UserError
from store.arrow_columns import fixed_width_view as _fixed_width
from store.arrow_columns import release_memory
from store.arrow_columns import strictly_increasing as _strictly_increasing
from store.reader import TableReader
from store.reader_manifest import ReaderManifest

log = logging.getLogger("store")

# What a joined table gives its reader besides the keys: each sample's bytes (named by their checksums) and what the
# manifest adds to them (img_shapes: the model's image grid; length: with img_shapes, the joint sequence length that
# orders and batches the samples). `JoinedTables.content_ids` hashes them.
CONTENT_COLUMNS = ("sample_sha256", "sample_crc32c", "img_shapes", "length")
CONTENT_FORMAT = b"joined-content-1"  # bump when what is hashed changes: ids recorded under another never match
_CHUNK = 1 << 16  # rows hashed at a time: the taken copy stays a few MB at 1M samples

class KeyList(Sequence[str]):
    """The joined keys (sorted): `keys[i]` is a str, a slice a list; no per-key Python objects unless asked for.
    Held as a table's own key array and the joined rows in it (`rows`, None: every row), not as a copy of the
    keys (~36 MB at 1M samples in every rank); `array` builds the joined keys as one Arrow array when asked."""

    def __init__(self, keys: pa.StringArray, rows: np.ndarray | None = None) -> None:
        self.source, self.rows = keys, rows

    @property
    def array(self) -> pa.StringArray:
        return self.source if self.rows is None else self.source.take(pa.array(self.rows))

    def subset(self, keep: np.ndarray) -> "KeyList":
        """The keys where the boolean mask `keep` is True."""
        rows = np.arange(len(self.source), dtype=np.int64) if self.rows is None else self.rows
        return KeyList(self.source, rows[keep])

    def __len__(self) -> int:
        return len(self.source) if self.rows is None else len(self.rows)

    def __getitem__(self, i):  # type: ignore[override]
        if self.rows is None:
            return self.source[i].to_pylist() if isinstance(i, slice) else self.source[i].as_py()
        if isinstance(i, slice):
            return self.source.take(pa.array(self.rows[i])).to_pylist()
        return self.source[int(self.rows[i])].as_py()

    def __iter__(self) -> Iterator[str]:
        return iter(self.array.to_pylist())

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, (list, tuple, KeyList)) else NotImplemented

    def __repr__(self) -> str:
        return f"KeyList({len(self)} keys)"


def _member(sorted_values: np.ndarray, probe: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(hit mask, position) of each probe in a sorted array: binary search in C, no hash table."""
    pos = np.searchsorted(sorted_values, probe)
    clipped = np.minimum(pos, len(sorted_values) - 1)
    hit = (sorted_values[clipped] == probe) if len(sorted_values) else np.zeros(len(probe), bool)
    return hit, clipped


def _row_numbers(rows: np.ndarray) -> np.ndarray:
    """Row numbers as int32 (half of int64: ~4 MB less at 1M samples, kept by every rank) where they fit."""
    return rows.astype(np.int32 if len(rows) == 0 or rows.max() < 2**31 else np.int64)


def _join_sorted_fixed(j: "JoinedTables", readers: dict[str, TableReader], split_rows: dict[str, np.ndarray],
                       say_unmatched: bool = True) -> bool:
    """The common case (sorted manifests, 32-hex keys): intersect by binary search on zero-copy byte views.
    Fills j.keys / j.rows / j.only and returns True; False when the keys do not allow it."""
    fixed = {t: _fixed_width(r.key_array) for t, r in readers.items()}
    widths = {f.dtype.itemsize for f in fixed.values() if f is not None}
    if any(f is None for f in fixed.values()) or len(widths) != 1 or not all(r.keys_sorted for r in readers.values()):
        return False
    # the usual case, every table holding the same keys in the same split, told on the tables' own (zero-copy)
    # views: the split's keys are taken out (a copy, ~30 MB per table at 1M samples) only when they differ
    f0, r0 = next(iter(fixed.values())), next(iter(split_rows.values()))
    same = all(np.array_equal(split_rows[t], r0) and len(fixed[t]) == len(f0) and np.array_equal(fixed[t], f0)
               for t in readers)
    ks = {} if same else {t: fixed[t][split_rows[t]] for t in readers}  # still sorted
    first = next(iter(ks.values()), None)
    if same or all(len(k) == len(first) and np.array_equal(k, first) for k in ks.values()):  # the same keys
        j.rows = {}
        for t in readers:  # tables with the same rows share one array (read only)
            same = [r for r in j.rows.values() if np.array_equal(r, split_rows[t])]
            j.rows[t] = same[0] if same else _row_numbers(split_rows[t])
        whole = next(iter(fixed.values()))
        owner = next(iter(readers.values())).view
        for r, f in zip(readers.values(), fixed.values()):
            if r.view is not owner and len(f) == len(whole) and np.array_equal(f, whole):
                r.view.keys.adopt(owner.keys)  # one parsed key column for every table that holds the same keys
        j.only = {t: set() for t in readers}
        first_table = next(iter(readers))
        j.keys = KeyList(readers[first_table].key_array, j.rows[first_table])
        return True
    common = None
    for k in ks.values():
        common = k if common is None else common[_member(k, common)[0]]
    j.rows, j.only = {}, {}
    for t in readers:
        hit, pos = _member(ks[t], common)
        j.rows[t] = _row_numbers(split_rows[t][pos])
        alone = ks[t][~_member(common, ks[t])[0]]
        j.only[t] = {k.decode() for k in alone.tolist()}
    width = widths.pop()
    offsets = pa.py_buffer(np.arange(0, width * len(common) + 1, width, dtype=np.int32).tobytes())
    j.keys = KeyList(pa.Array.from_buffers(pa.string(), len(common), [None, offsets, pa.py_buffer(common.tobytes())]))
    if say_unmatched and any(j.only.values()):
        log.warning("join of %s: keys only in one side dropped: %s", list(readers), j.unmatched)
    return True


class JoinedTables:
    """Inner join on key of several tables (the first one that records img_shapes gives them).

    `keys` (sorted) and `rows[table]` (each key's row number in that table) are Arrow / numpy arrays, so a join
    of two million-sample tables costs a few hash lookups per key in C, not Python sets and dicts."""

    stand_ins: dict[str, str] = {}  # `stand_in`: table -> column hashed for its samples' checksums (never mutated)

    def __init__(self, readers: dict[str, TableReader], split: str | None = None, store_root: Path | None = None,
                 say_unmatched: bool = True):
        """`say_unmatched`: the warning line for keys only in some table; False where the caller counts them and
        says them its own way (`run all`'s val check: the images table holds every sample, an encoder fewer)."""
        if len(readers) < 2:
            raise UserError("a join needs at least two tables")
        self.readers, self.split = readers, split
        self.store_root = Path(store_root) if store_root is not None else next(iter(readers.values())).dir.parents[1]
        # filled by whoever opens the join (features/open.py): joint sequence length per key (int64 numbers, not
        # a list: ~36 MB of Python ints at 1M samples in every rank)
        self.lengths: np.ndarray = np.zeros(0, np.int64)
        self.report: dict[str, Any] = {}  # filled by the opener: samples, dropped, reasons
        # the opener's reading keys (features/open.py), and with on_damaged="skip" the samples a reader found
        # damaged and left out (key -> problem), filled as they are met: nothing reads ahead of the consumer
        self.on_damaged, self.max_damaged_fraction, self.section = "stop", 0.0, "train"
        self.damaged: dict[str, str] = {}
        self.lease: Any = None  # the opener's read lease on these versions (store/lease.py)
        self._versions: dict[str, str] | None = None  # `versions()`, once computed
        self._contents: dict[str, str] | None | bool = False  # `content_ids()` (False: not computed yet)
        self._prefix_contents: dict[int, dict[str, str] | None] = {}  # `content_ids(first)`, once each
        split_rows = {t: r.rows_of(split) for t, r in readers.items()}
        for r in readers.values():
            r.view.forget("split")  # the join's rows replace it
        if _join_sorted_fixed(self, readers, split_rows, say_unmatched):
            release_memory()  # the dropped columns' pages
            return
        split_keys_ = {t: r.key_array.take(pa.array(split_rows[t])) for t, r in readers.items()}
        common = None
        for ks in split_keys_.values():
            common = ks if common is None else common.filter(pc.is_in(common, value_set=ks))
        if not _strictly_increasing(common):  # manifests are sorted by key: usually nothing to do
            common = common.take(pc.sort_indices(common))
        self.only = {t: set(ks.filter(pc.invert(pc.is_in(ks, value_set=common))).to_pylist())
                     for t, ks in split_keys_.items()}  # keys each table holds alone
        if say_unmatched and any(self.only.values()):
            log.warning("join of %s: keys only in one side dropped: %s", list(readers), self.unmatched)
        self.keys = KeyList(common)
        self.rows = {t: _row_numbers(pc.index_in(common, value_set=r.key_array).to_numpy(zero_copy_only=False))
                     for t, r in readers.items()}

    @property
    def unmatched(self) -> dict[str, int]:
        return {t: len(ks) for t, ks in self.only.items()}

    def __len__(self) -> int:
        return len(self.keys)

    def __getattr__(self, table: str) -> TableReader:  # `joined.text`, `joined.vae`
        readers = self.__dict__.get("readers", {})
        if table in readers:
            return readers[table]
        raise AttributeError(table)

    def get(self, key: str) -> dict[str, dict[str, Any]]:
        return {t: r.get(key) for t, r in self.readers.items()}

    def meta(self, key: str) -> dict[str, dict[str, Any]]:
        return {t: r.meta(key) for t, r in self.readers.items()}

    def tensors(self, key: str) -> dict[str, dict[str, Any]]:
        return {t: r.tensors(key) for t, r in self.readers.items()}

    def features(self, key: str) -> tuple[dict, dict, list[tuple[int, int, int]], str]:
        """(text tensors, vae tensors, img_shapes, where): the arguments of `models.sample.from_features`."""
        return self.readers["text"].tensors(key), self.readers["vae"].tensors(key), self.img_shapes(key), self.where("vae")

    def features_at(self, i: int) -> tuple[str, dict, dict, list[tuple[int, int, int]], str]:
        """(key, text tensors, vae tensors, img_shapes, where) of the i-th joined key, by row number (no key
        lookups): `models.sample.from_features(*joined.features_at(i))`."""
        text, vae = self.readers["text"], self.readers["vae"]
        ti, vi = int(self.rows["text"][i]), int(self.rows["vae"][i])
        return self.keys[i], text.tensors_at(ti), vae.tensors_at(vi), vae.img_shapes_at(vi), self.where("vae")

    def img_shapes(self, key: str) -> list[tuple[int, int, int]]:
        return self._shapes_reader().img_shapes(key)

    def check_ahead(self, order: Callable[[], Iterable[int]], window: int = 32) -> None:
        """Check the joined samples in the consumer's read order ahead of it: one check-ahead thread per table
        (store/check_ahead.py), each walking its own copy of `order()` (joined indices, may be endless)."""
        def table_rows(rows: np.ndarray) -> Iterator[int]:  # a function: each table's own rows, bound now
            return (int(rows[i]) for i in order())

        for t, r in self.readers.items():
            r.check_ahead(table_rows(self.rows[t]), window)

    def stop_check_ahead(self) -> None:
        for r in self.readers.values():
            r.stop_check_ahead()

    def close(self) -> None:
        """Close every reader (check-ahead threads, shard descriptors) and release the read lease; idempotent.
        Tensors already handed out stay valid (they own their buffers, or keep their shard's map alive)."""
        for r in self.readers.values():
            r.close()
        if self.lease is not None:
            self.lease.release()

    def __enter__(self) -> "JoinedTables":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def where(self, table: str) -> str:
        r = self.readers[table]
        return f"'{table}' v{r.version} ({r.dir})"

    def versions(self) -> dict[str, str]:
        """Identities of the joined tables (version + manifest hash; see `Store.version_id`), of the manifests
        read; computed once (hundreds of MB hashed at 1M samples, and versions are immutable)."""
        if self._versions is None:
            self._versions = {t: r.view.version_id() for t, r in self.readers.items()}
        return dict(self._versions)

    def content_ids(self, first: int | None = None) -> dict[str, str] | None:
        """Content identities of the joined tables as read through this join (`_content_ids`): equal ids, the
        same samples (keys, bytes, img_shapes, lengths) of the same split, whatever the versions are numbered
        (encode carrying every sample of an earlier version forward into a new one, e.g. after an `images`
        rerun that changed no sample). None when a table has none (compare `versions()` then). Computed once.
        `first`: of the first `first` joined rows alone (the samples a reader of a prefix reads: evaluate's
        `max_loss_samples`), another id than the whole split's; at or above its size, the whole split's."""
        if first is not None and first < len(self):
            if first not in self._prefix_contents:
                self._prefix_contents[first] = _content_ids(self, first)
            contents = self._prefix_contents[first]
            return dict(contents) if contents else None
        if self._contents is False:
            self._contents = _content_ids(self)
        return dict(self._contents) if self._contents else None

    def stand_in(self, table: str, column: str) -> None:
        """`content_ids` of `table` hash `column` in place of its samples' checksums where every joined row holds a
        value there (a checksum of the part of each sample its reader reads: train's vae latents without the mask
        weights, where they weigh nothing); else the checksums, as without. Set before the first `content_ids`."""
        self.stand_ins = {**self.stand_ins, table: column}
        self._contents, self._prefix_contents = False, {}

    def content_names(self, first: int | None = None) -> dict[str, str]:
        """The joined tables as a record of what was read from them names them: `content:<id>` (`content_ids`,
        of the first `first` rows where given), so an `images` rerun that changed no sample keeps the record
        (evaluate's loss arrays, reports and caches; train's validation curve); the version ids (`versions()`)
        where a table has no content id."""
        contents = self.content_ids(first)
        return {t: f"content:{c}" for t, c in sorted(contents.items())} if contents else self.versions()

    def iter_keys(
        self, rank: int = 0, world_size: int = 1, seed: int | None = None, epoch: int = 0, buffer_size: int = 1024,
    ) -> list[str]:
        """Same ordering rules as one table (`TableReader.iter_keys`), grouped by the first table's shards."""
        first = next(iter(self.readers))
        return self.readers[first].epoch_keys(self.rows[first], rank, world_size, seed, epoch, buffer_size)

    def _shapes_reader(self) -> TableReader:
        return self.readers.get("vae") or next(iter(self.readers.values()))


class _NotHashed(Exception):
    """A column whose type `_feed` has no canonical bytes for."""


def _feed(h: "hashlib._Hash", a: pa.Array) -> None:
    """Canonical bytes of an Arrow array into `h`: validity, then values (integers as int64 whatever their stored
    width; strings as lengths + bytes; lists as lengths + their flattened values), so equal values give equal
    bytes however the array is laid out (offsets, slices, a narrowed type)."""
    t = a.type
    h.update(str(len(a)).encode() + b"\0")
    h.update(a.is_valid().to_numpy(zero_copy_only=False).astype(np.uint8).tobytes())
    if pa.types.is_integer(t):
        h.update(b"i" + a.fill_null(0).to_numpy(zero_copy_only=False).astype("<i8").tobytes())
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        a = a.cast(pa.large_string()).fill_null("")  # int64 offsets; nulls hold no bytes
        offsets = np.frombuffer(a.buffers()[1], dtype="<i8")[a.offset : a.offset + len(a) + 1]
        h.update(b"s" + np.diff(offsets).tobytes())
        data = a.buffers()[2]
        h.update(memoryview(data)[int(offsets[0]) : int(offsets[-1])] if data is not None else b"")
    elif pa.types.is_list(t) or pa.types.is_large_list(t):
        h.update(b"l" + pc.list_value_length(a).fill_null(0).to_numpy(zero_copy_only=False).astype("<i8").tobytes())
        _feed(h, pc.list_flatten(a))  # null lists hold no values
    elif pa.types.is_null(t):  # a column no row has a value in (an optional meta column): its validity says it
        h.update(b"n")
    elif pa.types.is_boolean(t):
        h.update(b"b" + a.fill_null(False).to_numpy(zero_copy_only=False).astype(np.uint8).tobytes())
    elif pa.types.is_floating(t):
        h.update(b"f" + a.cast(pa.float64()).fill_null(0.0).to_numpy(zero_copy_only=False).astype("<f8").tobytes())
    else:
        raise _NotHashed(str(t))


def _feed_rows(h: "hashlib._Hash", column: pa.Array, rows: np.ndarray | None) -> None:
    """`_feed` of `column`'s rows (all for None), a chunk at a time."""
    n = len(column) if rows is None else len(rows)
    for a in range(0, max(n, 1), _CHUNK):
        b = min(a + _CHUNK, n)
        _feed(h, column.slice(a, b - a) if rows is None else column.take(pa.array(rows[a:b])))


def _feed_column(h: "hashlib._Hash", view: Any, name: str, rows: np.ndarray, whole: bool) -> None:
    """`_feed_rows` of column `name` of the view's `rows`, the crc column as its numbers where they are numbers.
    `whole`: rows of the whole split, the column parsed whole (and dropped again where only this parsed it); else
    a few rows (a split's first ones) read from their row groups alone, unless the column is parsed already: the
    same bytes hashed, as `_feed` hashes values however they are laid out."""
    if name == "sample_crc32c":
        crcs = view.samples.crcs() if whole else view.samples.crcs_at(rows)
        if crcs is not None:  # the numbers a reader checks against (kept by the view for its checks)
            h.update(b"u32" + (crcs[rows] if whole else crcs).astype("<u4").tobytes())
            return
    parsed = name in view.parsed
    if not whole and not parsed:
        _feed_rows(h, view.column_at(name, rows), None)
        return
    _feed_rows(h, view.column(name), rows)
    if not parsed:  # parsed for this hash alone (sample_sha256: ~70 MB at 1M samples)
        view.forget(name)


def _content_ids(j: JoinedTables, first: int | None = None) -> dict[str, str] | None:
    """table -> sha256 of what a reader of the join gets from it: the joined keys (sorted: a sample's index) and
    their joint sequence lengths, the split, and per joined row the table's `CONTENT_COLUMNS` (the checksums of
    the sample's bytes, its img_shapes and text length). Train's sampler orders samples by index and length alone
    (stages/train/sampler.py), never by shard: a version whose shards group the samples otherwise is the same.

    None for a table no encode stage wrote (no feature lineage in its schema: a sample whose first member is not
    its safetensors file is read by the manifest's `tensors` layout, which is not hashed) or of schema v1 (its
    img_shapes come from other columns): such a join is named by its version ids alone. `first`: of the first
    `first` joined rows only (`JoinedTables.content_ids`), their count hashed: never a whole split's id."""
    from store.reuse import FEATURE_LINEAGE_ATTR

    if any(r.view.is_v1 or not r.schema.attrs.get(FEATURE_LINEAGE_ATTR) for r in j.readers.values()):
        return None
    split = {"split": j.split, **({"first": first} if first is not None else {})}
    common = hashlib.sha256(CONTENT_FORMAT + b"\0" + json.dumps(split).encode())
    n = len(j) if first is None else min(first, len(j))
    try:
        if first is None:
            _feed_rows(common, j.keys.source, j.keys.rows)
        else:
            keys = np.arange(n, dtype=np.int64) if j.keys.rows is None else np.asarray(j.keys.rows[:n])
            _feed_rows(common, j.keys.source, keys)
        _feed(common, pa.array(np.asarray(j.lengths[:n], dtype=np.int64)))
        out = {}
        for t, r in j.readers.items():
            h = common.copy()
            h.update(b"\0table\0" + t.encode())
            rows = np.asarray(j.rows[t])[:n]
            for name in _content_columns(r.view, j.stand_ins.get(t), rows, h):
                h.update(b"\0column\0" + name.encode())
                if not r.view.has_column(name):
                    h.update(b"\0absent")
                    continue
                _feed_column(h, r.view, name, rows, whole=first is None)
            out[t] = h.hexdigest()
    except _NotHashed as e:
        log.warning("join of %s: a content column of type %s is not hashed; the tables are named by their "
                    "version ids", list(j.readers), e)
        return None
    finally:
        release_memory()
    return out


def _content_columns(view: Any, stand_in: str | None, rows: np.ndarray, h: "hashlib._Hash") -> tuple[str, ...]:
    """The columns hashed for a table: `CONTENT_COLUMNS`, or with `stand_in` (a column every one of `rows` holds a
    value in) that column in place of the sample checksums, its name hashed first (never the id of the checksums)."""
    if stand_in is None or not view.has_column(stand_in) or len(rows) == 0 or \
            view.column_at(stand_in, rows).null_count:
        return CONTENT_COLUMNS
    h.update(b"\0stand-in\0" + stand_in.encode())
    return (stand_in, *(c for c in CONTENT_COLUMNS if c not in ("sample_sha256", "sample_crc32c")))


def split_keys(r: ReaderManifest, split: str | None) -> list[str]:
    if split is None:
        return r.keys()
    return sorted(r.key_array.take(pa.array(r.rows_of(split))).to_pylist())


def text_lengths(text: ReaderManifest) -> np.ndarray:
    """Prompt token count per row of the text table (the `length` column, else the prompt_embeds shape)."""
    if text.has_column("length"):
        return text.column("length").to_numpy(zero_copy_only=False).astype(np.int64)
    rows = text.column("tensors").to_pylist()
    return np.array([next(t["shape"][0] for t in r if t["name"] == "prompt_embeds") for r in rows], np.int64)


def image_tokens(vae: ReaderManifest) -> np.ndarray:
    """Image token count per row of the vae table: the sum over its img_shapes of frames x h x w, computed on
    the Arrow buffers (list<list<int64>>) without Python objects; schema v1 tables per row."""
    if vae.is_v1 or not vae.has_column("img_shapes"):
        return np.array([sum(prod(s) for s in vae.img_shapes_at(i)) for i in range(len(vae))], np.int64)
    shapes = vae.column("img_shapes")
    per_row = pc.list_value_length(shapes).to_numpy(zero_copy_only=False).astype(np.int64)
    inner = pc.list_flatten(shapes)
    if len(inner) and not np.all(pc.list_value_length(inner).to_numpy(zero_copy_only=False) == 3):
        raise UserError(f"table 'vae' v{vae.version} ({vae.dir}): img_shapes entries must be [frames, h, w]")
    prods = pc.list_flatten(inner).to_numpy(zero_copy_only=False).astype(np.int64).reshape(-1, 3).prod(axis=1)
    ends = np.cumsum(per_row)
    cum = np.concatenate([[0], np.cumsum(prods)])
    return cum[ends] - cum[ends - per_row]


def sequence_lengths_of(joined: JoinedTables) -> np.ndarray:
    """Token count of each joined sample's joint sequence (image tokens + text tokens), from the manifests only."""
    text, vae = joined.readers["text"], joined.readers["vae"]
    out = image_tokens(vae)[joined.rows["vae"]] + text_lengths(text)[joined.rows["text"]]
    text.view.forget("length")  # read once, here
    release_memory()  # the million-row temporaries' pages
    return out


ROWS_FORMAT = b"rows-content-1"  # bump when what `rows_content_id` hashes changes


def rows_content_id(r: ReaderManifest, keys: pa.Array, columns: Iterable[str]) -> str | None:
    """sha256 of what a reader of `r` gets for `keys` (in their order): per key whether the table holds it, its
    sample checksums (the bytes, tar headers with the member names included) and the values of `columns` (e.g.
    the caption of an `images` row), a chunk at a time in Arrow. Equal ids: the same rows, whatever version they
    are numbered under. None when the table has no sample checksums (schema v1), or a column holds values
    `_feed` has no canonical bytes for: the caller names the table by its version id then."""
    if r.view.is_v1 or not r.view.has_column("sample_sha256"):
        return None
    keys = pa.array(keys, pa.string()) if not isinstance(keys, pa.Array) else keys
    rows = pc.index_in(keys, value_set=r.key_array)  # null: the key is not in the table
    h = hashlib.sha256(ROWS_FORMAT + b"\0")
    try:
        _feed_rows(h, keys, None)
        for name in ("sample_sha256", "sample_crc32c", *sorted(set(columns))):
            h.update(b"\0column\0" + name.encode())
            if not r.view.has_column(name):
                h.update(b"\0absent")
                continue
            column = r.view.column(name)
            for a in range(0, max(len(rows), 1), _CHUNK):
                _feed(h, column.take(rows.slice(a, _CHUNK)))
    except _NotHashed as e:
        log.warning("'%s': a column of type %s is not hashed; the table is named by its version id", r.dir, e)
        return None
    return h.hexdigest()
