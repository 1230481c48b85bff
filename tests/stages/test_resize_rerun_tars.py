"""A resize-bucket rerun over a webdataset source whose tars are unchanged (a view setting changed) opens none of
them (stages/resize/known_tars.py): their samples are carried by their recorded rows. A tar rewritten in place
(same size, mtime put back) is read again, alone; a tar with a sample quarantined or dropped as a duplicate before
is read again, so its quarantine rows are a fresh run's. The table equals a fresh run's (rows, bytes, quarantine)."""

from __future__ import annotations

import io
import os
import tarfile
from collections import Counter
from pathlib import Path

from models import file_hashes
from pipeline.config import load_config
from pipeline.demo_data import make_demo_data
from stages.resize import content, stage, webdataset_source
from stages.resize.split_rule import pictures_id, split_for
from store import Store
from tests.stages.test_resize_rerun_reads import SMALL, _rows, _same_as_fresh


class Opened:
    """Every tar opened (streamed by the reader or header-walked by the sample count) and file hashed, while active."""

    def __init__(self, monkeypatch) -> None:
        self.tars: Counter = Counter()
        self.hashed: list[str] = []
        real_open_shard, real_tar_open, real_sha = webdataset_source.open_shard, tarfile.open, file_hashes.file_sha256

        def open_shard(url):
            self.tars[Path(url).name] += 1
            return real_open_shard(url)

        def tar_open(name=None, *a, **kw):
            if name is not None:
                self.tars[Path(name).name] += 1
            return real_tar_open(name, *a, **kw)

        monkeypatch.setattr(webdataset_source, "open_shard", open_shard)
        monkeypatch.setattr(tarfile, "open", tar_open)
        monkeypatch.setattr(file_hashes, "file_sha256", lambda p: self.hashed.append(str(p)) or real_sha(p))
        monkeypatch.setattr(content, "file_sha256", lambda p: self.hashed.append(str(p)) or real_sha(p))


