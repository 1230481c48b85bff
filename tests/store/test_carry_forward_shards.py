"""`store.reuse.carry_forward` over many shards: every shard linked once with exactly its rows in their order, and
a progress bar counting shards (a million samples in tens of thousands of shards took minutes with no bar; the
per-shard filter was O(shards x rows): 109 s measured for 20,000 shards of 1M rows, 0.5 s grouped by one sort)."""

from __future__ import annotations

from schemas import FieldSpec, Lineage, TableSchema, atomic_write
from store import Store
from store.reuse import FEATURE_LINEAGE_ATTR, carry_forward, reusable


def _schema(tag: str) -> TableSchema:
    return TableSchema(name="t", lineage=Lineage("s", config_hash=tag, upstream={}, code_version="x"),
                       fields=[FieldSpec("a", "bytes", kind="file"), FieldSpec("split", "string", kind="column"),
                               FieldSpec("img_shapes", "json", kind="column")],
                       attrs={FEATURE_LINEAGE_ATTR: "features"})


def _store_of_forty(tmp_path) -> tuple[Store, list[str]]:
    """Version 1 of table 't': 40 samples of 300 bytes in many small shards."""
    st = Store(tmp_path / "store")
    w = st.writer("t", _schema("one"), shard_size_mb=0.0005)
    keys = [f"{i:032x}" for i in range(40)]
    for i, k in enumerate(keys):
        w.add(k, files={"a": bytes([i]) * 300}, meta={"split": "train", "img_shapes": [[1, 2, 2]]})
    w.commit()
    return st, keys


def test_carry_forward_links_each_shard_with_its_rows_and_shows_a_bar(tmp_path, capsys):
    st, keys = _store_of_forty(tmp_path)
    before = st.reader("t", 1)
    shards = before.manifest.column("shard").to_pylist()
    assert len(set(shards)) > 5
    capsys.readouterr()

    w = st.writer("t", _schema("two"), shard_size_mb=0.0005)
    [(version, rows)] = reusable(st, "t", "features", keys[::-1]).items()
    assert carry_forward(w, version, rows, {"split": {k: "val" for k in keys}}) == 40
    w.commit()

    n = len(set(shards))
    assert f"carry forward 't':   0%|          | 0/{n} [" in capsys.readouterr().err  # a total: % and an ETA
    after = st.reader("t", 2)
    assert sorted(after.keys()) == keys and len(set(after.manifest.column("shard").to_pylist())) == len(set(shards))
    for i, k in enumerate(keys):
        assert after.files(k)["a"] == bytes([i]) * 300 and after.meta(k)["split"] == "val"
    by_shard: dict[str, list[str]] = {}
    for s, k in zip(shards, before.manifest.column("key").to_pylist()):
        by_shard.setdefault(s, []).append(k)
    carried = {}
    for s, k in zip(after.manifest.column("shard").to_pylist(), after.manifest.column("key").to_pylist()):
        carried.setdefault(s, []).append(k)
    assert sorted(carried.values()) == sorted(by_shard.values())  # each shard whole, its rows in their order
    before.close()
    after.close()


def test_linked_shards_fsync_their_folder_once_before_the_rank_done_file(tmp_path, monkeypatch):
    """Carrying a shard forward writes no bytes but its index's (fsynced before its name exists): the version
    folder is fsynced once for all the linked shards' names, after the last of them and before the rank's done
    file (which says they are all committed), not once per shard (590 fsyncs of ~2 ms at 100k samples:
    bench/carry_fsync.py). What the folder fsync covers, in order, is what a power loss can keep."""
    from store import format as fmt

    st, keys = _store_of_forty(tmp_path)

    w = st.writer("t", _schema("two"), shard_size_mb=0.0005)
    events: list[str] = []
    fsync_dir, atomic_write_bytes = atomic_write.fsync_dir, fmt.atomic_write_bytes

    def record_fsync(path):
        if path == w.dir:
            events.append("fsync folder")
        fsync_dir(path)

    def record_write(path, *args, **kwargs):
        events.append("index" if path.name.endswith(".index.parquet") else path.name)
        atomic_write_bytes(path, *args, **kwargs)

    monkeypatch.setattr(atomic_write, "fsync_dir", record_fsync)
    monkeypatch.setattr(fmt, "atomic_write_bytes", record_write)
    [(version, rows)] = reusable(st, "t", "features", keys).items()
    assert carry_forward(w, version, rows) == 40
    w.commit()
    done = events.index(fmt.rank_done_name(0))
    linked = events[:done]
    assert linked.count("index") == 40 and linked.count("fsync folder") == 1
    assert linked[-1] == "fsync folder"  # after every linked index, before the done file
    assert sorted(st.reader("t", 2).keys()) == keys


def test_a_shard_copied_where_links_fail_has_its_bytes_fsynced_before_its_name(tmp_path, monkeypatch):
    """Across file systems (EXDEV) a carried shard is copied, not linked: its bytes are its own, and the writer
    names and commits it fsyncing only the folder (above). The copy is fsynced before it is named, each shard
    before its index. Before: copied with shutil.copy2 and never fsynced, so a power loss after the rank's done
    file could keep a committed shard's name over lost bytes."""
    import errno
    import os

    from store import format as fmt

    st, keys = _store_of_forty(tmp_path)
    w = st.writer("t", _schema("two"), shard_size_mb=0.0005)
    events: list[str] = []
    fsync, real_write = os.fsync, fmt.atomic_write_bytes

    def no_link(src, dst, *args, **kwargs):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src), None, str(dst))

    def record_fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.endswith(".tar.tmp"):  # a shard's temp file (named by `_publish` after)
            events.append("fsync shard")
        fsync(fd)

    def record_write(path, *args, **kwargs):
        events.append("index" if path.name.endswith(".index.parquet") else path.name)
        real_write(path, *args, **kwargs)

    monkeypatch.setattr(os, "link", no_link)
    monkeypatch.setattr(os, "fsync", record_fsync)
    monkeypatch.setattr(fmt, "atomic_write_bytes", record_write)
    [(version, rows)] = reusable(st, "t", "features", keys).items()
    assert carry_forward(w, version, rows) == 40
    w.commit()
    carried = [e for e in events[:events.index(fmt.rank_done_name(0))] if e in ("fsync shard", "index")]
    assert carried == ["fsync shard", "index"] * 40
    after = st.reader("t", 2)
    assert [after.files(k)["a"] for k in keys] == [bytes([i]) * 300 for i in range(40)]
    after.close()


def test_a_source_version_gc_removed_after_it_was_chosen_is_refused_in_one_line(tmp_path):
    """`source_held` / `source_reader` (carry forward, encode's same-pictures copy and its completion): a version
    `store gc` removed between the stage's choice and its read is one line saying to rerun, its lease released; a
    version there is read under a lease gc respects, released after."""
    import pytest

    from schemas.errors import UserError
    from store.lease import leases
    from store.reuse import source_held, source_reader

    st, keys = _store_of_forty(tmp_path)
    with source_reader(st.root, "t", 1, "a test's read", "carry forward") as reader:
        assert reader.files(keys[3])["a"] == bytes([3]) * 300
        assert [(f.live, f.record["versions"]) for f in leases(st.root)] == [(True, {"t": [1]})]
    assert leases(st.root) == []
    with pytest.raises(UserError) as gone, source_held(st.root, "t", 7, "a test's read", "complete"):
        raise AssertionError("a removed version's block ran")
    assert str(gone.value) == ("table 't' v7 was removed (`store gc`) while this stage chose samples to complete "
                               "from it; rerun the stage (it resumes)")
    assert leases(st.root) == []
