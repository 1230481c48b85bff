"""What a rerun reads of a sample an earlier version rendered before carrying it forward instead of rendering it
(stage.py): its source pictures' headers, no pixel decoded, where the stored row cannot tell.

- a resize.max_image_pixels lowered since the row was checked (pixel_limit.py);
- resize-bucket revision 4 (stage.REVISION_4_FIX): a picture with one transparent colour (a PNG's tRNS on an RGB,
  L, 1 or 16-bit grey picture) is taken as alpha since; no stored column tells such a picture, so each row of an
  earlier revision (`colour_checked`) is carried only when none of its target and controls has one
  (features.decode.has_transparent_colour; a mask's is not read as alpha). A row with one is rendered again.

Such a sample is never carried unread (`unread_ok`): a folder or JSONL source reads its files, a webdataset or
parquet source its tar or file whole (known_sources.py, known_tars.py). Rendering every row of a revision-3 store
again cost what its first build cost (80-250 ms a sample); reading a header is the file read plus
~10-20 µs (a 1024x1024 PNG 12 µs, JPEG 21 µs; their decode alone 23 and 8 ms).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from features.decode import has_transparent_colour
from stages.resize.pixel_limit import PixelLimit


@dataclass
class HeaderChecks:
    limit: PixelLimit
    colour_checked: set[str] = field(default_factory=set)  # keys rendered before revision 4 (module doc)

    def unread_ok(self, key: str) -> bool:
        """May the sample be carried without reading its bytes?"""
        return key not in self.colour_checked and self.limit.unread_ok(key)

    def fits(self, key: str, rec: Any) -> bool:
        """May the read sample `rec` be carried (its headers say it renders as its row says)?"""
        if not self.limit.fits(key, rec):
            return False
        return key not in self.colour_checked or not any(has_transparent_colour(b) for b in (rec.target, *rec.controls))
