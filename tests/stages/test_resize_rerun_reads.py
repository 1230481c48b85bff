"""A resize-bucket rerun over a folder source whose files are unchanged (a view setting changed, a few samples
added) reads no image bytes of the samples the newest version holds and hashes no key again
(stages/resize/known_sources.py): they are carried forward by their recorded key. A file rewritten in place, even
with the same size and its mtime put back, is read again. The table equals a fresh run's (rows, bytes, quarantine)."""

from __future__ import annotations

import os
import shutil
from collections import Counter
from pathlib import Path

from PIL import Image

from models import file_hashes
from pipeline.config import load_config
from pipeline.demo_data import make_demo_data
from stages.resize import content, folder_source, jsonl_source, judge, sources, stage
from stages.resize.split_rule import pictures_id, split_for
from store import Store

SMALL = {"resize.target_area": 64 * 64, "resize.control_vae_area": 64 * 64, "resize.control_vl_area": 32 * 32,
         "resize.multiple": 16, "resize.min_side": 16, "resize.max_controls": 2, "resize.shard_size_mb": 0.01}
LAYOUT = ("target", "control", "control_1", "mask")


def _rows(st: Store) -> dict[str, tuple]:
    with st.reader("images") as r:
        return {k: (r.files(k), r.meta(k)) for k in r.keys()}


def _quarantine(st: Store) -> list[tuple]:
    q = st.quarantine()
    return sorted(set(zip(q.column("source").to_pylist(), q.column("reason").to_pylist(),
                          q.column("key").to_pylist()))) if q is not None else []


class Reads:
    """Every source image read (read_source_file, not captions), file hashed and key computed, while active."""

    def __init__(self, monkeypatch) -> None:
        self.images: Counter = Counter()
        self.hashed: list[str] = []
        self.keys = 0
        real_read, real_sha, real_key = sources.read_source_file, file_hashes.file_sha256, judge.sample_key

        def read(p, *a):
            if a[2] != "caption":
                self.images[os.path.relpath(p, p.parents[1])] += 1
            return real_read(p, *a)

        def key(*a):
            self.keys += 1
            return real_key(*a)

        for reader in (folder_source, jsonl_source):
            monkeypatch.setattr(reader, "read_source_file", read)
        monkeypatch.setattr(file_hashes, "file_sha256", lambda p: self.hashed.append(str(p)) or real_sha(p))
        monkeypatch.setattr(content, "file_sha256", lambda p: self.hashed.append(str(p)) or real_sha(p))
        monkeypatch.setattr(judge, "sample_key", key)


def _source(tmp_path: Path, n: int = 16) -> Path:
    """Demo samples with masks, plus one undecodable target (quarantined) and a copy of sample 0 (a duplicate)."""
    src = tmp_path / "src"
    make_demo_data(src, n=n, fmt="folder", max_controls=2, seed=3, with_masks=True)
    (src / "target" / "sample_bad.png").write_bytes(b"\x89PNG\r\n\x1a\n not a png")
    (src / "target" / "sample_bad.txt").write_text("make it blue")
    for d in LAYOUT:
        for f in (src / d).glob("sample_0000.*"):
            shutil.copy(f, src / d / f.name.replace("sample_0000", "sample_0000_dup"))
    return src


def _same_as_fresh(tmp_path: Path, out: Path, src: Path, over: dict) -> None:
    fresh = tmp_path / f"fresh{len(list(tmp_path.glob('fresh*')))}"
    stage.run(load_config(None, {**SMALL, **over}), src, fresh)
    a, b = Store(out), Store(fresh)
    assert _rows(a) == _rows(b)  # same keys, PNG bytes, metadata (split, source, hashes...)
    assert _quarantine(a) == _quarantine(b)


def test_a_rerun_with_only_val_fraction_changed_reads_no_image_bytes(tmp_path: Path, monkeypatch) -> None:
    src, out = _source(tmp_path), tmp_path / "store"
    first = stage.run(load_config(None, {**SMALL, "resize.val_fraction": 0.1}), src, out)
    assert first.written == 16 and sum(first.quarantined.values()) == 2 and first.quarantined["duplicate"] == 1

    reads = Reads(monkeypatch)
    again = stage.run(load_config(None, {**SMALL, "resize.val_fraction": 0.5}), src, out)
    assert (again.written, again.reused, again.version) == (0, 16, 2)
    # only the two quarantined samples (not in the table) are read and keyed again; before: all 18, 18 keys
    assert set(reads.images) == {"target/sample_bad.png"} | {
        os.path.relpath(p, src) for p in src.rglob("sample_0000_dup.*") if p.suffix != ".txt"}
    assert max(reads.images.values()) == 1
    assert reads.keys == 2 and reads.hashed == []
    monkeypatch.undo()
    # carried unread, split by their pictures (recorded source_hashes) under the new fraction, as a fresh run
    assert Counter(split_for(k, pictures_id(m["source_hashes"]), 0.5, "pictures")
                   for k, (_, m) in _rows(Store(out)).items()) == again.splits
    _same_as_fresh(tmp_path, out, src, {"resize.val_fraction": 0.5})


