"""resize-bucket on hostile files, each a real file built here: what each one becomes (rendered, converted, or one
quarantine row with its reason) is deliberate and documented (docs/resize-bucket.md, 'Sanitising' and 'Bad
input'); one bad sample never stops the run; and a rerun after the user fixes the file picks it up."""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from pipeline.config import load_config
from stages.resize.stage import run
from store import Store

SMALL = {"resize.target_area": 64 * 64, "resize.control_vae_area": 64 * 64, "resize.control_vl_area": 32 * 32,
         "resize.multiple": 16, "resize.min_side": 16, "resize.max_controls": 2}


def cfg(**over):
    return load_config(None, {**SMALL, **{f"resize.{k}": v for k, v in over.items()}})


def encoded(im: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    b = io.BytesIO()
    im.save(b, format=fmt, **kw)
    return b.getvalue()


def quadrants(w: int = 96, h: int = 64) -> Image.Image:
    """Four flat colours, one per quadrant: every flip and rotation gives another picture."""
    a = np.zeros((h, w, 3), np.uint8)
    a[: h // 2, : w // 2] = (250, 0, 0)
    a[: h // 2, w // 2:] = (0, 250, 0)
    a[h // 2:, : w // 2] = (0, 0, 250)
    a[h // 2:, w // 2:] = (250, 250, 0)
    return Image.fromarray(a)


def put(root: Path, name: str, target: bytes, caption: bytes | None = b"make it blue", controls=(), mask=None):
    """`name` is the target's file name (stem + suffix); controls and mask are PNGs of the same stem."""
    stem = Path(name).stem
    (root / "target").mkdir(parents=True, exist_ok=True)
    (root / "target" / name).write_bytes(target)
    if caption is not None:
        (root / "target" / f"{stem}.txt").write_bytes(caption)
    for i, c in enumerate(controls):
        d = root / ("control" if i == 0 else f"control_{i}")
        d.mkdir(exist_ok=True)
        (d / f"{stem}.png").write_bytes(c)
    if mask is not None:
        (root / "mask").mkdir(exist_ok=True)
        (root / "mask" / f"{stem}.png").write_bytes(mask)


def quarantined(store: Path) -> dict[str, dict]:
    """File name of the target -> its quarantine row."""
    return {Path(r["source"]).name: r for r in Store(store).quarantine().to_pylist()}


def table(store: Path) -> dict[str, tuple[dict, dict[str, bytes]]]:
    """Target file name -> (manifest row, stored files) of the current images version."""
    r = Store(store).reader("images")
    return {Path(m["source"]).name: (m, r.files(m["key"])) for m in r.manifest.to_pylist()}


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)))


def test_hostile_image_files_each_end_deliberately(tmp_path):
    root, store = tmp_path / "src", tmp_path / "store"
    photo = encoded(Image.fromarray(np.random.default_rng(0).integers(0, 256, (96, 96, 3), np.uint8)), "JPEG")
    put(root, "good.png", encoded(quadrants()))
    put(root, "cutjpeg.jpg", photo[: len(photo) // 2])  # a download cut off mid-scan
    put(root, "zerojpeg.jpg", b"")
    put(root, "textjpeg.jpg", b"<html>404 Not Found</html>")  # an error page saved under the image's name
    pal = Image.new("P", (64, 64), 1)
    pal.putpalette([0, 0, 0, 200, 30, 30] + [0] * 762)
    pal.paste(0, (0, 0, 32, 64))  # left half: palette entry 0, declared transparent (tRNS)
    put(root, "palette_trns.png", encoded(pal, transparency=0))
    put(root, "la.png", encoded(Image.new("LA", (64, 64), (100, 0))))  # fully transparent grey
    put(root, "i16.png", encoded(Image.fromarray(np.full((64, 64), 65535, np.uint16))))
    put(root, "rgb16.png", _rgb16_png(64, 48))
    frames = [Image.new("RGB", (64, 64), c) for c in ((250, 0, 0), (0, 0, 250))]
    put(root, "animgif.gif", encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50))
    put(root, "animwebp.webp", encoded(frames[0], "WEBP", save_all=True, append_images=frames[1:], lossless=True))
    put(root, "onepixel.png", encoded(Image.new("RGB", (1, 1), (10, 20, 30))))
    put(root, "sliver.png", encoded(Image.new("RGB", (100000, 10), (10, 200, 30))))
    s = run(cfg(), root, store)

    q = quarantined(store)
    assert {n: r["reason"] for n, r in q.items()} == {
        "cutjpeg.jpg": "corrupt-image", "zerojpeg.jpg": "empty-image", "textjpeg.jpg": "unreadable-image"}
    assert all("\n" not in r["detail"] and str(root.resolve() / "target") in r["detail"] for r in q.values())
    assert s.quarantined == {"corrupt-image": 1, "empty-image": 1, "unreadable-image": 1}
    t = table(store)
    assert len(t) == s.written == 9
    p = pixels(t["palette_trns.png"][1]["target.png"])
    assert p[32, 4].tolist() == [255, 255, 255] and p[32, -4].tolist() == [200, 30, 30]  # transparent -> white
    assert "P alpha composited over white" in t["palette_trns.png"][0]["conversions"]
    assert pixels(t["la.png"][1]["target.png"])[8, 8].tolist() == [255, 255, 255]
    assert pixels(t["i16.png"][1]["target.png"])[8, 8].tolist() == [255, 255, 255]  # 65535 -> 255
    assert pixels(t["rgb16.png"][1]["target.png"])[8, 8].tolist() == [128, 64, 255]  # 16-bit RGB: high bytes
    # noted as every other conversion is (the grayscale one below too); before, only 16-bit RGB went unsaid
    sixteen = "16-bit RGB read as 8-bit RGB (each channel's high byte)"
    assert t["rgb16.png"][0]["conversions"] == [sixteen] and s.conversions[sixteen] == 1
    assert t["i16.png"][0]["conversions"] == ["16-bit I;16 scaled to 8-bit RGB"]
    for anim in ("animgif.gif", "animwebp.webp"):  # the first frame, said so
        assert pixels(t[anim][1]["target.png"])[8, 8].tolist() == [250, 0, 0]
        assert "first frame of 2 used" in t[anim][0]["conversions"]
    # tiny images are accepted and stretched up to their bucket; an extreme aspect is centre-cropped to 4:1 first
    one = t["onepixel.png"][0]
    assert one["source_size"] == [1, 1] and one["bucket"] == [64, 64]
    assert pixels(t["onepixel.png"][1]["target.png"])[30, 30].tolist() == [10, 20, 30]
    assert "target upscaled more than 4x per side (a small source image)" in one["conversions"]
    assert "target upscaled more than 4x per side (a small source image)" not in t["good.png"][0]["conversions"]
    assert s.conversions["target upscaled more than 4x per side (a small source image)"] == 1  # 1x1 only
    sliver = t["sliver.png"][0]
    assert sliver["source_size"] == [10, 100000] and sliver["bucket"] == [32, 128]


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def test_a_png_whose_metadata_is_past_pillows_guards_says_to_strip_it(tmp_path):
    """Pillow refuses a compressed text chunk or colour profile decompressing to over 1 MB (before or after the pixel
    data) and over 64 MB of text in all with its constant's name only; the row says what it is and what to do,
    counted as any."""
    root, store = tmp_path / "src", tmp_path / "store"
    png = encoded(quadrants())
    ztxt = _png_chunk(b"zTXt", b"Comment\0\0" + zlib.compress(b"x" * 2_000_000))
    put(root, "good.png", png)
    put(root, "ztxt_first.png", png[:33] + ztxt + png[33:])  # after IHDR: read while opening
    put(root, "ztxt_last.png", png[:-12] + ztxt + png[-12:])  # before IEND: read while loading
    icc = _png_chunk(b"iCCP", b"wide\0\0" + zlib.compress(b"\0" * 2_000_000))
    put(root, "iccp_first.png", png[:33] + icc + png[33:], caption=b"make it red")
    put(root, "text_70mb.png", png[:33] + _png_chunk(b"tEXt", b"Comment\0" + b"y" * 1_000_000) * 70 + png[33:],
        caption=b"make it green")
    s = run(cfg(), root, store)

    q = quarantined(store)
    assert {n: r["reason"] for n, r in q.items()} == dict.fromkeys(
        ("ztxt_first.png", "ztxt_last.png", "iccp_first.png", "text_70mb.png"), "unreadable-image")
    for name in ("ztxt_first.png", "ztxt_last.png", "iccp_first.png"):
        assert "a compressed metadata chunk (zTXt / iTXt text or an iCCP colour profile) that decompresses to over " \
            "1 MiB" in q[name]["detail"]
    assert "text chunks (metadata) of over 64 MiB in all" in q["text_70mb.png"]["detail"]
    assert all("strip its metadata" in r["detail"] and "MAX_TEXT" not in r["detail"] for r in q.values())
    assert s.quarantined == {"unreadable-image": 4} and s.written == 1


def test_an_image_beyond_the_aspect_clamp_is_counted_as_cropped(tmp_path):
    """A 6:1 panorama loses a third of its width to the centre crop into `resize.max_aspect` (4), an edit near its
    edge all of it; before, nothing said so (a stretch of a small image is counted, a crop was not)."""
    root, store = tmp_path / "src", tmp_path / "store"
    wide, tall, square = (encoded(Image.new("RGB", size, (200, 30, 30))) for size in ((600, 100), (100, 600), (96, 96)))
    put(root, "panorama.png", wide, controls=[square])
    put(root, "portrait.png", square, caption=b"make it tall", controls=[tall])
    put(root, "inside.png", encoded(Image.new("RGB", (400, 100), (30, 30, 200))), controls=[square])  # 4:1 exactly
    s = run(cfg(), root, store)
    t = table(store)
    target_note = "target centre-cropped to resize.max_aspect 4 (its sides beyond it dropped)"
    control_note = "control centre-cropped to resize.max_aspect 4 (its sides beyond it dropped)"
    assert {n: [c for c in m["conversions"] if "cropped" in c] for n, (m, _) in t.items()} == {
        "panorama.png": [target_note], "portrait.png": [control_note], "inside.png": []}
    assert s.conversions[target_note] == 1 and s.conversions[control_note] == 1
    assert f"1x {target_note}" in str(s)


def _rgb16_png(w: int, h: int) -> bytes:
    """A 16-bit-per-channel RGB PNG (Pillow writes none): each channel's high byte 0x80, 0x40, 0xff."""
    import struct
    import zlib

    px = np.empty((h, w, 3), ">u2")
    px[...] = (0x80FF, 0x4001, 0xFFFF)
    raw = b"".join(b"\0" + px[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def test_exif_orientations_2_to_8_on_targets_controls_and_masks(tmp_path):
    """Every orientation is shown as a viewer shows it (Pillow's `ImageOps.exif_transpose` as the reference), on
    the target, the control and the mask alike."""
    root, store = tmp_path / "src", tmp_path / "store"
    base = quadrants()
    mask_base = Image.new("L", base.size, 0)
    mask_base.paste(255, (0, 0, 48, 32))  # the red quadrant is the edit
    for o in range(1, 9):
        ex = Image.Exif()
        ex[0x0112] = o
        control = ImageOps.mirror(base)
        put(root, f"o{o}.png", encoded(base, exif=ex.tobytes()), caption=f"orientation {o}".encode(),
            controls=[encoded(control, exif=ex.tobytes())], mask=encoded(mask_base, exif=ex.tobytes()))
    run(cfg(), root, store)
    t = table(store)
    assert len(t) == 8 and not Store(store).quarantine().num_rows
    for o in range(1, 9):
        meta, files = t[f"o{o}.png"]
        shown = ImageOps.exif_transpose(Image.open(io.BytesIO(encoded(base, exif=_exif(o)))))
        h, w = meta["bucket"]
        assert (h > w) == (shown.height > shown.width) and meta["source_size"] == [shown.height, shown.width]
        expect = np.asarray(shown.convert("RGB").resize((w, h), Image.Resampling.LANCZOS))
        assert np.array_equal(pixels(files["target.png"]), expect), o
        ch, cw = meta["control_sizes"][0]
        shown_c = ImageOps.exif_transpose(Image.open(io.BytesIO(encoded(ImageOps.mirror(base), exif=_exif(o)))))
        expect_c = np.asarray(shown_c.convert("RGB").resize((cw, ch), Image.Resampling.LANCZOS))
        assert np.array_equal(pixels(files["control_0.png"]), expect_c), o
        # the mask turns with its own EXIF tag: still exactly over the (turned) red quadrant
        m, tgt = pixels(files["mask.png"]), pixels(files["target.png"]).astype(int)
        red = (tgt[..., 0] > 200) & (tgt[..., 1] < 50) & (tgt[..., 2] < 50)
        assert m[red].mean() > 240 and m[~red].mean() < 30, o
        if o > 1:
            assert f"EXIF orientation {o} applied" in meta["conversions"]


@pytest.mark.parametrize("orientation", [0, 9, 65535])
def test_an_exif_orientation_outside_1_to_8_is_said_ignored_not_applied(orientation):
    """0 ("undefined", which some phones write) and 9+ name no rotation: the pixels stay as stored, and the
    sample's conversions (and the summary's `converted:` line) say so; before: "EXIF orientation 0 applied"."""
    from features.decode import decode_image

    base = quadrants()
    for fmt in ("JPEG", "PNG"):
        decoded = decode_image(encoded(base, fmt, exif=_exif(orientation)), 1 << 24)
        assert decoded.notes == [f"EXIF orientation {orientation} is not one of 1-8: ignored"], fmt
        assert decoded.orientation == 1
        plain = decode_image(encoded(base, fmt), 1 << 24)
        assert np.array_equal(np.asarray(decoded.image), np.asarray(plain.image)), fmt



@pytest.mark.parametrize("orientation", [*range(1, 10)])
def test_a_tiff_orientation_is_applied_once_noted_and_recorded_as_a_png_or_webp_eXIf_one(orientation):
    """Pillow's TIFF loader turns the pixels by the tag itself and removes it: the TIFF was shown turned, but with
    no note and orientation 1 recorded, so a mask drawn on its stored pixels was not turned with it. Every lossless
    format now decodes to the same pixels, notes and orientation; the mask decoder too."""
    from features.decode import decode_image, decode_mask

    base, mask = quadrants(), Image.new("L", (96, 64), 0)
    mask.paste(255, (0, 0, 48, 32))
    expect = decode_image(encoded(base, exif=_exif(orientation)), 1 << 24)
    expect_mask = decode_mask(encoded(mask, exif=_exif(orientation)), 1 << 24)
    assert expect.orientation == expect_mask.orientation == (orientation if orientation < 9 else 1)
    for fmt, kw in (("TIFF", {}), ("TIFF", {"compression": "tiff_lzw"}), ("WEBP", {"lossless": True})):
        if orientation == 9 and kw:  # libtiff refuses to write the tag 9; the plain TIFF writer carries it
            continue
        got = decode_image(encoded(base, fmt, exif=_exif(orientation), **kw), 1 << 24)
        assert (got.orientation, got.notes) == (expect.orientation, expect.notes), (fmt, kw)
        assert np.array_equal(np.asarray(got.image), np.asarray(expect.image)), (fmt, kw)
        got_mask = decode_mask(encoded(mask, fmt, exif=_exif(orientation), **kw), 1 << 24)
        exif_notes = [n for n in got_mask.notes if "EXIF" in n]  # WebP stores the L mask as RGB: noted as well
        assert (got_mask.orientation, exif_notes) == (expect_mask.orientation, expect_mask.notes), (fmt, kw)
        assert np.array_equal(np.asarray(got_mask.image), np.asarray(expect_mask.image)), (fmt, kw)

def _exif(o: int) -> bytes:
    ex = Image.Exif()
    ex[0x0112] = o
    return ex.tobytes()


def test_odd_names_are_read_and_recorded_as_valid_utf8(tmp_path):
    """Spaces, tabs, newlines, unicode, '..' and 240-character stems are ordinary names. A name whose bytes are
    not UTF-8 (a Latin-1 name from an old archive) is read by its real name and recorded with `\\xNN` escapes:
    it stopped the run with a traceback (no sqlite row, parquet cell or summary line can hold it)."""
    import tarfile

    root = tmp_path / "src"
    stems = ["with space", "ünïcödé", "a..b", "x" * 240, "tab\tname", "new\nline"]
    for i, stem in enumerate(stems):
        put(root, f"{stem}.png", encoded(Image.new("RGB", (64, 48), (i * 30, 0, 0))))
    latin1 = os.fsencode(root / "target") + b"/caf\xe9"
    Path(os.fsdecode(latin1 + b".png")).write_bytes(encoded(Image.new("RGB", (64, 48), (0, 200, 0))))
    Path(os.fsdecode(latin1 + b".txt")).write_bytes(b"make it green")
    s = run(cfg(), root, tmp_path / "store")
    assert s.written == 7 and not s.quarantined
    names = {Path(m["source"]).name for m, _ in table(tmp_path / "store").values()} | set(table(tmp_path / "store"))
    assert {f"{stem}.png" for stem in stems} | {"caf\\xe9.png"} <= names

    tars = tmp_path / "tars"  # a tar member named in Latin-1
    tars.mkdir()
    with tarfile.open(tars / "s.tar", "w", format=tarfile.GNU_FORMAT, encoding="latin-1") as tf:
        for name, data in (("caf\xe9.png", encoded(Image.new("RGB", (64, 48)))), ("caf\xe9.txt", b"a caption")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    assert run(cfg(), tars, tmp_path / "store-tar").written == 1
    [row] = Store(tmp_path / "store-tar").reader("images").manifest.to_pylist()
    assert row["source"] == f"{(tars / 's.tar').resolve()}:caf\\xe9"

    j = tmp_path / "jsonl"  # JSON's "\udce9" is a lone surrogate: a caption that is no text
    j.mkdir()
    (j / "a.png").write_bytes(encoded(Image.new("RGB", (64, 48))))
    (j / "b.png").write_bytes(encoded(Image.new("RGB", (48, 64))))
    (j / "m.jsonl").write_text('{"target": "a.png", "caption": "ok"}\n{"target": "b.png", "caption": "\\udce9x"}\n')
    s = run(cfg(), j, tmp_path / "store-jsonl")
    assert s.written == 1 and s.quarantined == {"caption-not-utf8": 1}


def test_same_webdataset_key_in_two_shards_is_two_samples_same_content_a_duplicate(tmp_path):
    """Keys are content hashes: a member key reused in another shard (every shard counting from 000000) is another
    sample; the same content again is a duplicate naming the copy kept."""
    import tarfile

    def shard(path: Path, members: dict[str, bytes]) -> None:
        with tarfile.open(path, "w") as tf:
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))

    red, blue = encoded(Image.new("RGB", (64, 48), (250, 0, 0))), encoded(Image.new("RGB", (64, 48), (0, 0, 250)))
    src = tmp_path / "tars"
    src.mkdir()
    shard(src / "a.tar", {"000000.png": red, "000000.txt": b"red"})
    shard(src / "b.tar", {"000000.png": blue, "000000.txt": b"blue", "000001.png": red, "000001.txt": b"red"})
    s = run(cfg(), src, tmp_path / "store")
    assert s.written == 2 and s.quarantined == {"duplicate": 1}
    [q] = Store(tmp_path / "store").quarantine().to_pylist()
    assert q["source"].endswith("b.tar:000001") and q["detail"].endswith("a.tar:000000")


def test_a_fixed_file_is_picked_up_by_the_rerun(tmp_path):
    """Quarantined files, each then fixed by the user (replaced, re-saved as UTF-8, its control added): the rerun
    makes a new version holding them (the rejection is not remembered); an unchanged source is then up to date."""
    root, store = tmp_path / "src", tmp_path / "store"
    good = encoded(quadrants())
    put(root, "keep.png", good)
    (root / "control").mkdir(parents=True)
    put(root, "cut.png", good[: len(good) // 2])
    put(root, "zero.png", b"")
    put(root, "latin1.png", encoded(quadrants(64, 64)), caption="café".encode("latin-1"))
    put(root, "bomb.png", encoded(Image.new("RGB", (300, 300))))  # over max_image_pixels below
    put(root, "nocontrol.png", encoded(quadrants(80, 48)))  # min_controls 1 below
    for stem in ("keep", "cut", "zero", "latin1", "bomb"):  # a control each, as min_controls asks
        (root / "control" / f"{stem}.png").write_bytes(encoded(Image.new("RGB", (64, 64), (1, 2, len(stem)))))
    c = cfg(max_image_pixels=256 * 256, min_controls=1)
    first = run(c, root, store)
    reasons = {"corrupt-image": 1, "empty-image": 1, "caption-not-utf8": 1, "image-too-large": 1, "control-count": 1}
    assert first.written == 1 and first.quarantined == reasons

    (root / "target" / "cut.png").write_bytes(good)  # the complete download
    (root / "target" / "zero.png").write_bytes(encoded(quadrants(48, 96)))
    (root / "target" / "latin1.txt").write_text("café", encoding="utf-8")
    (root / "target" / "bomb.png").write_bytes(encoded(Image.new("RGB", (200, 200))))
    (root / "control" / "nocontrol.png").write_bytes(encoded(Image.new("RGB", (64, 64), (9, 9, 9))))
    second = run(c, root, store)
    assert second.version == first.version + 1 and not second.quarantined
    assert second.written + second.reused == 6
    assert set(table(store)) == {"keep.png", "cut.png", "zero.png", "latin1.png", "bomb.png", "nocontrol.png"}
    assert Store(store).quarantine().num_rows == 5  # the history stays; nothing was added
    assert run(c, root, store).up_to_date


def test_an_unreadable_file_costs_its_sample_and_is_read_once_permitted(tmp_path):
    """A file without read permission: its sample is quarantined naming the file, the run goes on; after `chmod`
    the rerun renders it. As root (which reads any file) the first run is made without the capability to
    override file permissions (setpriv), as a user's run would be."""
    import shutil

    root, store = tmp_path / "src", tmp_path / "store"
    put(root, "open.png", encoded(quadrants()))
    put(root, "locked.png", encoded(quadrants(64, 96)))
    (root / "target" / "locked.png").chmod(0)
    code = (f"from tests.stages.test_resize_hostile_files import cfg; from stages.resize.stage import run; "
            f"print(run(cfg(), {str(root)!r}, {str(store)!r}))")
    cmd = [sys.executable, "-c", code]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: every file is readable")
        cmd = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *cmd]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr
    # a permission error is the file system's, not bad data: `read-error`, and the summary says a rerun adds it
    assert "1 sample written" in out.stdout and "quarantined 1: read-error 1" in out.stdout
    assert "could not read 1 sample(s)" in out.stdout
    [q] = Store(store).quarantine().to_pylist()
    assert q["source"].endswith("locked.png") and "Permission denied" in q["detail"]

    (root / "target" / "locked.png").chmod(0o644)
    s = run(cfg(), root, store)
    assert s.version == 2 and set(table(store)) == {"open.png", "locked.png"}


def test_a_mask_of_another_aspect_is_a_bad_mask_not_stretched_onto_its_target(tmp_path):
    """A mask of another size than its target is resized onto it: right at the target's aspect (a mask saved at
    half size, an odd side rounded, a few pixels cropped), but a transposed mask or a square one for a 3:2 photo
    was stretched across the target, its edit region over the wrong pixels, counted only as "mask resized".
    Now such a sample is quarantined as `bad-mask` naming both sizes, and a copy with a fitting mask is kept
    instead, as for a mask that does not decode."""
    root, store = tmp_path / "src", tmp_path / "store"
    white = lambda w, h: encoded(Image.new("L", (w, h), 255))  # noqa: E731
    put(root, "sliver.png", encoded(Image.new("RGB", (300, 10), (200, 30, 30))), mask=white(10, 300))
    photo = encoded(quadrants(96, 64))
    put(root, "square.png", photo, mask=white(64, 64))
    put(root, "square_again.png", photo, mask=white(48, 32))  # the same sample, a mask of its aspect: kept instead
    put(root, "half.png", encoded(quadrants(97, 65)), caption=b"half", mask=white(48, 32))  # 97/2, 65/2 rounded down
    put(root, "trimmed.png", encoded(quadrants(100, 64)), caption=b"trimmed", mask=white(97, 64))  # 3 px off
    s = run(cfg(), root, store)
    q = quarantined(store)
    assert {n: r["reason"] for n, r in q.items()} == {"sliver.png": "bad-mask", "square.png": "bad-mask"}
    assert "is 10x300, its target 300x10" in q["sliver.png"]["detail"]
    assert "is 64x64, its target 96x64" in q["square.png"]["detail"]
    assert str(root / "mask" / "square.png") in q["square.png"]["detail"]
    t = table(store)
    assert set(t) == {"square_again.png", "half.png", "trimmed.png"}
    assert all("mask resized to its target" in m["conversions"] for m, _ in t.values())
    assert dict(s.quarantined) == {"bad-mask": 2} and s.written == 3
    assert "quarantined 2: bad-mask 2 (rows in" in str(s), str(s)  # no "duplicate 0" for the copy kept instead


def test_a_max_image_pixels_above_pillows_own_limit_is_honoured(tmp_path, monkeypatch):
    """Pillow refuses to open a picture over 2 x Image.MAX_IMAGE_PIXELS (~179 Mpx: a 200 Mpx phone photo) whatever
    resize.max_image_pixels says: one raised above it quarantined such pictures as 'decompression bomb'. Our limit
    decides. (Pillow's limit lowered here, as to 10,000 px, so that the pictures stay small.)"""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10_000)  # Pillow's hard limit: 20,000 px
    root, store = tmp_path / "src", tmp_path / "store"
    put(root, "big.png", encoded(quadrants(200, 150)))  # 30,000 px
    put(root, "bigger.png", encoded(quadrants(300, 200)), caption=b"make it red")  # 60,000 px
    summary = run(cfg(max_image_pixels=50_000), root, store)
    assert summary.written == 1 and summary.quarantined == {"image-too-large": 1}
    assert set(table(store)) == {"big.png"}
    [q] = Store(store).quarantine().to_pylist()
    assert q["source"].endswith("bigger.png") and "over resize.max_image_pixels = 50000" in q["detail"]


def test_a_masks_own_conversions_reach_its_row_and_the_summary(tmp_path):
    """A mask's decode notes (an RGB mask made grayscale, a 16-bit one scaled to 8 bits) are the sample's
    `conversions` and the summary's `converted:` line, as its target's and controls' are. Before, they were
    dropped: a colour mask read as its luminance, unsaid."""
    root, store = tmp_path / "src", tmp_path / "store"
    photo = lambda shade: encoded(Image.new("RGB", (64, 48), (shade, 30, 30)))  # noqa: E731
    put(root, "rgb.png", photo(200), mask=encoded(Image.new("RGB", (64, 48), (255, 255, 255))))
    put(root, "deep.png", photo(100), caption=b"deep",
        mask=encoded(Image.fromarray(np.full((48, 64), 65535, np.uint16)).convert("I;16")))
    put(root, "plain.png", photo(50), caption=b"plain", mask=encoded(Image.new("L", (64, 48), 255)))
    s = run(cfg(), root, store)
    t = table(store)
    rgb, deep = "RGB mask converted to grayscale", "16-bit mask scaled to 8 bits"
    assert {n: m["conversions"] for n, (m, _) in t.items()} == {"rgb.png": [rgb], "deep.png": [deep], "plain.png": []}
    assert (s.conversions[rgb], s.conversions[deep]) == (1, 1) and f"1x {rgb}" in str(s), str(s)


def frames_file(n: int, fmt: str) -> bytes:
    """An animated GIF / multi-page TIFF of `n` distinct 32x32 frames."""
    frames = [Image.new("RGB", (32, 32), (i * 7 % 256, i * 13 % 256, 90)) for i in range(n)]
    return encoded(frames[0], fmt, save_all=True, append_images=frames[1:])


@pytest.mark.parametrize("fmt", ["GIF", "TIFF"])
def test_a_file_of_more_frames_than_max_image_frames_is_quarantined_naming_the_setting(tmp_path, fmt):
    """Counting a GIF's or TIFF's frames walked every one, unbounded (a hostile file of millions held a render
    worker 20-40 min): now up to resize.max_image_frames, and a file past it is image-too-large, as a picture past
    max_image_pixels; one at the limit is kept, its first frame used."""
    from features.decode import MAX_FRAMES
    from schemas.config import ResizeConfig

    assert ResizeConfig().max_image_frames == MAX_FRAMES  # the decoder's default for predict/evaluate is the same
    root, store = tmp_path / "src", tmp_path / "store"
    suffix = fmt.lower()
    put(root, f"at_limit.{suffix}", frames_file(6, fmt))
    put(root, f"past_limit.{suffix}", frames_file(7, fmt), caption=b"make it red")
    summary = run(cfg(max_image_frames=6), root, store)
    assert summary.written == 1 and summary.quarantined == {"image-too-large": 1}
    assert "first frame of 6 used" in table(store)[f"at_limit.{suffix}"][0]["conversions"]
    q = quarantined(store)[f"past_limit.{suffix}"]
    assert q["reason"] == "image-too-large" and f"past_limit.{suffix}" in q["detail"]
    assert "more than 6 frames (pages), over resize.max_image_frames = 6" in q["detail"], q["detail"]


def test_a_rerun_under_a_lowered_max_image_frames_quarantines_as_a_fresh_run(tmp_path):
    """A carried sample is not decoded: its row's `first frame of N used` tells its frames (frame_limit.py), so a
    rerun under a lower resize.max_image_frames quarantines what a fresh run under it does, not carries it."""
    root = tmp_path / "src"
    put(root, "few.gif", frames_file(3, "GIF"))
    put(root, "many.gif", frames_file(8, "GIF"), caption=b"make it red")
    first = run(cfg(), root, tmp_path / "store")
    assert first.written == 2
    rerun = run(cfg(max_image_frames=5), root, tmp_path / "store")
    fresh = run(cfg(max_image_frames=5), root, tmp_path / "fresh")
    assert set(table(tmp_path / "store")) == set(table(tmp_path / "fresh")) == {"few.gif"}
    assert rerun.reused == 1 and rerun.quarantined == fresh.quarantined == {"image-too-large": 1}
    q, f = quarantined(tmp_path / "store")["many.gif"], quarantined(tmp_path / "fresh")["many.gif"]
    assert (q["reason"], q["detail"].rsplit(": ", 1)[-1]) == (f["reason"], f["detail"].rsplit(": ", 1)[-1])


def test_a_rerun_at_the_default_max_image_frames_after_a_raised_one_quarantines_as_a_fresh_run(tmp_path):
    """A version rendered under a resize.max_image_frames raised past its default holds rows of more frames than
    the default: a rerun back at the default must judge them (frame_limit.py), not take every row as within it."""
    from features.decode import MAX_FRAMES

    root = tmp_path / "src"
    put(root, "few.gif", frames_file(3, "GIF"))
    many = [Image.new("RGB", (32, 32), ((i % 2) * 200, 90, 90)) for i in range(MAX_FRAMES + 2)]
    put(root, "many.gif", encoded(many[0], "GIF", save_all=True, append_images=many[1:]), caption=b"make it red")
    first = run(cfg(max_image_frames=MAX_FRAMES + 10), root, tmp_path / "store")
    assert first.written == 2
    rerun = run(cfg(), root, tmp_path / "store")
    fresh = run(cfg(), root, tmp_path / "fresh")
    assert set(table(tmp_path / "store")) == set(table(tmp_path / "fresh")) == {"few.gif"}
    assert rerun.quarantined == fresh.quarantined == {"image-too-large": 1}


def test_the_limits_a_rerun_checks_carried_rows_under_read_each_version_schema_once(tmp_path, monkeypatch):
    """max_image_pixels (pixel_limit.py) and max_image_frames (frame_limit.py) both go by the limits each complete
    version's schema records: they read them once per version (recorded_resize.py), where each read and checked
    every schema.json itself; and what they judge is unchanged (the version under a raised limit is looked at)."""
    import pathlib

    from stages.resize.frame_limit import frames_over
    from stages.resize.pixel_limit import pixel_limit
    from stages.resize.recorded_resize import recorded_resize
    from store import format as fmt

    root, store = tmp_path / "src", tmp_path / "store"
    put(root, "few.gif", frames_file(3, "GIF"))
    put(root, "many.gif", frames_file(8, "GIF"), caption=b"make it red")
    run(cfg(), root, store)
    run(cfg(max_image_frames=20, max_image_pixels=2_000_000), root, store)  # v2: both limits raised
    reads: list[str] = []
    real = pathlib.Path.read_bytes

    def counted(path: pathlib.Path) -> bytes:
        if path.name == fmt.SCHEMA_JSON:
            reads.append(path.parent.name)
        return real(path)

    monkeypatch.setattr(pathlib.Path, "read_bytes", counted)
    st = Store(store)
    recorded = recorded_resize(st)
    limit, over = pixel_limit(st, 1_000_000, recorded), frames_over(st, 5, recorded)
    assert sorted(reads) == ["v1", "v2"]
    keys = {name: row["key"] for name, (row, _) in table(store).items()}
    assert over == {keys["many.gif"]}
    assert set(limit.recheck) == set(keys.values())  # both versions were checked under a higher pixel limit


def test_several_mask_files_for_one_sample_are_refused_as_several_controls_are(tmp_path):
    """mask/a.png beside mask/a.jpg: the first listed was used and the other dropped unsaid (several target or
    control files, and a tar's several .mask members, are refused). Now the sample is quarantined naming both;
    its neighbour with one mask is rendered with it."""
    root, store = tmp_path / "src", tmp_path / "store"
    half = Image.fromarray(np.repeat(np.array([[0, 255]], np.uint8), 48, 0).repeat(48, 1))  # 96 x 48
    put(root, "two.png", encoded(quadrants(96, 48)), mask=encoded(half))
    (root / "mask" / "two.jpg").write_bytes(encoded(Image.new("L", (96, 48), 255), "JPEG"))
    put(root, "one.png", encoded(quadrants(96, 48)), caption=b"make it red", mask=encoded(half))
    s = run(cfg(), root, store)
    assert s.written == 1 and s.quarantined == {"bad-source": 1}
    q = quarantined(store)["two.png"]
    assert q["detail"] == "several mask files in mask/: two.jpg, two.png", q["detail"]
    assert table(store)["one.png"][0]["has_mask"]
