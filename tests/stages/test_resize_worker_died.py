"""resize-bucket with worker processes: a worker that dies (the out-of-memory killer, a crash in an image
library) costs its own sample, quarantined as `worker-died` naming its file, never the run (before: the whole
stage stopped with `BrokenProcessPool`, a traceback naming no file, and a rerun met the same file again); and a
SIGKILLed stage leaves no worker process behind."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from PIL import Image

import crashing_render
from pipeline.config import load_config
from pipeline.demo_data import make_demo_data
from stages.resize import render_loop
from stages.resize.images_table import sample_key
from stages.resize.stage import run
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
    monkeypatch.setattr(render_loop, "render_item", crashing_render.render_item)  # pickled by name to the workers

    summary = run(load_config(None, {**SMALL, "resize.workers": 2}), src, tmp_path / "store")

    assert summary.written == 6 and dict(summary.quarantined) == {"worker-died": 1}
    [row] = Store(tmp_path / "store").quarantine().to_pylist()
    assert row["reason"] == "worker-died" and row["source"] == str(src.resolve() / "target" / "s2.png")
    assert str(src.resolve() / "target" / "s2.png") in row["detail"] and "resize.workers" in row["detail"]
    r = Store(tmp_path / "store").reader("images")
    assert set(r.keys()) == expected
    assert verify_store(tmp_path / "store", progress=False) == []


def _processes_with(marker: str) -> list[int]:
    """Processes whose environment holds `marker` (a spawned worker inherits its parent's environment)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:  # gone meanwhile, or not ours
            pass
    return found


def test_a_sigkilled_stage_leaves_no_worker_process_behind(tmp_path):
    """Before: the stage's spawned workers outlived a SIGKILL of the stage (re-parented, waiting for work
    forever, each holding its memory); every kill and rerun left `resize.workers` more processes."""
    make_demo_data(tmp_path / "src", n=24, fmt="folder", max_controls=2, seed=2)
    marker = f"R1_WORKER_TEST={uuid.uuid4().hex}"
    code = ("import sys; from pipeline.config import load_config; from stages.resize.stage import run;"
            f"cfg = load_config(None, {{**{SMALL!r}, 'resize.workers': 2, 'resize.shard_size_mb': 0.01}});"
            "run(cfg, sys.argv[1], sys.argv[2])")
    env = {**os.environ, "STORE_CRASH_AT": "after_shard_commit", marker.split("=")[0]: marker.split("=")[1]}
    with open(tmp_path / "stderr", "w") as err:  # not a pipe: a worker left behind would hold it open
        killed = subprocess.run([sys.executable, "-c", code, str(tmp_path / "src"), str(tmp_path / "store")],
                                env=env, stdout=subprocess.DEVNULL, stderr=err, timeout=300)
    assert killed.returncode == -9, (tmp_path / "stderr").read_text()  # killed at its first committed shard
    deadline = time.monotonic() + 120  # a generous bound for a loaded machine; they end within ~1 s
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _processes_with(marker)
    for pid in left:  # do not leave them to the rest of the test session either
        os.kill(pid, signal.SIGKILL)
    assert left == []


def test_workers_dying_on_every_sample_stop_the_run_instead_of_quarantining_all(tmp_path, monkeypatch):
    """No memory left, or an environment the spawned workers cannot run in: then every sample's worker dies, and
    quarantining them all would hide the cause. The run stops with one line after three in a row, nothing
    quarantined, no table."""
    from schemas.errors import UserError

    src = tmp_path / "src"
    (src / "target").mkdir(parents=True)
    for i in range(5):
        (src / "target" / f"s{i}.png").write_bytes(_png((30 * i, 10, 10)))
        (src / "target" / f"s{i}.txt").write_text("crash the worker")
    monkeypatch.setattr(render_loop, "render_item", crashing_render.render_item)
    with pytest.raises(UserError, match="a worker process died on 3 samples in a row, each rendered alone"):
        run(load_config(None, {**SMALL, "resize.workers": 2}), src, tmp_path / "store")
    st = Store(tmp_path / "store")
    assert st.quarantine().num_rows == 0 and "images" not in st.tables()


def test_deaths_apart_from_each_other_are_each_the_sample_s_own():
    """Three samples that end their worker, each among good ones: each is quarantined, the run goes on (only
    deaths in a row, each alone, mean the workers cannot work at all)."""
    from stages.resize.render_pool import rendered_in_order

    items = ["kill" if i in (0, 9, 19, 29) else f"ok {i}" for i in range(30)]
    out = list(rendered_in_order(crashing_render.echo_or_die, items, workers=1, ahead=0, on_crash=lambda i: "died"))
    assert out == [(i, "died" if i == "kill" else i.upper()) for i in items]
