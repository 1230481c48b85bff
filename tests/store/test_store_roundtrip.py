"""Write -> read round trips: bf16 exact through the mmap reader, random access, meta, versions, quarantine."""

from __future__ import annotations

import json

import pytest
import torch

from schemas import UserError
from store import Store

from store_samples import fill, key_of, lineage, sample, vae_schema
import warm_start


def test_roundtrip_exact_random_access(store: Store) -> None:
    v = fill(store, 24)
    assert v == 1 and store.tables() == {"vae": 1}
    r = store.reader("vae")
    assert len(r) == 24 and r.keys() == sorted(key_of(i) for i in range(24))
    assert len(r.shard_paths()) > 3  # tiny shard size forced several shards
    for i in [7, 0, 23, 11, 3]:  # random order: access by key, not by scan
        s, got = sample(i), r.get(key_of(i))
        assert got["tensors"].keys() == s["tensors"].keys()
        for name, t in s["tensors"].items():
            assert got["tensors"][name].dtype == t.dtype
            assert torch.equal(got["tensors"][name].view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32),
                               t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32))
        assert got["files"] == s["files"]
        assert got["meta"]["caption"] == f"caption {i}" and got["meta"]["split"] == s["meta"]["split"]
        assert r.img_shapes(key_of(i)) == [tuple(x) for x in s["meta"]["img_shapes"]]


def test_scans_view_the_shard_map_and_random_reads_own_their_bytes(store: Store) -> None:
    import ctypes

    from store.shard_io import SCAN_RUN

    fill(store, 24, shard_size_mb=0.05)
    r = store.reader("vae")
    shards = r.manifest.column("shard").to_pylist()
    by_shard: dict[str, list[str]] = {}
    for k, s in zip(r.keys(), shards):
        by_shard.setdefault(s, []).append(k)
    shard, keys = max(by_shard.items(), key=lambda kv: len(kv[1]))
    assert len(keys) > SCAN_RUN and len(by_shard) > 1
    # A scan (reads in a row from one shard): from the SCAN_RUN-th read on, tensors lie inside the mapped shard.
    got = [r.tensors(k)["target"] for k in keys]
    m = r.shard_map(shard)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    inside = [base <= t.data_ptr() < base + len(m) for t in got]
    assert inside == [False] * (SCAN_RUN - 1) + [True] * (len(keys) - SCAN_RUN + 1)
    other = next(k for s, ks in by_shard.items() if s != shard for k in ks)
    r.tensors(other)  # the scan is over: a read from the still-mapped shard gets bytes of its own
    t = r.tensors(keys[0])["target"]
    assert not base <= t.data_ptr() < base + len(m) and torch.equal(t, got[0])
    # Random reads (alternating shards): each sample's tensors own a fresh buffer - writing to one changes
    # neither the other sample, nor a re-read, nor the store.
    r2 = store.reader("vae")
    a, b = r2.tensors(keys[0])["target"], r2.tensors(other)["target"]
    a0, b0 = a.clone(), b.clone()
    a.fill_(7)
    assert torch.equal(r2.tensors(keys[0])["target"], a0) and torch.equal(b, b0)
    assert torch.equal(store.reader("vae").tensors(keys[0])["target"], a0)
    assert all(isinstance(h, int) for h in r2.shards.open_handles())  # no shard was mapped


def test_find_version_and_new_version_on_lineage_change(store: Store) -> None:
    assert store.find_version("vae", lineage("a")) is None
    assert fill(store, 4, tag="a") == 1
    assert store.find_version("vae", lineage("a")) == 1
    assert store.find_version("vae", lineage("b")) is None
    assert fill(store, 4, tag="b") == 2
    assert store.tables() == {"vae": 2} and store.find_version("vae", lineage("a")) == 1
    assert len(store.reader("vae", version=1)) == 4


def test_a_version_of_exactly_the_lineage_wins_over_a_newer_serving_one(store: Store) -> None:
    """`serving`: versions of settings that hold more (e.g. encode_text.no_control_embeds true for a run with it
    false) serve a run too, but a non-current exact one is preferred to a newer serving one (its numbers are the
    run's own; a serving one may differ by float32 rounding), and the current one, of either, to both."""
    assert fill(store, 4, tag="exact") == 1
    assert fill(store, 4, tag="more") == 2
    assert fill(store, 4, tag="other") == 3
    assert store.find_version("vae", lineage("exact"), [lineage("more")]) == 1
    store.set_current("vae", 2)
    assert store.find_version("vae", lineage("exact"), [lineage("more")]) == 2  # current: nothing downstream moves
    assert store.find_version("vae", lineage("none"), [lineage("more")]) == 2


