"""A store at a `file://` URL (a local or shared file system reached through the object-store protocol): the
guarantees S3 gives by itself - an object appears whole or not at all, write-once, compare-and-swap - given by
store/remote_local.py (fsspec's LocalFileSystem writes in place and has no conditional write)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from typer.testing import CliRunner

from pipeline.cli import app
from store import Store
from store.remote import open_remote
from store.remote_pull import pull
from store.remote_push import push
from store.verify import verify_store
from store_samples import fill

runner = CliRunner()

KILLED_PUSH = "import sys; from store.remote_push import push; push(sys.argv[1], sys.argv[2])"


def _under(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_push_and_pull_through_a_file_url_with_no_options(store: Store, tmp_path: Path) -> None:
    """Before: a FileNotFoundError for the remote's first folder (fsspec creates none without auto_mkdir)."""
    fill(store, 10, tag="a")
    url = f"file://{tmp_path / 'remote'}"
    assert "copied vae/v1" in str(push(str(store.root), url))
    fill(store, 6, tag="b", start=20)
    assert "copied vae/v2" in str(push(str(store.root), url))
    pull(url, tmp_path / "pulled")
    assert verify_store(tmp_path / "pulled") == []
    assert Store(tmp_path / "pulled", create=False).tables() == {"vae": 2}


def test_a_push_killed_mid_object_leaves_no_torn_object_and_its_rerun_finishes(store: Store, tmp_path: Path) -> None:
    """SIGKILL while an object's bytes are being written: nothing under a store name is partial (in-place writes
    left a torn shard, and the rerun stopped: 'the same name, another size'); the rerun completes, the pulled
    store verifies, and gc removes the killed write's temp file."""
    fill(store, 10, tag="a")
    remote = tmp_path / "remote"
    url = f"file://{remote}"
    killed = subprocess.run([sys.executable, "-c", KILLED_PUSH, str(store.root), url],
                            env={**os.environ, "STORE_CRASH_AT": "remote_local_mid_write"}, capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    temps = [p for p in (remote / ".uploads").iterdir()]
    assert len(temps) == 1  # the killed write's bytes went to a temp file only
    local = _under(store.root)
    for rel, data in _under(remote).items():
        if not rel.startswith("."):
            assert data == local[rel], rel  # every object under a store name is whole

    assert "copied vae/v1" in str(push(str(store.root), url))
    pull(url, tmp_path / "pulled")
    assert verify_store(tmp_path / "pulled") == []

    r = runner.invoke(app, ["store", "gc", url, "--incomplete-after", "0"])
    assert r.exit_code == 0 and "1 leftover(s) of killed commands" in r.output, r.output
    assert not any((remote / ".uploads").iterdir())


def test_write_once_and_compare_and_swap_hold_under_concurrent_writers(tmp_path: Path) -> None:
    """Of 8 writers creating one object at once exactly one wins (its bytes stay); 8 writers each adding a key
    to one JSON object by compare-and-swap, 20 times each, lose no update."""
    remote = open_remote(f"file://{tmp_path / 'remote'}")
    n, rounds = 8, 20
    sources = []
    for i in range(n):
        sources.append(tmp_path / f"src{i}")
        sources[-1].write_bytes(bytes([i]) * 100_000)
    start = threading.Barrier(n)
    won: list[int] = []

    class Bar:
        def update(self, k: int) -> None:
            pass

    def create(i: int) -> None:
        start.wait()
        if remote.upload(sources[i], "t/v1/obj", "crc", Bar()):
            won.append(i)

    def add(i: int) -> None:
        start.wait()
        for r in range(rounds):
            remote.swap("store.json", lambda old: json.dumps({**json.loads(old or b"{}"), f"{i}-{r}": 1}).encode())

    for fn in (create, add):
        threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(won) == 1 and remote.read("t/v1/obj") == bytes([won[0]]) * 100_000
    assert len(json.loads(remote.read("store.json"))) == n * rounds


def test_a_resumed_push_to_a_file_url_reads_no_object_back(store: Store, tmp_path: Path, monkeypatch) -> None:
    """A push killed after some objects, rerun: the objects already there are known by the CRC32C recorded with
    each (an xattr, as S3 object metadata), not by reading them back (before: every byte uploaded before the kill
    was read again: terabytes for a large store). An object of the same size but other bytes (not written by this
    push, no record) is still refused."""
    from schemas.errors import UserError
    from store import remote as remote_mod
    from transfer_gate import AfterN

    fill(store, 12)
    url = f"file://{tmp_path / 'remote'}"

    def reset(*args):
        raise ConnectionResetError("connection reset by peer")

    gate = AfterN(3, remote_mod.Remote.upload, after=reset)
    with monkeypatch.context() as m:
        m.setattr(remote_mod.Remote, "upload", lambda self, *a: gate(self, *a))
        try:
            push(str(store.root), url)
        except (UserError, ConnectionResetError):
            pass
    remote = open_remote(url)
    there = [r for r in remote.listing() if not r.startswith(".")]
    assert len(there) == 3  # the objects of the killed push
    read_back: list[str] = []
    real_open = type(remote.fs).open

    def counting_open(fs, path, mode="rb", **kw):
        if "r" in mode and "/vae/" in str(path):  # a version's object (store.json is read by its swap)
            read_back.append(path)
        return real_open(fs, path, mode, **kw)

    monkeypatch.setattr(type(remote.fs), "open", counting_open)
    summary = push(str(store.root), url)
    assert summary.objects_skipped == 3 and read_back == []
    pull(url, tmp_path / "pulled")
    assert verify_store(tmp_path / "pulled") == []

    # the same size, other bytes, no record: read and found to differ (a conflict, not skipped as "there")
    victim = next(p.relative_to(store.root).as_posix() for p in sorted(store.root.rglob("*.tar")))
    target = tmp_path / "remote2" / victim
    target.parent.mkdir(parents=True)
    data = (store.root / victim).read_bytes()
    target.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    with pytest.raises(UserError, match="incomplete version with other contents|differs"):
        push(str(store.root), f"file://{tmp_path / 'remote2'}")


@pytest.mark.parametrize("code", ["EROFS", "EACCES"])
def test_a_pull_into_a_read_only_folder_is_one_line_naming_it(store: Store, tmp_path: Path, monkeypatch, code) -> None:
    """The destination store on a read-only mount (EROFS) or another account's folder (EACCES): one line naming
    the version's folder (not its hidden pull folder, which never came to be) and what to do, nothing written there (before: the PermissionError / OSError of the version's temp
    folder, a traceback through the API). Simulated at the first write there, a folder made (the tests run as root,
    whom file modes do not stop); the URL's own folder stays writable."""
    import errno

    from schemas.errors import UserError

    fill(store, 6, tag="a")
    url = f"file://{tmp_path / 'remote'}"
    push(str(store.root), url)
    dst = tmp_path / "pulled"
    pull(url, dst)
    fill(store, 4, tag="b", start=20)
    push(str(store.root), url)
    real_mkdir = os.mkdir

    def refused_in_dst(path, *a, **k):
        if str(path).startswith(str(dst)):
            raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)), str(path))
        return real_mkdir(path, *a, **k)

    monkeypatch.setattr(os, "mkdir", refused_in_dst)
    with pytest.raises(UserError, match=rf"cannot write the pull of {url} into {dst}: {dst}/vae/v2 is not "
                                        rf"writable .*; make {dst} writable .* or pull into another folder") as e:
        pull(url, dst)
    assert "\n" not in str(e.value)
    assert Store(dst, create=False).versions("vae") == [1]
