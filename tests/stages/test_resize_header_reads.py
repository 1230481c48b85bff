"""The rerun of a store rendered before resize-bucket revision 4 reads each carried sample's pictures' headers
(header_checks.py) from their first bytes (a bounded prefix, more only for a longer header), not whole: before,
every picture of the source was read whole once per store (terabytes at 1M samples of ~1.5 MB pictures). Its
result is the one reading them whole gives (and a fresh store's)."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest
from PIL import Image, PngImagePlugin

from features.decode import has_transparent_colour
from pipeline.config import load_config
from stages.resize import folder_source, jsonl_source, picture_heads, sources, webdataset_source
from stages.resize import stage as resize_stage
from stages.resize.header_checks import FIRST_READ, from_header
from stages.resize.pixel_limit import picture_pixels

from tests.stages.test_fix_revisions_resize import SMALL, _contents
from tests.stages.test_fix_revisions_resize4 import _build_at_revision_3


def _noise(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 255, (240, 320, 3), dtype=np.uint8)  # ~230 KB as PNG


def _png(seed: int, keyed: bool = False, text: int = 0) -> bytes:
    arr, info = _noise(seed), PngImagePlugin.PngInfo()
    if text:  # an ancillary chunk before the image data (and the tRNS): a header longer than the first read
        info.add_text("comment", "x" * text)
    b = io.BytesIO()
    Image.fromarray(arr).save(b, format="PNG", pnginfo=info, **({"transparency": (0, 0, 0)} if keyed else {}))
    return b.getvalue()


def _counting(data: bytes, asked: list[int]):
    def read_first(n: int) -> bytes:
        asked.append(n)
        return data[:n]
    return read_first


def test_a_header_is_read_from_a_prefix_that_grows_only_while_the_header_goes_on():
    jpeg = io.BytesIO()
    big = np.random.default_rng(3).integers(1, 255, (720, 960, 3), dtype=np.uint8)
    Image.fromarray(big).save(jpeg, format="JPEG", quality=95, icc_profile=bytes(100_000))  # markers of 100 KB
    cases = [(_png(1), has_transparent_colour, False), (_png(2, keyed=True), has_transparent_colour, True),
             (_png(2, keyed=True, text=200_000), has_transparent_colour, True),
             (_png(1), picture_pixels, 320 * 240), (jpeg.getvalue(), picture_pixels, 720 * 960)]
    for data, judge, expected in cases:
        asked: list[int] = []
        assert from_header(_counting(data, asked), judge) == expected == judge(io.BytesIO(data))
        assert max(asked) < len(data)  # never the whole picture
    asked = []
    from_header(_counting(_png(1), asked), has_transparent_colour)
    assert asked == [FIRST_READ + 1]  # one read of a plain PNG's first 64 KiB
    asked = []
    from_header(_counting(_png(2, keyed=True, text=200_000), asked), has_transparent_colour)
    assert asked == [FIRST_READ + 1, 4 * FIRST_READ + 1]  # its tRNS past 200 KB of text: 256 KiB


def _webps() -> dict[str, bytes]:
    """WebP files of each first chunk: a simple lossy one (VP8), a lossless one (VP8L), one with alpha and one
    animated (VP8X: a canvas size), each past the first read."""
    big = Image.fromarray(np.random.default_rng(4).integers(1, 255, (300, 420, 3), dtype=np.uint8))
    cutout = big.convert("RGBA")
    cutout.putalpha(Image.fromarray(np.where(np.arange(420) < 30, 0, 255).astype(np.uint8)[None].repeat(300, 0)))
    out = {}
    for name, im, kw in (("lossy", big, {"quality": 95}), ("lossless", big, {"lossless": True}),
                         ("alpha", cutout, {"quality": 95}),
                         ("animated", big, {"save_all": True, "append_images": [big.rotate(180)], "lossless": True})):
        b = io.BytesIO()
        im.save(b, format="WEBP", **kw)
        out[name] = b.getvalue()
    return out


def test_a_webp_header_is_read_from_its_first_bytes_as_its_whole_file_says(monkeypatch):
    """Pillow reads a WebP whole to open it: its header checks read the RIFF header's first chunk instead (a VP8X
    canvas, a VP8 / VP8L frame header), answering as the whole file does, Pillow's bomb limit included."""
    from PIL import WebPImagePlugin

    from stages.resize.header_checks import HeaderChecks, Heads, webp_keyed
    from stages.resize.pixel_limit import PixelLimit, webp_pixels

    webps = _webps()
    assert {name: data[12:16] for name, data in webps.items()} == {"lossy": b"VP8 ", "lossless": b"VP8L",
                                                                    "alpha": b"VP8X", "animated": b"VP8X"}
    for limit in (None, 50_000):  # Pillow's own hard limit (2 x MAX_IMAGE_PIXELS) under the size: not opened
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", limit)
        for name, data in webps.items():
            assert len(data) > FIRST_READ + 1, name
            for judge, webp in ((picture_pixels, webp_pixels), (has_transparent_colour, webp_keyed)):
                asked: list[int] = []
                assert from_header(_counting(data, asked), judge, webp) == judge(io.BytesIO(data)), (name, judge)
                assert asked == [FIRST_READ + 1], (name, judge)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 50_000)
    assert picture_pixels(io.BytesIO(webps["lossy"])) == float("inf") and has_transparent_colour(webps["lossy"])
    monkeypatch.undo()
    assert picture_pixels(io.BytesIO(webps["lossy"])) == 420 * 300
    # a revision-3 row and a lowered pixel limit: each picture's first bytes alone, the answer the whole gives
    for limit, fits in ((420 * 300, True), (420 * 300 - 1, False)):
        asked = []
        checks = HeaderChecks(PixelLimit(limit, {"k": (float("inf"), True)}), colour_checked={"k"})
        heads = Heads(_counting(webps["lossy"], asked), (_counting(webps["alpha"], asked),
                                                         _counting(webps["animated"], asked)), None)
        assert checks.heads_fit("k", heads) is fits
        assert set(asked) == {FIRST_READ + 1}
    # a file whose first chunk is no frame header Pillow knows is judged from the whole file, as before
    damaged = webps["lossy"][:23] + b"\0\0\0" + webps["lossy"][26:]
    asked = []
    assert from_header(_counting(damaged, asked), picture_pixels, webp_pixels) == picture_pixels(io.BytesIO(damaged))
    assert max(asked) > len(damaged)
    assert WebPImagePlugin.SUPPORTED


