"""A picture whose transparency is one transparent colour (a PNG's tRNS chunk on an RGB, L, 1 or 16-bit grey
picture: what optipng, oxipng or ImageMagick write for an RGBA cut-out whose transparent pixels share one colour)
decodes as the same picture saved as RGBA: composited over white, or kept as RGBA under resize.keep_alpha, with a
note. Before, the transparent pixels kept their stored colour (often black) and no note said so."""

import io

import numpy as np
import pytest
from PIL import Image

from features.decode import decode_image, decode_keeping_alpha, decode_mask
from schemas.fixes import KEPT_ALPHA, TRANSPARENT_COLOUR

MAX = 1 << 20


def _png(im: Image.Image, **kw) -> bytes:
    b = io.BytesIO()
    im.save(b, format="PNG", **kw)
    return b.getvalue()


def _cutout() -> np.ndarray:
    """An RGBA product cut-out: opaque random colours (never black) on fully transparent black."""
    rgba = np.random.default_rng(0).integers(1, 256, (24, 32, 4), dtype=np.uint8)
    rgba[..., 3] = 255
    rgba[:8] = 0
    rgba[:, :5] = 0
    return rgba


def _keyed_rgb() -> bytes:
    data = _png(Image.fromarray(_cutout()[..., :3]), transparency=(0, 0, 0))
    assert b"tRNS" in data and Image.open(io.BytesIO(data)).mode == "RGB"
    return data


@pytest.mark.parametrize("decode", [decode_image, decode_keeping_alpha])
def test_an_rgb_png_with_a_transparent_colour_decodes_as_its_rgba_version(decode):
    keyed, rgba = decode(_keyed_rgb(), MAX), decode(_png(Image.fromarray(_cutout())), MAX)
    assert keyed.image.mode == rgba.image.mode == ("RGBA" if decode is decode_keeping_alpha else "RGB")
    assert np.array_equal(np.asarray(keyed.image), np.asarray(rgba.image))
    if decode is decode_image:
        assert np.asarray(keyed.image)[0, 0].tolist() == [255, 255, 255]  # white, not the stored black
        assert keyed.notes == [f"RGB {TRANSPARENT_COLOUR}, composited over white"]
    else:
        assert np.asarray(keyed.image)[0, 0, 3] == 0 and np.asarray(keyed.image)[-1, -1, 3] == 255
        assert len(keyed.notes) == 1 and KEPT_ALPHA in keyed.notes[0] and TRANSPARENT_COLOUR in keyed.notes[0]


def test_grey_bilevel_and_16_bit_grey_pngs_with_a_transparent_colour_are_composited_like_la():
    grey = _cutout()[..., 0]
    la = np.stack([grey, np.where(grey == 0, 0, 255).astype(np.uint8)], -1)
    want = np.asarray(decode_image(_png(Image.fromarray(la, "LA")), MAX).image)
    got = decode_image(_png(Image.fromarray(grey), transparency=0), MAX)
    assert np.array_equal(np.asarray(got.image), want) and got.notes == [f"L {TRANSPARENT_COLOUR}, composited over white"]
    sixteen = decode_image(_png(Image.fromarray(grey.astype(np.uint16) * 257), transparency=0), MAX)
    assert np.array_equal(np.asarray(sixteen.image), want)  # 257 x v scales back to v exactly
    assert sixteen.notes == [f"I;16 {TRANSPARENT_COLOUR}, composited over white"]
    bits = decode_image(_png(Image.fromarray(grey > 128), transparency=0), MAX).image
    assert np.asarray(bits)[grey <= 128].min() == 255  # black (0) transparent -> white: the whole picture white


def test_a_picture_without_a_transparent_colour_and_a_mask_decode_as_before():
    rgb = _cutout()[..., :3]
    plain = decode_image(_png(Image.fromarray(rgb)), MAX)
    assert np.array_equal(np.asarray(plain.image), rgb) and plain.notes == []
    # a mask's transparent colour is not read as alpha (white there would turn "edited" into "not edited")
    mask = np.where(rgb[..., 0] > 128, 255, 0).astype(np.uint8)
    assert np.array_equal(np.asarray(decode_mask(_png(Image.fromarray(mask), transparency=255), MAX).image), mask)


