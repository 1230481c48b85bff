"""Opening the trainer's features: `text` + `vae` of one split, built with the expected model, the samples both
hold (the dropped ones counted, with their quarantine reasons; too many is an error), damaged samples checked or
left out where they are read per the section's reading keys (features/damaged.py), sequence lengths from the manifests (`store.join`),
the `images` versions the two were encoded from checked (features/images_versions.py: a stale one said, two renders refused).
`open_configured` is the one way train, its validator, its up-to-date check and evaluate open them."""

from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from features.images_versions import check_images_versions
from features.tables import PRODUCER
from schemas.errors import UserError
from schemas.model_files import MODEL_FILES_ATTR, ModelFile, differing_files, fingerprint_of
from schemas.units import count_text
from store import format as fmt
from store.join import JoinedTables, sequence_lengths_of
from store.manifest_files import checked_groups, checked_manifest
from store.reader import DEFAULT_MAX_OPEN_SHARDS, TableReader
from store.reader_manifest import split_rows

log = logging.getLogger("store")


class ReadingSettings(Protocol):
    """The reading keys a config section declares (train, evaluate: schemas/config.py)."""

    on_damaged: str
    max_damaged_fraction: float
    max_dropped_fraction: float
    max_open_shards: int


def open_configured(settings: ReadingSettings, section: str, store: str | Path, model: str,
                    model_files: Sequence[ModelFile], split: str, say_dropped: bool = True) -> JoinedTables:
    """The one way a stage opens its features: `open_features` with the reading keys of its own config section
    (`section` names it in errors) on every path - training, its validator, its up-to-date check, evaluate.
    `model_files`: the model's (`models.loading.model_files`), whose fingerprint the tables must record; a table
    of another model is refused naming the files that differ."""
    return open_features(store, model, fingerprint_of(model_files), split, settings.max_dropped_fraction,
                         settings.max_open_shards, on_damaged=settings.on_damaged,
                         max_damaged_fraction=settings.max_damaged_fraction, section=section,
                         say_dropped=say_dropped, model_files=model_files)


