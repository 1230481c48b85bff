"""resize.max_image_frames applied to the samples a rerun carries forward instead of rendering (render_loop.py), as
pixel_limit.py applies max_image_pixels: a carried sample is not decoded, so its frames are not counted. Its row
tells them: a picture of several frames is noted `first frame of N used` (features/decode.py). A limit below the
one a complete `images` version was rendered under reads that note of its rows, and a key one of them notes with
more frames than the limit is rendered, so rejected exactly as a fresh run rejects it (`image-too-large`).

Only the versions rendered under a higher limit than `limit` are read (the one their schema records; none recorded:
the default), so at the default, after none raised it, nothing: no row rendered before the limit existed holds a
picture of more than 10000 frames but a hostile file's (its sample stays until its version is rendered again).
A version rendered under a limit raised past the default is read at the default too: its rows may be past it.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from features.decode import MAX_FRAMES
from store import Store

TABLE = "images"
_NOTE = r"^first frame of (?P<frames>\d+) used$"


def frames_over(st: Store, limit: int, recorded: dict[int, dict[str, Any] | None]) -> set[str]:
    """The keys a complete `images` version rendered under a higher limit notes with more frames than `limit`.
    `recorded`: the settings each complete version records (recorded_resize.py)."""
    from schemas import UserError
    from store.manifest_files import checked_manifest

    over: set[str] = set()
    for v, resize in recorded.items():
        if _rendered_under(resize) <= limit:
            continue
        try:
            rows = checked_manifest(st.version_dir(TABLE, v), ["key", "conversions"])
        except UserError:  # damaged or unreadable: nothing is carried from it (store/reuse.py)
            continue
        if "conversions" in rows.column_names:
            over.update(rows.column("key").take(_rows_over(rows.column("conversions"), limit)).to_pylist())
    return over


def _rendered_under(resize: dict[str, Any] | None) -> float:
    """The resize.max_image_frames a complete version's schema records (none: the default; unreadable, None:
    unknown, so its rows are looked at)."""
    if resize is None:
        return float("inf")
    value = resize.get("max_image_frames")
    return value if isinstance(value, int) else MAX_FRAMES


def _rows_over(conversions: pa.ChunkedArray, limit: int) -> pa.Array:
    """The row numbers whose notes say more frames than `limit` (in Arrow: no Python object per row)."""
    notes = conversions.combine_chunks()
    # as text: a manifest whose every row has no note holds list<null> (no kernel matches a null array)
    flat, parents = pc.list_flatten(notes).cast(pa.string()), pc.list_parent_indices(notes)
    frames = pc.struct_field(pc.extract_regex(flat, _NOTE), "frames")  # null where a note is another
    return parents.filter(pc.fill_null(pc.greater(pc.cast(frames, pa.int64()), limit), False))
