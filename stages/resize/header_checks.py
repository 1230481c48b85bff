"""What a rerun reads of a sample an earlier version rendered before carrying it forward instead of rendering it
(render_loop.py): its source pictures' headers, no pixel decoded, where the stored row cannot tell.

- a resize.max_image_pixels lowered since the row was checked (pixel_limit.py); a resize.max_image_frames below
  a frame count its row notes (frame_limit.py: such a key is rendered, never carried);
- resize-bucket revision 4 (images_table.REVISION_4_FIX): a picture with one transparent colour (a PNG's tRNS on an RGB,
  L, 1 or 16-bit grey picture) is taken as alpha since; no stored column tells such a picture, so each row of an
  earlier revision (`colour_checked`) is carried only when none of its target and controls has one
  (features.decode.has_transparent_colour; a mask's is not read as alpha). A row with one is rendered again.

A sample whose files are unchanged (known_sources.py, known_tars.py) is checked from the first bytes of each picture
(`Heads`: a folder or JSONL source's files, a carried local tar's members by their offsets), FIRST_READ at first and
4x more while the header goes on past them (`from_header`): a PNG's chunks before its image data, a JPEG's markers
up to its first scan; a WebP (which Pillow reads whole to open) its RIFF header's first chunk (`webp_canvas`).
Before, each picture was read whole for its header: a revision-3 store of 1M samples of ~1.5 MB pictures read
terabytes. Only a sample the check selects is read whole (to render it). A parquet source's cells have no prefix to
read (its pages are compressed whole): a row to check is read from its row group's mapped columns
(parquet_source._RowGroups, the group kept for the rows after it); before, its file was read whole. Rendering every
row of a revision-3 store again cost what its first build cost (80-250 ms a sample); reading a header is ~10-20 µs
more than its read (a 1024x1024 PNG 12 µs, JPEG 21 µs).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from functools import lru_cache
from typing import IO, Any, Callable, TypeVar

from features.decode import has_transparent_colour
from stages.resize.pixel_limit import PixelLimit

T = TypeVar("T")
# a PNG's IHDR, an ICC profile and tRNS, a JPEG's EXIF and ICC segments mostly fit: one read a picture
FIRST_READ = 64 * 1024
Reader = Callable[[int], bytes]  # a picture's first n bytes (fewer: the whole file)


class _PastPrefix(BaseException):
    """A header parse asked for bytes past those read. A BaseException: Pillow's plugins and the checks' own
    `except Exception` would take it for a damaged header and answer from the cut bytes."""


class _Prefix(io.BytesIO):
    """A file's first bytes: reading (or seeking from the end) past them raises _PastPrefix, unless they are all."""

    def __init__(self, data: bytes, whole: bool) -> None:
        super().__init__(data)
        self._size, self._whole = len(data), whole

    def _wants(self, n: int | None) -> None:
        if not self._whole and (n is None or n < 0 or self.tell() + n > self._size):
            raise _PastPrefix

    def read(self, n: int | None = -1) -> bytes:
        self._wants(n)
        return super().read(n)

    def read1(self, n: int = -1) -> bytes:
        self._wants(n)
        return super().read1(n)

    def readinto(self, b: Any) -> int:
        self._wants(len(b))
        return super().readinto(b)

    def readline(self, n: int | None = -1) -> bytes:
        line = super().readline(n)
        if not self._whole and not line.endswith(b"\n") and (n is None or n < 0 or len(line) < n):
            raise _PastPrefix
        return line

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence == 2 and not self._whole:
            raise _PastPrefix
        return super().seek(pos, whence)


def from_header(read_first: Reader, judge: Callable[[IO[bytes]], T],
                webp: Callable[[tuple[int, int]], T] | None = None) -> T:
    """`judge` of a picture file given its first bytes: the answer it gives of the whole file, from FIRST_READ
    bytes, 4x more each time the parse goes on past them. `webp`: its answer for a WebP from the canvas size its
    first bytes name (`webp_canvas`): Pillow reads a WebP whole to open it, so `judge` would read it all."""
    n = FIRST_READ
    data = read_first(n + 1)  # one byte more tells whether these are all
    if webp is not None and (canvas := webp_canvas(data)) is not None:
        return webp(canvas)
    while True:
        try:
            return judge(_Prefix(data[:n], whole=len(data) <= n))
        except _PastPrefix:
            n *= 4
            data = read_first(n + 1)


