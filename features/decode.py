"""Decode and sanitise one image: bytes in, an 8-bit RGB (RGBA kept for Qwen-Image-2.1, L for masks) PIL image
out, or a rejection. The one decoder of users' image files: resize-bucket's sources, predict's controls and
evaluate's extra prompts (so a picture is shown to a trained LoRA as training showed its pictures).

What is done (see docs/resize-bucket.md for the table):
- only PNG, JPEG, WebP, TIFF, BMP and GIF are opened (no plugin that shells out, e.g. EPS);
- 0-byte, unidentifiable, truncated or otherwise undecodable data -> `ImageRejected` with the reason;
- width x height over `max_pixels` is rejected from the header alone, before any pixel is decoded
  (decompression bombs); Pillow's own hard bomb limit (2 x `Image.MAX_IMAGE_PIXELS`, ~179 Mpx) is caught the same
  way, and raised to `max_pixels` where that is higher (`_pillow_opens`): the limit set decides;
- EXIF orientation is applied (the pixels are rotated/flipped as a viewer shows them);
- animated/multi-page files: the first frame;
- modes to RGB: L/1 replicated; P via its palette; alpha (RGBA, LA, PA, P with transparency) composited over
  white; so is an RGB, L, 1 or 16-bit grey picture with one transparent colour (a PNG's tRNS chunk, which PNG
  optimizers write for an RGBA picture whose transparent pixels share one colour): that colour is its alpha; CMYK through its embedded ICC profile to sRGB when it has one, else Pillow's plain conversion;
  YCbCr/LAB/HSV by Pillow; 16-bit grayscale (I;16*, and I with values in 0..65535) scaled 65535 -> 255 with
  rounding (Pillow's own convert would clip); 16-bit RGB(A) is read by Pillow as 8-bit (each channel's high
  byte), noted as the other conversions; 32-bit float (F) and anything else is rejected as unsupported.
- `resize.keep_alpha` (Qwen-Image-2.1, `decode_keeping_alpha`): a picture with transparency (a transparent
  colour too) stays RGBA (its VAE
  reads four channels; its pipeline composites over white only the copy the VLM sees);
- masks: the same decoding, then to L (white = edited); alpha is composited over black so that transparent
  means "not edited" (a mask's transparent colour is not read as alpha: `decode_mask` is unchanged).
"""

from __future__ import annotations

import io
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np
from PIL import Image, ImageCms, ImageOps, PngImagePlugin, UnidentifiedImageError

from features.pictures import flattened
from schemas.errors import UserError
from schemas.fixes import TRANSPARENT_COLOUR

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "TIFF", "BMP", "GIF")
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N", "I")
_ALPHA = ("RGBA", "LA", "La", "RGBa", "PA")
_COLOUR_KEYED = ("RGB", "L", "1", *_SIXTEEN_BIT)  # the modes whose one transparent colour is taken as alpha
# resize.max_image_frames' default: animated GIFs run to a few thousand frames, scanned TIFFs to hundreds of pages
MAX_FRAMES = 10_000