def _members(tar: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(tar) as tf:
        return [(m.name, tf.extractfile(m).read()) for m in tf.getmembers()]


def _write_tar(tar: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(tar, "w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tf.addfile(info, io.BytesIO(data))


def _source(tmp_path: Path) -> Path:
    """Three tars of 16 demo samples (masks, up to 2 controls)."""
    src = tmp_path / "src"
    make_demo_data(src, n=48, fmt="webdataset", max_controls=2, seed=5, with_masks=True)
    assert [t.name for t in sorted(src.glob("*.tar"))] == ["demo-000000.tar", "demo-000001.tar", "demo-000002.tar"]
    return src


def test_unchanged_tars_are_not_opened_on_a_val_fraction_rerun(tmp_path: Path, monkeypatch) -> None:
    src, out = _source(tmp_path), tmp_path / "store"
    first = stage.run(load_config(None, {**SMALL, "resize.val_fraction": 0.1}), src, out)
    assert first.written == 48 and not first.quarantined

    opened = Opened(monkeypatch)
    again = stage.run(load_config(None, {**SMALL, "resize.val_fraction": 0.5}), src, out)
    assert (again.written, again.reused, again.version) == (0, 48, 2)
    assert not opened.tars and opened.hashed == []  # before: every tar streamed (and header-walked) again
    monkeypatch.undo()
    # carried unread, split by their pictures (recorded source_hashes) under the new fraction, as a fresh run
    assert Counter(split_for(k, pictures_id(m["source_hashes"]), 0.5, "pictures")
                   for k, (_, m) in _rows(Store(out)).items()) == again.splits
    _same_as_fresh(tmp_path, out, src, {"resize.val_fraction": 0.5})

    # the record is carried with v2: a third run opens none either
    opened = Opened(monkeypatch)
    third = stage.run(load_config(None, {**SMALL, "resize.val_fraction": 0.3, "resize.max_controls": 1}), src, out)
    assert not opened.tars and third.written == 0 and third.quarantined["control-count"] > 0
    monkeypatch.undo()
    _same_as_fresh(tmp_path, out, src, {"resize.val_fraction": 0.3, "resize.max_controls": 1})


def test_a_tar_rewritten_in_place_with_the_same_size_alone_is_read(tmp_path: Path, monkeypatch) -> None:
    src, out = _source(tmp_path), tmp_path / "store"
    stage.run(load_config(None, SMALL), src, out)
    before = {m["source"]: k for k, (_, m) in _rows(Store(out)).items()}

    tar = src / "demo-000001.tar"
    members = _members(tar)
    name, caption = next((n, d) for n, d in members if n.endswith(".txt"))
    changed = caption[::-1] if caption[::-1] != caption else caption.swapcase()
    assert len(changed) == len(caption) and changed != caption
    st = os.stat(tar)
    _write_tar(tar, [(n, changed if n == name else d) for n, d in members])  # in place: same inode
    os.utime(tar, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime put back, as `touch -r` or `cp -p` would
    assert (os.stat(tar).st_size, os.stat(tar).st_mtime_ns, os.stat(tar).st_ino) == \
        (st.st_size, st.st_mtime_ns, st.st_ino)

    opened = Opened(monkeypatch)
    again = stage.run(load_config(None, {**SMALL, "resize.val_fraction": 0.4}), src, out)
    # the listing hash reads it once (its ctime changed), the sample count walks its headers, the reader streams it
    assert set(opened.tars) == {"demo-000001.tar"} and opened.hashed == [str(tar)]
    assert again.written == 1 and again.reused == 47
    monkeypatch.undo()
    after = {m["source"]: k for k, (_, m) in _rows(Store(out)).items()}
    sample = f"{tar}:{name.split('.')[0]}"
    assert after[sample] != before[sample]
    assert {s: k for s, k in after.items() if s != sample} == {s: k for s, k in before.items() if s != sample}
    _same_as_fresh(tmp_path, out, src, {"resize.val_fraction": 0.4})


def test_tars_with_a_quarantined_or_duplicate_sample_are_read_again(tmp_path: Path, monkeypatch) -> None:
    src, out = _source(tmp_path), tmp_path / "store"
    t0, t1, t2 = sorted(src.glob("*.tar"))
    first_sample = [(n, d) for n, d in _members(t0) if n.startswith("sample_0000.")]
    _write_tar(t1, [*_members(t1), ("zz_bad.png", b"\x89PNG\r\n\x1a\n not a png"), ("zz_bad.txt", b"make it blue")])
    _write_tar(t2, [*_members(t2), *((n.replace("sample_0000", "zz_dup"), d) for n, d in first_sample)])
    first = stage.run(load_config(None, SMALL), src, out)
    assert first.written == 48 and sum(first.quarantined.values()) == 2 and first.quarantined["duplicate"] == 1

    opened = Opened(monkeypatch)
    again = stage.run(load_config(None, {**SMALL, "resize.val_fraction": 0.6}), src, out)
    assert (again.written, again.reused) == (0, 48) and again.quarantined == first.quarantined
    assert "demo-000000.tar" not in opened.tars and {"demo-000001.tar", "demo-000002.tar"} <= set(opened.tars)
    monkeypatch.undo()
    _same_as_fresh(tmp_path, out, src, {"resize.val_fraction": 0.6})


def test_a_carried_tar_sample_met_after_its_copy_is_read_from_its_tar(tmp_path: Path, monkeypatch) -> None:
    """A tar added before an unchanged one, holding a copy of one of its samples: that sample is now the
    duplicate, judged from its bytes (read from its tar), as a fresh run judges it."""
    src, out = _source(tmp_path), tmp_path / "store"
    stage.run(load_config(None, SMALL), src, out)
    t1 = src / "demo-000001.tar"
    copy = [(n.replace("sample_0016", "aa_copy"), d) for n, d in _members(t1) if n.startswith("sample_0016.")]
    assert copy
    _write_tar(src / "a-first.tar", copy)

    opened = Opened(monkeypatch)
    again = stage.run(load_config(None, {**SMALL, "resize.val_fraction": 0.2}), src, out)
    assert again.quarantined["duplicate"] == 1 and again.reused == 48
    assert opened.tars["demo-000000.tar"] == 0 and opened.tars["demo-000002.tar"] == 0 and opened.tars[t1.name] == 1
    monkeypatch.undo()
    _same_as_fresh(tmp_path, out, src, {"resize.val_fraction": 0.2})


def test_a_lower_max_file_bytes_reads_the_tars_again(tmp_path: Path, monkeypatch) -> None:
    """resize.max_file_bytes is a view setting: lowered, a member now over it quarantines its sample, as in a
    fresh run; the tars read under a higher limit are not carried (their members' sizes are not recorded)."""
    src, out = _source(tmp_path), tmp_path / "store"
    stage.run(load_config(None, SMALL), src, out)
    sizes = sorted(len(d) for t in src.glob("*.tar") for n, d in _members(t) if n.endswith(".png"))
    limit = sizes[len(sizes) // 2]

    opened = Opened(monkeypatch)
    again = stage.run(load_config(None, {**SMALL, "resize.max_file_bytes": limit}), src, out)
    assert again.quarantined["bad-source"] > 0 and len(opened.tars) == 3
    monkeypatch.undo()
    _same_as_fresh(tmp_path, out, src, {"resize.max_file_bytes": limit})


def test_a_lowered_pixel_limit_streams_each_tar_holding_a_sample_to_check_once(tmp_path: Path, monkeypatch) -> None:
    """Samples with a control or a mask are checked from their bytes under a lowered resize.max_image_pixels
    (pixel_limit.py): their tar is read whole once, not streamed again up to each such sample (16 opens a tar)."""
    src, out = _source(tmp_path), tmp_path / "store"
    stage.run(load_config(None, SMALL), src, out)
    areas = sorted(m["source_size"][0] * m["source_size"][1] for _, m in _rows(Store(out)).values())
    over = {"resize.max_image_pixels": areas[-1] - 1}
    opened = Opened(monkeypatch)
    lowered = stage.run(load_config(None, {**SMALL, **over}), src, out)
    assert lowered.quarantined["image-too-large"] >= 1
    assert opened.tars and max(opened.tars.values()) <= 2, opened.tars  # streamed + header-walked, at most
    monkeypatch.undo()
    _same_as_fresh(tmp_path, out, src, over)


def test_a_note_of_another_tar_reader_revision_carries_nothing(tmp_path: Path, monkeypatch) -> None:
    """The rules making samples of a tar's members are not in the render lineage: a note written under another
    revision of them (`known_tars.READER`) carries no tar, so a changed rule applies to every tar as in a fresh run."""
    from stages.resize import known_tars

    src, out = _source(tmp_path), tmp_path / "store"
    monkeypatch.setattr(known_tars, "READER", known_tars.READER + 1)
    stage.run(load_config(None, SMALL), src, out)
    monkeypatch.undo()
    opened = Opened(monkeypatch)
    again = stage.run(load_config(None, {**SMALL, "resize.val_fraction": 0.5}), src, out)
    assert again.written == 0 and set(opened.tars) == {t.name for t in src.glob("*.tar")}  # every tar read anew
    monkeypatch.undo()
    opened = Opened(monkeypatch)
    stage.run(load_config(None, {**SMALL, "resize.val_fraction": 0.3}), src, out)
    assert not opened.tars  # the note of this revision, written by the run before, carries them all
