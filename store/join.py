"""The one join of tables by sample key: train and evaluate read `text` + `vae` as one sample through it.

`JoinedTables` is an inner join on key (optionally of one split); keys missing from some table are counted in
`unmatched` and logged, never silently lost. `open_features` is the trainer's view of a store: `text` + `vae`
built with the expected model, the samples both hold (the dropped ones counted, with their quarantine reasons;
too many is an error), sequence lengths from the manifests alone (Arrow compute, no per-row Python objects).
"""

from __future__ import annotations

import logging
import os
import weakref
from math import prod
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.errors import UserError
from store import format as fmt
from store.partition import epoch_order
from store.manifest_view import fixed_width_view as _fixed_width
from store.manifest_view import release_memory
from store.manifest_view import strictly_increasing as _strictly_increasing
from store.reader import DEFAULT_MAX_OPEN_SHARDS, TableReader

log = logging.getLogger("store")

STAGE_OF = {"images": "resize-bucket", "text": "encode-text", "vae": "encode-vae"}  # table -> the stage that writes it


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


def _split_rows(r: TableReader, split: str | None) -> np.ndarray:
    """Row numbers of one split (all rows for None)."""
    if split is None:
        return np.arange(len(r), dtype=np.int64)
    if not r.has_column("split"):
        raise UserError(f"table '{r.table}' v{r.version} ({r.dir}) has no split column; rebuild it with the current code")
    mask = pc.equal(r.column("split"), split).to_numpy(zero_copy_only=False)
    return np.flatnonzero(mask)


