"""`run resize-bucket` on 2 ranks of a plain env:// launch (a platform set WORLD_SIZE, RANK, MASTER_*; no torchrun
agent), where rank 0 serves the launch's store itself (models/collective/before_group.py `gather_before_group`): rank 0
does the work alone while rank 1 polls for its done mark (`main_alone`), then the command ends. Before: rank 0 marked it
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
BOUND_SECONDS = 240  # the hook's waits for the other rank: past it the hook ends its rank loudly (exit 97)

# Rank 1's first sleep between two polls lasts until rank 0's process has ended, or until rank 0 has entered its
# wait for every rank to have seen the done mark (a mark of the hook on `_count_and_wait`, after the work): by
# order, not time, so before the fix rank 1 surely polls again only once rank 0 is gone, however slow its exit.
# Rank 0's work starts only once rank 1 sleeps there (so rank 1 surely polls again after rank 0's mark), and rank 0
# waits for rank 1 longer than rank 1 can take. A hook wait that outlives BOUND_SECONDS fails the test, never
# lets it pass.
HOOK = """\
import os, sys, time, types
from pathlib import Path
if os.environ.get("RANK") in ("0", "1"):
    import psutil
    from models import collective
    marks = Path(os.environ["TEST_MARKS"])
    def wait_for(done, what):
        deadline = time.monotonic() + BOUND_SECONDS
        while not done():
            if time.monotonic() > deadline:
                print(f"HOOK rank {os.environ['RANK']} gave up waiting for {what}", file=sys.stderr, flush=True)
                os._exit(97)
            time.sleep(0.05)
    if os.environ["RANK"] == "0":
        collective.timing.HOST_WAIT_SECONDS = BOUND_SECONDS
        real_main_alone, real_count_and_wait = collective.main_alone, collective.counting._count_and_wait
        worked = []
        def main_alone(world, what, work, *args, **kwargs):
            def held():
                wait_for((marks / "rank-1-sleeps").exists, "rank 1 to sleep in its poll")
                result = work()
                worked.append(1)
                return result
            return real_main_alone(world, what, held, *args, **kwargs)
        def count_and_wait(*args, **kwargs):
            if worked:  # after the work: rank 0's wait for the others to have seen its done mark
                (marks / "rank-0-waits").touch()
            return real_count_and_wait(*args, **kwargs)
        collective.main_alone, collective.alone._count_and_wait = main_alone, count_and_wait  # as main_alone calls it
    else:
        host = int(os.environ["TEST_RANK_0_PID"])
        def rank_0_gone():
            try:
                return psutil.Process(host).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True
        def rank_0_waits():
            return (marks / "rank-0-waits").exists()
        held = []
        def sleep(seconds):
            if not held and sys._getframe(1).f_code.co_name == "main_alone":  # its poll's (the waits before poll too)
                held.append(1)
                (marks / "rank-1-sleeps").touch()
                wait_for(lambda: rank_0_gone() or rank_0_waits(), "rank 0 to end or to wait for this rank")
                print(f"HOOK rank 1 polls again, rank 0 {'waits' if rank_0_waits() else 'gone'}", file=sys.stderr,
                      flush=True)
            time.sleep(seconds)
        clock = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if not name.startswith("_")})
        clock.sleep = sleep
        collective.alone.time = clock  # main_alone's
"""


def test_resize_bucket_on_a_plain_launch_ends_0_on_every_rank_when_rank_0_finishes_first(tmp_path) -> None:
    from pipeline.demo_data import make_demo_data
    from store import Store

    make_demo_data(tmp_path / "data", n=2, fmt="folder", max_controls=2, seed=1)
    hook, marks = tmp_path / "hook", tmp_path / "marks"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK.replace("BOUND_SECONDS", str(BOUND_SECONDS)))
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
    assert "HOOK rank 1 polls again, rank 0 waits" in err_1, err_1[-3000:]  # rank 0 outlived rank 1's next poll
    assert "rank 1: resize-bucket ran on rank 0 alone; this rank waited for it" in err_1, err_1[-3000:]
    assert "error:" not in err_0 + err_1, err_1[-3000:]
