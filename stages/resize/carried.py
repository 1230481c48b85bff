"""The samples an earlier version rendered with this run's pixel settings, linked into the new version instead of
rendered again (their source and split this run's), and the refusal of a switch to the pictures split that such a
version, written without `source_hashes`, cannot follow."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from schemas import TableSchema, UserError
from schemas.config import ResizeConfig
from stages.resize.images_table import (TABLE, TRANSPARENCY_NOTED, fixed_since, pictures_before_fixes,
                                        pictures_other_alpha)
from stages.resize.split_rule import pictures_id, split_for
from stages.resize.summary import ResizeSummary

if TYPE_CHECKING:
    from store import Store


def carry_samples(st: Store, writer: Any, schema: TableSchema, now: tuple[str, ...], carry: dict[str, str],
                  summary: ResizeSummary, rc: ResizeConfig) -> None:
    """Link the shards of samples rendered before with the same settings; their source and split are this
    run's (a view of the same pixels: the split by this run's rule and val_fraction, from the recorded key and
    source_hashes)."""
    from store.reuse import carry_forward, reusable

    befores, other_alpha = pictures_before_fixes(schema), pictures_other_alpha(schema)
    changed = {**{h: fixed_since(r, by_rows=True) for r, h in befores},
               **dict.fromkeys(other_alpha, TRANSPARENCY_NOTED)}  # a picture with transparency: rendered again
    # the rows the source's headers settled (`TOLD_BY_SOURCE`) are in `carry` only where they said unchanged
    for version, rows in reusable(st, TABLE, (*now, *(h for _, h in befores), *other_alpha), carry,
                                  changed=changed or None).items():
        keys = rows.column("key").to_pylist()
        # a version written before source_hashes was recorded lacks them: split by key they are not needed
        hashes = rows.column("source_hashes").to_pylist() if "source_hashes" in rows.column_names else [None] * len(keys)
        if rc.split_by == "pictures" and None in hashes:  # the pictures' identity is those hashes: none to split by
            raise _without_hashes(st, version, hashes.count(None), "of the samples this run carries from it")
        splits = {k: split_for(k, None if h is None else pictures_id(h), rc.val_fraction, rc.split_by)
                  for k, h in zip(keys, hashes)}
        views = {"source": {k: carry[k] for k in keys}, "split": splits}
        summary.reused += carry_forward(writer, version, rows, views)  # counted in the summary from the version


def _without_hashes(st: Store, version: int, samples: int, which: str) -> UserError:
    return UserError(
        f"table 'images' v{version} ({st.version_dir(TABLE, version)}) was written by a release that did not record "
        f"source_hashes ({samples} {which}), which the pictures split (resize.split_by: pictures) reads: keep the "
        "key split (--set resize.split_by=key) or render the source into a new store")


def refuse_a_switch_without_hashes(st: Store, rc: ResizeConfig, schema: TableSchema, now: tuple[str, ...]) -> None:
    """A switch to the pictures split of a store whose current version records no source_hashes (an older
    release's) and whose samples this run would carry (the same pixels' settings, under either spelling of their
    lineage, `now`: `pictures_now`, or before this revision's fixes): refused before any sample is rendered, not
    after (`carry_samples` checks every version it carries from). One column of the manifest read, on a switch
    only. A switch that renders every sample anew (other pixels' settings) needs none."""
    from stages.resize.split_rule import recorded_rule
    from store.manifest_files import checked_manifest, checked_schema
    from store.reuse import same_features

    current = st.tables().get(TABLE)
    if rc.split_by != "pictures" or current is None:
        return
    vdir = st.version_dir(TABLE, current)
    try:  # checked: a flipped bit that still parses is no old release's version to refuse the switch for
        attrs = checked_schema(vdir).attrs
        befores = [h for _, h in pictures_before_fixes(schema)] + list(pictures_other_alpha(schema))
        if recorded_rule(attrs) == "pictures" or not same_features(attrs, (*now, *befores)):
            return
        rows = checked_manifest(vdir, ["source_hashes"])
    except (UserError, OSError):  # damaged (recorded: nothing is carried from it) or unreadable: said where read
        return
    missing = rows.column("source_hashes").null_count if "source_hashes" in rows.column_names else rows.num_rows
    if missing:
        raise _without_hashes(st, current, missing, "of its samples")
