"""resize.max_image_frames applied to the samples a rerun carries forward instead of rendering (stage.py), as
pixel_limit.py applies max_image_pixels: a carried sample is not decoded, so its frames are not counted. Its row
tells them: a picture of several frames is noted `first frame of N used` (features/decode.py). A limit set below
the default (`MAX_FRAMES`) reads that note of every complete `images` version, and a key one of them notes with
more frames than the limit is rendered, so rejected exactly as a fresh run rejects it (`image-too-large`).

At the default nothing is read: no row rendered before the limit existed holds a picture of more than 10000 frames
but a hostile file's (its sample stays until its version is rendered again), and rows rendered since are within it.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from features.decode import MAX_FRAMES
from store import Store

TABLE = "images"
_NOTE = r"^first frame of (?P<frames>\d+) used$"


def frames_over(st: Store, limit: int) -> set[str]:
    """The keys a complete `images` version notes with more frames than `limit` (none read at the default)."""
    from schemas import UserError
    from store import format as fmt
    from store.manifest_files import checked_manifest

    if limit >= MAX_FRAMES:
        return set()
    over: set[str] = set()
    for v in st.versions(TABLE):
        vdir = st.version_dir(TABLE, v)
        try:
            if not fmt.is_complete(vdir):
                continue
            rows = checked_manifest(vdir, ["key", "conversions"])
        except UserError:  # damaged or unreadable: nothing is carried from it (store/reuse.py)
            continue
        if "conversions" in rows.column_names:
            over.update(rows.column("key").take(_rows_over(rows.column("conversions"), limit)).to_pylist())
    return over


def _rows_over(conversions: pa.ChunkedArray, limit: int) -> pa.Array:
    """The row numbers whose notes say more frames than `limit` (in Arrow: no Python object per row)."""
    notes = conversions.combine_chunks()
    flat, parents = pc.list_flatten(notes), pc.list_parent_indices(notes)
    frames = pc.struct_field(pc.extract_regex(flat, _NOTE), "frames")  # null where a note is another
    return parents.filter(pc.fill_null(pc.greater(pc.cast(frames, pa.int64()), limit), False))
