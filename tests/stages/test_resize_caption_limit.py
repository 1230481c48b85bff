"""A caption over resize.max_caption_bytes (a log or a whole text named like a caption) is quarantined by resize,
per sample, as caption-too-long: the row names the file, its size and the limit. Before, any caption up to
resize.max_file_bytes (1 GiB) went into the images table and every version after it; encode-text refused it only
later. A limit lowered on a rerun refuses a carried sample's caption as a fresh run does; the default enters no
fingerprint, so a store made before keeps its own and its unchanged tars stay unread."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import load_config
from stages.resize import stage
from stages.resize.sources import DEFAULT_MAX_CAPTION_BYTES
from store import Store
from store.version_notes import note_path
from tests.stages.test_hostile_sources import _png, _quarantine, _resize, _stored_captions
from tests.stages.test_resize_rerun_reads import SMALL, _same_as_fresh
from tests.stages.test_resize_parquet import IMAGE
from tests.stages.test_resize_rerun_tars import Opened

LOG = b"2026-12-06 05:00:01 INFO step 1 loss 0.1234\n" * 1700  # 74,800 bytes: a log named like a caption


def _folder(src: Path, captions: dict[str, bytes]) -> None:
    (src / "target").mkdir(parents=True)
    for i, (stem, caption) in enumerate(captions.items()):
        (src / "target" / f"{stem}.png").write_bytes(_png((10 * i, 40, 40)))
        (src / "target" / f"{stem}.txt").write_bytes(caption)


def _tar(tar: Path, captions: dict[str, bytes]) -> None:
    tar.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tar, "w", format=tarfile.USTAR_FORMAT) as tf:
        for i, (key, caption) in enumerate(captions.items()):
            for name, data in ((f"{key}.png", _png((10 * i, 40, 40))), (f"{key}.txt", caption)):
                info = tarfile.TarInfo(name)
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                tf.addfile(info, io.BytesIO(data))


def test_a_caption_file_over_the_default_limit_is_quarantined_unread_naming_it(tmp_path, monkeypatch):
    src = tmp_path / "src"
    _folder(src, {"ok": b"make it red", "log": LOG})
    real, read = os.fdopen, []  # the size of each file opened for reading (read_source_file's fdopen)
    monkeypatch.setattr(os, "fdopen", lambda fd, *a, **kw: read.append(os.fstat(fd).st_size) or real(fd, *a, **kw))
    result = _resize(src, tmp_path / "store")
    monkeypatch.undo()
    assert result.exit_code == 0, result.output
    assert len(LOG) not in read  # refused from its size
    reason, detail = _quarantine(tmp_path / "store")[str(src / "target" / "log.png")]
    assert reason == "caption-too-long"
    assert f"caption {src / 'target' / 'log.txt'} is {len(LOG)} bytes, over resize.max_caption_bytes (65536)" in detail
    assert "raise resize.max_caption_bytes" in detail
    assert _stored_captions(tmp_path / "store") == ["make it red"]


def test_a_jsonl_field_and_a_tar_member_over_the_limit_are_quarantined(tmp_path):
    src = tmp_path / "jsonl"
    src.mkdir()
    for name in ("a", "b"):
        (src / f"{name}.png").write_bytes(_png((1, 2, 3) if name == "a" else (3, 2, 1)))
    lines = [{"target": "a.png", "caption": "fine"}, {"target": "b.png", "caption": "x" * 101}]
    (src / "m.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert _resize(src, tmp_path / "s1", "resize.max_caption_bytes=100").exit_code == 0
    (reason, detail), = [v for k, v in _quarantine(tmp_path / "s1").items() if "b.png" in k]
    assert reason == "caption-too-long" and "is 101 bytes, over resize.max_caption_bytes (100)" in detail
    assert _stored_captions(tmp_path / "s1") == ["fine"]

    tars = tmp_path / "tars"
    _tar(tars / "a.tar", {"ok": b"fine", "long": b"y" * 101})
    assert _resize(tars, tmp_path / "s2", "resize.max_caption_bytes=100").exit_code == 0
    reason, detail = _quarantine(tmp_path / "s2")[f"{tars / 'a.tar'}:long"]
    assert reason == "caption-too-long" and "member 'long.txt' is 101 bytes, over resize.max_caption_bytes" in detail
    assert _stored_captions(tmp_path / "s2") == ["fine"]


def _parquet(path: Path, captions: dict[str, bytes]) -> None:
    path.parent.mkdir(parents=True)
    images = [{"bytes": _png((10 * i, 40, 40)), "path": f"{k}.png"} for i, k in enumerate(captions)]
    pq.write_table(pa.table({"t": pa.array(images, IMAGE), "text": [c.decode() for c in captions.values()]}), path)


PARQUET = {"resize.columns.target": "t", "resize.columns.references": [], "resize.columns.instruction": "text"}


def test_a_lowered_limit_refuses_carried_captions_as_a_fresh_run(tmp_path):
    """A folder's caption is read again for a carried sample; a tar or parquet file carried unread is read whole
    when a stored caption is over the lowered limit (its note recorded a higher one)."""
    for fmt in ("folder", "webdataset", "parquet"):
        src, out = tmp_path / fmt / "src", tmp_path / fmt / "store"
        captions = {"short": b"make it red", "long": b"z" * 200}
        {"folder": lambda: _folder(src, captions), "webdataset": lambda: _tar(src / "a.tar", captions),
         "parquet": lambda: _parquet(src / "d.parquet", captions)}[fmt]()
        over = PARQUET if fmt == "parquet" else {}
        first = stage.run(load_config(None, {**SMALL, **over}), src, out)
        assert first.written == 2 and not first.quarantined
        lowered = {**over, "resize.max_caption_bytes": 100}
        again = stage.run(load_config(None, {**SMALL, **lowered}), src, out)
        assert (again.written, again.reused, again.quarantined) == (0, 1, {"caption-too-long": 1}), fmt
        _same_as_fresh(tmp_path / fmt, out, src, lowered)


def test_a_store_made_before_the_limit_keeps_its_fingerprint_and_its_tars_unread(tmp_path, monkeypatch):
    src, out = tmp_path / "src", tmp_path / "store"
    _tar(src / "a.tar", {"short": b"make it red", "other": b"make it blue"})
    first = stage.run(load_config(None, SMALL), src, out)
    note = note_path(out, "images", first.version, "source-tars")
    recorded = json.loads(note.read_text())
    assert recorded["value"].pop("max_caption_bytes") == 65536 == DEFAULT_MAX_CAPTION_BYTES
    note.write_text(json.dumps(recorded))  # as a run before the setting wrote it
    again = stage.run(load_config(None, SMALL), src, out)
    assert again.version == first.version  # up to date: the default is hashed as unset
    opened = Opened(monkeypatch)
    view = stage.run(load_config(None, {**SMALL, "resize.val_fraction": 0.5}), src, out)
    assert (view.written, view.reused) == (0, 2) and not opened.tars  # its stored captions fit: carried unread
    monkeypatch.undo()
    assert sorted(Store(out).reader("images").meta(k)["caption"] for k in Store(out).reader("images").keys()) == \
        ["make it blue", "make it red"]
