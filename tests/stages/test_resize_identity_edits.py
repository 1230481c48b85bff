"""A sample whose control is its target (the same file bytes: a dataset pipeline that mapped the wrong column, or
copied the target as control) trains an identity edit. resize-bucket keeps it (a few "no change" pairs may be
meant) but its summary says how many there are and names a few, counted from the version committed (carried
samples too), and `--json` has `identity_edits`."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
from PIL import Image
from typer.testing import CliRunner

from features.same_pictures import control_is_target
from pipeline.cli import app

LINE = "samples have a control identical to their target (an identity edit: the LoRA learns to change nothing there)"


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (24, 32, 3), np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _sample(src, stem: str, seed: int, copied: bool = False) -> None:
    for folder in ("target", "control"):
        (src / folder).mkdir(parents=True, exist_ok=True)
    target = _png(seed)
    (src / "target" / f"{stem}.png").write_bytes(target)
    (src / "target" / f"{stem}.txt").write_text(f"edit {stem}")
    (src / "control" / f"{stem}.png").write_bytes(target if copied else _png(seed + 1000))


def _resize(src, store) -> tuple[str, dict]:
    args = ["run", "resize-bucket", "--source", str(src), "--store", str(store), "--set", "resize.target_area=4096",
            "--set", "resize.multiple=16"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    again = CliRunner().invoke(app, [*args, "--json"])  # the up-to-date rerun
    assert again.exit_code == 0, again.output
    return result.output, json.loads(again.stdout.strip().splitlines()[-1])


def test_a_control_copied_from_its_target_is_said(tmp_path):
    src = tmp_path / "src"
    for i in range(4):
        _sample(src, f"s{i}", i, copied=i == 2)
    out, rec = _resize(src, tmp_path / "st")
    line = f"1 of 4 {LINE}, e.g. {src / 'target' / 's2.png'}; check the control column/folder"
    assert line in out.splitlines(), out
    assert rec["up_to_date"] and rec["identity_edits"] == 1 and rec["encoded"] == 0

    _sample(src, "s4", 4, copied=True)  # a new version: s2 carried forward, not rendered, and still counted
    out, rec = _resize(src, tmp_path / "st")
    assert "4 reused" in out and f"2 of 5 {LINE}, e.g. {src / 'target' / 's2.png'}, {src / 'target' / 's4.png'};" \
        in out, out
    assert rec["identity_edits"] == 2


def test_controls_unlike_their_targets_say_nothing(tmp_path):
    src = tmp_path / "src"
    for i in range(3):
        _sample(src, f"s{i}", i)
    out, rec = _resize(src, tmp_path / "st")
    assert LINE not in out and rec["identity_edits"] == 0


def test_control_is_target_per_row():
    """Any control equal to the target counts (not two equal controls); rows without hashes (null, empty: a shard
    index without the column) are no picture known."""
    rows = pa.table({"source_hashes": pa.array(
        [["t", "c"], ["t", "t"], ["t", "c", "t"], ["t", "c", "c"], None, [], ["t"], [None, None], ["x", None, "x"]],
        pa.list_(pa.string()))})
    assert control_is_target(rows).tolist() == [False, True, True, False, False, False, False, False, True]
    assert not control_is_target(pa.table({"key": ["a"]})).any()