def webp_canvas(head: bytes) -> tuple[int, int] | None:
    """A WebP's (width, height) from its first 30 bytes, as Pillow's decoder gives its size: the RIFF header, then
    the first chunk, a VP8X's canvas size or a simple file's VP8 (lossy) or VP8L (lossless) frame header. None for
    any other file, a header that does not read so, or a Pillow without WebP support (it opens none)."""
    if len(head) < 30 or head[:4] != b"RIFF" or head[8:12] != b"WEBP" or not _webp_supported():
        return None
    chunk, size = head[12:16], None
    if chunk == b"VP8X":
        size = int.from_bytes(head[24:27], "little") + 1, int.from_bytes(head[27:30], "little") + 1
    elif chunk == b"VP8 " and head[23:26] == b"\x9d\x01\x2a":  # a key frame's start code
        size = int.from_bytes(head[26:28], "little") & 0x3FFF, int.from_bytes(head[28:30], "little") & 0x3FFF
    elif chunk == b"VP8L" and head[20] == 0x2F:  # the lossless signature
        bits = int.from_bytes(head[21:25], "little")
        size = (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    return size if size is not None and min(size) > 0 else None  # a zero side: the decoder's to refuse


@lru_cache(maxsize=None)
def _webp_supported() -> bool:
    from PIL import features

    return bool(features.check("webp"))


def over_pillow_limit(canvas: tuple[int, int]) -> bool:
    """Would Pillow refuse to open a picture of this size (over 2 x Image.MAX_IMAGE_PIXELS, its hard bomb limit)?"""
    from PIL import Image

    return Image.MAX_IMAGE_PIXELS is not None and canvas[0] * canvas[1] > 2 * Image.MAX_IMAGE_PIXELS


def webp_keyed(canvas: tuple[int, int]) -> bool:
    """has_transparent_colour of a WebP of this size: no WebP names one transparent colour (its alpha is a
    channel); True where Pillow would not open it, as for any header that does not read."""
    return over_pillow_limit(canvas)


def whole(data: bytes | None) -> Reader:
    """The reader of bytes read whole (a sample read anyway)."""
    return lambda n: (data or b"")[:n]


@dataclass(frozen=True)
class Heads:
    """A sample's pictures, each as a reader of its first bytes."""

    target: Reader
    controls: tuple[Reader, ...]
    mask: Reader | None


def heads_of(rec: Any) -> Heads:
    """The pictures of a sample read whole."""
    return Heads(whole(rec.target), tuple(whole(c) for c in rec.controls), None if rec.mask is None else whole(rec.mask))


@dataclass
class HeaderChecks:
    limit: PixelLimit
    colour_checked: set[str] = field(default_factory=set)  # keys rendered before revision 4 (module doc)
    # keys whose row notes more frames than resize.max_image_frames (frame_limit.py): rendered, never carried
    frames_over: set[str] = field(default_factory=set)

    def unread_ok(self, key: str, heads: Callable[[], Heads | None] | None = None) -> bool:
        """May the sample be carried without reading its bytes whole? `heads`: its pictures' first bytes, to
        check them from where the row cannot tell (None, or giving None: they cannot be read so)."""
        if key in self.frames_over:
            return False
        if key not in self.colour_checked and self.limit.unread_ok(key):
            return True
        try:
            got = heads() if heads is not None else None
            return got is not None and self.heads_fit(key, got)
        except OSError:  # read whole instead, which names the error
            return False

    def fits(self, key: str, rec: Any) -> bool:
        """May the read sample `rec` be carried (its headers say it renders as its row says)?"""
        return self.heads_fit(key, heads_of(rec))

    def heads_fit(self, key: str, heads: Heads) -> bool:
        if key in self.frames_over:
            return False
        if not self.limit.fits(key, (heads.target, *heads.controls, *([heads.mask] if heads.mask else []))):
            return False
        return key not in self.colour_checked or \
            not any(from_header(r, has_transparent_colour, webp_keyed) for r in (heads.target, *heads.controls))
