"""`store gc URL --cache-dir D` and this node's working copy of `store repair URL` (`D/.work/<hash>/`, store/
remote_work.py). A killed repair left it for ever (it can hold whole table versions): now gc removes it once the
URL's store has moved on from it (another node published a newer version) or on `--drop-work`, with one line
naming the URL, the folder and the bytes freed; one a repair still holds (its flock, for the command's whole run)
is kept. The repairs are real processes killed or stopped at named points (`STORE_CRASH_AT` / `STORE_PAUSE_AT`)
against the S3 test server (tests/s3_server.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from typer.testing import CliRunner

from pipeline.cli import app
from store import Store
from schemas.units import size_text
from store.remote_work import work_root
from test_remote_maintenance import KILLED_REPAIR, _pushed_with_a_grown_shard, remote_current

runner = CliRunner()


def _cli(*args):
    r = runner.invoke(app, [str(a) for a in args])
    assert "Traceback" not in r.output, r.output
    return r


def _killed_repair(s3_env, work: Path, point: str = "push_before_manifest") -> Path:
    """A `store repair URL` SIGKILLed at `point`: by default with its repaired version in the working copy, before
    its push's manifest; `repair_trimmed`: before its version is committed."""
    killed = subprocess.run([sys.executable, "-c", KILLED_REPAIR, s3_env.url(), str(work)],
                            env={**os.environ, "STORE_CRASH_AT": point}, capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    root = work_root(s3_env.url(), work)
    assert (root / "vae" / "v2").is_dir()
    assert (root / "vae" / "v2" / "manifest.parquet").is_file() == (point != "repair_trimmed")
    assert (root / "source-url.txt").read_text().strip() == s3_env.url()  # the folder names its URL
    return root


def _bytes(folder: Path) -> int:
    seen = {}
    for p in folder.rglob("*"):
        if p.is_file():
            seen[(p.stat().st_dev, p.stat().st_ino)] = p.stat().st_size
    return sum(seen.values())


def test_gc_of_a_url_removes_a_killed_repairs_working_copy_once_the_store_moved_on(s3_env, store: Store,
                                                                                  tmp_path: Path) -> None:
    _pushed_with_a_grown_shard(store, s3_env)
    work = tmp_path / "work"
    root = _killed_repair(s3_env, work, "repair_trimmed")
    size = _bytes(root)
    assert size > 0

    # the URL has not moved on: the rerun would resume there, so gc keeps it unless asked
    r = _cli("store", "gc", s3_env.url(), "--cache-dir", work)
    assert r.exit_code == 0, r.output
    assert f"keep the working copy {root} of {s3_env.url()}" in r.output and "--drop-work" in r.output, r.output
    assert root.is_dir()

    # another node repairs the URL meanwhile: its store moves on (vae v2 current, which the copy never finished)
    other = _cli("store", "repair", s3_env.url(), "--cache-dir", tmp_path / "other")
    assert other.exit_code == 0 and remote_current(s3_env) == {"vae": 2}, other.output
    r = _cli("store", "gc", s3_env.url(), "--cache-dir", work, "--dry-run")
    assert r.exit_code == 0 and f"would remove the working copy {root} of {s3_env.url()}" in r.output, r.output
    assert root.is_dir()
    r = _cli("store", "gc", s3_env.url(), "--cache-dir", work)
    line = f"remove the working copy {root} of {s3_env.url()} (left by a killed store repair / migrate; the store " \
           f"there has moved on: vae v2 is current there; the copy was begun from vae v1; {size_text(size)} freed)"
    assert r.exit_code == 0 and line in r.output, r.output
    assert not root.exists() and not any((work / ".work").iterdir())  # nor its lock file
    assert _cli("store", "verify", s3_env.url()).exit_code == 0


def test_gc_of_a_url_drops_a_killed_repairs_working_copy_when_asked(s3_env, store: Store, tmp_path: Path) -> None:
    _pushed_with_a_grown_shard(store, s3_env)
    work = tmp_path / "work"
    root = _killed_repair(s3_env, work)
    size = _bytes(root)
    r = _cli("store", "gc", s3_env.url(), "--cache-dir", work, "--drop-work")
    assert r.exit_code == 0, r.output
    assert (f"remove the working copy {root} of {s3_env.url()} (left by a killed store repair / migrate; "
            f"--drop-work; {size_text(size)} freed)") in r.output, r.output
    assert not root.exists() and not any((work / ".work").iterdir())
    # the URL is as the killed repair left it (v1 current, damaged): a repair from scratch still repairs it
    assert remote_current(s3_env) == {"vae": 1}
    r = _cli("store", "repair", s3_env.url(), "--cache-dir", work)
    assert r.exit_code == 0 and "retired" in r.output and remote_current(s3_env) == {"vae": 2}, r.output
    assert not root.exists()


def test_gc_of_a_url_keeps_the_working_copy_of_a_running_repair(s3_env, store: Store, tmp_path: Path) -> None:
    _pushed_with_a_grown_shard(store, s3_env)
    work = tmp_path / "work"
    env = {**os.environ, "STORE_PAUSE_AT": "repair_trimmed", "PYTHONPATH": os.pathsep.join(sys.path)}
    repair = subprocess.Popen([sys.executable, "-c", KILLED_REPAIR, s3_env.url(), str(work)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240  # a bound for a hung repair, not a timing assertion

        def stopped() -> bool:  # state "T": the repair stopped itself mid-way, in its working copy
            return Path(f"/proc/{repair.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"

        while repair.poll() is None and not stopped() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert repair.poll() is None and stopped(), repair.stdout.read()
        root = work_root(s3_env.url(), work)
        before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
        r = _cli("store", "gc", s3_env.url(), "--cache-dir", work, "--drop-work")
        assert r.exit_code == 0, r.output
        assert (f"keep the working copy {root} of {s3_env.url()}" in r.output
                and f"a store repair / migrate of it is running (pid {repair.pid} on" in r.output), r.output
        assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before
        # a second repair of the URL on this node is refused with one line, not run into the same copy
        second = _cli("store", "repair", s3_env.url(), "--cache-dir", work)
        assert second.exit_code != 0 and f"is being written by pid {repair.pid}" in second.output, second.output
    finally:
        repair.send_signal(signal.SIGCONT)
    out = repair.communicate(timeout=240)[0]
    assert repair.returncode == 0 and "repaired and verified" in out, out
    assert remote_current(s3_env) == {"vae": 2} and not root.exists()


def _gc_removes_the_published_copy(s3_env, work: Path, root: Path, size: int) -> None:
    """`store gc URL` removes a killed command's working copy whose version the URL has published since."""
    r = _cli("store", "gc", s3_env.url(), "--cache-dir", work)
    assert r.exit_code == 0, r.output
    assert (f"remove the working copy {root} of {s3_env.url()} (left by a killed store repair / migrate; the store "
            f"there has moved on: its vae v2 is current there already; {size_text(size)} freed)") in r.output, \
        r.output
    assert not root.exists()


def test_gc_of_a_url_removes_a_killed_repairs_copy_whose_version_another_repair_published(s3_env, store: Store,
                                                                                       tmp_path: Path) -> None:
    """Killed before its manifest; another node's repair of the same damage then publishes the very same v2 and
    retires v1: the copy has nothing left to publish."""
    _pushed_with_a_grown_shard(store, s3_env)
    work = tmp_path / "work"
    root = _killed_repair(s3_env, work)
    size = _bytes(root)
    other = _cli("store", "repair", s3_env.url(), "--cache-dir", tmp_path / "other")
    assert other.exit_code == 0 and "retired" in other.output and remote_current(s3_env) == {"vae": 2}, other.output
    _gc_removes_the_published_copy(s3_env, work, root, size)


def test_gc_of_a_url_keeps_a_killed_repairs_copy_that_has_a_retirement_left(s3_env, store: Store,
                                                                          tmp_path: Path) -> None:
    """Killed after its v2 became current, before v1 was retired: the URL's current version is the copy's own and
    v1 is not marked there yet, so the rerun still has work there: kept, and the rerun retires v1."""
    _pushed_with_a_grown_shard(store, s3_env)
    work = tmp_path / "work"
    root = _killed_repair(s3_env, work, "repair_before_retire")
    assert remote_current(s3_env) == {"vae": 2}
    r = _cli("store", "gc", s3_env.url(), "--cache-dir", work)
    assert r.exit_code == 0 and f"keep the working copy {root} of {s3_env.url()}" in r.output, r.output
    assert root.is_dir()
    r = _cli("store", "repair", s3_env.url(), "--cache-dir", work)
    assert r.exit_code == 0 and "retired" in r.output and not root.exists(), r.output


KILLED_MIGRATE = ("import sys; from pipeline.cli import app; "
                  "app(['migrate', 'v1-to-v2', sys.argv[1], '--cache-dir', sys.argv[2]])")


def test_gc_of_a_url_removes_a_killed_migrates_working_copy_once_another_migrate_published(s3_env,
                                                                                         tmp_path: Path) -> None:
    """Killed with its v2 committed in the copy, before the copy's store.json switch; another node's migrate then
    publishes the same v2: nothing is left for the copy to publish (a migrate retires nothing)."""
    import pyarrow.parquet as pq

    from store.integrity import write_version_checksums
    from store.remote_push import push
    from test_v1_handwritten import write_v1_store

    v1 = tmp_path / "v1store"
    write_v1_store(v1)
    vdir = v1 / "vae" / "v1"
    write_version_checksums(vdir, pq.read_table(vdir / "manifest.parquet"), (vdir / "manifest.parquet").read_bytes())
    push(v1, s3_env.url())
    work = tmp_path / "work"
    killed = subprocess.run([sys.executable, "-c", KILLED_MIGRATE, s3_env.url(), str(work)],
                            env={**os.environ, "STORE_CRASH_AT": "migrate_before_switch"}, capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    root = work_root(s3_env.url(), work)
    assert (root / "source-url.txt").is_file()
    r = _cli("store", "gc", s3_env.url(), "--cache-dir", work)
    assert r.exit_code == 0 and f"keep the working copy {root} of {s3_env.url()}" in r.output, r.output

    other = _cli("migrate", "v1-to-v2", s3_env.url(), "--cache-dir", tmp_path / "other")
    assert other.exit_code == 0 and remote_current(s3_env) == {"vae": 2}, other.output
    size = _bytes(root)
    _gc_removes_the_published_copy(s3_env, work, root, size)
