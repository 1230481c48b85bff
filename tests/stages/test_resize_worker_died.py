"""resize-bucket with worker processes: a worker that dies (the out-of-memory killer, a crash in an image
library) costs its own sample, quarantined as `worker-died` naming its file, never the run. Before: the whole
stage stopped with `BrokenProcessPool` (a traceback naming no file), and a rerun met the same file again."""

from __future__ import annotations

import io

from PIL import Image

import crashing_render
from pipeline.config import load_config
from stages.resize import stage
from stages.resize.stage import run, sample_key
from store import Store
from store.verify import verify_store

SMALL = {"resize.target_area": 64 * 64, "resize.control_vae_area": 64 * 64, "resize.control_vl_area": 32 * 32,
         "resize.multiple": 16, "resize.min_side": 16}


def _png(colour) -> bytes:
    b = io.BytesIO()
    Image.new("RGB", (48, 32), colour).save(b, format="PNG")
    return b.getvalue()


def test_a_worker_killed_by_one_sample_quarantines_that_sample_and_the_run_goes_on(tmp_path, monkeypatch):
    src = tmp_path / "src"
    (src / "target").mkdir(parents=True)
    expected = set()
    for i in range(7):
        data, caption = _png((30 * i, 10, 10)), ("crash the worker" if i == 2 else f"edit {i}")
        (src / "target" / f"s{i}.png").write_bytes(data)
        (src / "target" / f"s{i}.txt").write_text(caption)
        if i != 2:
            expected.add(sample_key(data, [], caption))
    monkeypatch.setattr(stage, "_render_item", crashing_render.render_item)  # pickled by name to the workers

    summary = run(load_config(None, {**SMALL, "resize.workers": 2}), src, tmp_path / "store")

    assert summary.written == 6 and dict(summary.quarantined) == {"worker-died": 1}
    [row] = Store(tmp_path / "store").quarantine().to_pylist()
    assert row["reason"] == "worker-died" and row["source"] == str(src.resolve() / "target" / "s2.png")
    assert str(src.resolve() / "target" / "s2.png") in row["detail"] and "resize.workers" in row["detail"]
    r = Store(tmp_path / "store").reader("images")
    assert set(r.keys()) == expected
    assert verify_store(tmp_path / "store", progress=False) == []