class ImageRejected(Exception):
    """The image cannot be used: `kind` is the quarantine reason category, `str(e)` says what exactly."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class Decoded:
    image: Image.Image
    notes: list[str] = field(default_factory=list)  # conversions applied, counted in the stage summary
    orientation: int = 1  # the EXIF orientation applied (1: none)


def decode_image(data: bytes, max_pixels: int, max_frames: int = MAX_FRAMES) -> Decoded:
    """Bytes -> 8-bit RGB image with EXIF orientation applied; raises ImageRejected."""
    return as_rgb(*_open_oriented(data, max_pixels, max_frames))


def as_rgb(im: Image.Image, notes: list[str], orientation: int) -> Decoded:
    """An opened, oriented picture as 8-bit RGB, transparency over white (decode_image's last step)."""
    if (keyed := _colour_keyed(im)) is not None:
        return Decoded(flattened(keyed, (255, 255, 255)),
                       notes + [f"{im.mode} {TRANSPARENT_COLOUR}, composited over white"], orientation)
    rgb, note = _to_rgb(im, background=(255, 255, 255))
    return Decoded(rgb, notes + ([note] if note else []), orientation)


def decode_keeping_alpha(data: bytes, max_pixels: int, max_frames: int = MAX_FRAMES) -> Decoded:
    """Bytes -> RGBA when the image has an alpha channel or a transparent palette entry, else what `decode_image`
    gives, from the one decode (a second `decode_image` decoded every opaque image twice)."""
    im, notes, orientation = _open_oriented(data, max_pixels, max_frames)
    if im.mode in _ALPHA or (im.mode == "P" and "transparency" in im.info):
        return Decoded(im.convert("RGBA"), notes + [f"{im.mode} kept with its alpha (RGBA)"], orientation)
    if (keyed := _colour_keyed(im)) is not None:
        return Decoded(keyed, notes + [f"{im.mode} {TRANSPARENT_COLOUR}, kept with its alpha (RGBA)"], orientation)
    return as_rgb(im, notes, orientation)


def read_image_file(path: str | Path, keep_alpha: bool = False, what: str = "image",
                    max_pixels: int | None = None) -> Image.Image:
    """A user's image file (predict's controls, evaluate's extra prompts) decoded as resize-bucket decodes the
    training pictures; one line naming the file when it cannot be used. `max_pixels`: resize-bucket's default."""
    from schemas.config import ResizeConfig

    max_pixels = max_pixels or ResizeConfig().max_image_pixels
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise UserError(f"cannot read {what} {path}: {e.strerror or e}; check the path") from None
    try:
        return (decode_keeping_alpha if keep_alpha else decode_image)(data, max_pixels).image
    except ImageRejected as e:
        raise UserError(f"cannot use {what} {path}: {e}; pass a PNG, JPEG or WebP picture") from None


def decode_mask(data: bytes, max_pixels: int, max_frames: int = MAX_FRAMES) -> Decoded:
    """Bytes -> 8-bit L mask (white = edited) with EXIF orientation applied; raises ImageRejected."""
    im, notes, orientation = _open_oriented(data, max_pixels, max_frames)
    if im.mode in ("1", "L"):
        return Decoded(im.convert("L"), notes, orientation)
    if im.mode in _SIXTEEN_BIT:
        return Decoded(_sixteen_to_l(im), notes + ["16-bit mask scaled to 8 bits"], orientation)
    rgb, _ = _to_rgb(im, background=(0, 0, 0))
    return Decoded(rgb.convert("L"), notes + [f"{im.mode} mask converted to grayscale"], orientation)


def oriented_as(image: Image.Image, orientation: int) -> Image.Image:
    """`image` rotated/flipped as EXIF `orientation` says (Pillow's own table, via `exif_transpose`)."""
    im = image.copy()
    im.getexif()[0x0112] = orientation  # exif_transpose reads the tag from this (cached) Exif object
    return ImageOps.exif_transpose(im)


def is_picture(data: bytes | None) -> bool:
    """Whether `data` starts as a picture this module opens (one of ALLOWED_FORMATS, told by Pillow from the
    header alone; no pixel decoded): an image column's bytes rather than other binary (e.g. embeddings)."""
    if not data:
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS):
                return True
        except Image.DecompressionBombError:  # a picture, a large one
            return True
        except Exception:  # noqa: BLE001 - no header Pillow reads as a picture
            return False


def _open_oriented(data: bytes, max_pixels: int, max_frames: int) -> tuple[Image.Image, list[str], int]:
    if not data:
        raise ImageRejected("empty-image", "empty file (0 bytes)")
    notes: list[str] = []
    _pillow_opens(max_pixels)
    with warnings.catch_warnings():
        # our own limit (below) decides; Pillow's warning between its two limits is noise here
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            im = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
        except Image.DecompressionBombError as e:
            raise ImageRejected("image-too-large", _over_pillows_limit(e, max_pixels)) from None
        except UnidentifiedImageError:
            raise ImageRejected("unreadable-image", f"not a readable image (formats accepted: {', '.join(ALLOWED_FORMATS)})") from None
        except Exception as e:  # noqa: BLE001 - any header parse failure is a property of the input
            raise _text_chunks_too_large(e) or ImageRejected("unreadable-image", f"cannot read image header: {e}") \
                from None
        w, h = im.size
        if w <= 0 or h <= 0:
            raise ImageRejected("unreadable-image", f"image has no pixels ({w}x{h})")
        if w * h > max_pixels:
            raise ImageRejected(
                "image-too-large",
                f"image is {w}x{h} = {w * h} pixels, over resize.max_image_pixels = {max_pixels} (decompression bomb guard)"
            )
        deep = _sixteen_bit_read_as_eight(im)  # from the tile, which load() empties
        key = _header_colour_key(im)  # from the header and the tile, which load() empties
        try:
            # counting frames walks every frame's header: a file cut in its second frame fails here (IndexError,
            # TypeError...), not in load(), which reads the first frame only
            frames = _frame_count(im, max_frames)
            if im.format == "PNG":
                _check_png_chunks(data, im)
            named_before_load = _orientation_before_load(im)  # load() may turn the pixels and drop the tag
            im.load()
        except Exception as e:  # noqa: BLE001 - truncated/corrupt data raise OSError, ValueError, SyntaxError...
            raise _text_chunks_too_large(e) or ImageRejected("corrupt-image", f"truncated or corrupt image data: {e}") \
                from None
        if frames > max_frames:
            raise ImageRejected(
                "image-too-large", f"{im.format} of more than {max_frames} frames (pages), over "
                f"resize.max_image_frames = {max_frames} (counting them walks every frame); raise it to keep such files")
    if im.mode in _COLOUR_KEYED:
        # the header's: a tRNS after the image data (out of place: libpng ignores it), which load() reads, is
        # ignored, as before revision 4, so that the header alone tells a transparent colour (a rerun carries a
        # sample on it)
        if key is None:
            im.info.pop("transparency", None)
        else:
            im.info["transparency"] = key
    if deep:
        notes.append(deep)
    if frames > 1:
        notes.append(f"first frame of {frames} used")
    im, applied = _oriented(im, notes, named_before_load)
    return im, notes, applied


