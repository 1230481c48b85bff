"""A rerun whose re-read of the files a read error kept out of the newest version fails again, nothing else changed:
no new version. The files a version left unread are read again by every rerun (its listing names them: stage.py,
first_read.settle_listing); when they fail as before, the lineage settled for the commit is a complete version's
own and the rows are that version's, so committing would only make a copy under a new number, which the encoders
take for new input (their lineage names the images version: each rerun a new `text` and `vae` version, every
sample carried, nothing encoded, for nothing). That version is
kept (made current, as an up-to-date run does) and the in-progress one removed instead. When the failure kept
fewer or other samples out (the same lineage: the listing cannot tell how far a file was read), or anything else
changed, the rows differ and a new version is committed as before."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from store import Store

TABLE = "images"
ROW = ("source", "mask_sha256")  # with the key, what a row is rendered from (rendering.py `_render`)


def same_version(st: Store, writer: Any) -> int | None:
    """The complete version of the writer's (settled) lineage holding exactly the keys the writer would commit
    (resumed, written and carried), each from the same source copy with the same mask, or None. With equal lineages
    (settings, source listing, the same files left unread) such a set is a row set: a key is the content of its
    target, controls and caption, the split follows from the key and the settings. Not for a version written through
    a store URL's parts (its ranks' parts live on the remote)."""
    from store.manifest_files import checked_manifest

    if getattr(writer, "remote_url", None) is not None:
        return None
    found = st.find_version(TABLE, writer.schema.lineage)
    if found is None or found == writer.version:
        return None
    # key -> the source copy each row is of, and its mask (not part of the key): equal keys are not enough, a
    # duplicate's other copy may hold a key now (a fault that moved within a file: its first copy read now, the later
    # one, with its own mask, kept before), and the listing names an unread file without its bytes (content.py)
    held = writer.columns_of(ROW)
    rows = checked_manifest(st.version_dir(TABLE, found), ["key", *ROW])
    if len(rows) != len(held) or not set(ROW) <= set(rows.column_names):
        return None
    return found if dict(zip(rows.column("key").to_pylist(), zip(*(rows.column(c).to_pylist() for c in ROW)))) \
        == held else None
