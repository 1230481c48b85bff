"""Resize decodes each source PNG once: one open of the image, its chunks' CRCs checked over the bytes in memory
(features/decode.py), and a damaged chunk is still refused."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from schemas.config import ResizeConfig
from schemas.errors import Rejected
from features import decode as imaging
from stages.resize.sources import SourceSample
from stages.resize.rendering import bucket_rules, render


def png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def noise(w: int, h: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def with_text_chunk_after_pixels(data: bytes, crc_ok: bool) -> bytes:
    """The PNG with a tEXt chunk between its last IDAT and IEND (a chunk decoding never reads)."""
    body = b"Comment\x00written after the pixels"
    crc = zlib.crc32(b"tEXt" + body) ^ (0 if crc_ok else 1)
    chunk = struct.pack(">I", len(body)) + b"tEXt" + body + struct.pack(">I", crc)
    return data[:-12] + chunk + data[-12:]  # IEND is the last 12 bytes


@pytest.fixture
def opens(monkeypatch):
    """How many times PIL opens an image (Image.open is where a decode starts)."""
    calls = []
    real = Image.open

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(Image, "open", counting)
    return calls


def test_a_png_source_is_opened_once_and_decodes_to_its_pixels(opens):
    im = noise(48, 40)
    decoded = imaging.decode_image(with_text_chunk_after_pixels(png(im), crc_ok=True), 1 << 20)
    assert len(opens) == 1  # was 2: a second open only to run verify()
    assert np.array_equal(np.asarray(decoded.image), np.asarray(im))


def test_render_opens_each_png_of_a_sample_once(opens):
    rc = ResizeConfig(split_by="pictures")  # render is given the rule in force (resolved by the stage's run)
    rec = SourceSample("s", "src/s", target=png(noise(64, 48)), controls=[png(noise(40, 40, 1))],
                       caption=b"edit", mask=png(Image.new("L", (64, 48), 255)))
    out = render(rec, "ab" * 16, "edit", rc, bucket_rules(rc))
    assert not isinstance(out, Rejected), out
    assert len(opens) == 3  # target, control, mask: one open each


@pytest.mark.parametrize("damage", ["crc", "no-iend"])
def test_a_damaged_chunk_after_the_pixels_is_still_refused(damage, opens):
    good = with_text_chunk_after_pixels(png(noise(32, 32)), crc_ok=True)
    data = with_text_chunk_after_pixels(png(noise(32, 32)), crc_ok=False) if damage == "crc" else good[:-12]
    with pytest.raises(imaging.ImageRejected) as e:
        imaging.decode_image(data, 1 << 20)
    assert e.value.kind == "corrupt-image"
    assert len(opens) == 1


def test_keep_alpha_decodes_an_opaque_image_once_to_what_decode_image_gives(opens):
    """resize.keep_alpha (Qwen-Image-2.1): an image without transparency, most of a dataset, was decoded twice
    (once to look for alpha, then again by `decode_image`)."""
    from features.decode import decode_keeping_alpha

    data = with_text_chunk_after_pixels(png(noise(48, 40, seed=3)), crc_ok=True)
    kept = decode_keeping_alpha(data, 1 << 20)
    assert len(opens) == 1
    plain = imaging.decode_image(data, 1 << 20)
    assert kept.image.mode == "RGB" and np.array_equal(np.asarray(kept.image), np.asarray(plain.image))
    assert kept.notes == plain.notes