def test_the_header_tells_the_transparent_colour_that_decode_takes():
    """A rerun of a store rendered before revision 4 carries a sample whose pictures' headers name no transparent
    colour (header_checks.py): decode takes one only where the header names it. A tRNS after the image data (out of
    place: libpng ignores it) is read by Pillow's load(): taken as alpha before, so such a carried row differed from
    a fresh render."""
    import struct
    import zlib

    from features.decode import has_transparent_colour

    plain = _png(Image.fromarray(_cutout()[..., :3]))
    assert has_transparent_colour(_keyed_rgb()) and not has_transparent_colour(plain)
    assert has_transparent_colour(_png(Image.fromarray(_cutout()[..., 0]), transparency=0))
    assert not has_transparent_colour(_png(Image.fromarray(_cutout())))  # RGBA: alpha, as before revision 4
    chunk = b"tRNS" + bytes(6)
    end = plain.rindex(b"IEND") - 4
    late = plain[:end] + struct.pack(">I", 6) + chunk + struct.pack(">I", zlib.crc32(chunk)) + plain[end:]
    assert not has_transparent_colour(late)
    got = decode_image(late, MAX)
    assert got.notes == [] and np.array_equal(np.asarray(got.image), _cutout()[..., :3])


def _grey_png(depth: int, values: list[int], key: int) -> bytes:
    """A one-row grey PNG of `depth` bits (2 or 4: what optipng/oxipng reduce a few-grey picture to) with tRNS `key`
    (written by hand: Pillow saves grey as 8 bits)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    per = 8 // depth
    row = bytes(sum(v << (8 - depth * (j + 1)) for j, v in enumerate(values[i:i + per]))
                for i in range(0, len(values), per))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", len(values), 1, depth, 0, 0, 0, 0))
            + chunk(b"tRNS", struct.pack(">H", key)) + chunk(b"IDAT", zlib.compress(b"\x00" + row))
            + chunk(b"IEND", b""))


@pytest.mark.parametrize("depth", [2, 4])
def test_a_low_bit_depth_grey_png_takes_its_transparent_colour_at_its_depth(depth):
    """The tRNS grey of a 2- or 4-bit picture is in that depth's units (3 or 15 is white), its pixels scaled to 8
    bits by Pillow: compared unscaled, the key matched no pixel, the transparent white pixels stayed opaque while the
    note said the colour was taken as alpha."""
    top = (1 << depth) - 1
    data = _grey_png(depth, [0, 1, top, top], key=top)
    alpha = np.asarray(decode_keeping_alpha(data, MAX).image)[0, :, 3]
    assert alpha.tolist() == [255, 255, 0, 0]
    grey = _grey_png(depth, [0, 1, top, top], key=1)  # a grey key, composited over white
    assert np.asarray(decode_image(grey, MAX).image)[0, :, 0].tolist() == [0, 255, 255, 255]


def test_a_16_bit_rgb_png_takes_its_transparent_colour_by_the_high_bytes_pillow_reads():
    """Pillow reads a 48-bit PNG's channels as their high bytes but keeps its tRNS colour in 16 bits: compared so,
    the pixels of that colour stayed opaque and others (whose high byte was the key's low value) went transparent."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    pixels = np.array([[[200, 200, 200], [51400, 51400, 51400], [65535, 0, 0]]], ">u2")  # the key, 200 high, red
    data = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 3, 1, 16, 2, 0, 0, 0))
            + chunk(b"tRNS", struct.pack(">HHH", 200, 200, 200))
            + chunk(b"IDAT", zlib.compress(b"\x00" + pixels.tobytes())) + chunk(b"IEND", b""))
    assert np.asarray(decode_keeping_alpha(data, MAX).image)[0, :, 3].tolist() == [0, 255, 255]
    assert np.asarray(decode_image(data, MAX).image)[0].tolist() == [[255, 255, 255], [200, 200, 200], [255, 0, 0]]
