"""The 16-bit RGB note (`features.decode`): said of a PNG or TIFF of 16 bits per channel, which Pillow reads as each
channel's high byte; never of a 16-bit-per-pixel BMP (RGB565: channels of 5 and 6 bits, expanded, not truncated),
whose rawmode `BGR;16` also ends in 16."""

import io
import struct

import numpy as np
from features.decode import decode_image

HIGH_BYTE = "16-bit RGB read as 8-bit RGB (each channel's high byte)"


def _bmp565(w: int, h: int) -> bytes:
    """A 16-bit-per-pixel BMP (BI_BITFIELDS 5-6-5), pure red: a format Pillow reads (rawmode BGR;16)."""
    row = struct.pack("<H", 31 << 11) * w
    row += b"\0" * (-len(row) % 4)
    pixels = row * h
    dib = struct.pack("<IiiHHIIiiII", 40, w, h, 1, 16, 3, len(pixels), 2835, 2835, 0, 0)
    masks = struct.pack("<III", 0xF800, 0x07E0, 0x001F)
    offset = 14 + len(dib) + len(masks)
    return b"BM" + struct.pack("<IHHI", offset + len(pixels), 0, 0, offset) + dib + masks + pixels


def test_a_16_bit_per_pixel_bmp_is_not_noted_as_16_bits_per_channel():
    d = decode_image(_bmp565(4, 2), 1 << 20)
    assert np.asarray(d.image)[0, 0].tolist() == [255, 0, 0]
    assert not any("16-bit" in n for n in d.notes), d.notes


def test_a_16_bit_per_channel_png_and_tiff_are_noted():
    deep = np.full((4, 4, 3), 0x8040, dtype=">u2")
    assert HIGH_BYTE in decode_image(_png_rgb16(deep), 1 << 20).notes
    tiff = io.BytesIO()
    _tiff_rgb16(tiff)
    assert HIGH_BYTE in decode_image(tiff.getvalue(), 1 << 20).notes


def _png_rgb16(a: np.ndarray) -> bytes:
    import zlib

    h, w, _ = a.shape
    raw = b"".join(b"\0" + a[y].astype(">u2").tobytes() for y in range(h))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def _tiff_rgb16(f: io.BytesIO) -> None:
    """A little-endian 4x4 RGB TIFF of 16 bits per sample, uncompressed."""
    w = h = 4
    pixels = np.full((h, w, 3), 0x8040, dtype="<u2").tobytes()
    entries = [(256, 3, 1, w), (257, 3, 1, h), (258, 3, 3, 0), (259, 3, 1, 1), (262, 3, 1, 2),
               (273, 4, 1, 0), (277, 3, 1, 3), (278, 3, 1, h), (279, 4, 1, len(pixels))]
    ifd_at = 8
    ifd_len = 2 + 12 * len(entries) + 4
    bits_at = ifd_at + ifd_len
    data_at = bits_at + 6
    out = b"II*\0" + struct.pack("<I", ifd_at) + struct.pack("<H", len(entries))
    for tag, typ, count, value in entries:
        if tag == 258:
            value = bits_at
        elif tag == 273:
            value = data_at
        out += struct.pack("<HHI", tag, typ, count) + (struct.pack("<I", value) if typ == 4 or tag == 258
                                                       else struct.pack("<HH", value, 0))
    out += struct.pack("<I", 0) + struct.pack("<HHH", 16, 16, 16) + pixels
    f.write(out)
