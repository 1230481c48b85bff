"""resize.max_image_pixels applied to the samples a rerun carries forward instead of rendering (render_loop.py).

The limit is checked while decoding; a carried sample is not decoded. A limit lowered since its rows were rendered
must still quarantine them as a fresh run does, and a limit raised must read nothing. So each version records the
limit all its rows were checked under (a version note, `NOTE`); a version without one (written before the note, or
on a store URL) counts as checked under the highest limit any complete version of the table records (its
schema.json checked against checksums.json; one that does not read makes that limit unknown: every such row is
checked). A key held by a version checked under a limit no higher than now's is within it. Any other is checked:
by its target's recorded size (`source_size`) when that is its only image, else by the image headers of its bytes
(the reader's `reread`).
One that is over the limit (or whose header cannot be read) is rendered, so rejected exactly as a fresh run
rejects it: `image-too-large` (`bad-mask` for a mask) naming the first such file.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, Iterable

from PIL import Image

if TYPE_CHECKING:
    from stages.resize.header_checks import Reader
    from store import Store

TABLE = "images"
NOTE = "pixel-limit"


@dataclass
class PixelLimit:
    limit: int
    # key -> (target pixels, has controls or a mask) of the keys last checked under a higher limit than `limit`
    recheck: dict[str, tuple[float, bool]] = field(default_factory=dict)

    def unread_ok(self, key: str) -> bool:
        """May the sample be carried without reading its bytes?"""
        got = self.recheck.get(key)
        return got is None or (got[0] <= self.limit and not got[1])

    def fits(self, key: str, pictures: Iterable[Reader]) -> bool:
        """Is every image of the sample (target, controls, mask: readers of their first bytes) within the limit?"""
        from stages.resize.header_checks import from_header

        return key not in self.recheck or all(from_header(r, picture_pixels, webp_pixels) <= self.limit
                                              for r in pictures)


def pixel_limit(st: Store, limit: int, recorded: dict[int, dict[str, Any] | None]) -> PixelLimit:
    """What to check of the rows the complete `images` versions hold, under `limit` (module doc). `recorded`: the
    settings each complete version records (recorded_resize.py)."""
    from schemas import UserError
    from schemas.config import ResizeConfig
    from store.manifest_files import checked_manifest
    from store.version_notes import read_note

    # a complete version whose schema.json does not read (None) is carried from by none (store/reuse.py), but the
    # versions without a note may hold rows carried from it, checked under a limit it no longer tells: unknown
    unknown = any(resize is None for resize in recorded.values())
    default = ResizeConfig().max_image_pixels
    limits = {v: _recorded_limit(resize, default) for v, resize in recorded.items() if resize is not None}
    # an unknown limit may be the highest: those versions' rows are all checked, never taken as within one a
    # damaged schema.json names
    highest = float("inf") if unknown else max(limits.values(), default=0)
    checked = {v: _note(read_note(st, TABLE, v, NOTE), highest) for v in limits}
    if all(bound <= limit for bound in checked.values()):
        return PixelLimit(limit)
    within: set[str] = set()
    above: list[int] = []
    for v, bound in checked.items():
        if bound > limit:
            above.append(v)
            continue
        try:
            within.update(checked_manifest(st.version_dir(TABLE, v), ["key"]).column("key").to_pylist())
        except UserError:
            continue
    recheck: dict[str, tuple[float, bool]] = {}
    for v in above:
        try:
            rows = checked_manifest(st.version_dir(TABLE, v), ["key", "source_size", "num_controls", "has_mask"])
        except UserError:
            continue
        cols = [rows.column(c).to_pylist() if c in rows.column_names else [None] * rows.num_rows
                for c in ("key", "source_size", "num_controls", "has_mask")]
        for key, size, n, mask in zip(*cols):
            if key not in within:
                recheck[key] = (_area(size), n != 0 or mask is not False)
    return PixelLimit(limit, recheck)


def _recorded_limit(resize: dict[str, Any], default: int) -> int:
    value = resize.get("max_image_pixels")
    return value if isinstance(value, int) else default


def _note(value: object, highest: float) -> float:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else highest


def _area(size: object) -> float:
    """Pixels of a recorded `source_size` [h, w]; unknown: infinite (read)."""
    if isinstance(size, list) and len(size) == 2 and all(isinstance(s, int) for s in size):
        return size[0] * size[1]
    return float("inf")


def webp_pixels(canvas: tuple[int, int]) -> float:
    """picture_pixels of a WebP of this canvas size (header_checks.webp_canvas): infinite where Pillow would not
    open it."""
    from stages.resize.header_checks import over_pillow_limit

    return float("inf") if over_pillow_limit(canvas) else canvas[0] * canvas[1]


def picture_pixels(fp: IO[bytes]) -> float:
    """width x height from the header alone; infinite where it cannot be read (the render judges it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            with Image.open(fp) as im:
                w, h = im.size
        except Exception:  # noqa: BLE001 - any header problem (an empty file too): rendered, which says what it is
            return float("inf")
    return w * h