def _text_chunks_too_large(e: Exception) -> ImageRejected | None:
    """A PNG whose metadata is past Pillow's guards against decompression bombs - a compressed chunk (zTXt / iTXt
    text, an iCCP colour profile) over 1 MB decompressed, or over 64 MB of text in all - which refuse the file with
    their constant's name only ("Decompressed data too large for PngImagePlugin.MAX_TEXT_CHUNK"): what it is and
    what to do, as `unreadable-image` (before or after its pixel data alike: the pixels are not what is wrong).
    None for any other error."""
    text = str(e)
    if not isinstance(e, ValueError) or ("MAX_TEXT_CHUNK" not in text and "MAX_TEXT_MEMORY" not in text):
        return None
    what = ("a compressed metadata chunk (zTXt / iTXt text or an iCCP colour profile) that decompresses to over "
            f"{PngImagePlugin.MAX_TEXT_CHUNK // 2**20} MiB" if "MAX_TEXT_CHUNK" in text else
            f"text chunks (metadata) of over {PngImagePlugin.MAX_TEXT_MEMORY // 2**20} MiB in all")
    return ImageRejected("unreadable-image", f"the PNG holds {what}, more than Pillow reads (a guard against "
                         "decompression bombs); strip its metadata (e.g. `exiftool -all= FILE`, `mogrify -strip FILE`; a colour "
                         "profile: convert the picture to sRGB first) and rerun")


def _orientation_before_load(im: Image.Image) -> object:
    """The EXIF orientation a TIFF's header names, read before `load()`: Pillow's TIFF loader (13.0 here) turns
    the pixels by it itself and removes the tag, so a turned TIFF told none after (no note, orientation 1 recorded,
    and its mask drawn on the stored pixels not turned with it: a bad-mask). None for the other formats, whose tag
    stays until `exif_transpose` (a PNG's eXIf after its image data is read by `load()` only)."""
    return im.tag_v2.get(0x0112) if im.format == "TIFF" else None


def _oriented(im: Image.Image, notes: list[str], named_before_load: object = None) -> tuple[Image.Image, int]:
    """The picture turned as its EXIF orientation says, and the orientation applied (1: none); said in `notes`.
    Turned once: a tag that `load()` removed (`named_before_load`, a TIFF) was applied by Pillow already."""
    try:
        orientation = im.getexif().get(0x0112)
        turned_on_load = orientation is None and named_before_load is not None
        orientation = named_before_load if turned_on_load else 1 if orientation is None else orientation
        if isinstance(orientation, int) and 2 <= orientation <= 8:
            turned = im if turned_on_load else ImageOps.exif_transpose(im)
            notes.append(f"EXIF orientation {orientation} applied")
            return turned, orientation
        if orientation not in (None, 1):
            # 0 ("undefined", which some phones write) or 9: exif_transpose leaves the pixels as stored; noted
            # "applied" before, a rotation counted in the summary that no pixel had
            notes.append(f"EXIF orientation {orientation!r} is not one of 1-8: ignored")
    except Exception:  # noqa: BLE001 - a corrupt EXIF block: keep the pixels as stored, say so
        notes.append("EXIF unreadable, orientation ignored")
    return im, 1