def test_a_file_rewritten_with_the_same_size_and_mtime_is_read_again(tmp_path: Path, monkeypatch) -> None:
    src, out = _source(tmp_path), tmp_path / "store"
    target = src / "target" / "sample_0003.png"
    with Image.open(target) as im:  # its size kept: its mask (with_masks) is of its aspect
        size = im.size
    Image.new("RGB", size, (10, 200, 30)).save(target, compress_level=0)  # size set by the pixel count alone
    stage.run(load_config(None, SMALL), src, out)
    before = {m["source"]: k for k, (_, m) in _rows(Store(out)).items()}

    st = os.stat(target)
    with open(target, "r+b") as f:  # in place: same inode, same size, other pixels
        Image.new("RGB", size, (200, 10, 30)).save(f, compress_level=0)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime put back, as `touch -r` or `cp -p` would
    assert (os.stat(target).st_size, os.stat(target).st_mtime_ns) == (st.st_size, st.st_mtime_ns)

    reads = Reads(monkeypatch)
    again = stage.run(load_config(None, {**SMALL, "resize.val_fraction": 0.4}), src, out)
    assert again.written == 1 and again.reused == 15
    assert reads.images["target/sample_0003.png"] == 1
    assert {"target/sample_0001.png", "target/sample_0002.png"}.isdisjoint(reads.images)
    monkeypatch.undo()
    after = {m["source"]: k for k, (_, m) in _rows(Store(out)).items()}
    assert after[str(target)] != before[str(target)]
    assert {s: k for s, k in after.items() if s != str(target)} == \
        {s: k for s, k in before.items() if s != str(target)}
    _same_as_fresh(tmp_path, out, src, {"resize.val_fraction": 0.4})


def test_added_samples_alone_are_read(tmp_path: Path, monkeypatch) -> None:
    src, out = _source(tmp_path, n=19), tmp_path / "store"
    aside = tmp_path / "aside"
    for d in LAYOUT:
        (aside / d).mkdir(parents=True)
        for f in [*(src / d).glob("sample_0016.*"), *(src / d).glob("sample_0017.*"), *(src / d).glob("sample_0018.*")]:
            f.rename(aside / d / f.name)
    first = stage.run(load_config(None, SMALL), src, out)
    assert first.written == 16
    for d in LAYOUT:
        for f in (aside / d).iterdir():
            f.rename(src / d / f.name)

    reads = Reads(monkeypatch)
    again = stage.run(load_config(None, SMALL), src, out)
    assert again.written == 3 and again.reused == 16
    assert {p.split("/")[1].split(".")[0] for p in reads.images} == \
        {"sample_0016", "sample_0017", "sample_0018", "sample_bad", "sample_0000_dup"}
    monkeypatch.undo()
    _same_as_fresh(tmp_path, out, src, {})


def test_a_rerun_with_fewer_controls_allowed_quarantines_unread_samples_as_a_fresh_run(tmp_path: Path,
                                                                                         monkeypatch) -> None:
    src, out = _source(tmp_path), tmp_path / "store"
    stage.run(load_config(None, SMALL), src, out)
    reads = Reads(monkeypatch)
    again = stage.run(load_config(None, {**SMALL, "resize.max_controls": 1}), src, out)
    assert again.written == 0 and 0 < again.quarantined["control-count"] < 16
    assert {p.split("/")[1].split(".")[0] for p in reads.images} == {"sample_bad", "sample_0000_dup"}
    monkeypatch.undo()
    _same_as_fresh(tmp_path, out, src, {"resize.max_controls": 1})  # the same rows, the same control-count keys


def test_a_jsonl_source_rerun_reads_only_a_file_rewritten_in_place(tmp_path: Path, monkeypatch) -> None:
    """JSONL: the caption is in the line, so an unchanged sample's files are not opened at all; a target rewritten
    in place (same size, mtime put back) is read again and gets its new key."""
    import json

    src, out = tmp_path / "src", tmp_path / "store"
    make_demo_data(src, n=12, fmt="jsonl", max_controls=2, seed=4, with_masks=True)
    (manifest,) = src.glob("*.jsonl")
    target = src / json.loads(manifest.read_text().splitlines()[2])["target"]
    with Image.open(target) as im:  # its size kept: its mask (with_masks) is of its aspect
        size = im.size
    Image.new("RGB", size, (10, 200, 30)).save(target, compress_level=0)
    stage.run(load_config(None, SMALL), src, out)

    reads = Reads(monkeypatch)
    again = stage.run(load_config(None, {**SMALL, "resize.val_fraction": 0.5}), src, out)
    assert (again.written, again.reused) == (0, 12)
    assert not reads.images and reads.keys == 0 and reads.hashed == []  # before: 12 samples' files, 12 keys
    monkeypatch.undo()
    _same_as_fresh(tmp_path, out, src, {"resize.val_fraction": 0.5})

    st = os.stat(target)
    with open(target, "r+b") as f:
        Image.new("RGB", size, (200, 10, 30)).save(f, compress_level=0)  # the same size in bytes
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    reads = Reads(monkeypatch)
    third = stage.run(load_config(None, {**SMALL, "resize.val_fraction": 0.3}), src, out)
    assert third.written == 1 and third.reused == 11
    assert os.path.relpath(target, target.parents[1]) in reads.images and reads.keys == 1
    monkeypatch.undo()
    _same_as_fresh(tmp_path, out, src, {"resize.val_fraction": 0.3})
