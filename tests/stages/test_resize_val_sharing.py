"""A pair listed under several captions, split by key (`resize.split_by: key`, the rule of every store made before
the pictures rule; tests/stages/test_resize_split_rule.py): the key holds the caption, so its copies land
in both splits and the held-out loss scores pictures the LoRA was trained on (evaluate's best checkpoint then
favours memorising them). Before, nothing said so; now the resize summary counts the val samples whose target and
controls a train sample has too (`val_sharing_train_images` in --json)."""

from __future__ import annotations

import io
import json
from collections import defaultdict

import numpy as np
from PIL import Image
from typer.testing import CliRunner

from pipeline.cli import app
from store import Store


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (24, 32, 3), np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _resize(src, store, captions_per_pair: int) -> dict:
    src.mkdir()
    rows = []
    for pair in range(8):
        (src / f"t{pair}.png").write_bytes(_png(2 * pair))
        (src / f"c{pair}.png").write_bytes(_png(2 * pair + 1))
        rows += [{"target": f"t{pair}.png", "controls": [f"c{pair}.png"], "caption": f"edit {pair}, wording {n}"}
                 for n in range(captions_per_pair)]
    (src / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["run", "resize-bucket", "--source", str(src / "m.jsonl"), "--store", str(store), "--set",
            "resize.target_area=4096", "--set", "resize.multiple=16", "--set", "resize.val_fraction=0.3", "--set", "resize.split_by=key"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    again = CliRunner().invoke(app, [*args, "--json"])  # the up-to-date rerun says it too
    assert again.exit_code == 0, again.output
    return {"text": result.output, "json": json.loads(again.stdout.strip().splitlines()[-1])}


def _sharing(store) -> tuple[int, int]:
    """(val rows whose source_hashes a train row has, val rows), counted here row by row."""
    splits = defaultdict(set)
    rows = Store(store, create=False).reader("images").manifest.to_pylist()
    for r in rows:
        splits[tuple(r["source_hashes"])].add(r["split"])
    val = [r for r in rows if r["split"] == "val"]
    return sum("train" in splits[tuple(r["source_hashes"])] for r in val), len(val)


def test_val_samples_sharing_their_pictures_with_train_samples_are_counted(tmp_path):
    out = _resize(tmp_path / "src", tmp_path / "st", captions_per_pair=4)
    shared, val = _sharing(tmp_path / "st")
    assert 0 < shared <= val
    assert f"val: {shared} of {val} val samples have the target and controls of a train sample" in out["text"]
    assert out["json"]["up_to_date"] and out["json"]["val_sharing_train_images"] == shared


def test_pairs_listed_once_share_nothing_and_say_nothing(tmp_path):
    out = _resize(tmp_path / "src", tmp_path / "st", captions_per_pair=1)
    assert _sharing(tmp_path / "st")[0] == 0
    assert "val samples have the target" not in out["text"] and out["json"]["val_sharing_train_images"] == 0


def test_rows_without_source_hashes_share_nothing():
    """A manifest row with no `source_hashes` (null: a shard index without the column, merged permissively, as the
    resize reuse rule allows for: stages/resize/known_sources.py) is no picture known: before, a null val row
    matched a null train row and the summary said val samples shared a train sample's pictures."""
    import pyarrow as pa

    from stages.resize.summary import val_sharing

    rows = pa.table({"split": ["train", "val", "train", "val"],
                     "source_hashes": pa.array([None, None, ["a", "b"], ["a", "b"]], pa.list_(pa.string()))})
    assert val_sharing(rows) == 1  # the one val row with a train row's target and control