def _frame_count(im: Image.Image, most: int) -> int:
    """The frames (pages) of an opened picture, counted up to `most` + 1. Pillow's `n_frames` walks a GIF's or
    TIFF's every frame, unbounded: a file of millions of tiny frames held a render worker 20-40 min. APNG and WebP
    tell theirs in the header (`_n_frames` set at open); a GIF is stepped as its `n_frames` steps (no frame
    decoded), a TIFF by `seek` (its tags only). The first frame is selected again after."""
    if not getattr(im, "is_animated", False):  # looks at the second frame only
        return 1
    known = getattr(im, "_n_frames", None)
    if known is not None:
        return known
    step = (lambda: im._seek(im.tell() + 1, False)) if im.format == "GIF" else (lambda: im.seek(im.tell() + 1))
    try:
        while im.tell() < most:
            step()
        count = most + 1  # frame number `most` (from 0) is there: more than `most`
    except EOFError:
        count = im.tell() + 1
    im.seek(0)
    return count


def _pillow_opens(max_pixels: int) -> None:
    """Let Pillow open what `max_pixels` allows: it refuses a picture over 2 x `Image.MAX_IMAGE_PIXELS` (~179 Mpx)
    whatever our limit says, so a resize.max_image_pixels raised for 200 Mpx phone photos quarantined each as a
    'decompression bomb'. Only ever raised (a concurrent decode with a lower limit still applies its own check
    from the header, before any pixel is decoded). To `max_pixels`, not half: a picture just over it gets our
    line naming the setting, Pillow's only one over twice it."""
    cap = Image.MAX_IMAGE_PIXELS
    if cap is not None and 2 * cap < max_pixels:
        Image.MAX_IMAGE_PIXELS = max_pixels


def _over_pillows_limit(e: Image.DecompressionBombError, max_pixels: int) -> str:
    """Pillow's refusal of a picture over twice its MAX_IMAGE_PIXELS, said as our own limit's line: such a picture
    is over `max_pixels` too (`_pillow_opens` keeps twice Pillow's limit at or above it). Before, Pillow's line named
    its own limit (178956970), which no setting spells, and not resize.max_image_pixels."""
    found = re.search(r"\((\d+) pixels\)", str(e))  # Pillow: "Image size (N pixels) exceeds limit of M pixels, ..."
    size = f"{int(found.group(1))} pixels" if found else "over Pillow's limit"
    return f"image is {size}, over resize.max_image_pixels = {max_pixels} (decompression bomb guard)"


def _sixteen_bit_read_as_eight(im: Image.Image) -> str | None:
    """The note for a picture of 16 bits per channel that Pillow reads as 8 (a 48/64-bit PNG's RGB;16B, a TIFF's
    RGB;16N: each channel's high byte kept, its mode RGB/RGBA), as the other conversions are noted; 16-bit
    grayscale (I;16) is a mode of its own, scaled in `_to_rgb`. PNG and TIFF only: a BMP's `BGR;16` is 16 bits per
    pixel (5-6-5, each channel expanded to 8 bits, none dropped)."""
    if im.mode in _SIXTEEN_BIT or not im.tile or im.format not in ("PNG", "TIFF"):
        return None
    args = im.tile[0].args
    raw = args if isinstance(args, str) else args[0] if isinstance(args, tuple) and args and isinstance(args[0], str) else ""
    base, _, bits = raw.partition(";")
    return f"16-bit {base} read as 8-bit {im.mode} (each channel's high byte)" if bits.startswith("16") else None


def _header_colour_key(im: Image.Image) -> int | tuple | None:
    """The one transparent colour (a PNG's tRNS) an RGB, L, 1 or 16-bit grey picture's header names, in the 8-bit
    units of the pixels Pillow reads, or None. Pillow keeps it in the file's units, so it matched no pixel, or
    other ones: a 2- or 4-bit grey's (L, scaled: 3 or 15 is white; PNG optimizers reduce a few-grey picture to
    such depths) scaled alike; a 48-bit RGB's (each channel read as its high byte) as its high bytes: exact for
    8-bit values stored as 16 (v x 257), else a colour within 1/256 is taken as well. Pillow scales a 1-bit
    picture's itself. Read before load(), which empties the tile."""
    key = im.info.get("transparency")
    if im.mode not in _COLOUR_KEYED or not isinstance(key, (int, tuple)):
        return None
    if im.mode not in ("L", "RGB") or not im.tile or im.format != "PNG":
        return key
    args = im.tile[0].args
    raw = args if isinstance(args, str) else args[0] if isinstance(args, tuple) and args and isinstance(args[0], str) else ""
    if raw in ("L;2", "L;4") and isinstance(key, int):
        return key * 255 // ((1 << int(raw[2:])) - 1)
    if raw == "RGB;16B" and isinstance(key, tuple):
        return tuple(int(k) >> 8 for k in key)
    return key