def open_features(store: str | Path, model: str, model_fingerprint: str, split: str = "train",
                  max_dropped_fraction: float = 0.05, max_open_shards: int = DEFAULT_MAX_OPEN_SHARDS,
                  on_damaged: str = "stop", max_damaged_fraction: float = 0.0, section: str = "train",
                  say_dropped: bool = True, model_files: Sequence[ModelFile] = ()) -> JoinedTables:
    """`text` + `vae` of one split, built with the model whose fingerprint is given: the samples both tables
    hold (the intersection), with each one's joint sequence length in `lengths` and in `report` how many samples
    of the split were dropped (in the `images` table, or in one of the two, but not in both) and why (the
    quarantine rows of those keys, by stage and reason). UserError when the tables are missing, built with
    another model, empty, or when more than `max_dropped_fraction` of the split was dropped.

    on_damaged="stop": a damaged sample raises when it is first read (a missing / short shard on open).
    "skip": the tables open despite bad shards, and no sample is read here (a check of every sample before
    step 0 was a full read of the split, terabytes at 1M samples): whoever reads leaves a damaged sample out
    where it meets it and applies `max_damaged_fraction` to what it has read (features/damaged.py; train:
    stages/train/damaged.py). `section`: the config section errors name. `say_dropped`: a warning line for
    dropped samples (once per process and join); False where the caller prints its own (the trainer's line).
    `model_files`: the model's files, from the walk that gave `model_fingerprint` (`models.loading.model_files`):
    a table built with another model is refused naming the files that differ from those it recorded
    (schemas/model_files.py); without them, or for a table that records none, by the fingerprints alone."""
    from store.lease import hold
    from store.store import Store

    st = Store(store, create=False)
    # A read lease on the two versions (resolved and registered under the store lock): `store gc` keeps them
    # while this process reads them, even when newer versions become current meanwhile.
    lease = hold(st.root, {"text": None, "vae": None}, f"reader of the '{split}' split (train / evaluate)")
    readers: dict[str, TableReader] = {}
    try:
        joined = _open_features(st, lease, readers, model, model_fingerprint, split, max_dropped_fraction,
                                max_open_shards, on_damaged, max_damaged_fraction, section, say_dropped, model_files)
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
                   max_damaged_fraction: float, section: str = "train", say_dropped: bool = True,
                   model_files: Sequence[ModelFile] = ()) -> JoinedTables:
    """Fills `readers` as it opens them (the caller closes them when this raises)."""
    for t in ("text", "vae"):
        readers[t] = _open_table(st, t, model, max_open_shards, on_damaged, lease.version(t))
    for r in readers.values():
        found = r.schema.lineage.model_fingerprint
        if found != model_fingerprint:
            files = differing_files(r.schema.attrs.get(MODEL_FILES_ATTR), model_files) if model_files else None
            raise UserError(
                f"table '{r.table}' v{r.version} in {st.root} was built with a different model (fingerprint "
                f"{found or 'none'}) than --model {model} ({model_fingerprint}{'; ' + files if files else ''}); "
                + (_encoded_from_other_images(st, r.table, model_fingerprint, model) or
                   f"use the model that encoded the store, or re-run `pipeline run {PRODUCER[r.table]} --model "
                   f"{model}`")
            )
    # the `images` versions they were encoded from: a sample of two renders refused, a stale table said
    check_images_versions(st, readers, section)
    joined = JoinedTables(readers, split, st.root)
    text, vae = readers["text"], readers["vae"]
    joined.report = dropped_report(st, joined, split)
    rep = joined.report
    too_many = dropped_beyond(rep, max_dropped_fraction, section)
    if too_many:
        raise UserError(f"the '{split}' split of store {st.root}: {too_many}; fix those inputs, use a model that "
                        f"accepts them, or raise {section}.max_dropped_fraction to use the rest")
    if not len(joined.keys):
        fraction = _val_fraction(st, vae)
        if split == "val" and fraction == 0:  # the split's own setting, not a lack of samples
            raise UserError(
                f"the 'val' split is empty in store {st.root} (text v{text.version}, vae v{vae.version}): its "
                f"images were split with resize.val_fraction: 0, which puts every sample in 'train'; rerun "
                "resize-bucket (and the encoders) with resize.val_fraction > 0, e.g. 0.1 (`pipeline run all` does)"
            )
        raise UserError(
            f"the '{split}' split is empty in store {st.root} (text v{text.version}, vae v{vae.version}); "
            "add training samples (resize-bucket puts val_fraction of them in 'val', the rest in 'train')"
        )
    if rep["dropped"] and say_dropped:
        _say_dropped(st.root, split, {t: r.version for t, r in readers.items()}, rep)
    joined.on_damaged, joined.max_damaged_fraction, joined.section = on_damaged, max_damaged_fraction, section
    joined.lengths = sequence_lengths_of(joined)
    return joined


def _val_fraction(st, features: TableReader) -> float | None:
    """resize.val_fraction of the `images` version a feature table was encoded from (its lineage's upstream; the
    resize settings its schema records); None when it cannot be told."""
    from store.manifest_files import read_schema

    version = features.schema.lineage.upstream.get("images")
    try:
        resize = read_schema(st.version_dir("images", int(version))).attrs.get("resize") if version else None
    except Exception:  # only the error's wording depends on it: nothing here may hide the empty split
        return None
    return resize.get("val_fraction") if isinstance(resize, dict) else None


# (store, split, table versions) whose dropped samples this process has said: an up-to-date check and the read
# that follows open the same join (evaluate's val split), and one line is enough
_SAID_DROPPED: set[tuple[str, str, tuple]] = set()


def _say_dropped(root: Path, split: str, versions: dict[str, int], rep: dict[str, Any]) -> None:
    said = (str(root), split, tuple(sorted(versions.items())))
    if said in _SAID_DROPPED:
        return
    _SAID_DROPPED.add(said)
    log.warning("%s split: %d of %d samples are not in both the text and vae tables (%.1f%%): %s; rows in %s",
                split, rep["dropped"], rep["samples"], 100 * rep["dropped_fraction"], reasons_text(rep),
                rep["quarantine_file"])


