"""`store repair` writes the recorded bytes of a shard with bytes appended into the table's `.trim-v<N>/` before
linking them into the repaired version. A repair killed there left that folder for ever (gc looked only at version
names and `v<N>.damaged/`): now gc removes it, named with the bytes it frees, and the rerun of the repair writes its
copy afresh and completes. The folder of a repair still running (holding the table's writer lock) is kept. Both
repairs are real processes stopped at the same named point (`STORE_CRASH_AT` / `STORE_PAUSE_AT`), whatever the
machine's load."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from typer.testing import CliRunner

import warm_start
from pipeline.cli import app
from schemas.units import size_text
from store import Store, gc
from store.verify import verify_store
from store_samples import fill

REPAIR = [sys.executable, "-c", "from pipeline.cli import app; app()", "store", "repair"]


def _with_bytes_appended(store: Store) -> tuple[Path, dict]:
    """v1 of `vae` whose first shard has 700 bytes appended (every sample intact: repair carries its first bytes);
    returns that shard and every sample's tensors."""
    fill(store, 6, shard_size_mb=0.004)
    with store.reader("vae") as r:
        before = {k: {n: t.clone() for n, t in r.get(k)["tensors"].items()} for k in r.keys()}
    shard = sorted((store.root / "vae" / "v1").glob("*.tar"))[0]
    with open(shard, "ab") as f:
        f.write(os.urandom(700))
    return shard, before


def _same_samples(store: Store, before: dict) -> None:
    with Store(store.root, create=False).reader("vae") as r:
        assert r.version == 2 and sorted(r.keys()) == sorted(before)
        for k, tensors in before.items():
            got = r.get(k)["tensors"]
            assert all((got[n] == t).all() for n, t in tensors.items()), k


def test_gc_removes_the_working_folder_of_a_killed_repair_and_the_rerun_completes(store: Store) -> None:
    shard, before = _with_bytes_appended(store)
    killed = warm_start.run([*REPAIR, str(store.root)], env={**os.environ, "STORE_CRASH_AT": "repair_trimmed"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    work = store.root / "vae" / ".trim-v1"
    copy = work / shard.name
    assert copy.stat().st_size == shard.stat().st_size - 700 and copy.stat().st_nlink == 1  # linked nowhere yet

    lines: list[str] = []
    done = gc.collect(store.root, echo=lines.append)
    assert not work.exists() and done.freed[work] == shard.stat().st_size - 700
    # a few KiB, said in KiB (it read "0.0 MB freed")
    freed = size_text(shard.stat().st_size - 700)
    assert f"remove vae/.trim-v1 (the working folder of a store repair that was killed; {freed} freed)" in lines, lines
    assert store.versions("vae") == [1]  # (the killed repair's v2 is incomplete: gc removed it with no writer live)

    res = CliRunner().invoke(app, ["store", "repair", str(store.root)])
    assert res.exit_code == 0 and "bytes appended" in res.output, res.output
    assert not work.exists() and verify_store(store.root, progress=False) == []
    _same_samples(store, before)


def test_gc_keeps_the_working_folder_of_a_running_repair(store: Store) -> None:
    shard, before = _with_bytes_appended(store)
    env = {**os.environ, "STORE_PAUSE_AT": "repair_trimmed", "PYTHONPATH": os.pathsep.join(sys.path)}
    repair = subprocess.Popen([*REPAIR, str(store.root)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    try:
        deadline = time.monotonic() + 240  # a bound for a hung repair, not a timing assertion

        def stopped() -> bool:  # state "T": the repair stopped itself with its copy written, not yet linked
            return Path(f"/proc/{repair.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"

        while repair.poll() is None and not stopped() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert repair.poll() is None and stopped(), repair.stdout.read()
        work = store.root / "vae" / ".trim-v1"
        assert (work / shard.name).is_file()
        lines: list[str] = []
        kept = gc.collect(store.root, echo=lines.append)
        assert (work / shard.name).is_file() and work not in kept.repair_work
        assert not [ln for ln in lines if ".trim-v1" in ln], lines
        assert (store.root / "vae" / "v2").is_dir()  # the repair's version, its writer live
    finally:
        repair.send_signal(signal.SIGCONT)
    out = repair.communicate(timeout=240)[0]
    assert repair.returncode == 0 and "repaired and verified" in out, out
    assert not work.exists() and verify_store(store.root, progress=False) == []
    _same_samples(store, before)
