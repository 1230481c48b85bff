"""encode-vae: carry a sample's latents from an earlier vae row whose VAE inputs are the same pictures although
its key differs (a recaption: the key hashes the caption, which the VAE never reads). Without this a recaptioning
pass re-encoded every latent (hours of GPU at 1M samples for identical tensors).

Same pictures: an earlier vae row of a feature lineage carried by key (the render settings the VAE reads, the VAE
files, the code: `store.reuse.reusable`, fixes included), whose key an `images` version gives the same
`source_hashes` (sha256 of the target and control source bytes: a function of the key) as the sample has now,
and whose stored `mask_sha256` and `img_shapes` (the rendered sizes) equal the sample's now. Under the same
render settings the same source bytes render the same pixels; the latents are copied under the new key from
their checked bytes (never a link: a shard's entries are named by key)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from schemas.errors import UserError

if TYPE_CHECKING:
    from stages.encode.job import EncodeJob

IMAGES_TABLE = "images"


def _norm(value: Any) -> str | None:
    """A json column's value as one comparable string (stored as JSON text or as nested lists); None: unknown."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return json.dumps(value, sort_keys=True)


def _column(images, name: str, at: list[int]) -> list[Any]:
    if not images.has_column(name):
        return [None] * len(at)
    return images.column(name).take(pa.array(at, pa.int64())).to_pylist()


def _rows_holding(manifest: pa.Table, raw: list[Any]) -> pa.Table:
    """The rows of `manifest` whose `source_hashes` cell is one of `raw` as stored (the cells of the samples now):
    one vectorised test before the per-row JSON compare, which at 1M rows and several versions was a walk of
    seconds per version on every rank whenever any sample was left to encode (a few new samples). A version that
    stores the column as another type is compared row by row; one whose cells are spelled otherwise is not
    matched (its samples are encoded again: never a wrong carry)."""
    import pyarrow.compute as pc

    column = manifest.column("source_hashes")
    try:
        values = pa.array([v for v in raw if v is not None], type=column.type)
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):  # is_in has no list kernel
            column, values = pc.binary_join(column, "|"), pc.binary_join(values, "|")  # hex digests hold no "|"
        return manifest.filter(pc.fill_null(pc.is_in(column, value_set=values), False))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return manifest


def _any_version(store, table: str, lineages: tuple[str, ...]) -> bool:
    """A complete version of `table` of one of these feature lineages (schema.json alone): else no `images`
    manifest is read (a first encode, or new render settings). Unchecked: a gate only (a damaged schema's yes
    costs a manifest read, its no an encode); `reusable` checks each version before a latent is carried."""
    from store import format as fmt
    from store.manifest_files import read_schema
    from store.reuse import same_features

    for v in store.versions(table):
        vdir = store.version_dir(table, v)
        try:
            if fmt.is_complete(vdir) and same_features(read_schema(vdir).attrs, lineages):
                return True
        except UserError:
            continue
    return False


# (source_hashes, has_mask, mask hash, img_shapes) -> the (key, split) now wanting latents of those pictures
Wanted = dict[tuple[str, bool, str, str], list[tuple[str, str]]]


def carry_same_inputs(job: EncodeJob, todo: list[str]) -> set[str]:
    """Copy into the writer, under each key of `todo` (keys not carried by key), the latents of an earlier row with
    the same VAE inputs; returns the keys so carried."""
    from store.reuse import reusable

    images, store = job.images, job.store
    lineages = (job.feature_lineage, *job.earlier_lineages)
    if not todo or not images.has_column("source_hashes") or not _any_version(store, job.summary.table, lineages):
        return set()
    wanted, raw_hashes = _wanted(images, todo)
    if not wanted:
        return set()
    sources = _earlier_keys(store, set(todo), raw_hashes, {w[0] for w in wanted})
    if not sources:
        return set()
    found = reusable(store, job.summary.table, lineages, sources, changed=job.changed_by_fixes)
    carried: set[str] = set()
    for version, old in found.items():
        copies = []
        for row in old.to_pylist():
            mask, has = row.get("mask_sha256"), row.get("has_mask")
            if mask is None or has is None:  # a row stored before masks were compared: its mask is unknown
                continue
            copies += [(row, key, split) for key, split in
                       wanted.pop((sources[row["key"]], bool(has), mask, _norm(row.get("img_shapes"))), [])]
        if copies:
            carried |= _copy(job, version, copies)
    return carried


def _wanted(images, todo: list[str]) -> tuple[Wanted, list[Any]]:
    """The keys of `todo` by the VAE inputs `images` gives them now (`Wanted`; a value unknown - null: an older
    table - is never matched, "" is no mask), and their `source_hashes` cells as stored."""
    at = [int(i) for i in images.rows_of_keys(pa.array(todo, pa.string()))]
    keep = [(k, i) for k, i in zip(todo, at) if i >= 0]
    rows = [i for _, i in keep]
    raw_hashes = _column(images, "source_hashes", rows)
    hashes = [_norm(v) for v in raw_hashes]
    masks = _column(images, "mask_sha256", rows)
    has_masks = _column(images, "has_mask", rows)
    shapes = [_norm(v) for v in _column(images, "img_shapes", rows)]
    splits = _column(images, "split", rows)
    wanted: Wanted = {}
    for (key, _), h, has, m, s, split in zip(keep, hashes, has_masks, masks, shapes, splits):
        if None not in (h, has, m, s):
            wanted.setdefault((h, bool(has), m, s), []).append((key, split or "train"))
    return wanted, raw_hashes


def _earlier_keys(store, now: set[str], raw_hashes: list[Any], by_hashes: set[str]) -> dict[str, str]:
    """Earlier keys (not among `now`) whose source bytes are those pictures' (their `source_hashes`, one of
    `by_hashes`), as any complete `images` version holding them says -> that value."""
    from store import format as fmt
    from store.manifest_files import checked_manifest

    sources: dict[str, str] = {}
    for v in fmt.list_versions(store.root, IMAGES_TABLE):
        vdir = store.version_dir(IMAGES_TABLE, v)
        try:
            if not fmt.is_complete(vdir):
                continue
            m = checked_manifest(vdir, ["key", "source_hashes"], record=True)
        except UserError:  # damaged (recorded, as a reader's view does) or unreadable: its keys are not looked up
            continue
        if "source_hashes" not in m.column_names:
            continue
        m = _rows_holding(m, raw_hashes)
        for k, h in zip(m.column("key").to_pylist(), m.column("source_hashes").to_pylist()):
            if k not in now and k not in sources and (h := _norm(h)) in by_hashes:
                sources[k] = h
    return sources


def _copy(job: EncodeJob, version: int, copies: list[tuple[dict[str, Any], str, str]]) -> set[str]:
    """Each (stored row of `version`, key, split now) added under that key from the row's checked bytes (a damaged
    sample is not copied: encoded instead); returns the keys added."""
    from store.integrity import DamagedData
    from store.manifest import RESERVED_COLUMNS
    from store.reuse import source_reader

    writer, table = job.writer, job.summary.table
    added: set[str] = set()
    with source_reader(writer.store.root, table, version, f"carry latents of the same pictures into '{table}'",
                       "carry forward") as reader:
        for row, key, split in copies:
            try:
                s = reader.get(row["key"])
            except DamagedData:
                continue
            meta = {c: v for c, v in row.items() if c not in RESERVED_COLUMNS and c != "key" and v is not None}
            writer.add(key, tensors=s["tensors"], files=s["files"], meta={**meta, "split": split})
            added.add(key)
    return added
