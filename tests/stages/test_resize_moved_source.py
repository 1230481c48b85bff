"""resize-bucket with the same source content at another path (the dataset folder moved, renamed, mounted
elsewhere): a complete version is up to date and the summary says where it was read before and where now; a
killed run's version is resumed there (only the unfinished samples read and rendered) and ends equal to an
uninterrupted run at the new path; changed content still renders; `store repair` of a moved source says to pass
--source, and with it repairs (stages/resize/moved_source.py)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import models.file_hashes as file_hashes
from damage import HEADER, flip_bit, key_at, sample_byte
from pipeline.cli import app
from pipeline.config import load_config
from pipeline.demo_data import make_demo_data
from stages.resize import judge, stage
from store import Store
from store.verify import verify_store
from test_resize_resume_reads import _quarantine, _rows
import warm_start

SMALL = {"resize.target_area": 64 * 64, "resize.control_vae_area": 64 * 64, "resize.control_vl_area": 32 * 32,
         "resize.multiple": 16, "resize.min_side": 16, "resize.max_controls": 2, "resize.shard_size_mb": 0.01}
RUN = ("import sys; from pipeline.config import load_config; from stages.resize.stage import run;"
       f"run(load_config(None, {SMALL!r}), sys.argv[1], sys.argv[2])")


def _cfg():
    return load_config(None, SMALL)


def _killed(source: Path | str, store: Path, at: str = "after_shard_commit") -> None:
    done = warm_start.run([sys.executable, "-c", RUN, str(source), str(store)],  # started warm (tests/warm_start.py)
                          env={**os.environ, "STORE_CRASH_AT": at})
    assert done.returncode == -9, done.stderr[-2000:]


def _schema(st: Store) -> dict:
    return json.loads((st.version_dir("images", st.tables()["images"]) / "schema.json").read_text())


def test_a_moved_source_is_up_to_date_and_changed_content_there_renders(tmp_path: Path, monkeypatch) -> None:
    make_demo_data(tmp_path / "a", n=6, fmt="folder", max_controls=2, seed=1)
    st = Store(tmp_path / "store")
    first = stage.run(_cfg(), tmp_path / "a", st)
    (tmp_path / "a").rename(tmp_path / "b")
    read: list[int] = []
    real_sha = file_hashes.file_sha256
    monkeypatch.setattr(file_hashes, "file_sha256", lambda p: read.append(1) or real_sha(p))
    again = stage.run(_cfg(), tmp_path / "b", st)
    monkeypatch.undo()
    assert read == []  # the moved files known by their inodes: not read again for the listing hash
    assert again.up_to_date and again.version == 1 and again.written == 0 and st.versions("images") == [1]
    moved = [line for line in str(again).splitlines() if line.startswith("source:")]
    assert len(moved) == 1 and str(tmp_path / "a") in moved[0] and str(tmp_path / "b") in moved[0]
    assert again.to_json()["source_before"] == str(tmp_path / "a")
    assert first.to_json()["source_before"] is None and "source:" not in str(first)

    (tmp_path / "b" / "target" / "sample_0002.txt").write_text("a caption changed at the new path")
    changed = stage.run(_cfg(), tmp_path / "b", st)
    assert changed.version == 2 and changed.written == 1 and changed.reused == 5  # only the changed one rendered
    assert not changed.source_before  # v2 is read from b throughout
    with st.reader("images") as r:
        assert all(r.meta(k)["source"].startswith(str(tmp_path / "b")) for k in r.keys())
    assert _schema(st)["attrs"]["source"] == str(tmp_path / "b")


def _named(src: Path, how: str) -> Path | str:
    """The source as passed: its folder, its .jsonl file, or a brace list of its tars."""
    if how == "file":
        return src / "samples.jsonl"
    if how == "brace":
        tars = sorted(p.name for p in src.glob("*.tar"))
        assert len(tars) == 2
        return str(src / "demo-{000000..000001}.tar")
    return src


@pytest.mark.parametrize("fmt,before,after", [("folder", "dir", "dir"), ("jsonl", "file", "file"),
                                              ("webdataset", "dir", "brace"), ("parquet", "dir", "dir")])
def test_a_run_killed_then_moved_resumes_there(tmp_path: Path, monkeypatch, fmt: str, before: str,
                                              after: str) -> None:
    make_demo_data(tmp_path / "data" / "a", n=20, fmt=fmt, max_controls=2, seed=2)
    out = tmp_path / "store"
    _killed(_named(tmp_path / "data" / "a", before), out)
    (index,) = (out / "images" / "v1").glob("*.index.parquet")
    finished = pq.read_table(index, columns=["source"]).num_rows
    assert 0 < finished < 20
    # moved into a folder of another name at another depth (/data/x -> /mnt/x)
    (tmp_path / "mnt").mkdir()
    (tmp_path / "data" / "a").rename(tmp_path / "mnt" / "b")
    source = _named(tmp_path / "mnt" / "b", after)

    hashed: list[int] = []
    real_key = judge.sample_key
    monkeypatch.setattr(judge, "sample_key", lambda t, c, cap: hashed.append(1) or real_key(t, c, cap))
    resumed = stage.run(_cfg(), source, out)
    monkeypatch.undo()
    assert resumed.version == 1 and Store(out).versions("images") == [1]  # before: v2, all 20 rendered again
    assert resumed.resumed == finished and resumed.written == 20 - finished
    assert len(hashed) == 20 - finished  # the finished samples found by name, not read again
    assert resumed.source_before == str(tmp_path / "data" / "a" / ("samples.jsonl" if before == "file" else ""))\
        .rstrip("/")
    assert "resumed from" in str(resumed)

    fresh = stage.run(_cfg(), source, tmp_path / "fresh")
    assert fresh.written == 20 and not fresh.source_before
    a, b = Store(out), Store(tmp_path / "fresh")
    assert _rows(a) == _rows(b)  # same keys, PNG bytes and metadata: every row names the new path
    assert _quarantine(a) == _quarantine(b)
    assert _schema(a) == _schema(b)  # attrs.source: the new path
    assert verify_store(out, progress=False) == []


def test_an_adoption_killed_half_way_is_finished_wherever_the_source_is_then(tmp_path: Path) -> None:
    """Killed after the renamed copies of the indexes and the mark, before they were put in place: the next run
    (the folder moved back meanwhile) finishes that adoption, adopts the version back, and resumes it."""
    make_demo_data(tmp_path / "a", n=16, fmt="folder", max_controls=2, seed=3)
    out = tmp_path / "store"
    _killed(tmp_path / "a", out)
    (tmp_path / "a").rename(tmp_path / "b")
    _killed(tmp_path / "b", out, at="moved_source_marked")
    vdir = out / "images" / "v1"
    assert (vdir / ".source-moved.json").is_file() and list(vdir.glob(".*.tmp-moved"))
    (tmp_path / "b").rename(tmp_path / "a")
    resumed = stage.run(_cfg(), tmp_path / "a", out)
    assert resumed.version == 1 and resumed.resumed > 0 and resumed.resumed + resumed.written == 16
    assert not (vdir / ".source-moved.json").exists() and not list(vdir.glob(".*.tmp-moved"))
    stage.run(_cfg(), tmp_path / "a", tmp_path / "fresh")
    assert _rows(Store(out)) == _rows(Store(tmp_path / "fresh"))
    assert _schema(Store(out)) == _schema(Store(tmp_path / "fresh"))


def test_a_run_killed_then_moved_with_a_changed_file_renders_anew(tmp_path: Path) -> None:
    make_demo_data(tmp_path / "a", n=16, fmt="folder", max_controls=2, seed=2)
    out = tmp_path / "store"
    _killed(tmp_path / "a", out)
    (tmp_path / "a").rename(tmp_path / "b")
    (tmp_path / "b" / "target" / "sample_0000.txt").write_text("another caption")
    s = stage.run(_cfg(), tmp_path / "b", out)
    # another source listing: another lineage, so v1 (incomplete, never carried from) is not resumed
    assert s.version == 2 and s.resumed == 0 and s.written == 16 and not s.source_before
    assert json.loads((out / "images" / "v1" / "schema.json").read_text())["attrs"]["source"] == str(tmp_path / "a")


def test_repair_of_a_moved_source_asks_for_it_then_repairs_from_it(tmp_path: Path) -> None:
    import yaml

    runner = CliRunner()
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"resize": {k.split(".", 1)[1]: v for k, v in SMALL.items()}}))
    make_demo_data(tmp_path / "a", n=8, fmt="folder", max_controls=1, seed=1)
    store = tmp_path / "store"
    stage.run(load_config(config), tmp_path / "a", store)
    clean = Path(shutil.copytree(store, tmp_path / "clean"))
    key = key_at(store, "images", 3)
    flip_bit(*sample_byte(store, "images", key, HEADER, 3), 5)
    (tmp_path / "a").rename(tmp_path / "b")

    res = runner.invoke(app, ["store", "repair", str(store), "--config", str(config)])
    assert res.exit_code == 1
    assert f"built from {tmp_path / 'a'}, which is not there any more" in res.output and "--source" in res.output

    res = runner.invoke(app, ["store", "repair", str(store), "--config", str(config), "--source", str(tmp_path / "b")])
    assert res.exit_code == 0, res.output
    a, b = Store(clean).reader("images"), Store(store).reader("images")
    assert b.version == 2 and a.keys() == b.keys()
    assert all(a.files(k) == b.files(k) for k in a.keys())  # the damaged one re-rendered, the rest carried
    assert all(b.meta(k)["source"].startswith(str(tmp_path / "b")) for k in b.keys())
    assert json.loads((store / "images" / "v2" / "schema.json").read_text())["attrs"]["source"] == str(tmp_path / "b")
    assert verify_store(store, progress=False) == []


def test_renaming_in_the_indexes_of_an_adopted_version_has_a_bar(tmp_path: Path, capsys) -> None:
    """Every committed shard's index is rewritten and synced when a killed run's version is adopted at the new
    path: thousands of them for a million samples, with a bar counting them against their total."""
    make_demo_data(tmp_path / "a", n=20, fmt="folder", max_controls=2, seed=2)
    out = tmp_path / "store"
    _killed(tmp_path / "a", out)
    indexes = len(list((out / "images" / "v1").glob("*.index.parquet")))
    (tmp_path / "a").rename(tmp_path / "b")
    capsys.readouterr()
    assert stage.run(_cfg(), tmp_path / "b", out).source_before == str(tmp_path / "a")
    err = capsys.readouterr().err
    assert f"source moved: renaming in the shard indexes of v1:   0%|          | 0/{indexes} [00:00<?, ?index/s]" in err, err