def _check_png_chunks(data: bytes, im: Image.Image) -> None:
    """Every chunk's CRC from the first image data to IEND (those before were checked while opening). Decoding
    stops once the pixels are complete, so only this walk catches a file cut after its image data or a flipped
    byte in a chunk. It is the walk Pillow's `verify()` runs, over the bytes already in memory, without the
    second open of the image that `verify()` needs (it must come directly after an open, and spends the image)."""
    chunks = PngImagePlugin.ChunkStream(io.BytesIO(data))
    chunks.fp.seek(im.tile[0][2] - 8)  # back to the first IDAT's header, as `PngImageFile.verify`
    chunks.verify()


def has_transparent_colour(data: bytes | IO[bytes]) -> bool:
    """Would `decode_image` take a transparent colour of this picture as alpha (`_colour_keyed`)? From its header
    alone (Pillow's open reads a PNG's chunks up to its image data, tRNS among them; no pixel is decoded): what a
    rerun of a store rendered before revision 4 reads to carry a sample instead of rendering it again. True where
    the header does not read (the render judges it). `data`: the bytes, or a file of them (header_checks.py reads
    its first bytes only)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data) if isinstance(data, bytes) else data, formats=ALLOWED_FORMATS) as im:
                return _header_colour_key(im) is not None
        except Exception:  # noqa: BLE001 - any header problem: rendered, which says what it is
            return True


def _colour_keyed(im: Image.Image) -> Image.Image | None:
    """An RGB, L, 1 or 16-bit grey picture whose transparency is one transparent colour (PNG's tRNS: Pillow's
    `info["transparency"]`, a tuple or an int) as 8-bit RGBA, that colour's pixels transparent, as the same picture
    saved as RGBA/LA decodes; None for any other. Before, such pixels kept their stored colour (often black)."""
    if im.mode not in _COLOUR_KEYED or not isinstance(im.info.get("transparency"), (int, tuple)):
        return None
    key = im.info["transparency"]
    if im.mode in _SIXTEEN_BIT:  # Pillow's convert would clip the grey values; scaled as `_to_rgb` scales them
        out = _sixteen_to_l(im).convert("RGBA")
        out.putalpha(Image.fromarray(np.where(np.asarray(im) == key, 0, 255).astype(np.uint8)))
        return out
    return im.convert("RGBA")  # Pillow applies the key for RGB, L and 1


def _to_rgb(im: Image.Image, background: tuple[int, int, int]) -> tuple[Image.Image, str | None]:
    mode = im.mode
    if mode == "RGB":
        return im, None
    if mode in ("L", "1", "YCbCr", "LAB", "HSV"):
        return im.convert("RGB"), f"{mode} converted to RGB"
    if mode in _SIXTEEN_BIT:
        return _sixteen_to_l(im).convert("RGB"), f"16-bit {mode} scaled to 8-bit RGB"
    if mode == "P" and "transparency" not in im.info:
        return im.convert("RGB"), "palette converted to RGB"
    if mode in _ALPHA or mode == "P":
        return flattened(im, background), f"{mode} alpha composited over {'white' if background[0] else 'black'}"
    if mode == "CMYK":
        icc = im.info.get("icc_profile")
        if icc:
            try:
                src = ImageCms.ImageCmsProfile(io.BytesIO(icc))
                out = ImageCms.profileToProfile(im, src, ImageCms.createProfile("sRGB"), outputMode="RGB")
                return out, "CMYK converted to sRGB via its ICC profile"
            except (ImageCms.PyCMSError, OSError):
                pass
        return im.convert("RGB"), "CMYK converted to RGB (no usable ICC profile)"
    raise ImageRejected("unsupported-mode", f"unsupported image mode {mode!r} (e.g. floating point); convert it to 8-bit RGB")


def _sixteen_to_l(im: Image.Image) -> Image.Image:
    arr = np.asarray(im).astype(np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > 65535):
        raise ImageRejected("unsupported-mode", f"integer image mode {im.mode!r} with values outside 0..65535 is not supported")
    return Image.fromarray(((arr * 255 + 32767) // 65535).astype(np.uint8))