def test_missing_table_and_bad_adds_are_user_errors(store: Store) -> None:
    with pytest.raises(UserError, match="table 'text' not in store"):
        store.reader("text")
    w = store.writer("vae", vae_schema())
    s = sample(1)
    with pytest.raises(UserError, match="no dots"):
        w.add("a.b", tensors=s["tensors"], meta=s["meta"])
    with pytest.raises(UserError, match="schema says bfloat16 rank 4"):
        w.add("k1", tensors={"target": torch.zeros(2, 2)}, meta=s["meta"])
    with pytest.raises(UserError, match="not a field"):
        w.add("k1", tensors={**s["tensors"], "extra": torch.zeros(1)}, meta=s["meta"])
    with pytest.raises(UserError, match="img_shapes"):
        w.add("k1", tensors=s["tensors"], meta={"split": "train"})
    w.add("k1", tensors=s["tensors"], meta=s["meta"])
    with pytest.raises(UserError, match="duplicate key k1"):
        w.add("k1", tensors=s["tensors"], meta=s["meta"])
    w.close()


def test_store_format_is_checked_on_open(tmp_path) -> None:
    from store.checksum import seal

    root = tmp_path / "s"
    Store(root)
    record = {"format": "qwen-edit-feature-store", "format_version": 99, "tables": {}}
    (root / "store.json").write_bytes(seal(record))
    with pytest.raises(UserError, match=r"written by a newer version of pipeline \(format 99, this one reads up to 2"):
        Store(root)
    (root / "store.json").write_bytes(seal({**record, "format": "another-store"}))
    with pytest.raises(UserError, match="expected store format 'qwen-edit-feature-store' version 1 or 2, found .*"):
        Store(root)
    (root / "store.json").write_text(json.dumps(record))  # unsealed: only format 1 is; a later number is damage
    with pytest.raises(UserError, match="no checksum, which only format version 1 lacks; it is damaged"):
        Store(root)
    with pytest.raises(UserError, match="no store at"):
        Store(tmp_path / "nowhere", create=False)


def test_a_missing_version_folder_says_what_to_do(store: Store) -> None:
    """The current version's folder gone (deleted, or left out of a copy) and a version asked for that is not
    there: each error ends in what to do, not only what is wrong."""
    import shutil

    from store.repair import scan

    fill(store, 2)
    with pytest.raises(UserError, match=r"pipeline store inspect .*lists the versions there"):
        store.reader("vae", 7)
    shutil.rmtree(store.root / "vae" / "v1")
    with pytest.raises(UserError, match="names it as current, but its folder is gone: rerun the stage that writes"):
        store.reader("vae")
    (store.root.parent / "a-file").write_text("")
    with pytest.raises(UserError, match="check the path: repair needs the store folder a stage wrote"):
        scan(store.root.parent / "a-file")


def test_quarantine_appends_rows(store: Store) -> None:
    store.add_quarantine([{"key": "k1", "source": "a/b.png", "stage": "resize-bucket", "reason": "truncated"}])
    store.add_quarantine([{"source": "c.tar/x.jpg", "stage": "resize-bucket", "reason": "too large",
                           "detail": {"pixels": 10**9}, "width": 40000}])
    rows = store.quarantine().to_pylist()
    assert [r["reason"] for r in rows] == ["truncated", "too large"]
    assert rows[0]["key"] == "k1" and rows[1]["key"] is None and rows[1]["width"] == "40000"
    assert rows[1]["detail"] == '{"pixels": 1000000000}'
    with pytest.raises(UserError, match="lacks"):
        store.add_quarantine([{"source": "x"}])


def _merged_rows_before(old, rows):
    """The de-duplication rule as it was (every row a Python tuple): the reference for the vectorised one, kept
    once, as the baseline of bench/quarantine_append.py."""
    from bench.quarantine_append import old_merged_rows

    return old_merged_rows(old, rows)


