"""A resumed writer never deletes or replaces a tar it cannot prove uncommitted: a shared filesystem's view can lag
on one node and hide a committed shard's index and the rank's done file (or the shard itself). A tar no index
names is only an unreferenced file: the commit neither lists nor ships it, verify ignores it, `store gc` removes it.
"""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator

import pyarrow.parquet as pq
import pytest

from schemas import atomic_write, view_lag
from schemas.errors import UserError

from store import Store, writer_open
from store import format as fmt
from store.checksum import unseal
from store.gc import collect
from store.remote_pull import pull
from store.remote_push import push
from store.verify import verify_store
from store_samples import sample, vae_schema
from test_store_writer import assert_exact, run_writer


def _add(w, i: int) -> None:
    s = sample(i)
    w.add(s["key"], tensors=s["tensors"], files=s["files"], meta=s["meta"])


@contextmanager
def _lagging_view(monkeypatch: pytest.MonkeyPatch, vdir: Path, hidden: set[str]) -> Iterator[None]:
    """This process's view of `vdir` lists none of `hidden` and finds none of them by name, though they are there
    (an NFS client's cached listing and lookups); a hard link to a hidden name still meets the file."""
    def shown(p: Path) -> bool:
        return not (p.parent == vdir and p.name in hidden)

    glob, iterdir, is_file, is_dir, exists = Path.glob, Path.iterdir, Path.is_file, Path.is_dir, Path.exists
    with monkeypatch.context() as m:
        m.setattr(Path, "glob", lambda self, pattern: (p for p in glob(self, pattern) if shown(p)))
        m.setattr(Path, "iterdir", lambda self: (p for p in iterdir(self) if shown(p)))
        m.setattr(Path, "is_file", lambda self: shown(self) and is_file(self))
        m.setattr(Path, "is_dir", lambda self: shown(self) and is_dir(self))
        m.setattr(Path, "exists", lambda self: shown(self) and exists(self))
        yield


def _finished_rank(store: Store, n: int) -> Path:
    """Rank 0 wrote samples 0..n-1 (one shard each) and its done file, then was stopped before the commit."""
    w = store.writer("vae", vae_schema(), shard_size_mb=0.0001)
    for i in range(n):
        _add(w, i)
    w.finish_rank()
    w.close()
    return store.version_dir("vae", 1)


def _shard_names(vdir: Path) -> set[str]:
    return {p.name for p in vdir.glob("shard-r00-*.tar")}


@pytest.mark.parametrize("tar_hidden", [False, True], ids=["index-and-done-hidden", "shard-too-hidden"])
def test_a_resume_through_a_lagging_view_keeps_every_committed_shard(store: Store, monkeypatch, tar_hidden) -> None:
    """The resumed writer sees neither the last shard's index nor rank-00.done (and, in the second case, not the
    shard itself). It used to delete that tar (no index, no done file: "uncommitted"), or to write its next
    shard under that very name; the shard's index, seen once the view catches up, then named lost bytes."""
    vdir = _finished_rank(store, 4)
    last = sorted(vdir.glob("shard-r00-*.tar"))[-1]
    kept = last.read_bytes()
    hidden = {fmt.index_name(last.name), "rank-00.done"} | ({last.name} if tar_hidden else set())
    before = _shard_names(vdir)
    with _lagging_view(monkeypatch, vdir, hidden):
        w = store.writer("vae", vae_schema(), shard_size_mb=0.0001)
        assert len(w.done_keys) == 3  # the hidden shard's sample is not known to be done
        for i in (4, 5):  # the samples of this session (a real one would redo sample 3: test_writer_done_record.py)
            _add(w, i)
    assert last.read_bytes() == kept  # neither deleted nor replaced
    new = _shard_names(vdir) - before
    assert len(new) == 2 and all(n > last.name for n in new)  # numbered past it: no name reused
    assert w.commit() == 1  # the view caught up: every index seen
    assert verify_store(store.root, progress=False) == []
    assert last.name in pq.read_table(vdir / "manifest.parquet").column("shard").to_pylist()
    assert_exact(Store(store.root), 6)  # a fresh reader: every sample once, the kept shard's too