def _member(sorted_values: np.ndarray, probe: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(hit mask, position) of each probe in a sorted array: binary search in C, no hash table."""
    pos = np.searchsorted(sorted_values, probe)
    clipped = np.minimum(pos, len(sorted_values) - 1)
    hit = (sorted_values[clipped] == probe) if len(sorted_values) else np.zeros(len(probe), bool)
    return hit, clipped


def _row_numbers(rows: np.ndarray) -> np.ndarray:
    """Row numbers as int32 (half of int64: ~4 MB less at 1M samples, kept by every rank) where they fit."""
    return rows.astype(np.int32 if len(rows) == 0 or rows.max() < 2**31 else np.int64)


def _join_sorted_fixed(j: "JoinedTables", readers: dict[str, TableReader], split_rows: dict[str, np.ndarray]) -> bool:
    """The common case (sorted manifests, 32-hex keys): intersect by binary search on zero-copy byte views.
    Fills j.keys / j.rows / j.only and returns True; False when the keys do not allow it."""
    fixed = {t: _fixed_width(r.key_array) for t, r in readers.items()}
    widths = {f.dtype.itemsize for f in fixed.values() if f is not None}
    if any(f is None for f in fixed.values()) or len(widths) != 1 or not all(r.keys_sorted for r in readers.values()):
        return False
    ks = {t: fixed[t][split_rows[t]] for t in readers}  # still sorted
    first = next(iter(ks.values()))
    if all(len(k) == len(first) and np.array_equal(k, first) for k in ks.values()):  # the usual case: same keys
        j.rows = {}
        for t in readers:  # tables with the same rows share one array (read only)
            same = [r for r in j.rows.values() if np.array_equal(r, split_rows[t])]
            j.rows[t] = same[0] if same else _row_numbers(split_rows[t])
        whole = next(iter(fixed.values()))
        owner = next(iter(readers.values())).view
        for r, f in zip(readers.values(), fixed.values()):
            if r.view is not owner and len(f) == len(whole) and np.array_equal(f, whole):
                r.view.adopt_keys(owner)  # one parsed key column for every table that holds the same keys
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
    if any(j.only.values()):
        log.warning("join of %s: keys only in one side dropped: %s", list(readers), j.unmatched)
    return True


class JoinedTables:
    """Inner join on key of several tables (the first one that records img_shapes gives them).

    `keys` (sorted) and `rows[table]` (each key's row number in that table) are Arrow / numpy arrays, so a join
    of two million-sample tables costs a few hash lookups per key in C, not Python sets and dicts."""

    def __init__(self, readers: dict[str, TableReader], split: str | None = None, store_root: Path | None = None):
        if len(readers) < 2:
            raise UserError("a join needs at least two tables")
        self.readers, self.split = readers, split
        self.store_root = Path(store_root) if store_root is not None else next(iter(readers.values())).dir.parents[1]
        # filled by `open_features`: joint sequence length per key (int64 numbers, not a list: ~36 MB of Python
        # ints at 1M samples in every rank)
        self.lengths: np.ndarray = np.zeros(0, np.int64)
        self.report: dict[str, Any] = {}  # filled by `open_features`: samples, dropped, reasons
        self.damaged: dict[str, str] = {}  # open_features(on_damaged="skip"): key -> problem, left out of `keys`
        self.lease: Any = None  # open_features: the read lease on these versions (store/lease.py)
        split_rows = {t: _split_rows(r, split) for t, r in readers.items()}
        for r in readers.values():
            r.view.forget("split")  # the join's rows replace it
        if _join_sorted_fixed(self, readers, split_rows):
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
        if any(self.only.values()):
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
        """Identities of the joined tables (version + manifest hash; see `Store.version_id`)."""
        from store.store import Store

        st = Store(self.store_root, create=False)
        return {t: st.version_id(t, r.version) for t, r in self.readers.items()}

    def iter_keys(
        self, rank: int = 0, world_size: int = 1, seed: int | None = None, epoch: int = 0, buffer_size: int = 1024,
    ) -> list[str]:
        """Same ordering rules as one table (`TableReader.iter_keys`), grouped by the first table's shards."""
        keep = set(self.keys)
        groups = [[k for k in g if k in keep] for g in next(iter(self.readers.values())).shard_groups(self.split)]
        return epoch_order([g for g in groups if g], rank, world_size, seed, epoch, buffer_size)

    def _shapes_reader(self) -> TableReader:
        return self.readers.get("vae") or next(iter(self.readers.values()))


def split_keys(r: TableReader, split: str | None) -> list[str]:
    if split is None:
        return r.keys()
    return sorted(r.key_array.take(pa.array(_split_rows(r, split))).to_pylist())


def _name_keys(keys: set[str], limit: int = 5) -> str:
    shown = sorted(keys)[:limit]
    return ", ".join(shown) + (f" … ({len(keys)} in all)" if len(keys) > limit else "")


class ReadingSettings(Protocol):
    """The reading keys a config section declares (train, evaluate: schemas/config.py)."""

    on_damaged: str
    max_damaged_fraction: float
    max_dropped_fraction: float
    max_open_shards: int


def open_configured(settings: ReadingSettings, section: str, store: str | Path, model: str, model_fingerprint: str,
                    split: str, rank: int = 0, world: int = 1,
                    combine: Callable[[np.ndarray], np.ndarray] | None = None) -> JoinedTables:
    """The one way a stage opens its features: `open_features` with the reading keys of its own config section
    (`section` names it in errors) on every path - training, its validator, its up-to-date check, evaluate."""
    return open_features(store, model, model_fingerprint, split, settings.max_dropped_fraction,
                         settings.max_open_shards, on_damaged=settings.on_damaged,
                         max_damaged_fraction=settings.max_damaged_fraction, section=section, rank=rank, world=world,
                         combine=combine)


def open_features(store: str | Path, model: str, model_fingerprint: str, split: str = "train",
                  max_dropped_fraction: float = 0.05, max_open_shards: int = DEFAULT_MAX_OPEN_SHARDS,
                  on_damaged: str = "stop", max_damaged_fraction: float = 0.0, section: str = "train",
                  rank: int = 0, world: int = 1,
                  combine: Callable[[np.ndarray], np.ndarray] | None = None) -> JoinedTables:
    """`text` + `vae` of one split, built with the model whose fingerprint is given: the samples both tables
    hold (the intersection), with each one's joint sequence length in `lengths` and in `report` how many samples
    of the split were dropped (in the `images` table, or in one of the two, but not in both) and why (the
    quarantine rows of those keys, by stage and reason). UserError when the tables are missing, built with
    another model, empty, or when more than `max_dropped_fraction` of the split was dropped.

    on_damaged="stop": a damaged sample raises when it is first read (a missing / short shard on open).
    "skip": every joined sample is checked now, each rank (`rank` of `world`) a share of them in a few
    threads, and `combine` (the stage's all-ranks OR of a per-row mask) gives every rank every rank's findings;
    damaged ones are left out and listed in `damaged` (more than `max_damaged_fraction` of them: UserError, the
    same on every rank). `section`: the config section errors name."""
    from store.lease import hold
    from store.store import Store

    st = Store(store, create=False)
    # A read lease on the two versions (resolved and registered under the store lock): `store gc` keeps them
    # while this process reads them, even when newer versions become current meanwhile.
    lease = hold(st.root, {"text": None, "vae": None}, f"reader of the '{split}' split (train / evaluate)")
    readers: dict[str, TableReader] = {}
    try:
        joined = _open_features(st, lease, readers, model, model_fingerprint, split, max_dropped_fraction,
                                max_open_shards, on_damaged, max_damaged_fraction, section, rank, world, combine)
    except BaseException:
        for r in readers.values():  # a refused store (wrong model, too many dropped) leaves nothing open
            r.close()
        lease.release()
        raise
    joined.lease = lease
    weakref.finalize(joined, lease.release)
    return joined


def _open_features(st, lease, readers: dict[str, TableReader], model: str, model_fingerprint: str, split: str,
                   max_dropped_fraction: float, max_open_shards: int, on_damaged: str,
                   max_damaged_fraction: float, section: str = "train", rank: int = 0, world: int = 1,
                   combine: Callable[[np.ndarray], np.ndarray] | None = None) -> JoinedTables:
    """Fills `readers` as it opens them (the caller closes them when this raises)."""
    for t in ("text", "vae"):
        readers[t] = _open_table(st, t, model, max_open_shards, on_damaged, lease.version(t))
    for r in readers.values():
        found = r.schema.lineage.model_fingerprint
        if found != model_fingerprint:
            raise UserError(
                f"table '{r.table}' v{r.version} in {st.root} was built with a different model (fingerprint "
                f"{found or 'none'}) than --model {model} ({model_fingerprint}); use the model that encoded the "
                f"store, or re-run `pipeline run {STAGE_OF[r.table]} --model {model}`"
            )
    joined = JoinedTables(readers, split, st.root)
    text, vae = readers["text"], readers["vae"]
    joined.report = dropped_report(st, joined, split)
    rep = joined.report
    if rep["dropped"]:
        log.warning("%s split: %d of %d samples are not in both the text and vae tables (%.1f%%): %s; rows in %s",
                    split, rep["dropped"], rep["samples"], 100 * rep["dropped_fraction"], _reasons_text(rep),
                    rep["quarantine_file"])
    if rep["dropped_fraction"] > max_dropped_fraction:
        raise UserError(
            f"the '{split}' split of store {st.root}: {rep['dropped']} of {rep['samples']} samples "
            f"({100 * rep['dropped_fraction']:.1f}%) are not in both the text and vae tables, above "
            f"{section}.max_dropped_fraction = {max_dropped_fraction}: {_reasons_text(rep)} (rows in "
            f"{rep['quarantine_file']}); fix those inputs, use a model that accepts them, or raise "
            f"{section}.max_dropped_fraction to use the rest"
        )
    if not len(joined.keys):
        raise UserError(
            f"the '{split}' split is empty in store {st.root} (text v{text.version}, vae v{vae.version}); "
            "add training samples (resize-bucket puts val_fraction of them in 'val', the rest in 'train')"
        )
    if on_damaged == "skip":
        bad = find_damaged(joined, rank, world)
        if combine is not None:
            bad = combine(bad)
        bad_rows = np.flatnonzero(bad)
        if len(bad_rows) > max_damaged_fraction * len(joined.keys):
            raise UserError(
                f"{len(bad_rows)} of {len(joined.keys)} '{split}' samples in {st.root} are damaged, more than "
                f"max_damaged_fraction {max_damaged_fraction} (e.g. {damage_of(joined, int(bad_rows[0]))}); "
                f"run `pipeline store repair {st.root}`"
            )
        # what is wrong with each (found by any rank: checked again here, a few samples at most)
        joined.damaged = {joined.keys[int(i)]: damage_of(joined, int(i)) for i in bad_rows}
        if len(bad_rows):
            keep = np.ones(len(joined.keys), dtype=bool)
            keep[bad_rows] = False
            joined.keys = joined.keys.subset(keep)
            joined.rows = {t: r[keep] for t, r in joined.rows.items()}
        if not len(joined.keys):
            raise UserError(f"every '{split}' sample in {st.root} is damaged; run `pipeline store repair {st.root}`")
    joined.lengths = sequence_lengths_of(joined)
    return joined


CHECK_CHUNK = 256  # joined rows per task of the damage pre-pass


def find_damaged(joined: JoinedTables, rank: int = 0, world: int = 1,
                 workers: int | None = None) -> np.ndarray:
    """A mask over the joined rows, True where this rank's share (rows rank, rank + world, ...) holds a damaged
    sample in either table. The bytes are read by pread and CRC-checked in `workers` threads (crc32c and the
    reads release the GIL), each with shard descriptors of its own; intact rows count as checked in the readers
    (training does not check them again). Not a library: the same check as every first read
    (store/sample_check.py), only spread over threads and ranks."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    from store.shard_io import ShardFiles

    text, vae = joined.readers["text"], joined.readers["vae"]
    for r in (text, vae):
        r.prepare_checks()  # columns parsed here, before the threads only read them
    t_rows, v_rows = joined.rows["text"], joined.rows["vae"]
    mine = np.arange(rank, len(joined.keys), world, dtype=np.int64)
    bad = np.zeros(len(joined.keys), dtype=bool)
    workers = workers or max(1, min(8, len(os.sched_getaffinity(0))))

    def check(chunk: np.ndarray) -> int:
        files = {r.table: ShardFiles(r.dir, 4, scans=False) for r in (text, vae)}
        try:
            for i in chunk:
                for r, row in ((text, int(t_rows[i])), (vae, int(v_rows[i]))):
                    if r.checks.is_checked(row):
                        continue
                    try:
                        problem = r.checks.problem(row, files[r.table])
                    except UserError as e:  # e.g. a shard gone under the reader
                        problem = str(e)
                    if problem is None:
                        r.checks.mark_checked(row)
                    else:
                        bad[i] = True
                        break
        finally:
            for f in files.values():
                f.close()
        return len(chunk)

    chunks = [mine[k : k + CHECK_CHUNK] for k in range(0, len(mine), CHECK_CHUNK)]
    with ThreadPoolExecutor(workers) as pool, tqdm(total=len(mine), desc="check samples", unit="sample",
                                                   leave=False) as bar:
        for n in pool.map(check, chunks):
            bar.update(n)
    return bad


def damage_of(joined: JoinedTables, i: int) -> str:
    """What is wrong with joined row i (the first table's problem; recorded in the store as any read's)."""
    return (joined.readers["text"].damaged_at(int(joined.rows["text"][i]))
            or joined.readers["vae"].damaged_at(int(joined.rows["vae"][i])) or "damaged")


def dropped_report(st, joined: JoinedTables, split: str | None) -> dict[str, Any]:
    """How many samples of the split did not make it into the join, and the quarantine reasons of those keys
    (by stage, then reason; keys without a quarantine row count as 'not encoded', e.g. an images version
    newer than an encode stage's table)."""
    universe = set().union(*joined.only.values())
    images_version = joined.readers["vae"].schema.lineage.upstream.get("images")
    if images_version is not None and fmt.is_complete(fmt.version_dir(st.root, "images", images_version)):
        with st.reader("images", images_version) as images:
            ks = images.key_array.take(pa.array(_split_rows(images, split)))
        missing = ks.filter(pc.invert(pc.is_in(ks, value_set=joined.keys.array)))
        universe |= set(missing.to_pylist())
        total = len(ks)
    else:
        total = len(joined.keys) + len(universe)
    reasons: dict[str, dict[str, int]] = {}
    q = st.quarantine()
    explained: set[str] = set()
    if universe and q.num_rows:
        q = q.filter(pc.is_in(q.column("key"), value_set=pa.array(sorted(universe), pa.string())))
        seen = set()
        for key, stage, reason in zip(*(q.column(c).to_pylist() for c in ("key", "stage", "reason"))):
            if (key, stage, reason) not in seen:
                seen.add((key, stage, reason))
                reasons.setdefault(stage, {}).setdefault(reason, 0)
                reasons[stage][reason] += 1
                explained.add(key)
    for t, ks in joined.only.items():  # in one table, not the other, no quarantine row: the other lacks it
        other = STAGE_OF["vae" if t == "text" else "text"]
        unexplained = len(ks - explained)
        if unexplained:
            reasons.setdefault(other, {})["not encoded"] = reasons.get(other, {}).get("not encoded", 0) + unexplained
            explained |= ks
    rest = len(universe - explained)
    if rest:
        reasons.setdefault("encode-text/encode-vae", {})["not encoded"] = rest
    dropped = len(universe)
    return {"split": split, "samples": total, "joined": len(joined.keys), "dropped": dropped,
            "dropped_fraction": dropped / total if total else 0.0, "reasons": reasons,
            "only_in": {t: len(ks) for t, ks in joined.only.items()},
            "quarantine_file": str(st.root / fmt.QUARANTINE)}


def _reasons_text(rep: dict[str, Any]) -> str:
    return "; ".join(f"{stage}: " + ", ".join(f"{r} {n}" for r, n in sorted(rs.items()))
                     for stage, rs in sorted(rep["reasons"].items())) or "no reasons recorded"


def _open_table(st, table: str, model: str, max_open_shards: int = DEFAULT_MAX_OPEN_SHARDS,
                on_damaged: str = "stop", version: int | None = None) -> TableReader:
    if table not in st.tables():
        raise UserError(
            f"store {st.root} has no '{table}' table (tables: {sorted(st.tables()) or 'none'}); "
            f"run `pipeline run {STAGE_OF[table]} --store {st.root} --model {model}` first"
        )
    return st.reader(table, version, on_damaged=on_damaged, max_open_shards=max_open_shards)


def text_lengths(text: TableReader) -> np.ndarray:
    """Prompt token count per row of the text table (the `length` column, else the prompt_embeds shape)."""
    if text.has_column("length"):
        return text.column("length").to_numpy(zero_copy_only=False).astype(np.int64)
    rows = text.column("tensors").to_pylist()
    return np.array([next(t["shape"][0] for t in r if t["name"] == "prompt_embeds") for r in rows], np.int64)


def image_tokens(vae: TableReader) -> np.ndarray:
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


def sequence_lengths(text: TableReader, vae: TableReader, keys: list[str]) -> list[int]:
    """Token count of each sample's joint sequence (image tokens + text tokens), from the manifests only."""
    ka = pa.array(list(keys), pa.string())
    t_rows = pc.index_in(ka, value_set=text.key_array).to_numpy(zero_copy_only=False).astype(np.int64)
    v_rows = pc.index_in(ka, value_set=vae.key_array).to_numpy(zero_copy_only=False).astype(np.int64)
    return (image_tokens(vae)[v_rows] + text_lengths(text)[t_rows]).tolist()
