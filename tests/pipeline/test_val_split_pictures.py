"""`run all`'s empty-'val' line under the pictures split (stages/resize/split_rule.py): resize-bucket's quarantine
took every sample the split put in 'val' (here: each has 2 controls, above resize.max_controls 1). Their split is a
hash of their pictures, which the key alone does not give: the quarantine row records the pictures' identity, so the
line names the quarantine (before: it blamed the hash split, 'put none of the 3 there: raise resize.val_fraction')."""

from __future__ import annotations

import hashlib
import io
import json

import numpy as np
import pytest
from PIL import Image

from pipeline.config import load_config
from pipeline.val_split import check_val_split
from schemas.errors import UserError
from stages.resize import stage
from stages.resize.split_rule import pictures_id, split_for
from store import Store

FRACTION = 0.3


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (32, 32, 3), np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _split(*pictures: bytes) -> str:
    return split_for("", pictures_id(hashlib.sha256(b).hexdigest() for b in pictures), FRACTION, "pictures")


def _source(src) -> None:
    """3 samples of 2 controls the pictures split puts in 'val', 3 of 1 control it puts in 'train'."""
    src.mkdir()
    rows, val, train, seed = [], 0, 0, 0
    while val < 3 or train < 3:
        t, c, d = (_png(seed + i) for i in range(3))
        name = f"s{seed}"
        if val < 3 and _split(t, c, d) == "val":
            controls, val = [c, d], val + 1
        elif train < 3 and _split(t, c) == "train":
            controls, train = [c], train + 1
        else:
            seed += 3
            continue
        (src / f"{name}_t.png").write_bytes(t)
        for i, b in enumerate(controls):
            (src / f"{name}_c{i}.png").write_bytes(b)
        rows.append({"target": f"{name}_t.png", "controls": [f"{name}_c{i}.png" for i in range(len(controls))],
                     "caption": f"edit {name}"})
        seed += 3
    (src / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_quarantine_that_took_every_val_sample_is_named_under_the_pictures_split(tmp_path):
    _source(tmp_path / "src")
    cfg = load_config(None, {"resize.target_area": 32 * 32, "resize.control_vae_area": 32 * 32,
                             "resize.multiple": 16, "resize.min_side": 16, "resize.val_fraction": FRACTION,
                             "resize.max_controls": 1})
    done = stage.run(cfg, tmp_path / "src" / "m.jsonl", tmp_path / "st")
    assert done.split_by == "pictures" and dict(done.splits) == {"train": 3} and done.quarantined == {"control-count": 3}
    with pytest.raises(UserError) as e:
        check_val_split("resize-bucket", cfg, str(tmp_path / "st"))
    line = str(e.value)
    assert "0 of 3 samples are in the 'val' split" in line, line
    assert "put 3 there, and resize-bucket quarantined all 3 (control-count 3; rows in" in line, line
    rows = [r for r in Store(tmp_path / "st").quarantine().to_pylist() if r["reason"] == "control-count"]
    assert len(rows) == 3 and all(r.get("pictures") for r in rows)


def test_the_line_names_the_val_fraction_the_version_was_split_with(tmp_path):
    """The empty-'val' line took resize.val_fraction from the config, not from the images version, which records
    the one it was split with: under another config value it named that value and redrew the quarantined samples'
    split with it (here 0.01 puts none of them in 'val', so it blamed the hash split instead of the quarantine)."""
    _source(tmp_path / "src")
    sets = {"resize.target_area": 32 * 32, "resize.control_vae_area": 32 * 32, "resize.multiple": 16,
            "resize.min_side": 16, "resize.val_fraction": FRACTION, "resize.max_controls": 1}
    stage.run(load_config(None, sets), tmp_path / "src" / "m.jsonl", tmp_path / "st")
    other = load_config(None, {**sets, "resize.val_fraction": 0.01})
    with pytest.raises(UserError) as e:
        check_val_split("encode-text", other, str(tmp_path / "st"))
    line = str(e.value)
    assert f"the hash split with resize.val_fraction {FRACTION} put 3 there" in line, line
    assert "0.01" not in line, line