def dropped_report(st, joined: JoinedTables, split: str | None) -> dict[str, Any]:
    """How many samples of the split did not make it into the join, and the quarantine reasons of those keys
    (by stage, then reason; keys without a quarantine row count as 'not encoded', e.g. an images version
    newer than an encode stage's table)."""
    universe = set().union(*joined.only.values())
    # the split's samples: those of the `images` version(s) the two tables were encoded from - two while one
    # encoder has run on a newer `images` and the other not yet (counted from one, the dropped ones could
    # outnumber the samples: "35 of 16 samples (218.8%)")
    versions = {r.schema.lineage.upstream.get("images") for r in joined.readers.values()} - {None}
    for images_version in sorted(versions):
        if fmt.is_complete(fmt.version_dir(st.root, "images", images_version)):
            universe |= _keys_not_joined(fmt.version_dir(st.root, "images", images_version), images_version, split,
                                         joined)
    total = len(joined.keys) + len(universe)
    reasons: dict[str, dict[str, int]] = {}
    q = st.quarantine(["key", "stage", "reason"])  # every rank, every start: not the long source/detail texts
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
        other = PRODUCER["vae" if t == "text" else "text"]
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


def dropped_beyond(rep: dict[str, Any], max_dropped_fraction: float, section: str,
                   held_by: str = "both the text and vae tables") -> str | None:
    """The one rule for too many dropped samples (`dropped_report`'s `rep`): what and why when more than
    `max_dropped_fraction` of the split is not held by the tables (`held_by` names them), else None. Train and
    evaluate refuse to open their split on it; `run all` applies evaluate's to the 'val' split after each encoder."""
    if rep["dropped_fraction"] <= max_dropped_fraction:
        return None
    return (f"{rep['dropped']} of {count_text(rep['samples'], 'sample')} ({100 * rep['dropped_fraction']:.1f}%) "
            "are not in "
            f"{held_by}, above {section}.max_dropped_fraction = {max_dropped_fraction}: {reasons_text(rep)} "
            f"(rows in {rep['quarantine_file']})")


def _keys_not_joined(vdir: Path, version: int, split: str | None, joined: JoinedTables) -> set[str]:
    """The keys of one split of an `images` version that the join lacks, from two columns of its checked manifest
    (a reader would stat every shard of the table, on every rank, that no one reads here) read a row group at a time (`checked_groups`), each group's keys looked up in a joined table's sorted keys
    (`rows_of_keys`: a binary search in the usual case). Every rank does this at every start: the whole columns and
    an Arrow hash set of the joined keys peaked at ~+160 MB private memory at 1M samples (bench/train_startup.py)."""
    table = next(iter(joined.readers))
    reader = joined.readers[table]
    joined_row = np.zeros(len(reader), bool)
    joined_row[np.asarray(joined.rows[table])] = True
    out: set[str] = set()
    # damage recorded, as a reader's open records it: resize-bucket's rerun must not call the version up to date
    for group in checked_groups(vdir, ["key", "split"], record=True):
        keys = group.column("key").combine_chunks()
        if split is not None:
            column = group.column("split") if "split" in group.column_names else None
            keys = keys.take(split_rows(column, split, f"table 'images' v{version} ({vdir})"))
        rows = reader.rows_of_keys(keys)
        held = rows >= 0
        held[held] = joined_row[rows[held]]
        out.update(keys.filter(pa.array(~held)).to_pylist())
    return out


def _keys_and_splits(vdir: Path) -> tuple[pa.Array, pa.ChunkedArray | None]:
    # damage recorded, as a reader's open records it: resize-bucket's rerun must not call the version up to date
    m = checked_manifest(vdir, ["key", "split"], record=True)
    return m.column("key").combine_chunks(), (m.column("split") if "split" in m.column_names else None)


def images_in_split(store: str | Path, split: str) -> tuple[int, int, int]:
    """(samples of `split`, samples in all, version) of the store's current `images` version, from its manifest
    (`_keys_and_splits`' read): how many samples resize-bucket's hash split put in the split."""
    from store.store import Store

    st = Store(store, create=False)
    version = st.tables()["images"]
    vdir = st.version_dir("images", version)
    keys, column = _keys_and_splits(vdir)
    return len(split_rows(column, split, f"table 'images' v{version} ({vdir})")), len(keys), version


