"""`run resize-bucket` on 2 ranks of a plain env:// launch (a platform set WORLD_SIZE, RANK, MASTER_*; no torchrun
agent), where rank 0 serves the launch's store itself (models/collective.py `gather_before_group`): rank 0 does the
work alone while rank 1 polls for its done mark (`main_alone`), then the command ends. Before: rank 0 marked it
done and exited at once, its store with it, and rank 1, asleep between two polls, found the store gone and ended
on "rank 1 lost its connection to another rank ... ended without a word", exit 1, though the images table was
written (2 of 10 plain launches here). Under `pipeline launch` torchrun's agent serves the store until every rank
has ended (its workers' group succeeds only once all have exited), so it never showed there."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from launch_ports import Logged, start_host_first

REPO = Path(__file__).resolve().parents[2]
SETTLE_SECONDS = 5  # how long rank 0 must stay up after its work before rank 1 polls again (it exited within 1 s)

# Rank 1's first sleep between two polls lasts until rank 0's process has ended, or until rank 0 has outlived its
# work by SETTLE_SECONDS (it waits for rank 1 to have seen the mark); rank 0's work starts only once rank 1 sleeps
# there (so rank 1 surely polls again after rank 0's mark), and rank 0 waits for rank 1 longer than rank 1 holds.
HOOK = """\
import os, sys, time, types
from pathlib import Path
if os.environ.get("RANK") in ("0", "1"):
    import psutil
    from models import collective
    marks = Path(os.environ["TEST_MARKS"])
    def wait_for(done, bound=120):
        deadline = time.monotonic() + bound
        while not done() and time.monotonic() < deadline:
            time.sleep(0.05)
    if os.environ["RANK"] == "0":
        collective.HOST_WAIT_SECONDS = 120
        real_main_alone = collective.main_alone
        def main_alone(world, what, work, *args, **kwargs):
            def held():
                wait_for((marks / "rank-1-sleeps").exists)
                result = work()
                (marks / "rank-0-worked").write_text(str(time.time()))
                return result
            return real_main_alone(world, what, held, *args, **kwargs)
        collective.main_alone = main_alone
    else:
        host = int(os.environ["TEST_RANK_0_PID"])
        def rank_0_gone():
            try:
                return psutil.Process(host).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True
        def rank_0_settled():
            done = marks / "rank-0-worked"
            return done.exists() and time.time() - float(done.read_text() or "inf") > SETTLE_SECONDS
        held = []
        def sleep(seconds):
            if not held:
                held.append(1)
                (marks / "rank-1-sleeps").touch()
                wait_for(lambda: rank_0_gone() or rank_0_settled())
                print(f"HOOK rank 1 polls again, rank 0 {'gone' if rank_0_gone() else 'up'}", file=sys.stderr,
                      flush=True)
            time.sleep(seconds)
        clock = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if not name.startswith("_")})
        clock.sleep = sleep
        collective.time = clock
"""


def test_resize_bucket_on_a_plain_launch_ends_0_on_every_rank_when_rank_0_finishes_first(tmp_path) -> None:
    from pipeline.demo_data import make_demo_data
    from store import Store

    make_demo_data(tmp_path / "data", n=2, fmt="folder", max_controls=2, seed=1)
    hook, marks = tmp_path / "hook", tmp_path / "marks"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK.replace("SETTLE_SECONDS", str(SETTLE_SECONDS)))
    base = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(REPO)]), "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    for name in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        base.pop(name, None)
    args = ["run", "resize-bucket", "--source", str(tmp_path / "data"), "--store", str(tmp_path / "store"),
            "--target-area", "4096", "--control-vae-area", "4096", "--workers", "0"]
    started: list[Logged] = []

    def start(rank: int, port: int) -> Logged:
        if rank == 0:  # a fresh start (another port): no marks of the last attempt
            marks.mkdir(exist_ok=True)
            for mark in marks.iterdir():
                mark.unlink()
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "MASTER_PORT": str(port), "TEST_MARKS": str(marks),
               **({"TEST_RANK_0_PID": str(started[-1].pid)} if rank else {})}
        started.append(Logged([sys.executable, "-m", "pipeline.cli", *args], env=env))
        return started[-1]

    ranks = start_host_first(start, 2)
    try:
        ended = [(p.wait(420), *p.output()) for p in ranks]  # a bound for a hang, generous under load
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    (code_0, out_0, err_0), (code_1, _, err_1) = ended
    assert Store(tmp_path / "store").versions("images") == [1], err_0[-3000:]  # rank 0's work was done
    assert "images v1: 2 samples written" in out_0, out_0[-2000:]
    assert "HOOK rank 1 polls again" in err_1, err_1[-3000:]  # it slept in its poll while rank 0 finished
    assert (code_0, code_1) == (0, 0), f"rank 0:\n{err_0[-2000:]}\nrank 1:\n{err_1[-3000:]}"
    assert "rank 1: resize-bucket ran on rank 0 alone; this rank waited for it" in err_1, err_1[-3000:]
    assert "error:" not in err_0 + err_1, err_1[-3000:]
