"""resize-bucket with worker processes, interrupted: a Ctrl-C (or a launcher's signal) taken by a thread other than
the main one, while the main thread waits for a sample that a worker is stuck on, ends the stage at once with its
workers gone, and the rerun resumes from the committed shards with nothing lost. Before: the main thread's wait
for the sample's result (an untimed `Future.result()`) woke only when the sample was rendered, here never, and
a stopped stage waited for its workers' samples."""

from __future__ import annotations

import io
from pathlib import Path

from PIL import Image

from pipeline.config import load_config
from stages.resize.images_table import sample_key
from stages.resize.stage import run
from store import Store
from store.verify import verify_store

HERE = Path(__file__).resolve().parent
SMALL = {"resize.target_area": 64 * 64, "resize.control_vae_area": 64 * 64, "resize.control_vl_area": 32 * 32,
         "resize.multiple": 16, "resize.min_side": 16, "resize.shard_size_mb": 0.01, "resize.workers": 2}
HANG_AT = 8  # the samples before it are rendered and committed (several shards) before the main thread waits
HOLD_SECONDS = 240  # the interrupted stage's bound: far above what a passing run needs under load

_INTERRUPTED = f"""
import os, signal, sys, threading
os.environ["HANG_CAPTION"] = "edit {HANG_AT}"  # inherited by the spawned workers
sys.path.insert(0, {str(HERE)!r})  # hanging_render, for the spawned workers too
import hanging_render
from signal_elsewhere import signal_elsewhere_once_main_waits
from pipeline.config import load_config
from stages.resize import render_loop, stage

render_loop.render_item = hanging_render.render_item

def head_hangs():  # the sample the main thread waits for is the stuck one: nothing else will wake it
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None and frame.f_code.co_name != "rendered_in_order":
        frame = frame.f_back
    item = frame.f_locals.get("item") if frame is not None else None
    return isinstance(item, tuple) and item[2] == os.environ["HANG_CAPTION"]

try:
    signal_elsewhere_once_main_waits("rendered_in_order", signal.SIGINT, when=head_hangs)
    stage.run(load_config(None, {SMALL!r}), sys.argv[1], sys.argv[2])
except KeyboardInterrupt:
    import multiprocessing
    print("interrupted,", len(multiprocessing.active_children()), "workers left")
    sys.exit(130)
"""


def _png(colour) -> bytes:
    b = io.BytesIO()
    Image.new("RGB", (48, 32), colour).save(b, format="PNG")
    return b.getvalue()


def test_ctrl_c_elsewhere_ends_a_stage_waiting_for_a_stuck_worker_and_the_rerun_loses_nothing(tmp_path):
    from signal_elsewhere import run_script

    src = tmp_path / "src"
    (src / "target").mkdir(parents=True)
    expected = set()
    for i in range(12):
        data, caption = _png((20 * i, 10, 10)), f"edit {i}"
        (src / "target" / f"s{i:02d}.png").write_bytes(data)
        (src / "target" / f"s{i:02d}.txt").write_text(caption)
        expected.add(sample_key(data, [], caption))
    code = _INTERRUPTED.replace("sys.argv[1], sys.argv[2]", f"{str(src)!r}, {str(tmp_path / 'store')!r}")

    proc = run_script(code, timeout=HOLD_SECONDS)
    assert (proc.returncode, proc.stdout.strip()) == (130, "interrupted, 0 workers left"), proc.stderr[-3000:]

    summary = run(load_config(None, SMALL), src, tmp_path / "store")
    assert summary.resumed >= 1 and summary.resumed + summary.written == 12
    assert set(Store(tmp_path / "store").reader("images").keys()) == expected
    assert verify_store(tmp_path / "store", progress=False) == []


_CTRL_C_AT_START = """
import os, signal, sys
from multiprocessing import util
from stages.resize.render_pool import rendered_in_order

spawn = util.spawnv_passfds

def spawn_then_ctrl_c(path, args, passfds):  # the worker exists, its start-up waits for what the parent sends next
    pid = spawn(path, args, passfds)
    os.kill(pid, signal.SIGINT)
    return pid

util.spawnv_passfds = spawn_then_ctrl_c
print(list(rendered_in_order(abs, [-1, -2, -3], workers=2, ahead=1, on_crash=lambda item: "died")))
"""


def test_a_ctrl_c_during_a_workers_start_up_is_ignored_as_after_it():
    """A terminal's Ctrl-C reaches the workers too (the whole process group); it is the stage's to act on. A
    worker that took it during its start-up (before the pool's initializer) printed a KeyboardInterrupt traceback
    and died, breaking the pool. Here each worker gets one at the start-up's one certain moment: spawned, waiting
    for the parent's data. Each renders as if none had come."""
    from signal_elsewhere import run_script

    proc = run_script(_CTRL_C_AT_START, timeout=HOLD_SECONDS)
    assert (proc.returncode, proc.stdout.strip()) == (0, "[(-1, 1), (-2, 2), (-3, 3)]"), proc.stderr[-3000:]
    assert "KeyboardInterrupt" not in proc.stderr, proc.stderr[-3000:]