def _folder(root, pictures: dict[str, list[bytes]]) -> None:
    for i in range(max(len(p) for p in pictures.values())):
        (root / ("target" if i == 0 else "control" if i == 1 else f"control_{i - 1}")).mkdir(parents=True)
    for stem, pics in pictures.items():
        for i, data in enumerate(pics):
            (root / ("target" if i == 0 else "control" if i == 1 else f"control_{i - 1}") / f"{stem}.png").write_bytes(data)
        (root / "target" / f"{stem}.txt").write_text(f"edit {stem}")


def _tar(root, pictures: dict[str, list[bytes]]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(root / "a.tar", "w", format=tarfile.USTAR_FORMAT) as tf:
        for stem, pics in pictures.items():
            exts = ["png", *("control.png" if i == 0 else f"control_{i}.png" for i in range(len(pics) - 1))]
            for ext, data in [*zip(exts, pics), ("txt", f"edit {stem}".encode())]:
                info = tarfile.TarInfo(f"{stem}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))


def _jsonl(root, pictures: dict[str, list[bytes]]) -> None:
    import json

    (root / "img").mkdir(parents=True)
    lines = []
    for stem, pics in pictures.items():
        for i, data in enumerate(pics):
            (root / "img" / f"{stem}_{i}.png").write_bytes(data)
        lines.append({"target": f"img/{stem}_0.png", "controls": [f"img/{stem}_{i}.png" for i in range(1, len(pics))],
                      "caption": f"edit {stem}"})
    (root / "pairs.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


PICTURES = {"plain0": [_png(10), _png(11), _png(12)], "plain1": [_png(13), _png(14)],
            "cutout": [_png(15), _png(16, keyed=True)]}  # its control's transparent colour: rendered again


@pytest.mark.parametrize("layout", [_folder, _jsonl, _tar])
def test_a_revision_3_rerun_reads_the_carried_pictures_first_bytes_only(monkeypatch, tmp_path, layout):
    cfg = load_config(None, SMALL)
    layout(tmp_path / "src", PICTURES)
    _build_at_revision_3(monkeypatch, cfg, tmp_path / "src", tmp_path / "store")
    for copy in ("whole", "heads"):
        (tmp_path / copy).mkdir()
        for f in (tmp_path / "store").rglob("*"):
            dest = tmp_path / copy / f.relative_to(tmp_path / "store")
            dest.mkdir(exist_ok=True) if f.is_dir() else dest.write_bytes(f.read_bytes())

    whole_reads, first_reads, streamed = [], [], []
    real_file, real_first, real_open = sources.read_source_file, picture_heads.read_first, webdataset_source.open_shard
    for reader in (folder_source, jsonl_source):
        monkeypatch.setattr(reader, "read_source_file", lambda *a, **k: whole_reads.append(len(d := real_file(*a, **k))) or d)
    monkeypatch.setattr(webdataset_source, "open_shard", lambda url: streamed.append(url) or real_open(url))

    def counted_first(path, n, offset=0, size=None):
        data = real_first(path, n, offset, size)
        first_reads.append((n, len(data)))
        return data

    with monkeypatch.context() as m:  # today's rerun: every carried picture read whole for its header
        m.setattr(picture_heads, "read_first", lambda *a, **k: (_ for _ in ()).throw(OSError(5, "off")))
        whole = resize_stage.run(cfg, tmp_path / "src", tmp_path / "whole")
    whole_reads.clear(), streamed.clear()
    monkeypatch.setattr(picture_heads, "read_first", counted_first)
    rerun = resize_stage.run(cfg, tmp_path / "src", tmp_path / "heads")

    assert (rerun.written, rerun.reused) == (whole.written, whole.reused) == (1, 2)
    assert _contents(tmp_path / "heads") == _contents(tmp_path / "whole")
    # the 7 pictures' headers from their first 64 KiB; the cut-out's 2 pictures read whole to render it
    heads = [got for n, got in first_reads if n == FIRST_READ + 1]
    assert heads == [FIRST_READ + 1] * 7 and 3 * (FIRST_READ + 1) < min(len(p) for ps in PICTURES.values() for p in ps)
    cutout = sorted(len(p) for p in PICTURES["cutout"])
    if layout is not _tar:
        assert sorted(n for n in whole_reads if n > 100) == cutout  # no other picture read whole (100: a caption)
    else:  # its members by their offsets, the tar never streamed
        assert streamed == [] and sorted(got for n, got in first_reads if n != FIRST_READ + 1) == \
            sorted([*cutout, len(b"edit cutout")])
    resize_stage.run(cfg, tmp_path / "src", tmp_path / "fresh")
    assert _contents(tmp_path / "heads") == _contents(tmp_path / "fresh")


def test_a_tar_rewritten_after_its_walk_is_read_by_streaming_not_at_its_old_offsets(tmp_path):
    """A carried tar's samples are read by the offsets one walk of its headers found; a tar rewritten since (the
    same names in another order) would give another member's bytes there: it is streamed instead."""
    pictures = {"s0": [_png(20)], "s1": [_png(21)]}
    _tar(tmp_path / "src", pictures)
    tar = str(tmp_path / "src" / "a.tar")
    index = picture_heads.TarIndex(tar, 1 << 30)
    assert index.sample(f"{tar}:s1").target == pictures["s1"][0]  # walked, read by its offsets
    (tmp_path / "src" / "a.tar").unlink()
    _tar(tmp_path / "src", {"s1": pictures["s1"], "s0": pictures["s0"]})
    assert index.heads(f"{tar}:s1") is None
    assert index.sample(f"{tar}:s1").target == pictures["s1"][0]


def test_a_tar_read_whole_keeps_no_header_of_its_members(monkeypatch, tmp_path):
    """tarfile remembers every header it meets (~1 KB each): a tar of a million samples (a folder dataset put in one
    `.tar`) held GBs of them while streamed, and again while counted for the bar. Each header is let go once read:
    at most the one being read is held, however many members."""
    from stages.resize.source_count import count_samples

    _tar(tmp_path / "src", {f"s{i}": [b"not a picture"] for i in range(40)})  # 80 members
    held = []
    real_next = tarfile.TarFile.next

    def next_header(self):
        held.append(len(self.members))
        return real_next(self)

    monkeypatch.setattr(tarfile.TarFile, "next", next_header)
    tar = str(tmp_path / "src" / "a.tar")
    assert count_samples(tar, "webdataset") == 40
    assert len(list(webdataset_source.iter_webdataset(tar))) == 40
    assert len(held) > 160 and max(held) <= 1
    held.clear()
    assert len(picture_heads.TarIndex(tar, 1 << 30).heads(f"{tar}:s3").controls) == 0
    assert len(held) > 80 and max(held) <= 1


def test_a_carried_tar_whose_headers_do_not_read_is_streamed_for_its_samples(tmp_path):
    """A walk that fails (a header cut, a read error) gives no offsets: each sample is read by streaming, which
    quarantines what it cannot read as a fresh run does, instead of the run stopping on tarfile's error."""
    pictures = {"s0": [_png(20)], "s1": [_png(21)]}
    _tar(tmp_path / "src", pictures)
    tar = tmp_path / "src" / "a.tar"
    data = tar.read_bytes()
    tar.write_bytes(data[:512 + len(pictures["s0"][0]) + 100])  # cut in s0's caption header
    index = picture_heads.TarIndex(str(tar), 1 << 30)
    assert index.heads(f"{tar}:s1") is None
    again = index.sample(f"{tar}:s1")
    assert again.target is None and "no longer in" in again.problem


def test_a_carried_tar_whose_samples_became_copies_is_not_streamed_once_a_sample(monkeypatch, tmp_path):
    """A tar added before a carried one (sorted first) holding copies of its samples makes each of them a duplicate,
    judged from its bytes: read by its members' offsets, not by streaming the tar up to it once per sample (a tar
    of n samples was read ~n/2 times whole). The quarantine is a fresh run's."""
    cfg = load_config(None, SMALL)
    pictures = {f"s{i}": [_png(30 + i)] for i in range(4)}
    src = tmp_path / "src"
    src.mkdir()
    with tarfile.open(src / "b.tar", "w", format=tarfile.USTAR_FORMAT) as tf:
        for stem, (data,) in pictures.items():
            for ext, member in (("png", data), ("txt", f"edit {stem}".encode())):
                info = tarfile.TarInfo(f"{stem}.{ext}")
                info.size = len(member)
                tf.addfile(info, io.BytesIO(member))
    resize_stage.run(cfg, src, tmp_path / "store")
    (src / "a.tar").write_bytes((src / "b.tar").read_bytes())  # the same samples, listed first now

    streamed = []
    real_open = webdataset_source.open_shard
    monkeypatch.setattr(webdataset_source, "open_shard", lambda url: streamed.append(url) or real_open(url))
    rerun = resize_stage.run(cfg, src, tmp_path / "store")
    assert (rerun.written, rerun.quarantined["duplicate"]) == (0, 4)
    assert streamed.count(str(src / "b.tar")) == 0  # 4 before: one stream a copy
    resize_stage.run(cfg, src, tmp_path / "fresh")
    from store import Store

    def quarantine(store):
        return sorted((r["reason"], r["source"], r["detail"]) for r in Store(store).quarantine().to_pylist())
    assert quarantine(tmp_path / "store") == quarantine(tmp_path / "fresh")


def test_a_revision_3_rerun_of_a_parquet_source_checks_its_rows_from_their_row_groups(monkeypatch, tmp_path):
    """A parquet row's cells have no prefix to read: each carried row is checked from its row group's mapped
    columns (parquet_source._RowGroups), each group read once, the file carried (before: read whole, every row
    judged from its bytes). The cut-out alone is rendered again, as a fresh run renders it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stages.resize import parquet_source

    cfg = load_config(None, SMALL)
    (tmp_path / "src").mkdir()
    stems = list(PICTURES)
    pq.write_table(pa.table({
        "target": pa.array([PICTURES[s][0] for s in stems], pa.binary()),
        "controls": pa.array([PICTURES[s][1:] for s in stems], pa.list_(pa.binary())),
        "caption": pa.array([f"edit {s}" for s in stems]),
    }), tmp_path / "src" / "pairs.parquet", row_group_size=2)
    _build_at_revision_3(monkeypatch, cfg, tmp_path / "src", tmp_path / "store")
    groups, whole = [], []
    real_group, real_file = parquet_source._RowGroups._read_group, parquet_source._file_samples
    monkeypatch.setattr(parquet_source._RowGroups, "_read_group", lambda self, no: groups.append(no) or
                        real_group(self, no))
    monkeypatch.setattr(parquet_source, "_file_samples", lambda *a, **k: whole.append(a[0]) or real_file(*a, **k))
    rerun = resize_stage.run(cfg, tmp_path / "src", tmp_path / "store")
    assert (rerun.written, rerun.reused) == (1, 2)
    # rows in the version's order: each of the 2 groups read once (the cut-out read again from the kept group)
    assert whole == [] and len(groups) == 2 and {no // 2 for no in groups} == {0, 1}
    monkeypatch.undo()
    resize_stage.run(cfg, tmp_path / "src", tmp_path / "fresh")
    assert _contents(tmp_path / "store") == _contents(tmp_path / "fresh")