def test_quarantine_merge_drops_rows_held_already_and_keeps_the_rest_in_order() -> None:
    """Equal in every column of the incoming rows but `time` (null equals null, a column the file lacks is null
    there): dropped, against the file and against earlier incoming rows; the file's own rows stay as they are.
    Random tables (nulls, columns on one side only, repeats, several chunks) against the former rule."""
    import random

    import pyarrow as pa

    from store.quarantine import merged_rows

    def t(**cols):
        return pa.table({c: pa.array(v, pa.string()) for c, v in cols.items()})

    old = t(key=["a", "a", None], stage=["s", "s", "s"], reason=["r", "r", "r"], time=["1", "2", "3"])
    rows = t(key=["a", None, "b", "b", "a"], stage=["s", "s", "s", "s", "s"], reason=["r", "r", "r", "r", "x"],
             detail=[None, None, None, None, None], time=["9", "9", "8", "9", "9"])
    merged, added = merged_rows(old, rows)
    assert added == 2 and merged.column("key").to_pylist() == ["a", "a", None, "b", "a"]
    assert merged.column("time").to_pylist() == ["1", "2", "3", "8", "9"]  # the first of the equal new rows
    assert merged_rows(merged, rows) == (merged, 0)
    rng = random.Random(0)
    names = ["key", "source", "stage", "reason", "detail", "time", "table_version"]
    for _ in range(300):
        def table(n, cols):
            chunks = [t(**{c: [rng.choice([None, "a", "b"]) for _ in range(k)] for c in cols}) for k in (n, n // 2)]
            return pa.concat_tables(chunks)

        old = table(rng.randint(0, 20), rng.sample(names, rng.randint(1, 7))) if rng.random() < 0.9 else None
        rows = table(rng.randint(0, 20), rng.sample(names, rng.randint(1, 7)))
        (got, n), (want, m) = merged_rows(old, rows), _merged_rows_before(old, rows)
        assert n == m and got.equals(want)


def test_close_without_commit_resumes_same_version_and_empty_table_commits(store: Store) -> None:
    w = store.writer("vae", vae_schema(), shard_size_mb=0.004)
    for i in range(5):
        s = sample(i)
        w.add(s["key"], tensors=s["tensors"], files=s["files"], meta=s["meta"])
    w.close()  # e.g. an exception in the stage: the open shard is dropped, committed ones stay
    w2 = store.writer("vae", vae_schema(), shard_size_mb=0.004)
    assert w2.version == 1 and 0 < len(w2.done_keys) <= 5
    for i in range(5):
        s = sample(i)
        if s["key"] not in w2.done_keys:
            w2.add(s["key"], tensors=s["tensors"], files=s["files"], meta=s["meta"])
    assert w2.commit() == 1 and len(store.reader("vae")) == 5
    assert store.writer("vae", vae_schema()).commit() == 2  # same lineage, but v1 is complete: a new version
    assert len(store.reader("vae")) == 0 and store.reader("vae").keys() == []


def test_zero_element_tensor_round_trips(store: Store) -> None:
    # e.g. a (0, 8) tensor for a sample with no control views: the writer accepts it, the reader must return it
    s = sample(1)
    tensors = {**s["tensors"], "mask_weight": torch.zeros(0), "control_0": torch.zeros(4, 1, 0, 6).bfloat16()}
    w = store.writer("vae", vae_schema(), shard_size_mb=1e-7)  # one sample per shard: the empty one ends a shard
    w.add(s["key"], tensors=tensors, files=s["files"], meta=s["meta"])
    w.add(key_of(2), tensors=sample(2)["tensors"], meta=sample(2)["meta"])
    w.commit()
    got = store.reader("vae").tensors(s["key"])
    assert got["mask_weight"].shape == (0,) and got["mask_weight"].dtype == torch.float32
    assert got["control_0"].shape == (4, 1, 0, 6) and got["control_0"].dtype == torch.bfloat16
    assert torch.equal(got["target"], tensors["target"])


def test_tensors_outlive_the_shard_lru_and_the_reader(tmp_path):
    """A tensor is a view of its shard's map: the LRU dropping that map (max_open_shards=1) or the reader's
    close() must not unmap memory the tensor still reads (run in a child process: that bug is a segfault)."""
    import os
    import sys
    from pathlib import Path

    script = f"""
import torch
from store import Store
from store_samples import fill, key_of
st = Store({str(tmp_path / 'store')!r})
fill(st, 12, shard_size_mb=0.002)
r = st.reader("vae", max_open_shards=1)
assert len(r.shard_paths()) > 3
# the 3rd read in a row from one shard is served from its map (a scan); the next shard's map drops it
kept = [[r.tensors(key_of(i)) for _ in range(3)][-1]["target"] for i in range(12)]
assert not any(isinstance(h, int) for h in r.shards.open_handles())
r.close()
fresh = Store({str(tmp_path / 'store')!r}).reader("vae")
assert all(torch.equal(t.clone(), fresh.tensors(key_of(i))["target"]) for i, t in enumerate(kept))
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    done = warm_start.run([sys.executable, "-c", script], env=env)  # started warm (tests/warm_start.py)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])


def test_open_shards_stay_bounded(store: Store) -> None:
    import os
    import random

    fill(store, 24)
    fds = len(os.listdir("/proc/self/fd"))
    r = store.reader("vae", max_open_shards=2)
    keys = r.keys()
    assert len(r.shard_paths()) > 3
    for k in random.Random(0).choices(keys, k=60) + keys:  # random reads, then a scan (maps shards)
        assert r.tensors(k)["target"].numel() > 0
        assert len(r.shards.open_handles()) <= 2
    assert len(os.listdir("/proc/self/fd")) <= fds + 4  # 2 descriptors + 2 maps' own duplicates at most
    r.close()
    assert len(os.listdir("/proc/self/fd")) <= fds + 2  # maps still viewed by live tensors close when they go


def test_lookup_by_key_without_a_key_dict(store: Store) -> None:
    fill(store, 24)
    r = store.reader("vae")
    keys = r.keys()
    assert [r.row_of(k) for k in keys] == list(range(24))
    assert not r.view.keys.dict_built  # found by binary search on the sorted fixed-width key column
    k = keys[5]
    for absent in (k[:-1], k + "0", k[:-1] + ("0" if k[-1] != "0" else "1"), "", keys[-1] + "f"):
        assert absent not in r and r.row_of(absent) is None
    with pytest.raises(UserError, match="not in table 'vae'"):
        r.tensors(k[:-1])


def test_tensors_come_from_the_samples_own_header_not_the_parsed_manifest(store: Store) -> None:
    """The manifest's `tensors` column (the largest a reader would hold: ~400 MB per rank at 1M samples) is
    never parsed for reads: each sample's tensors come from its checked safetensors header, the same as the
    manifest's layout and as safetensors' own loader reads the member."""
    from safetensors.torch import load

    fill(store, 12)
    r = store.reader("vae")
    got = {k: r.tensors(k) for k in r.keys()}
    assert "tensors" not in r.view.parsed
    layout = r.manifest.column("tensors").to_pylist()
    for i, k in enumerate(r.keys()):
        assert [t["name"] for t in layout[i]] == list(got[k])
        assert [t["shape"] for t in layout[i]] == [list(t.shape) for t in got[k].values()]
        shard, start, n = r.view.samples.locate(i)
        raw = (r.dir / shard).read_bytes()[start + 512 : start + n]
        ref = load(raw[: 8 + int.from_bytes(raw[:8], "little") + sum(t["nbytes"] for t in layout[i])])
        assert all(torch.equal(ref[name], got[k][name]) for name in ref)
    r.close()


def test_a_damaged_index_of_an_unfinished_version_is_one_line_and_the_lock_is_released(store: Store) -> None:
    """Resuming a version whose committed shard index is unreadable (a damaged disk): one line naming the file and
    what to do, and the rank's lock is released (a long-lived process opening the writer again is not refused as
    'being written'); once the damaged index and its shard are deleted, the resume writes their samples again."""
    w = store.writer("vae", vae_schema(), shard_size_mb=0.004)
    for i in range(5):
        s = sample(i)
        w.add(s["key"], tensors=s["tensors"], files=s["files"], meta=s["meta"])
    w.close()  # killed before the commit: committed shards stay
    vdir = store.root / "vae" / "v1"
    index = sorted(vdir.glob("shard-r00-*.index.parquet"))[0]
    index.write_bytes(b"not parquet at all")
    for _ in range(2):  # the second open would be refused as locked if the first kept the lock
        with pytest.raises(UserError) as e:
            store.writer("vae", vae_schema(), shard_size_mb=0.004)
        assert str(index) in str(e.value) and "\n" not in str(e.value) and "delete it" in str(e.value)
    index.unlink()
    (vdir / index.name.replace(".index.parquet", ".tar")).unlink()
    w2 = store.writer("vae", vae_schema(), shard_size_mb=0.004)
    for i in range(5):
        s = sample(i)
        if s["key"] not in w2.done_keys:
            w2.add(s["key"], tensors=s["tensors"], files=s["files"], meta=s["meta"])
    assert w2.commit() == 1 and len(store.reader("vae")) == 5
