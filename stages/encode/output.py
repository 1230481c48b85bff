"""The output side of an encode job: open (or resume) the table version, carry forward what an earlier version
with the same feature lineage holds, or adopt a version another process completed meanwhile."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.errors import UserError
from schemas.table import TableSchema
from stages.encode.intake import Todo, key_rows, refused_by_controls, refuses_any
from store.reuse import FEATURE_LINEAGE_ATTR, carry_forward, reusable

if TYPE_CHECKING:
    from stages.encode.job import EncodeJob

# schema attr: the feature lineages whose stored samples the version's rows may hold a part of, the rest computed by
# this run (`_completed`; encode-text: {"columns": [...], "feature_lineages": [...]}), as `feature_lineage` names
# the one its rows carried whole were stored under
PART_LINEAGES_ATTR = "part_lineages"


def open_writer(job: EncodeJob, schema: TableSchema, shard_size_mb: float) -> Todo:
    """Open (or resume) the output version, carry forward every key an earlier version with the same feature
    lineage holds (hard-linked shards, split relabelled from `images`); return this rank's keys left to do (with
    their `images` rows where looked up, for `read_inputs`)."""
    from models.collective import arrive_together
    from stages.encode.nodes import writer_place

    # the ranks' first agreement after their model loads: a node reading the model from a slower disk comes minutes
    # later, waited for through the launcher's store (in a collective, NCCL's 10-minute timeout ended the others)
    arrive_together(job.ranks.world_size, f"{job.summary.stage}: the model loaded")
    schema = _with_settings(job, replace(schema, attrs={**schema.attrs, FEATURE_LINEAGE_ATTR: job.feature_lineage}))
    place = writer_place(job, schema)  # several nodes' caches of a store URL: agreed by all ranks
    if place.committed is not None:
        _adopt_committed(job, place.url, place.committed, place.rows, schema, place.current or None)
        return Todo()
    mine = job.images.iter_keys(rank=job.ranks.rank, world_size=job.ranks.world_size)
    # a resume: each rank learns which keys of its share are committed (its own indexes only, unless the shares
    # moved: every rank agrees on that)
    job.writer = job.store.writer(
        job.summary.table, schema, rank=job.ranks.rank, world_size=job.ranks.world_size,
        shard_size_mb=shard_size_mb, version=place.version, remote_url=place.url,
        share=mine, agree=lambda alone: _all_agree(job.ranks.world_size, alone),
    )
    if _completed_meanwhile(job, several_caches=place.url is not None, refused=place.refused):
        return Todo()
    job.summary.version = job.writer.version
    job.shard_sizes_before = rank_shard_sizes(job)
    job.total = job.writer.given = len(mine)  # the commit refuses rows plus rejections short of the keys given
    todo = [k for k in mine if k not in job.writer.done_keys]
    job.summary.skipped = len(mine) - len(todo)
    todo, at = _carried_forward(job, todo)
    job.loop_started = time.perf_counter()
    return Todo(tuple(todo), at)  # the rows looked up here travel with their keys to `read_inputs`


def _carried_forward(job: EncodeJob, todo: list[str]) -> tuple[list[str], np.ndarray | None]:
    """Carry forward what an earlier version with the same feature lineage holds of `todo` (and, encode-vae, a
    recaptioned sample's latents); return the keys left, with their `images` rows where the model's rule was asked
    of them (`_model_takes`), else None."""
    at = key_rows(job, todo) if refuses_any(job, job.by_controls) else None
    carriable = _model_takes(job, todo, at)
    # encode-vae: a row a fix changed the mask of alone is found too, and left to `recompute_masks`
    changed, lineages = _changed_beyond_mask(job) if job.mask_only_carry else job.changed_by_fixes, {}
    found = reusable(job.store, job.summary.table, (job.feature_lineage, *job.earlier_lineages), carriable,
                     changed=changed, lineages=lineages)
    for version, rows in found.items():
        whole = _without_masks_changed(job, rows, lineages[version]) if job.mask_only_carry else rows
        job.summary.reused += carry_forward(job.writer, version, carried_rows(job, whole))
    if job.summary.reused:
        todo, at = _left(todo, at, job.writer.carried_keys)
        carriable = [k for k in carriable if k not in job.writer.carried_keys]
    # (a resumed version begun without the record - `store repair`'s copy of an older one - completes none)
    if job.complete_rows is not None and PART_LINEAGES_ATTR in job.writer.schema.attrs and carriable:
        completed = _completed(job, carriable)
        todo, at = _left(todo, at, completed)
        carriable = [k for k in carriable if k not in completed]
    if job.mask_only_carry and carriable:  # encode-vae: a sample whose mask alone changed (stages/encode/mask_only.py)
        from stages.encode.mask_only import recompute_masks

        masks = recompute_masks(job, carriable, found)  # the rows found above: no manifest read again
        job.summary.completed += len(masks)
        todo, at = _left(todo, at, masks)
        carriable = [k for k in carriable if k not in masks]
    if job.same_inputs_carry and carriable:  # encode-vae: a recaptioned sample's latents (stages/encode/same_inputs.py)
        from stages.encode.same_inputs import carry_same_inputs

        same = carry_same_inputs(job, carriable)
        job.summary.reused += len(same)
        todo, at = _left(todo, at, same)
    return todo, at


def _changed_beyond_mask(job: EncodeJob) -> dict[str, Callable[[pa.Table], np.ndarray]]:
    """`job.changed_by_fixes` where a fix that changes the mask alone (`Fixes.mask_only`) does not count."""
    return {lineage: getattr(rule, "beyond_mask", rule) for lineage, rule in job.changed_by_fixes.items()}


def _without_masks_changed(job: EncodeJob, rows: pa.Table, lineage: str | None) -> pa.Table:
    """`rows` (found under `_changed_beyond_mask`) but those a fix changed the mask of: their mask weights are
    not the stored ones (the mask's source, `mask_sha256`, may be the same), so they are never carried whole."""
    alone = getattr(job.changed_by_fixes.get(lineage), "mask_alone", None)
    if alone is None or not rows.num_rows:
        return rows
    return rows.filter(pa.array(~alone(rows), pa.bool_()))


def _completed(job: EncodeJob, keys: list[str]) -> set[str]:
    """Complete the `keys` a version of `job.partial_lineages` holds (its rows as `carried_rows` keeps them):
    their stored part is copied and only the missing columns computed (`job.complete_rows`), instead of encoding
    the whole sample again. Returns the keys done (written or quarantined); a stored sample found damaged is encoded
    whole instead."""
    done: set[str] = set()
    for version, rows in reusable(job.store, job.summary.table, job.partial_lineages, keys,
                                  changed=job.changed_by_fixes).items():
        rows = carried_rows(job, rows)
        if rows.num_rows:
            done |= job.complete_rows(version, rows)
    return done


def completing(job: EncodeJob, version: int, keys: list[str], step: int,
               complete_some: Callable[[Any, list[str]], set[str]]) -> set[str]:
    """`complete_some(reader, part)` (-> the keys of `part` it did) over `keys`, `step` at a time (the stored
    tensors of that many samples held at once), with `version` of the job's table open checked (a damaged sample
    raises `DamagedData` when read: the stage leaves it to be encoded whole) under a read lease; the keys done."""
    from tqdm.auto import tqdm

    from store.reuse import source_reader

    table, done = job.summary.table, set()
    with source_reader(job.store.root, table, version, f"complete samples of '{table}' v{version}",
                       "complete") as reader:
        for i in tqdm(range(0, len(keys), max(1, step)), desc=f"{job.summary.stage}: completing samples of "
                      f"'{table}' v{version}", unit="part", leave=False):
            done |= complete_some(reader, keys[i : i + max(1, step)])
    return done


def _left(todo: list[str], at: np.ndarray | None, carried) -> tuple[list[str], np.ndarray | None]:
    """The keys of `todo` not in `carried`, and their rows `at` (kept aligned)."""
    keep = [k not in carried for k in todo]
    return [k for k, kept in zip(todo, keep) if kept], (None if at is None else at[np.asarray(keep, bool)])


def _model_takes(job: EncodeJob, keys: list[str], at: np.ndarray | None) -> list[str]:
    """The keys whose control count the model's rule accepts (`job.by_controls`, from the `images` column; `at`:
    their rows): only those are carried from an earlier version. Edit and Edit-Plus models with the same VAE files
    share encode-vae's feature lineage, and an Edit model's `vae` table carried an Edit-Plus run's 2-control latents
    that its `text` table (and a fresh encode) quarantines. The refused keys stay to do: read_inputs quarantines
    them unread."""
    if at is None:  # no rule, or one that refuses no count the table holds
        return keys
    _, refused = refused_by_controls(job, keys, job.by_controls, at)
    return [k for k, no in zip(keys, refused) if not no]


def _all_agree(world: int, yes: bool) -> bool:
    """True when every rank says yes."""
    from models.collective import all_max

    (no,) = all_max(world, [0 if yes else 1])
    return no == 0


def carried_rows(job: EncodeJob, rows: pa.Table) -> pa.Table:
    """The stored rows of an earlier version that this run carries forward: those whose content outside the key
    is the images' now (`_same_content`) and, for encode-text, whose prompt fits next to the images now
    (`_shapes_now`), with the split (and encode-text's img_shapes) `images` gives now. Looked up for the whole
    column and compared in Arrow: row by row (each sample's images meta), ~12 s per rank at 1M samples and 8 ranks
    before the model's first batch (bench/encode_carry.py)."""
    at = job.images.rows_of_keys(rows.column("key"))
    rows, at = _same_content(job, rows, at)
    if job.prompt_fits is not None:
        rows, at = _shapes_now(job.images, rows, at, job.prompt_fits)
    return _split_now(job.images, rows, at)


def _same_content(job: EncodeJob, rows: pa.Table, at: np.ndarray) -> tuple[pa.Table, np.ndarray]:
    """The rows (and their `images` rows `at`, -1: none) whose `match_columns` (content outside the key, e.g. the
    mask) equal the images row's now; a value unknown on either side (older tables, a null) never matches, so
    such a sample is recomputed."""
    keep = at >= 0
    for c in job.match_columns if rows.num_rows else ():
        if c not in rows.column_names or not job.images.has_column(c):
            keep[:] = False
            break
        keep &= _equal_at(rows.column(c), job.images.column(c), at)
    return (rows, at) if keep.all() else (rows.filter(pa.array(keep)), at[keep])


def _equal_at(stored: pa.ChunkedArray, now: pa.Array, at: np.ndarray) -> np.ndarray:
    """stored[i] == now[at[i]] for every row i; False where either value is null or at[i] is -1."""
    now = now.take(pa.array(np.maximum(at, 0)))
    stored = stored.combine_chunks()
    same = None
    if stored.type == now.type:
        try:
            same = pc.equal(stored, now).fill_null(False).to_numpy(zero_copy_only=False)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):  # a type Arrow does not compare
            pass
    if same is None:  # e.g. a column no row of one table has a value in (type null): compared as values
        same = np.array([a is not None and a == b for a, b in zip(stored.to_pylist(), now.to_pylist())], bool)
    return same & (at >= 0)


def _shapes_now(images, rows: pa.Table, at: np.ndarray,
                fits: Callable[[int, list], bool]) -> tuple[pa.Table, np.ndarray]:
    """The carried rows with the img_shapes `images` gives their samples now, as a fresh encode stores them (the
    text encoder does not read the target, so a new target size carries its rows forward); a row whose shapes
    changed is kept only if its stored prompt `length` still `fits` next to them (the others are encoded again
    and rejected as a fresh encode rejects them, e.g. "caption too long"; a row without a length is encoded
    again). Compared in numpy, `fits` asked once per distinct (length, shapes): not a Python call per row."""
    if "img_shapes" not in rows.column_names or not rows.num_rows:
        return rows, at
    now = images.column("img_shapes").take(pa.array(at)) if images.has_column("img_shapes") else \
        pa.array([[list(s) for s in images.img_shapes_at(int(i))] for i in at])  # schema v1: derived
    stored, wanted = _padded_shapes(rows.column("img_shapes")), _padded_shapes(now)
    width = max(stored.shape[1], wanted.shape[1])
    stored, wanted = (np.pad(a, ((0, 0), (0, width - a.shape[1]))) for a in (stored, wanted))
    changed = (stored != wanted).any(axis=1)
    if changed.any():
        stored_length = rows.column("length") if "length" in rows.column_names else None
        lengths = np.full(rows.num_rows, -1, np.int64) if stored_length is None or \
            not pa.types.is_integer(stored_length.type) else \
            stored_length.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
        distinct, which = np.unique(np.column_stack([lengths[changed], wanted[changed]]), axis=0, return_inverse=True)
        ok = np.array([n >= 0 and fits(int(n), _shapes_of(row)) for n, *row in distinct.tolist()], bool)
        keep = ~changed
        keep[changed] = ok[which.reshape(-1)]
        if not keep.all():
            rows, at, now = rows.filter(pa.array(keep)), at[keep], now.filter(pa.array(keep))
    i = rows.schema.get_field_index("img_shapes")
    return rows.set_column(i, rows.schema.field(i), now.cast(rows.schema.field(i).type)), at


def _padded_shapes(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Each row's img_shapes as one int64 row: the number of entries, then each [frames, h, w], zeros after."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    counts = pc.list_value_length(column).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    values = pc.list_flatten(pc.list_flatten(column)).to_numpy(zero_copy_only=False).astype(np.int64).reshape(-1, 3)
    out = np.zeros((len(counts), 1 + 3 * int(counts.max(initial=0))), np.int64)
    out[:, 0] = counts
    row = np.repeat(np.arange(len(counts)), counts)
    entry = np.arange(len(values)) - np.repeat(np.cumsum(counts) - counts, counts)
    for j in range(3):
        out[row, 1 + 3 * entry + j] = values[:, j]
    return out


def _shapes_of(padded: list[int]) -> list[list[int]]:
    """The img_shapes of one `_padded_shapes` row."""
    return [padded[1 + 3 * e : 4 + 3 * e] for e in range(padded[0])]


def _split_now(images, rows: pa.Table, at: np.ndarray) -> pa.Table:
    """The carried rows with the split `images` gives their samples now (a relabelled split carries the same
    features); "train" where `images` records none."""
    if "split" not in rows.column_names:
        return rows
    i = rows.schema.get_field_index("split")
    field = rows.schema.field(i)
    split = images.column("split").take(pa.array(at)) if images.has_column("split") else \
        pa.array(["train"] * rows.num_rows, pa.string())
    return rows.set_column(i, field, split.cast(field.type))


def _completed_meanwhile(job: EncodeJob, several_caches: bool = False, refused: int | None = None) -> bool:
    """Another process finished this very table (same lineage) after our up-to-date check, while we loaded
    the model: reuse it ("up to date") instead of writing a duplicate version. `refused`: the store URL's version
    the ranks refused together (nodes.writer_place), which this cache now holds to carry from: never that one (its
    rows may be on the remote alone)."""
    assert job.writer is not None
    from stages.encode.current import serving_version

    found = job.store.find_version(job.summary.table, job.lineage, job.serving)
    # one that left damaged inputs out, and this run stops on them, is not adopted either (as in plan.open_job)
    found = serving_version(job.store, job.summary.stage, job.summary.table, None if found == refused else found,
                            job.on_damaged, remote_rows=job.ranks.rank == 0)
    found = agreed_found(found, job.ranks.world_size, several_caches)
    if found is None:
        return False
    mine, job.writer = job.writer, None
    from models.collective import together

    # agreed as at the start (plan.open_job): a rank that cannot make the newest version any rank saw current (its
    # view of a shared folder lags), or rank 0 failing to remove its empty version, stops every rank with its line,
    # not itself alone while the others go on to wait for it
    with together(job.ranks.world_size, f"{job.summary.stage}: reusing table '{job.summary.table}' v{found}"):
        if job.ranks.rank == 0 and not any(mine.dir.glob("shard-*")):  # the empty folder this run just created
            # removed while its lock is held: deleted after, a writer of these settings opening in between (another
            # launch) resumed it and lost it under its feet
            from store.writer_commit import discard_version

            discard_version(mine)
        else:
            mine.close()
        adopt(job, found)
    return True


def _adopt_committed(job: EncodeJob, url: str, version: int, rows: int, schema: TableSchema,
                     over: int | None = None) -> None:
    """The remote holds `version` of this very schema complete, not current: its commit's store.json swap was lost
    (a lost connection, a kill right after the manifest) or went to another writer's version, or another run's
    settings replaced it since. Rank 0 redoes only the swap, over `over` (the current version it saw: a local
    store's rerun makes the version of its settings current too, `adopt`), "up to date" (encoding it all again into
    the next number took hours at 1M samples), and each node drops its part of it from its cache."""
    from models.collective import together
    from store.remote import open_remote, remote_errors
    from store.remote_parts import drop_part, make_current

    table = job.summary.table
    with together(job.ranks.world_size, f"{job.summary.stage}: making table '{table}' v{version} current at {url}"):
        if job.ranks.rank == 0:
            with remote_errors(url, f"making table '{table}' v{version} current"):
                current = make_current(open_remote(url), table, version, over)
            job.summary.newer_current = current if current != version else None  # another writer's stays current
        drop_part(job.store.root, table, version, schema.to_dict())
    job.summary.version, job.summary.up_to_date, job.summary.skipped = version, True, rows
    job.summary.committed_to = url


def agreed_found(found: int | None, world: int, several_caches: bool) -> int | None:
    """The version every rank adopts, from what each one's look found (None: encode). Agreed by all ranks:
    another launch's commit can land between two ranks' looks, and a rank that adopts while the others encode
    leaves them waiting at the commit. Ranks sharing one store folder adopt the newest any of them saw (only
    complete versions are found). Ranks on several caches of a store URL adopt only a version every cache
    holds; otherwise all of them encode (a duplicate version: wasted work, nothing wrong)."""
    from models.collective import spread

    ((newest, oldest),) = spread(world, [-1 if found is None else found])
    if newest < 0 or (several_caches and newest != oldest):
        return None
    return newest


def _with_settings(job: EncodeJob, schema: TableSchema) -> TableSchema:
    """`schema` with the settings and the model's files recorded (`attrs.settings`, `attrs.model_files`: a later
    run with others names what differs, `plan._say_why_new`, as train's refusal of another model does), unless an
    in-progress version of the table has this schema with another record of them or none - begun by a release
    that did not record them, or `store repair`'s copy of the version it repairs: the writer resumes only an exact
    schema, so that version's records (or their absence) are taken and it is resumed."""
    from schemas.model_files import MODEL_FILES_ATTR, files_record
    from stages.encode.settings import SETTINGS_ATTR
    from store import format as fmt

    def without(d: dict[str, Any]) -> dict[str, Any]:
        return {**d, "attrs": {k: v for k, v in (d.get("attrs") or {}).items()
                               if k not in (SETTINGS_ATTR, MODEL_FILES_ATTR, PART_LINEAGES_ATTR)}}

    want = without(schema.to_dict())
    store, table = job.store, job.summary.table
    for v in reversed(store.versions(table)):
        vdir = store.version_dir(table, v)
        if fmt.is_complete(vdir) or not (vdir / fmt.SCHEMA_JSON).is_file():
            continue
        try:
            begun = fmt.read_json(vdir / fmt.SCHEMA_JSON, "schema.json")
        except UserError:
            continue
        if isinstance(begun, dict) and without(begun) == want:
            return TableSchema.from_dict(begun)
    return replace(schema, attrs={**schema.attrs, SETTINGS_ATTR: job.settings,
                                  MODEL_FILES_ATTR: files_record(job.model_files)})


def adopt(job: EncodeJob, found: int) -> None:
    """Reuse the complete version `found` of this lineage: make it current (a run killed after its manifest,
    before the store.json switch, left it not current, or another run's settings replaced it since) and report the
    table up to date. In a store URL's cache, a copy of the remote's version is made current there too, over the
    current one the cache was opened with (the push after it never moves the remote's current back)."""
    from store.remote_parts import adopt_version

    # rank 0 alone swaps the remote's store.json; another writer's newer current stays, and the summary says so
    job.summary.newer_current = adopt_version(job.store, job.summary.table, found, on_remote=job.ranks.rank == 0)
    job.summary.version, job.summary.up_to_date = found, True
    with job.store.reader(job.summary.table, found) as done:
        job.summary.skipped = len(done)


def rank_shard_sizes(job: EncodeJob) -> dict[str, int]:
    assert job.writer is not None
    from store.format import shard_prefix

    return {p.name: p.stat().st_size for p in Path(job.writer.dir).glob(f"{shard_prefix(job.ranks.rank)}*.tar")
            if p.name not in job.writer.linked_shards}  # carried shards are not written bytes
