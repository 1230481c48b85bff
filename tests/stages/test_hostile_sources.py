"""Hostile sources through `pipeline run resize-bucket`: nothing outside the source is read (symlinks, `..`),
only regular files of at most `resize.max_file_bytes` are read (a `/dev/zero` path is refused at once, unread),
and a tar member twice in one sample is quarantined rather than silently keeping the last copy."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

from PIL import Image
from typer.testing import CliRunner

from pipeline.cli import app
from store import Store


def _png(colour=(200, 40, 40), size=(64, 64)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def _resize(source: Path, store: Path, *sets: str):
    args = ["run", "resize-bucket", "--source", str(source), "--store", str(store), "--set", "resize.target_area=4096",
            "--set", "resize.multiple=16", "--set", "resize.val_fraction=0.0"]
    for s in sets:
        args += ["--set", s]
    result = CliRunner().invoke(app, args)
    assert "Traceback" not in result.output, result.output
    return result


def _quarantine(store: Path) -> dict[str, tuple[str, str]]:
    """source -> (reason, detail)."""
    return {r["source"]: (r["reason"], r["detail"]) for r in Store(store, create=False).quarantine().to_pylist()}


def _stored_captions(store: Path) -> list[str]:
    r = Store(store, create=False).reader("images")
    try:
        return sorted(r.meta(k)["caption"] for k in r.keys())
    finally:
        r.close()


def test_a_folder_source_never_follows_a_symlink_outside(tmp_path):
    secret = tmp_path / "elsewhere" / "secret.png"
    secret.parent.mkdir()
    secret.write_bytes(_png((1, 2, 3)))
    (tmp_path / "elsewhere" / "note.txt").write_text("a secret caption")
    src = tmp_path / "src"
    (src / "target").mkdir(parents=True)
    (src / "target" / "ok.png").write_bytes(_png())
    (src / "target" / "ok.txt").write_text("fine")
    (src / "target" / "x.png").symlink_to(secret)
    (src / "target" / "x.txt").write_text("stolen")
    (src / "target" / "y.png").write_bytes(_png((9, 9, 9)))
    (src / "target" / "y.txt").symlink_to(tmp_path / "elsewhere" / "note.txt")
    inside = src / "target" / "z.png"  # a symlink within the source is fine
    (src / "real").mkdir()
    (src / "real" / "z.png").write_bytes(_png((5, 50, 5)))
    inside.symlink_to(src / "real" / "z.png")
    (src / "target" / "z.txt").write_text("linked inside")
    result = _resize(src, tmp_path / "store")
    assert result.exit_code == 0, result.output
    q = _quarantine(tmp_path / "store")
    assert q[str(src / "target" / "x.png")][0] == "outside-source"
    assert "outside the source" in q[str(src / "target" / "x.png")][1]
    assert q[str(src / "target" / "y.png")][0] == "outside-source"
    assert _stored_captions(tmp_path / "store") == ["fine", "linked inside"]


def test_jsonl_paths_stay_in_their_folder_and_only_regular_files_are_read(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok.png").write_bytes(_png())
    (tmp_path / "outside.png").write_bytes(_png((3, 3, 3)))
    big = src / "big.png"
    big.write_bytes(_png() + b"\0" * 5000)
    os.mkfifo(src / "fifo.png")
    lines = [
        {"target": "ok.png", "caption": "fine"},
        {"target": "../outside.png", "caption": "traversal"},
        {"target": "../../../../../../etc/passwd", "caption": "passwd"},
        {"target": "/dev/zero", "caption": "endless"},  # absolute: allowed, but not a regular file
        {"target": "fifo.png", "caption": "fifo"},
        {"target": "big.png", "caption": "big"},
        {"target": str(tmp_path / "outside.png"), "caption": "absolute is allowed"},
    ]
    (src / "data.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = _resize(src, tmp_path / "store", "resize.max_file_bytes=4000")
    assert result.exit_code == 0, result.output
    reasons = {src_.split(":")[-1].split(" ")[0]: v for src_, v in _quarantine(tmp_path / "store").items()}
    assert reasons["2"][0] == "outside-source" and reasons["3"][0] == "outside-source"
    assert reasons["4"][0] == "not-a-file" and reasons["5"][0] == "not-a-file"
    assert reasons["6"][0] == "file-too-large" and "resize.max_file_bytes" in reasons["6"][1]
    assert _stored_captions(tmp_path / "store") == ["absolute is allowed", "fine"]


def test_a_tar_member_twice_is_quarantined_and_a_large_member_unread(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    with tarfile.open(src / "a.tar", "w") as tf:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))

        add("ok.png", _png())
        add("ok.txt", b"fine")
        add("dup.png", _png((1, 1, 1)))
        add("dup.txt", b"first")
        add("dup.png", _png((2, 2, 2)))
        add("big.png", _png() + b"\0" * 5000)
        add("big.txt", b"big")
    result = _resize(src, tmp_path / "store", "resize.max_file_bytes=4000")
    assert result.exit_code == 0, result.output
    q = _quarantine(tmp_path / "store")
    assert "appears twice" in q[f"{src / 'a.tar'}:dup"][1]
    assert "resize.max_file_bytes" in q[f"{src / 'a.tar'}:big"][1]
    assert _stored_captions(tmp_path / "store") == ["fine"]


def test_two_control_folders_for_one_index_are_refused_naming_both(tmp_path):
    """control/ and control_0/ (or control_1/ and control_01/) are both one control index: before, one of the two
    folders was dropped unread (whichever the directory listing gave last), silently giving samples the other
    folder's control image."""
    src = tmp_path / "src"
    for d in ("target", "control", "control_0", "control_1", "control_01"):
        (src / d).mkdir(parents=True)
    (src / "target" / "a.png").write_bytes(_png((1, 1, 1)))
    (src / "target" / "a.txt").write_text("make it red")
    for i, d in enumerate(("control", "control_0", "control_1", "control_01")):
        (src / d / "a.png").write_bytes(_png((40 * i, 0, 0)))
    result = _resize(src, tmp_path / "store", "resize.max_controls=3")
    assert result.exit_code == 1, result.output
    assert "folders control/ and control_0/ both hold control 0" in result.output, result.output
    assert not (tmp_path / "store" / "images").exists()
    for d in ("control_0", "control_01"):
        (src / d / "a.png").unlink()
        (src / d).rmdir()
    result = _resize(src, tmp_path / "store", "resize.max_controls=3")
    assert result.exit_code == 0, result.output
    r = Store(tmp_path / "store", create=False).reader("images")
    assert [r.meta(k)["num_controls"] for k in r.keys()] == [2]
    r.close()


