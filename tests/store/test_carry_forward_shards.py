"""`store.reuse.carry_forward` over many shards: every shard linked once with exactly its rows in their order, and
a progress bar counting shards (a million samples in tens of thousands of shards took minutes with no bar; the
per-shard filter was O(shards x rows): 109 s measured for 20,000 shards of 1M rows, 0.5 s grouped by one sort)."""

from __future__ import annotations

from schemas import FieldSpec, Lineage, TableSchema
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
    fsync_dir, atomic_write_bytes = fmt.fsync_dir, fmt.atomic_write_bytes

    def record_fsync(path):
        if path == w.dir:
            events.append("fsync folder")
        fsync_dir(path)

    def record_write(path, *args, **kwargs):
        events.append("index" if path.name.endswith(".index.parquet") else path.name)
        atomic_write_bytes(path, *args, **kwargs)

    monkeypatch.setattr(fmt, "fsync_dir", record_fsync)
    monkeypatch.setattr(fmt, "atomic_write_bytes", record_write)
    [(version, rows)] = reusable(st, "t", "features", keys).items()
    assert carry_forward(w, version, rows) == 40
    w.commit()
    done = events.index(fmt.rank_done_name(0))
    linked = events[:done]
    assert linked.count("index") == 40 and linked.count("fsync folder") == 1
    assert linked[-1] == "fsync folder"  # after every linked index, before the done file
    assert sorted(st.reader("t", 2).keys()) == keys


def test_shards_carried_by_copy_where_hard_links_fail_have_their_bytes_fsynced_before_the_rank_done_file(
        tmp_path, monkeypatch):
    """Where the file system refuses hard links (or across file systems) `link_or_copy` copies the shard: those
    are new bytes, and the folder fsync makes only their names durable. Each copy's bytes are fsynced before the
    rank's done file says it is committed (a power loss kept a named, indexed shard of zeros: a damaged version)."""
    import os

    from store import format as fmt

    st = Store(tmp_path / "store")
    w = st.writer("t", _schema("one"), shard_size_mb=0.0005)
    keys = [f"{i:032x}" for i in range(12)]
    for i, k in enumerate(keys):
        w.add(k, files={"a": bytes([i]) * 300}, meta={"split": "train", "img_shapes": [[1, 2, 2]]})
    w.commit()

    w = st.writer("t", _schema("two"), shard_size_mb=0.0005)
    events: list[str] = []
    fsync, atomic_write_bytes = os.fsync, fmt.atomic_write_bytes

    def no_link(src, dst, *args, **kwargs):
        raise OSError(1, "Operation not permitted")  # e.g. a FUSE or SMB mount

    def record_fsync(fd):
        events.append("fsync " + os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def record_write(path, *args, **kwargs):
        events.append(path.name)
        atomic_write_bytes(path, *args, **kwargs)

    monkeypatch.setattr(os, "link", no_link)
    monkeypatch.setattr(os, "fsync", record_fsync)
    monkeypatch.setattr(fmt, "atomic_write_bytes", record_write)
    [(version, rows)] = reusable(st, "t", "features", keys).items()
    assert carry_forward(w, version, rows) == 12
    w.commit()
    vdir = st.version_dir("t", 2)
    copied = sorted(p.name + ".tmp" for p in vdir.glob("*.tar"))
    assert len(copied) > 5 and not any(os.path.samefile(vdir / c[:-4], st.version_dir("t", 1) / c[:-4]) for c in copied)
    done = events.index(fmt.rank_done_name(0))
    assert sorted(e[len("fsync "):] for e in events[:done] if e.endswith(".tar.tmp")) == copied
    assert sorted(st.reader("t", 2).keys()) == keys