def test_a_tar_killed_before_its_index_is_not_committed_shipped_or_damage_and_gc_removes_it(tmp_path: Path) -> None:
    """A real kill between a shard's tar and its index: the resumed writer leaves the tar (it cannot tell it from a
    shard whose index its view hides) and writes those samples again under new names. The commit's manifest and
    checksums.json do not name it, verify does not count it, a push does not ship it, and `store gc` removes it."""
    root = tmp_path / "s"
    Store(root)
    killed = run_writer(root, 30, kill_after=-1, env={"STORE_CRASH_AT": "shard_before_index"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    vdir = root / "vae" / "v1"
    orphan, = (p for p in vdir.glob("*.tar") if not (vdir / fmt.index_name(p.name)).exists())
    assert run_writer(root, 30, kill_after=-1).returncode == 0
    st = Store(root)
    assert_exact(st, 30)
    assert orphan.is_file()  # left to gc: the commit does not delete what its own view may not see whole
    assert orphan.name not in pq.read_table(vdir / "manifest.parquet").column("shard").to_pylist()
    assert orphan.name not in unseal((vdir / "checksums.json").read_bytes())["files"]
    assert verify_store(root, progress=False) == []
    url = f"file://{tmp_path / 'remote'}"
    push(str(root), url)
    assert not (tmp_path / "remote" / "vae" / "v1" / orphan.name).exists()
    pull(url, tmp_path / "pulled")
    assert verify_store(tmp_path / "pulled", progress=False) == []
    files = sorted(os.listdir(vdir))
    said: list[str] = []
    plan = collect(root, echo=said.append)
    assert plan.unreferenced == [orphan] and not plan.remove
    assert sorted(os.listdir(vdir)) == [f for f in files if f != orphan.name]  # the version's own files all stay
    assert any(f"remove vae/v1/{orphan.name}" in line for line in said)
    assert verify_store(root, progress=False) == []
    assert_exact(Store(root), 30)



def test_without_hard_links_a_shard_still_never_replaces_a_file_of_its_name(store: Store, monkeypatch) -> None:
    """Where the file system makes no hard links, a shard is renamed into place - but not over a file this view
    shows under its name (here a tar whose index was lost: the name is skipped, the tar kept)."""
    vdir = _finished_rank(store, 2)
    stray = vdir / fmt.shard_name(0, 2)
    stray.write_bytes(b"a tar no index names")

    def no_links(src, dst):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    monkeypatch.setattr("store.writer.next_shard_index", lambda *a: 2)  # a view that missed it
    w = store.writer("vae", vae_schema(), shard_size_mb=0.0001)
    _add(w, 2)
    assert w.commit() == 1
    assert stray.read_bytes() == b"a tar no index names"
    assert (vdir / fmt.index_name(fmt.shard_name(0, 3))).is_file()
    assert verify_store(store.root, progress=False) == []
    assert_exact(Store(store.root), 3)


def test_a_shard_whose_index_is_in_place_is_kept_when_the_folder_fsync_fails(tmp_path, monkeypatch) -> None:
    """The index renamed into place commits the shard; an error after it (the folder's fsync: EIO on an NFS commit,
    Ctrl-C) must not take the tar away from its index (before: deleted, and a resumed writer counted its keys as
    committed, so the complete version lacked a shard)."""
    import pyarrow as pa

    from store.writer_shards import RankShards

    shards = RankShards(tmp_path, 0, 0, 1 << 30, "table 't' v1")
    monkeypatch.setattr(shards, "drop_done", lambda: None)
    tmp = tmp_path / "x.tar.tmp"
    tmp.write_bytes(b"\0" * 1024)
    real = atomic_write.fsync_dir

    def failing(p: Path) -> None:
        if any(q.name.endswith(".index.parquet") for q in p.iterdir()):
            raise OSError(5, "Input/output error")
        real(p)

    monkeypatch.setattr(atomic_write, "fsync_dir", failing)
    with pytest.raises(OSError):
        shards._publish(tmp, lambda name: pa.table({"key": ["a"], "shard": [name]}))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-r00-000000.index.parquet", "shard-r00-000000.tar"]


def _lagging_clock(monkeypatch, catch_up: Callable[[], None] | None = None) -> list[float]:
    """store/writer_open.py's clock, advanced by its waits alone (no real sleep); `catch_up`: called at each wait
    (the view lags until it says otherwise). The waits, returned."""
    now, waits = [0.0], []

    def wait(seconds: float) -> None:
        waits.append(seconds)
        now[0] += seconds
        if catch_up is not None:
            catch_up()

    monkeypatch.setattr(view_lag, "time", SimpleNamespace(monotonic=lambda: now[0], sleep=wait))
    return waits


def test_a_rank_whose_view_lags_writes_the_version_rank_0_just_opened(store: Store, monkeypatch) -> None:
    """stages/encode/nodes.py: rank 0 opens the ranks' version, then every rank's writer opens that number. On
    another node the table folder may not show it yet (an NFS attribute cache): that rank's writer tried to make
    the folder and met it (FileExistsError: a traceback, the launch stopped); then its schema.json, unseen for a
    moment more, was "another writer's version: remove that folder". Now the writer uses the folder and waits for
    its schema.json to show; both ranks' samples are committed in that version."""
    v, vdir = writer_open.open_version(store.root, "vae", vae_schema().to_dict())  # rank 0 opens it
    rank0 = store.writer("vae", vae_schema(), rank=0, world_size=2, version=v, shard_size_mb=0.0001)
    folder, schema = {vdir.name}, {fmt.SCHEMA_JSON}
    waits = _lagging_clock(monkeypatch, catch_up=lambda: schema.clear() if len(waits) >= 2 else None)
    with _lagging_view(monkeypatch, vdir.parent, folder), _lagging_view(monkeypatch, vdir, schema):
        rank1 = store.writer("vae", vae_schema(), rank=1, world_size=2, version=v, shard_size_mb=0.0001)
    assert (rank1.version, rank1.dir) == (v, vdir) and len(waits) == 2  # waited for the view to catch up
    for i, w in enumerate((rank0, rank1)):
        _add(w, i)
        w.finish_rank()
    rank1.close()
    assert rank0.commit() == v
    assert_exact(store, 2)


def test_a_rank_whose_view_lags_writes_the_first_version_of_a_table_rank_0_just_made(store: Store,
                                                                                       monkeypatch) -> None:
    """The table's first version: rank 0 made the table folder itself a moment ago, and this node's view shows
    neither it nor the version. The writer's lock met the table folder (FileExistsError: "... is a file, not a
    folder" on that rank); now it waits for the folder to show, then writes the version."""
    v, vdir = writer_open.open_version(store.root, "vae", vae_schema().to_dict())  # rank 0 opens it
    table, version, schema = {"vae"}, {vdir.name}, {fmt.SCHEMA_JSON}

    def catch_up() -> None:  # one name more shows at each wait
        next(s for s in (table, version, schema, {None}) if s).clear()

    waits = _lagging_clock(monkeypatch, catch_up)
    with _lagging_view(monkeypatch, store.root, table), _lagging_view(monkeypatch, vdir.parent, version), \
            _lagging_view(monkeypatch, vdir, schema):
        rank1 = store.writer("vae", vae_schema(), rank=1, world_size=2, version=v, shard_size_mb=0.0001)
    assert (rank1.version, rank1.dir) == (v, vdir) and len(waits) == 3  # till the table, version and schema show
    _add(rank1, 1)
    rank1.finish_rank()
    rank1.close()
    assert (vdir / "rank-01.done").is_file()


def test_a_file_where_the_table_folder_goes_is_one_line_at_once(store: Store, monkeypatch) -> None:
    (store.root / "vae").write_text("not a table")
    waits = _lagging_clock(monkeypatch)
    with pytest.raises(UserError, match=r"/vae is not a folder seen from this node: a file of that name \(remove it"):
        store.writer("vae", vae_schema())
    assert waits == []  # no wait for a view to catch up: the file is seen


def test_a_version_folder_whose_schema_never_shows_is_one_line(store: Store, monkeypatch) -> None:
    """The agreed version's folder is there but this node never sees its schema.json (a view lagging past
    VIEW_LAG_SECONDS, or a writer killed as it made the folder): one line naming the folder, after the wait."""
    v, vdir = writer_open.open_version(store.root, "vae", vae_schema().to_dict())
    waits = _lagging_clock(monkeypatch)
    with _lagging_view(monkeypatch, vdir.parent, {vdir.name}), _lagging_view(monkeypatch, vdir, {fmt.SCHEMA_JSON}):
        with pytest.raises(UserError, match=rf"{vdir} holds no schema.json, though the ranks agreed to write table "
                                            rf"'vae' v{v} there \(waited 60 s.*remove that folder and rerun"):
            store.writer("vae", vae_schema(), rank=1, world_size=2, version=v)
    assert sum(waits) >= view_lag.VIEW_LAG_SECONDS