def test_jsonl_null_fields_are_absent_fields(tmp_path):
    """pandas' and HF datasets' `to_json` write a missing value as null: `"controls": null` (or `"control": null`)
    is a row without controls and `"caption": null` falls back to `"prompt"`, as absent fields do. Before: the row
    was quarantined ("field 'controls[0]' is missing or not a path string", "missing-caption")."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.png").write_bytes(_png((10, 20, 30)))
    (src / "b.png").write_bytes(_png((30, 20, 10)))
    rows = [{"target": "a.png", "controls": None, "caption": "a red square"},
            {"target": "b.png", "control": None, "caption": None, "prompt": "a blue square", "mask": None},
            {"target": "a.png", "controls": ["b.png"], "caption": "make it blue"},
            {"target": "b.png", "controls": [None], "caption": "a null inside the list is still a broken entry"}]
    (src / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = _resize(src / "m.jsonl", tmp_path / "store")
    assert result.exit_code == 0, result.output
    assert _stored_captions(tmp_path / "store") == ["a blue square", "a red square", "make it blue"]
    assert [(reason, detail) for reason, detail in _quarantine(tmp_path / "store").values()] == [
        ("bad-source", "field 'controls[0]' is missing or not a path string")]


def test_a_jsonl_manifest_saved_with_a_bom_reads_its_first_line(tmp_path):
    """A UTF-8 byte order mark before the first line (Notepad, PowerShell 5's `-Encoding utf8`): before, the
    first row was quarantined as "line is not valid JSON: Unexpected UTF-8 BOM"."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.png").write_bytes(_png((10, 20, 30)))
    rows = [{"target": "a.png", "caption": "a red square"}, {"target": "a.png", "caption": "a blue square"}]
    (src / "m.jsonl").write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in rows).encode())
    result = _resize(src / "m.jsonl", tmp_path / "store")
    assert result.exit_code == 0, result.output
    assert _stored_captions(tmp_path / "store") == ["a blue square", "a red square"]
    assert _quarantine(tmp_path / "store") == {}


def test_edit_pairs_missing_their_control_are_counted_in_the_summary(tmp_path):
    """A control file missing from an edit pair makes a sample with 0 controls (a text-to-image sample, valid
    by default): the summary now counts the samples per number of controls and says how to refuse them; before,
    nothing in the output showed it."""
    src = tmp_path / "src"
    for d in ("target", "control"):
        (src / d).mkdir(parents=True)
    for i in range(3):
        (src / "target" / f"s{i}.png").write_bytes(_png((60 * i, 0, 0)))
        (src / "target" / f"s{i}.txt").write_text(f"make picture {i} blue")
        if i:  # s0's control went missing
            (src / "control" / f"s{i}.png").write_bytes(_png((0, 60 * i, 0)))
    result = _resize(src, tmp_path / "store")
    assert result.exit_code == 0, result.output
    assert ("controls per sample: 0: 1, 1: 2; samples without a control train text-to-image "
            "(resize.min_controls: 1 quarantines them)") in result.output, result.output
    again = _resize(src, tmp_path / "store2", "resize.min_controls=1")
    assert "controls per sample: 1: 2\n" in again.output and "control-count 1" in again.output, again.output


def test_a_file_gone_between_the_listing_and_its_hash_costs_its_sample_not_the_run(tmp_path, monkeypatch):
    """A source file deleted (or made unreadable) after the listing, before its content hash: the stage goes on,
    that sample is quarantined naming its files, the others are written (before: an OSError traceback)."""
    from stages.resize import content

    src = tmp_path / "src"
    (src / "target").mkdir(parents=True)
    for name, colour in (("a", (200, 40, 40)), ("b", (40, 200, 40)), ("c", (40, 40, 200))):
        (src / "target" / f"{name}.png").write_bytes(_png(colour))
        (src / "target" / f"{name}.txt").write_text(f"caption {name}")
    doomed = src / "target" / "b.png"
    real = content.FileHashes.sha256

    def vanishing(self, f):
        if Path(f) == doomed:
            doomed.unlink(missing_ok=True)
        return real(self, f)

    monkeypatch.setattr(content.FileHashes, "sha256", vanishing)
    result = _resize(src, tmp_path / "store")
    assert result.exit_code == 0, result.output
    assert _stored_captions(tmp_path / "store") == ["caption a", "caption c"]
    assert [Path(source).stem for source in _quarantine(tmp_path / "store")] == ["b"]  # its caption: an orphan now


def test_a_source_that_is_not_there_leaves_no_store_behind(tmp_path):
    """A typo in --source is one line, and the --store folder it named is not created (before: an empty store
    with a store.json, which the next command then took for the user's store)."""
    result = _resize(tmp_path / "no-such-source", tmp_path / "store")
    assert result.exit_code != 0 and "does not exist" in result.output, result.output
    assert not (tmp_path / "store").exists()
