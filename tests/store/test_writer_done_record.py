"""Rank 0's commit through a lagging view of a shared folder (NFS: a node's cached listing). Each rank's
`rank-RR.done` names its committed shards' indexes: rank 0 lists again while one is missing, then refuses, rather
than commit a manifest without that shard's rows. A rank whose view hid one of its own indexes wrote those samples
again: the same rank's identical rows keep the earlier shard's, so the rerun commits instead of failing forever."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from schemas import view_lag
from schemas.errors import UserError
from store import Store
from store import format as fmt
from store.manifest import merge_indexes
from store.verify import verify_store
from store_samples import key_of, sample, vae_schema
from test_store_writer import assert_exact
from test_writer_lagging_view import _add, _finished_rank, _lagging_view


class _Clock:
    """Stands in for `time` of schemas/view_lag.py (`seen_in_time`): each wait recorded (and `on_wait` called), none
    slept."""

    def __init__(self, on_wait=lambda: None) -> None:
        self.waits: list[float] = []
        self.on_wait = on_wait

    def sleep(self, s: float) -> None:
        self.waits.append(s)
        self.on_wait()


def _two_ranks_finished(store: Store) -> tuple[object, Path]:
    """Ranks 0 and 1 wrote samples 0..7 (even ones rank 0's, one shard each) and finished; rank 0's writer is
    returned before its commit."""
    w0 = store.writer("vae", vae_schema(), rank=0, world_size=2, shard_size_mb=0.0001)
    w1 = store.writer("vae", vae_schema(), rank=1, world_size=2, shard_size_mb=0.0001)
    for i in range(8):
        _add((w0, w1)[i % 2], i)
    w1.finish_rank()
    w1.close()
    return w0, store.version_dir("vae", 1)


def test_the_done_file_names_the_committed_indexes_it_sees_and_wrote(store: Store) -> None:
    w0, vdir = _two_ranks_finished(store)
    done = json.loads((vdir / "rank-01.done").read_text())
    assert done["indexes"] == sorted(p.name for p in vdir.glob("shard-r01-*.index.parquet")) and len(done["indexes"]) == 4
    w0.close()


def test_a_commit_whose_view_hides_an_index_a_done_file_names_is_refused(store: Store, monkeypatch) -> None:
    """Rank 0 does not list one of rank 1's indexes (and keeps not listing it): the commit used to write a manifest
    without that shard's rows - 7 of 8 samples, silently, for a writer that does not count its keys."""
    w0, vdir = _two_ranks_finished(store)
    hidden = sorted(p.name for p in vdir.glob("shard-r01-*.index.parquet"))[1]
    clock = _Clock()
    monkeypatch.setattr(view_lag, "time", clock)
    with _lagging_view(monkeypatch, vdir, {hidden}):
        with pytest.raises(UserError, match=rf"1 committed shard\(s\).*\['{hidden}'\].*Rerun") as e:
            w0.commit()
    assert "\n" not in str(e.value)
    assert clock.waits == list(view_lag.VIEW_LAG_WAITS_S)  # listed again before refusing
    assert not (vdir / "manifest.parquet").exists() and store.tables() == {}
    w0 = store.writer("vae", vae_schema(), rank=0, world_size=2)  # the rerun, the view caught up
    assert w0.commit() == 1
    assert_exact(store, 8)


def test_a_view_that_catches_up_while_listed_again_commits_every_row(store: Store, monkeypatch) -> None:
    w0, vdir = _two_ranks_finished(store)
    hidden = {sorted(p.name for p in vdir.glob("shard-r01-*.index.parquet"))[0]}
    clock = _Clock(on_wait=hidden.clear)  # caught up after the first wait
    monkeypatch.setattr(view_lag, "time", clock)
    with _lagging_view(monkeypatch, vdir, hidden):
        assert w0.commit() == 1
    assert len(clock.waits) == 1
    assert verify_store(store.root, progress=False) == []
    assert_exact(store, 8)


def test_done_files_of_older_code_without_the_record_commit_as_before(store: Store, monkeypatch) -> None:
    w0, vdir = _two_ranks_finished(store)
    done = vdir / "rank-01.done"
    record = json.loads(done.read_text())
    record.pop("indexes", None)
    fmt.atomic_write_json(done, record)
    clock = _Clock()
    monkeypatch.setattr(view_lag, "time", clock)
    assert w0.commit() == 1 and clock.waits == []
    assert_exact(store, 8)


def test_a_sample_written_again_because_the_view_hid_its_index_commits_once(store: Store, monkeypatch) -> None:
    """The resumed rank does not see its last shard's index (nor its done file), so it writes that shard's sample
    again, in a new shard with another. The commit used to fail on "duplicate keys across shards" at every rerun;
    the row of the earlier shard is kept (same content), the later shard's other row stays."""
    vdir = _finished_rank(store, 4)
    last = sorted(vdir.glob("shard-r00-*.tar"))[-1]
    with _lagging_view(monkeypatch, vdir, {fmt.index_name(last.name), "rank-00.done"}):
        w = store.writer("vae", vae_schema(), shard_size_mb=1)
        assert key_of(3) not in w.done_keys
        for i in (3, 4):
            _add(w, i)
    assert w.commit() == 1  # the view caught up: both shards' indexes listed
    manifest = pq.read_table(vdir / "manifest.parquet")
    rows = [r for r in manifest.select(["key", "shard"]).to_pylist() if r["key"] == key_of(3)]
    assert [r["shard"] for r in rows] == [last.name]
    assert verify_store(store.root, progress=False) == []
    assert_exact(Store(store.root), 5)


def _index(vdir: Path, name: str, i: int, **meta) -> Path:
    """A committed shard `name` holding sample i (with `meta` over its own)."""
    s = sample(i)
    w = Store(vdir.parent.parent.parent / f"scratch-{name}").writer("vae", vae_schema())
    w.add(s["key"], tensors=s["tensors"], files=s["files"], meta={**s["meta"], **meta})
    w.finish_rank()
    src = w.dir
    w.close()
    rows = pq.read_table(src / "shard-r00-000000.index.parquet")
    path = vdir / fmt.index_name(name)
    vdir.mkdir(parents=True, exist_ok=True)
    pq.write_table(rows.set_column(rows.schema.get_field_index("shard"), "shard", [[name]]), path)
    return path


def test_duplicates_of_other_content_or_across_ranks_are_still_refused(store: Store) -> None:
    vdir = store.root / "vae" / "v9"
    a = _index(vdir, fmt.shard_name(0, 0), 1)
    same = _index(vdir, fmt.shard_name(0, 4), 1)
    other = _index(vdir, fmt.shard_name(0, 5), 1, split="val")
    other_rank = _index(vdir, fmt.shard_name(1, 0), 1)
    assert merge_indexes([same, a]).column("shard").to_pylist() == [fmt.shard_name(0, 0)]
    with pytest.raises(UserError, match=r"in shard-r00-000000.tar and shard-r00-000005.tar \(other content\).*rerun"):
        merge_indexes([a, other])
    with pytest.raises(UserError, match=r"in shard-r00-000000.tar and shard-r01-000000.tar: each sample"):
        merge_indexes([a, other_rank])


def test_a_truncated_shard_index_is_one_line_naming_it(tmp_path: Path) -> None:
    """The commit reads the shard indexes through pq.ParquetFile, whose errors do not name the file: a truncated
    index is a UserError naming it (a traceback without the file name before)."""
    import pyarrow as pa

    paths = []
    for i in range(2):
        p = tmp_path / f"shard-r0-{i:06d}.index.parquet"
        pq.write_table(pa.table({"key": [f"k{i}"], "shard": [f"shard-r0-{i:06d}.tar"]}), p)
        paths.append(p)
    paths[1].write_bytes(paths[1].read_bytes()[:20])
    with pytest.raises(UserError, match="shard-r0-000001.index.parquet: the shard index is unreadable"):
        merge_indexes(paths)


def test_the_commit_reads_each_index_once_and_checksums_the_bytes_it_merged(store: Store, monkeypatch) -> None:
    """checksums.json used to read every shard index again (~6,000 files at 1M samples) after the merge had read
    them all: each index's CRC32C is now taken from the bytes its rows were parsed from, and it is the file's."""
    from store import integrity
    from store.checksum import file_crc, unseal

    w0, vdir = _two_ranks_finished(store)
    read_again: list[str] = []
    monkeypatch.setattr(integrity, "file_crc", lambda p: read_again.append(Path(p).name) or file_crc(p))
    assert w0.commit() == 1
    assert not [n for n in read_again if n.endswith(".index.parquet")], read_again
    files = unseal((vdir / fmt.CHECKSUMS).read_bytes())["files"]
    indexes = sorted(p.name for p in vdir.glob("shard-r*-*.index.parquet"))
    assert len(indexes) == 8 and all(n in files for n in indexes)
    assert all(file_crc(vdir / n) == (files[n]["crc32c"], files[n]["nbytes"]) for n in indexes)
    assert verify_store(store.root, progress=False) == []


def test_an_unreadable_index_at_the_commit_is_refused_with_nothing_committed(store: Store) -> None:
    """An index damaged between its rank's finish and rank 0's commit (cut short): the commit, which now parses
    the bytes it read for the checksum, still refuses it in one line naming the file, and commits nothing."""
    w0, vdir = _two_ranks_finished(store)
    index = sorted(vdir.glob("shard-r01-*.index.parquet"))[1]
    index.write_bytes(index.read_bytes()[:40])
    with pytest.raises(UserError, match="the shard index is unreadable") as e:
        w0.commit()
    assert str(index) in str(e.value) and "\n" not in str(e.value)
    assert not (vdir / "manifest.parquet").exists() and not (vdir / fmt.CHECKSUMS).exists()
    assert store.tables() == {}


def test_a_merge_in_joined_batches_writes_the_manifest_the_former_merge_wrote(store: Store, monkeypatch) -> None:
    """`merge_measured` joins the indexes a few at a time and sorts one column at a time (bench/merge_memory.py):
    the manifest's bytes are the former merge's (every index held, `Table.sort_by`), with the indexes spread over
    several batches, a meta column one batch lacks and another holds only nulls, and a same-rank duplicate."""
    import pyarrow as pa

    from bench.merge_memory import old_merged
    from store import manifest

    vdir = store.root / "vae" / "v9"
    paths = [_index(vdir, fmt.shard_name(r, j), 7 * j + r, **({"note": None} if j == 1 else
                                                                {"note": f"n{j}"} if j == 2 else {}))
             for r in range(2) for j in range(3)]
    paths.append(_index(vdir, fmt.shard_name(0, 5), 0))  # sample 0 again, in a later shard of rank 0
    monkeypatch.setattr(manifest, "JOINED_INDEXES", 2)
    got = manifest.merge_indexes(paths)
    want = old_merged([pq.read_table(p) for p in paths])
    assert got.num_rows == 6 and got.column("note").type == pa.string()
    assert fmt.parquet_bytes(got) == fmt.parquet_bytes(want)