def quarantined_keys(store: str | Path, stage: str) -> tuple[list[str], list[str], list[str | None]]:
    """(keys, reasons, pictures ids) of the samples `stage` quarantined from the source of the store's current
    `images` version and that version does not hold (a duplicate's key is its first copy's): samples that never got
    a split. Rows without a key (unreadable, no caption) cannot be told apart and are left out; a row recorded
    before its pictures id was (stages/resize/split_rule.py) has None."""
    from store.manifest_files import read_schema
    from store.store import Store

    st = Store(store, create=False)
    q = st.quarantine()
    if not q.num_rows:
        return [], [], []
    vdir = st.version_dir("images", st.tables()["images"])
    source = read_schema(vdir).attrs.get("source")
    mine = pc.and_(pc.equal(q.column("stage"), stage), pc.is_valid(q.column("key")))
    if source:  # rows of another source quarantined into the same store earlier are not these samples'
        mine = pc.and_(mine, pc.starts_with(q.column("source"), pattern=str(source)))
    q = q.filter(mine)
    q = q.filter(pc.invert(pc.is_in(q.column("key"), value_set=_keys_and_splits(vdir)[0])))
    pictures = q.column("pictures").to_pylist() if "pictures" in q.column_names else [None] * q.num_rows
    return q.column("key").to_pylist(), q.column("reason").to_pylist(), pictures


def split_report(store: str | Path, tables: tuple[str, str], split: str) -> dict[str, Any]:
    """`dropped_report` of the join of two tables' current versions on one split (e.g. ("images", "text"): the
    samples encode-text kept of it; ("text", "vae"): those evaluate reads), opened as `open_features` opens them
    (under a read lease) and closed again: `joined` samples of `samples`, the dropped ones' reasons."""
    from store.lease import hold
    from store.store import Store

    st = Store(store, create=False)
    lease = hold(st.root, {t: None for t in tables}, f"check of the '{split}' split")
    readers: dict[str, TableReader] = {}
    try:
        for t in tables:
            readers[t] = st.reader(t, lease.version(t))
        # quiet join: the caller says the dropped ones with their reasons (its line), not the join's key counts
        return dropped_report(st, JoinedTables(readers, split, st.root, say_unmatched=False), split)
    finally:
        for r in readers.values():
            r.close()
        lease.release()


def _encoded_from_other_images(st, table: str, model_fingerprint: str, model: str) -> str | None:
    """The way back to the newest complete version of `table` this model encoded from an `images` version that is
    no longer current (another run's resize-bucket, with its own settings, came between), or None. Re-running the
    encoder alone would encode the current images instead: their resize settings (reference limit, alpha,
    sizes) are the other run's."""
    current = st.tables().get("images")
    if current is None:  # no current images (none made current, or removed): nothing to compare with, no hint
        return None
    for v in reversed(st.versions(table)):
        if not fmt.is_complete(st.version_dir(table, v)):
            continue
        try:
            lineage = st.checked_schema(table, v).lineage
        except UserError:  # unreadable: the next older one
            continue
        images = lineage.upstream.get("images")
        if lineage.model_fingerprint != model_fingerprint or images is None:
            continue
        # the current images: the encoder finds it up to date and makes it current (the plain advice holds);
        # images gone (`store gc`): resize-bucket would render again, so nothing is promised
        if int(images) == current or int(images) not in st.versions("images"):
            return None
        return (f"its {table} v{v} was encoded by this model from images v{images}, not the current images "
                f"v{current} (another run's resize settings): rerun `pipeline run resize-bucket` with the config "
                f"that made images v{images} (it renders nothing again), then the encoders with --model {model} "
                "find their tables up to date (`pipeline run all --config F` runs all three); re-running "
                f"`pipeline run {PRODUCER[table]}` alone encodes images v{current}")
    return None


def reasons_text(rep: dict[str, Any]) -> str:
    return "; ".join(f"{stage}: " + ", ".join(f"{r} {n}" for r, n in sorted(rs.items()))
                     for stage, rs in sorted(rep["reasons"].items())) or "no reasons recorded"


def _open_table(st, table: str, model: str, max_open_shards: int = DEFAULT_MAX_OPEN_SHARDS,
                on_damaged: str = "stop", version: int | None = None) -> TableReader:
    if table not in st.tables():
        raise UserError(
            f"store {st.root} has no '{table}' table (tables: {sorted(st.tables()) or 'none'}); "
            f"run `pipeline run {PRODUCER[table]} --store {st.root} --model {model}` first"
        )
    return st.reader(table, version, on_damaged=on_damaged, max_open_shards=max_open_shards)
