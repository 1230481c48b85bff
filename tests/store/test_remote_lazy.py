"""A store URL read through the lazy cache (store/remote_shards.py) against the S3 test server: opening fetches
metadata only; a random read fetches the sample's byte range, a scan whole shards (checked, renamed into place);
an object damaged on the server is refused on first read and nothing of it is cached; the cache stays under its
limit during a read of a store bigger than it; two processes share one cache."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from store import Store
from store import format as fmt
from store.integrity import DamagedData
from store.remote_cache import local_store
from store.remote_shards import FETCH_TAG, MARKER, RANGED, fetch_stats
from store.remote_push import push
from s3_server import aws_env, new_bucket
from store_samples import fill
import warm_start  # the processes sharing one cache: real ones, started warm


def _pushed(s3_env, store: Store, n: int = 24) -> str:
    fill(store, n, shard_size_mb=0.02)  # 4 shards of 6 samples (~30 KB each, a sample ~4 KB)
    push(store.root, s3_env.url())
    return s3_env.url()


@pytest.fixture(scope="module")
def _one_push(s3_server, tmp_path_factory) -> tuple[str, Store]:
    """The store most tests here read, pushed once for the module (a push per test was most of their time): they
    read its URL through a cache of their own and compare with the local copy. Tests that damage or delete objects
    on the server push a store of their own (`_pushed`); the teardown checks that no test changed this one."""
    with pytest.MonkeyPatch.context() as mp:
        aws_env(mp, s3_server)
        env = new_bucket(s3_server)
        store = Store(tmp_path_factory.mktemp("pushed") / "store")
        url = _pushed(env, store)
        before = _objects(env), _local_files(store.root)
    yield url, store
    with pytest.MonkeyPatch.context() as mp:
        aws_env(mp, s3_server)
        assert (_objects(env), _local_files(store.root)) == before, "a test changed the module's shared store"


@pytest.fixture
def pushed(s3_env, _one_push) -> tuple[str, Store]:
    """The module's pushed store (its URL, the local store), with this test's AWS environment (`s3_env`)."""
    return _one_push


def _objects(env) -> dict[str, str]:
    """Every object of the bucket and its ETag (a test's lease objects go with it)."""
    pages = env.client().get_paginator("list_objects_v2").paginate(Bucket=env.bucket)
    return {o["Key"]: o["ETag"] for page in pages for o in page.get("Contents", [])}


def _local_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _shard_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if fmt.SHARD_RE.fullmatch(p.name))


def _cache_bytes(cache: Path) -> int:
    """What the cache limit counts: every file but the lock files (store/remote_cache._counted)."""
    return sum(p.stat().st_size for p in cache.rglob("*") if p.is_file() and not p.name.endswith(".lock"))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _one_key_per_shard(reader) -> list[str]:
    return [group[len(group) // 2] for group in reader.shard_groups()]


def test_open_fetches_metadata_and_a_random_read_only_byte_ranges(pushed: tuple[str, Store], tmp_path: Path) -> None:
    url, store = pushed
    root = local_store(url, ["vae"], tmp_path / "cache")
    vdir = fmt.version_dir(root, "vae", 1)
    assert (vdir / MARKER).is_file() and (vdir / fmt.MANIFEST).is_file()
    assert _shard_files(root) == []  # open: no shard fetched
    before = fetch_stats()
    with store.reader("vae") as local, Store(root, create=False).reader("vae") as cached:
        keys = _one_key_per_shard(local)  # one sample of each shard: random reads, never a scan
        assert len(keys) == 4
        for k in keys:
            assert _same(cached.tensors(k), local.tensors(k))
        read = sum(local.view.samples.locate(local.row_of(k))[2] for k in keys)
    after = fetch_stats()
    assert _shard_files(root) == []  # byte ranges only: no shard file appeared in the cache
    assert after["shards"] == before["shards"]
    assert after["ranges"] - before["ranges"] == 4 and after["range_bytes"] - before["range_bytes"] == read


def test_shard_paths_of_a_lazy_version_are_whole_shards_webdataset_reads(pushed: tuple[str, Store],
                                                                        tmp_path: Path) -> None:
    """`shard_paths()` hands files to a reader of its own (webdataset): in a lazy version they are fetched first."""
    import webdataset as wds
    from safetensors.torch import load as load_safetensors

    url, store = pushed
    root = local_store(url, ["vae"], tmp_path / "cache")
    assert _shard_files(root) == []
    with Store(root, create=False).reader("vae") as cached, store.reader("vae") as local:
        paths = cached.shard_paths()
        assert [p.name for p in paths] == [p.name for p in local.shard_paths()]
        got = {s["__key__"]: s["safetensors"] for s in wds.WebDataset([str(p) for p in paths], shardshuffle=False)}
        assert sorted(got) == local.keys()
        assert all(_same(load_safetensors(got[k]), local.tensors(k)) for k in got)
    for p in paths:
        assert p.read_bytes() == (store.root / "vae" / "v1" / p.name).read_bytes()


def test_a_scan_caches_whole_checked_shards(pushed: tuple[str, Store], tmp_path: Path) -> None:
    url, store = pushed
    root = local_store(url, ["vae"], tmp_path / "cache")
    assert _shard_files(root) == []
    with store.reader("vae") as local, Store(root, create=False).reader("vae") as cached:
        for group in local.shard_groups():
            for k in group:
                assert _same(cached.tensors(k), local.tensors(k))
    shards = _shard_files(root)
    assert [p.name for p in shards] == [p.name for p in _shard_files(store.root)]
    for p in shards:
        assert p.read_bytes() == (store.root / "vae" / "v1" / p.name).read_bytes()
    assert not [p for p in root.rglob("*") if FETCH_TAG in p.name and not p.name.endswith(RANGED)]  # no temp file
    assert Store(root, create=False).versions("vae") == [1]


def _flip_in_place(path: Path, at: int, bits: int) -> None:
    """Damage a cached file on this node's disk as a failing disk does: a byte flipped, size and mtime kept (the
    cache's open trusts its record of the file)."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[at] ^= bits
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _damaged_cached_sample(local, vdir: Path, damage: str) -> tuple[list[str], str, Path]:
    """The middle sample of the version's second shard group, damaged in this node's cached copy of its shard:
    a byte of its tensors flipped ("flipped", size kept) or the shard cut short inside them ("truncated"), the
    mtime kept. `local` reads the pushed store. (the group's keys, the sample's key, the cached shard)."""
    group = local.shard_groups()[1]
    bad = group[len(group) // 2]
    shard, start, n = local.view.samples.locate(local.row_of(bad))
    cached = vdir / shard
    st = cached.stat()
    data = bytearray(cached.read_bytes())
    if damage == "flipped":
        data[start + n - 3] ^= 0xFF  # inside the sample's tensor bytes
    else:
        data = data[: start + n - 3]
    os.chmod(cached, 0o644)
    cached.write_bytes(bytes(data))
    os.utime(cached, ns=(st.st_atime_ns, st.st_mtime_ns))
    return group, bad, cached


def _damage_on_server(s3_env, shard: str, at: int) -> None:
    """Flip one byte of an object on the server (same size), through boto3, as a disk or a bad copy would."""
    client = s3_env.client()
    key = f"store/vae/v1/{shard}"
    data = bytearray(client.get_object(Bucket=s3_env.bucket, Key=key)["Body"].read())
    data[at] ^= 0xFF
    client.put_object(Bucket=s3_env.bucket, Key=key, Body=bytes(data))


@pytest.mark.parametrize("how", ["random", "scan"])
def test_an_object_damaged_on_the_server_is_refused_on_first_read_and_not_cached(s3_env, store: Store,
                                                                              tmp_path: Path, how: str) -> None:
    url = _pushed(s3_env, store)
    with store.reader("vae") as local:
        group = local.shard_groups()[1]
        bad = group[len(group) // 2]
        shard, start, n = local.view.samples.locate(local.row_of(bad))
        _damage_on_server(s3_env, shard, start + n - 3)  # inside the sample's tensor bytes
        root = local_store(url, ["vae"], tmp_path / "cache")
        with Store(root, create=False).reader("vae") as cached:
            order = group if how == "scan" else [bad]
            for k in order:
                if k == bad:
                    with pytest.raises(DamagedData) as e:
                        cached.tensors(k)
                    assert "\n" not in str(e.value) and bad in str(e.value) and "crc32c mismatch" in str(e.value)
                else:  # the shard's intact samples still read (by range: the shard is not cached)
                    assert _same(cached.tensors(k), local.tensors(k))
    vdir = fmt.version_dir(root, "vae", 1)
    assert not (vdir / shard).exists()  # nothing of the damaged object stays cached
    assert not [p for p in root.rglob("*") if FETCH_TAG in p.name and not p.name.endswith(RANGED)]  # no temp file


@pytest.mark.parametrize("how", ["random", "scan"])
@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_a_shard_damaged_in_the_nodes_cache_is_read_again_from_the_url(pushed: tuple[str, Store], tmp_path: Path,
                                                                        how: str, damage: str) -> None:
    """A shard cached whole, then damaged on this node's disk (a byte flipped with its size and mtime kept - bit
    rot; or cut short), the copy on the server intact: the sample was refused as damaged, recorded so in the cache,
    with `pipeline store repair URL` as advice (recomputing a sample the server holds intact) and on_damaged=skip
    leaving it out of every run on the node for ever. Now the cached copy is dropped and the sample read again
    from the URL: every sample reads back as written, nothing is recorded as damaged, the shard is cached again
    intact."""
    url, store = pushed
    root = local_store(url, ["vae"], tmp_path / "cache", whole=True)
    vdir = fmt.version_dir(root, "vae", 1)
    with store.reader("vae") as local:
        group, bad, cached = _damaged_cached_sample(local, vdir, damage)
        root = local_store(url, ["vae"], tmp_path / "cache")
        with Store(root, create=False).reader("vae") as reader:
            for k in group if how == "scan" else [bad]:
                assert _same(reader.tensors(k), local.tensors(k))
    assert not fmt.damaged_marker(root, "vae", 1).exists()
    with Store(root, create=False).reader("vae") as reader, store.reader("vae") as local:
        for group in local.shard_groups():  # a scan: the shard is cached whole again, intact
            for k in group:
                assert _same(reader.tensors(k), local.tensors(k))
    assert cached.read_bytes() == (store.root / "vae" / "v1" / cached.name).read_bytes()


def test_several_samples_damaged_in_a_cached_shard_read_with_check_ahead_are_read_from_the_url(
        pushed: tuple[str, Store], tmp_path: Path) -> None:
    """Every third sample damaged in the node's cached shards, read in order with the check-ahead thread (as train
    reads): the thread's results for the later damaged samples came from its descriptor of the dropped copy, and
    the consumer refused them (no cached file left to blame). Now the consumer reads them itself: all intact."""
    url, store = pushed
    root = local_store(url, ["vae"], tmp_path / "cache", whole=True)
    vdir = fmt.version_dir(root, "vae", 1)
    with store.reader("vae") as local:
        keys = local.keys()
        for k in keys[::3]:
            shard, start, n = local.view.samples.locate(local.row_of(k))
            path = vdir / shard
            _flip_in_place(path, start + n - 3, 0xFF)
        root = local_store(url, ["vae"], tmp_path / "cache")
        with Store(root, create=False).reader("vae") as reader:
            reader.check_ahead([reader.row_of(k) for k in keys])
            for k in keys:
                assert _same(reader.tensors(k), local.tensors(k))
    assert not fmt.damaged_marker(root, "vae", 1).exists()


@pytest.mark.parametrize("name", [fmt.MANIFEST, fmt.SCHEMA_JSON, fmt.CHECKSUMS])
def test_metadata_damaged_in_the_nodes_cache_are_fetched_again_from_the_url(pushed: tuple[str, Store], tmp_path: Path,
                                                                            name: str) -> None:
    """A version's metadata file in the cache damaged on this node's disk (a byte flipped, size and mtime kept: the
    cache's open trusts its record of the file), the URL's intact: the reader's open refused the version for
    ever on the node (the damage recorded in the cache; the advice `store repair URL` or a rerun of the encoder).
    Now the file is fetched again from the URL and the version reads back as written."""
    url, store = pushed
    root = local_store(url, ["vae"], tmp_path / "cache")
    vdir = fmt.version_dir(root, "vae", 1)
    path = vdir / name
    _flip_in_place(path, len(path.read_bytes()) // 2, 0x01)
    root = local_store(url, ["vae"], tmp_path / "cache")
    with Store(root, create=False).reader("vae") as reader, store.reader("vae") as local:
        assert reader.keys() == local.keys()
        for k in _one_key_per_shard(local):
            assert _same(reader.tensors(k), local.tensors(k))
    assert not fmt.damaged_marker(root, "vae", 1).exists()
    assert path.read_bytes() == (store.root / "vae" / "v1" / name).read_bytes()


@pytest.mark.parametrize("how", ["random", "scan"])
def test_a_shard_deleted_on_the_server_is_named_not_rerun_for_ever(s3_env, store: Store, tmp_path: Path,
                                                                   how: str) -> None:
    """A shard deleted behind the tool's back (its version's manifest still there): a lazy read said "(an object
    disappeared meanwhile?); rerun", and every rerun of train or evaluate failed alike. Now the object is named,
    with what helps (as pull names it)."""
    from schemas.errors import UserError

    url = _pushed(s3_env, store)
    with store.reader("vae") as local:
        group = local.shard_groups()[1]
        shard = local.view.samples.locate(local.row_of(group[0]))[0]
    s3_env.client().delete_object(Bucket=s3_env.bucket, Key=f"store/vae/v1/{shard}")
    root = local_store(url, ["vae"], tmp_path / "cache")
    with Store(root, create=False).reader("vae") as cached:
        with pytest.raises(UserError) as e:
            for k in group if how == "scan" else [group[len(group) // 2]]:
                cached.tensors(k)
    assert f"{url}/vae/v1/{shard} is missing" in str(e.value) and "store repair" in str(e.value), str(e.value)
    assert "meanwhile" not in str(e.value)


@pytest.mark.parametrize("how", ["random", "scan"])
def test_a_shard_cut_short_on_the_server_is_damaged_data_not_rerun_for_ever(s3_env, store: Store, tmp_path: Path,
                                                                           how: str) -> None:
    """A shard object replaced by its first half behind the tool's back: a sample starting past the new end was
    read by a Range the server answers 416, and the reader said "answered: The requested range is not
    satisfiable; rerun" (every rerun alike, on_damaged=skip stopping too). Now it is the sample's damage, named
    as a cut-off read is: one DamagedData line with repair as the fix; the samples before the cut still read."""
    url = _pushed(s3_env, store)
    with store.reader("vae") as local:
        group = local.shard_groups()[1]
        shard = local.view.samples.locate(local.row_of(group[0]))[0]
        key = f"store/vae/v1/{shard}"
        client = s3_env.client()
        data = client.get_object(Bucket=s3_env.bucket, Key=key)["Body"].read()
        client.put_object(Bucket=s3_env.bucket, Key=key, Body=data[: len(data) // 2])
        root = local_store(url, ["vae"], tmp_path / "cache")
        ends = {k: sum(local.view.samples.locate(local.row_of(k))[1:]) for k in group}
        past = [k for k in group if local.view.samples.locate(local.row_of(k))[1] >= len(data) // 2]
        assert past  # a sample that starts past the cut: the server answers its Range 416
        with Store(root, create=False).reader("vae") as cached:
            for k in group if how == "scan" else [group[0], past[-1]]:
                if ends[k] <= len(data) // 2:
                    assert _same(cached.tensors(k), local.tensors(k))
                    continue
                with pytest.raises(DamagedData) as e:
                    cached.tensors(k)
                assert "\n" not in str(e.value) and k in str(e.value) and "the shard ends" in str(e.value)
                assert f"pipeline store repair {url}" in str(e.value)
    assert not (fmt.version_dir(root, "vae", 1) / shard).exists()  # nothing of the cut object cached


def test_a_read_of_a_store_bigger_than_the_cache_stays_under_its_limit(pushed: tuple[str, Store], tmp_path: Path,
                                                                       monkeypatch) -> None:
    from store import remote_shards

    url, store = pushed
    cache = tmp_path / "cache"
    root = local_store(url, ["vae"], cache)
    metadata = _cache_bytes(cache)
    shard = max(p.stat().st_size for p in _shard_files(store.root))
    limit = metadata + 2 * shard + 100  # room for two of the four shards
    root = local_store(url, ["vae"], cache, limit_gb=limit / 1e9)
    seen = []
    real = remote_shards.ShardFetcher.fetch_whole

    def fetch_whole(self, name, wait=True):  # the cache's size after every fetch
        got = real(self, name, wait)
        seen.append(_cache_bytes(cache))
        return got

    monkeypatch.setattr(remote_shards.ShardFetcher, "fetch_whole", fetch_whole)
    fetched = fetch_stats()["shards"]
    with store.reader("vae") as local, Store(root, create=False).reader("vae") as cached:
        for epoch in range(2):
            for group in local.shard_groups():
                for k in group:
                    assert _same(cached.tensors(k), local.tensors(k))
    assert seen and max(seen) <= limit and _cache_bytes(cache) <= limit
    assert 1 <= len(_shard_files(root)) <= 2  # the least recently used went first
    assert fetch_stats()["shards"] - fetched >= 4 + 2  # evicted shards were fetched again in the second epoch

    # the metadata of the versions in use alone over the limit: one line at open
    from schemas.errors import UserError

    with pytest.raises(UserError, match="over its limit"):
        local_store(url, ["vae"], cache, limit_gb=metadata / 2 / 1e9)


READER = textwrap.dedent("""
    import random, sys, zlib
    from store import Store
    from store.remote_cache import local_store
    url, cache, limit = sys.argv[1], sys.argv[2], float(sys.argv[3])
    root = local_store(url, ["vae"], cache, limit_gb=limit)
    crc = {}
    with Store(root, create=False).reader("vae") as r:
        keys = r.keys()
        for order in ([k for g in r.shard_groups() for k in g], random.Random(int(sys.argv[4])).sample(keys, len(keys))):
            for k in order:
                t = r.tensors(k)
                crc[k] = zlib.crc32(b"".join(t[n].view(-1).view(__import__("torch").uint8).numpy().tobytes()
                                            for n in sorted(t)))
    print(sum(crc.values()), len(crc))
""")


def test_two_processes_share_one_cache(pushed: tuple[str, Store], tmp_path: Path) -> None:
    import zlib

    url, store = pushed
    cache = tmp_path / "cache"
    root = local_store(url, ["vae"], cache)
    limit = (_cache_bytes(cache) + 3 * max(p.stat().st_size for p in _shard_files(store.root))) / 1e9
    # started warm (tests/warm_start.py): two processes of their own, without importing torch twice (~9 s each)
    procs = [warm_start.WarmProcess([sys.executable, "-c", READER, url, str(cache), str(limit), str(seed)])
             for seed in (1, 2)]
    outs = [(out, err) for code, out, err in warm_start.outcomes(procs, timeout=300)]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    with store.reader("vae") as local:
        want = 0
        for k in local.keys():
            t = local.tensors(k)
            want += zlib.crc32(b"".join(t[n].view(-1).view(torch.uint8).numpy().tobytes() for n in sorted(t)))
        expected = f"{want} {len(local)}"
    assert [out.strip().splitlines()[-1] for out, _ in outs] == [expected, expected]
    assert _cache_bytes(cache) <= limit * 1e9
    assert not [p for p in root.rglob("*") if FETCH_TAG in p.name and not p.name.endswith(RANGED)]  # no temp file


def test_a_writer_carries_forward_shards_of_a_lazily_cached_version(pushed: tuple[str, Store], tmp_path: Path) -> None:
    """An encoder on a URL reusing its previous version links that version's shards: fetched (checked) first."""
    from store.reuse import carry_forward
    from store_samples import vae_schema

    url, store = pushed
    root = local_store(url, ["vae"], tmp_path / "cache")
    cached = Store(root, create=False)
    with cached.reader("vae") as r:
        rows = r.manifest
    w = cached.writer("vae", vae_schema("b"), shard_size_mb=0.02)
    assert carry_forward(w, 1, rows) == 24
    w.commit()
    with store.reader("vae") as local, cached.reader("vae", 2) as new:
        assert sorted(new.keys()) == sorted(local.keys())
        for k in local.keys():
            assert _same(new.tensors(k), local.tensors(k))
    assert len(_shard_files(fmt.version_dir(root, "vae", 2))) == 4


def test_the_temp_file_of_a_killed_fetch_is_evicted_first(pushed: tuple[str, Store], tmp_path: Path) -> None:
    url, store = pushed
    cache = tmp_path / "cache"
    root = local_store(url, ["vae"], cache)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    vdir = fmt.version_dir(root, "vae", 1)
    orphan = vdir / f".shard-r00-000000.tar{FETCH_TAG}{int(dead.stdout)}-1"
    orphan.write_bytes(b"x" * 50_000)  # left by a fetch SIGKILLed half-way
    mine = vdir / f".shard-r00-000001.tar{FETCH_TAG}{os.getpid()}-1"
    mine.write_bytes(b"x" * 10)  # a fetch of a live process: kept
    local_store(url, ["vae"], cache, limit_gb=_cache_bytes(cache) / 2 / 1e9 + 40_000 / 1e9)
    assert not orphan.exists() and mine.exists()


def test_a_dead_writers_folder_under_a_number_the_remote_committed_is_set_aside(s3_env, store: Store,
                                                                               tmp_path: Path) -> None:
    """A node killed between a multi-node encode's remote commit and dropping its part (or a killed writer whose
    number another writer took) leaves `vae/v1/` without a manifest in its cache: the next open sets it aside and
    opens the remote's v1 - unless a live writer of the node holds the table's lock (then the conflict stands)."""
    import hashlib

    from schemas.errors import UserError

    url = _pushed(s3_env, store, n=6)
    cache = tmp_path / "cache"
    root = cache / hashlib.sha256(url.encode()).hexdigest()[:16]
    stale = fmt.version_dir(root, "vae", 1)
    stale.mkdir(parents=True)
    (stale / "shard-r01-000000.tar").write_bytes(b"this node's part, uploaded before the kill")
    with fmt.flock(root / "vae" / ".write-r01.lock", blocking=False):  # a live writer: not touched
        with pytest.raises(UserError, match="differs between"):
            local_store(url, ["vae"], cache)
    assert (stale / "shard-r01-000000.tar").is_file()

    with Store(local_store(url, ["vae"], cache), create=False).reader("vae") as cached, store.reader("vae") as local:
        assert cached.keys() == local.keys()
        assert all(_same(cached.tensors(k), local.tensors(k)) for k in local.keys())
    assert not (stale / "shard-r01-000000.tar").exists() and not list((root / "vae").glob(".v1.stale-*"))


def test_ranges_read_by_several_processes_of_a_node_count_together(pushed: tuple[str, Store], tmp_path: Path) -> None:
    """Ranks of one node read disjoint samples of the same shards: two processes (two fetchers) each reading 30% of
    a shard by range make the node's 60%, so the shard is fetched whole once the node passed half of it - a count
    per process (30% each) would range-read it again every epoch."""
    from store.remote_shards import WHOLE_AFTER, ShardFetcher

    url, store = pushed
    root = local_store(url, ["vae"], tmp_path / "cache")
    vdir = fmt.version_dir(root, "vae", 1)
    a, b = ShardFetcher(vdir), ShardFetcher(vdir)  # as two processes sharing the cache
    shard = next(n for n in sorted(a.sums) if fmt.SHARD_RE.fullmatch(n))
    size = int(a.sums[shard]["nbytes"])
    chunk = size // 20
    original = (store.root / "vae" / "v1" / shard).read_bytes()
    for i in range(6):  # 30% of the shard through process a
        assert bytes(a.read(shard, i * chunk, chunk)) == original[i * chunk:(i + 1) * chunk]
    whole_at = None
    for i in range(6, 12):  # the next 30% through process b (a reader asks only while the shard is not cached)
        got = b.read(shard, i * chunk, chunk)
        if got is None:  # the shard is cached whole from here on
            whole_at = i
            break
        assert bytes(got) == original[i * chunk:(i + 1) * chunk]
    assert whole_at is not None and (whole_at + 1) * chunk >= WHOLE_AFTER * size > whole_at * chunk
    assert (vdir / shard).read_bytes() == original
    assert not list(vdir.glob(f".{shard}.fetch-*"))  # the count goes with the whole fetch


def test_a_shard_evicted_between_the_check_and_the_open_is_read_by_range(pushed: tuple[str, Store], tmp_path: Path,
                                                                         monkeypatch) -> None:
    """Two processes share a tight cache: one evicts a shard right after the other saw it there, and no room is
    left to fetch it again. The read goes on by range (it used to raise DamagedData: a flake of the two-process
    test under load)."""
    import types

    from store import shard_io
    from store.remote_shards import ShardFetcher

    url, store = pushed
    root = local_store(url, ["vae"], tmp_path / "cache")
    racing_os = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os) if not k.startswith("__")})
    racing_os.path = types.SimpleNamespace(join=os.path.join, exists=lambda p: True)  # "it is there" at the check
    with Store(root, create=False).reader("vae") as cached, store.reader("vae") as local:
        key = _one_key_per_shard(local)[0]
        monkeypatch.setattr(shard_io, "os", racing_os)
        monkeypatch.setattr(ShardFetcher, "fetch_whole", lambda self, shard, wait=True: "no room in the store cache")
        assert _same(cached.tensors(key), local.tensors(key))
    assert not _shard_files(root)


def test_a_shard_evicted_right_after_its_whole_fetch_is_read_by_range(pushed: tuple[str, Store], tmp_path: Path,
                                                                      monkeypatch) -> None:
    """A scan fetches a shard whole, and another process of the node evicts it before this one opens it (twice in
    a row: the cache is that tight). The scan goes on by range; before, the shard was reported lost (DamagedData)."""
    from store.remote_shards import ShardFetcher

    url, store = pushed
    root = local_store(url, ["vae"], tmp_path / "cache")
    # a scan's fetch "succeeds" and the file is gone; a range read's try at a whole fetch finds no room
    monkeypatch.setattr(ShardFetcher, "fetch_whole",
                        lambda self, shard, wait=True: None if wait else "no room in the store cache")
    with store.reader("vae") as local, Store(root, create=False).reader("vae") as cached:
        for group in local.shard_groups():
            for k in group:
                assert _same(cached.tensors(k), local.tensors(k))
    assert not _shard_files(root)


def test_one_process_of_a_node_fetches_a_shard_whole(pushed: tuple[str, Store], tmp_path: Path) -> None:
    """Ranks of a node pass the whole-fetch threshold of a shard together. While one process holds the shard's
    fetch lock, another's random read takes its range (no second download, no second reservation), and a scan
    (or a caller needing the file) waits and then uses the file the first process put there."""
    import threading

    from store.remote_shards import FETCH_LOCK, WHOLE_AFTER, ShardFetcher

    url, store = pushed
    root = local_store(url, ["vae"], tmp_path / "cache")
    vdir = fmt.version_dir(root, "vae", 1)
    fetcher = ShardFetcher(vdir)
    shard = next(n for n in sorted(fetcher.sums) if fmt.SHARD_RE.fullmatch(n))
    size = int(fetcher.sums[shard]["nbytes"])
    original = (store.root / "vae" / "v1" / shard).read_bytes()
    half = int(WHOLE_AFTER * size) + 1
    with fmt.flock(vdir / f".{shard}{FETCH_LOCK}"):  # another process of the node is fetching it (its own flock)
        got = fetcher.read(shard, 0, half)  # past the threshold: would fetch it whole
        assert got is not None and bytes(got) == original[:half]
        assert not (vdir / shard).exists() and fetcher.stats["shards"] == 0
        waited: list[str | None] = []
        scan = threading.Thread(target=lambda: waited.append(fetcher.fetch_whole(shard)))
        scan.start()
        scan.join(0.5)
        assert scan.is_alive() and not waited  # waits for the other process's fetch
        (vdir / shard).write_bytes(original)  # the other process's rename
    scan.join(120)  # a bound for a loaded machine
    assert waited == [None] and fetcher.stats["shards"] == 0  # no second download
    assert (vdir / shard).read_bytes() == original


def test_the_cache_walk_counts_what_is_on_disk(pushed: tuple[str, Store], tmp_path: Path) -> None:
    """The walk before each whole fetch takes a lazily cached version's metadata sizes from its checksums.json
    instead of a stat per file (a 1M-sample version has ~20k shard indexes): its total must be what the files
    hold, with shards cached, range counts and fetch locks beside them."""
    from store.remote_cache import _candidates

    url, store = pushed
    cache = tmp_path / "cache"
    root = local_store(url, ["vae"], cache)
    with store.reader("vae") as local, Store(root, create=False).reader("vae") as cached:
        for k in local.shard_groups()[0] + _one_key_per_shard(local)[1:]:  # one shard scanned, others by range
            assert _same(cached.tensors(k), local.tensors(k))
    assert 1 <= len(_shard_files(root)) < 4 and list(root.rglob(f"*{RANGED}"))
    total, candidates, _ = _candidates(cache, set(), whole_versions=False)
    assert total == _cache_bytes(cache)
    assert [p.name for _, _, p, _ in candidates] == [p.name for p in _shard_files(root)]  # only shards may go


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_a_damaged_cached_shard_another_rank_of_the_node_dropped_first_is_read_from_the_url(
        pushed: tuple[str, Store], tmp_path: Path, monkeypatch, damage: str) -> None:
    """The node's ranks open and read a version together, so each meets a shard damaged in the node's cache (cut
    short: every open's size check; a flipped byte: the sample read) and drops it: another rank's unlink came
    first, and this rank, its own unlink finding no file, refused the shard as damage (recorded so in the cache,
    and its samples refused on this rank alone). The drop of another rank is as good as its own: the samples
    are read again from the URL, intact, and nothing is recorded."""
    import store.remote_shards as remote_shards

    url, store = pushed
    root = local_store(url, ["vae"], tmp_path / "cache", whole=True)
    vdir = fmt.version_dir(root, "vae", 1)
    own = remote_shards.drop_damaged_copy

    def after_another_rank(vdir: Path, shard: str, problem: str) -> bool:
        (Path(vdir) / shard).unlink(missing_ok=True)  # the other rank's drop, just before this rank's
        return own(vdir, shard, problem)

    monkeypatch.setattr(remote_shards, "drop_damaged_copy", after_another_rank)
    with store.reader("vae") as local:
        _, bad, _ = _damaged_cached_sample(local, vdir, damage)
        root = local_store(url, ["vae"], tmp_path / "cache")
        with Store(root, create=False).reader("vae") as reader:
            assert _same(reader.tensors(bad), local.tensors(bad))
    assert not fmt.damaged_marker(root, "vae", 1).exists()


@pytest.mark.parametrize("name", [fmt.MANIFEST, fmt.SCHEMA_JSON, fmt.CHECKSUMS])
def test_cached_metadata_another_rank_of_the_node_fetched_again_first_are_read(
        pushed: tuple[str, Store], tmp_path: Path, monkeypatch, name: str) -> None:
    """The node's ranks open a version together, each finding its cached metadata file damaged: the first rank
    fetches it again from the URL; a rank whose own fetch then found nothing left to fetch refused the version
    as damage (recorded so in the cache, for every later run on the node) though its copy was intact by then. It
    reads the copy the other rank fetched."""
    import store.remote_shards as remote_shards

    url, store = pushed
    root = local_store(url, ["vae"], tmp_path / "cache")
    vdir = fmt.version_dir(root, "vae", 1)
    path = vdir / name
    _flip_in_place(path, len(path.read_bytes()) // 2, 0x01)
    own = remote_shards.refetch_metadata

    def after_another_rank(vdir: Path) -> bool:
        assert own(vdir)  # the other rank's fetch, just before this rank's
        return own(vdir)

    monkeypatch.setattr(remote_shards, "refetch_metadata", after_another_rank)
    root = local_store(url, ["vae"], tmp_path / "cache")
    with Store(root, create=False).reader("vae") as reader, store.reader("vae") as local:
        assert reader.keys() == local.keys()
        for k in _one_key_per_shard(local):
            assert _same(reader.tensors(k), local.tensors(k))
    assert not fmt.damaged_marker(root, "vae", 1).exists()


def test_a_damaged_cached_metadata_file_is_never_missing_while_it_is_fetched_again(
        pushed: tuple[str, Store], tmp_path: Path, monkeypatch) -> None:
    """A rank fetching a damaged cached metadata file again removed it first: another rank of the node opening
    the version meanwhile found it missing, and refused the version as damage with nothing left to fetch. The
    intact copy now replaces the damaged one in one rename: at every moment of the fetch the file is there."""
    import store.remote_shards as remote_shards
    import store.remote_pull as remote_pull

    url, store = pushed
    root = local_store(url, ["vae"], tmp_path / "cache")
    vdir = fmt.version_dir(root, "vae", 1)
    path = vdir / fmt.SCHEMA_JSON
    _flip_in_place(path, len(path.read_bytes()) // 2, 0x01)
    seen = []
    own = remote_pull.fetch_checked

    def looked_at_meanwhile(*args, **kwargs):
        seen.append(path.exists())  # what another rank's open finds while this fetch streams
        return own(*args, **kwargs)

    monkeypatch.setattr(remote_pull, "fetch_checked", looked_at_meanwhile)
    assert remote_shards.refetch_metadata(vdir)
    assert seen == [True]
    assert path.read_bytes() == (store.root / "vae" / "v1" / fmt.SCHEMA_JSON).read_bytes()


def test_a_schema_damaged_in_the_nodes_cache_is_fetched_again_when_a_stage_looks_for_its_version(
        pushed: tuple[str, Store], tmp_path: Path) -> None:
    """A stage's rerun through a store URL looks for the version of its settings in the node's cache
    (`find_version`): a schema.json damaged on the node's disk there was recorded as damage in the cache and the
    version not reused (the whole table computed again, though the URL holds it intact), where a reader's open
    fetches it again. It is fetched again here too: the version is found, nothing is recorded."""
    from store_samples import lineage

    url, store = pushed
    root = local_store(url, ["vae"], tmp_path / "cache")
    path = fmt.version_dir(root, "vae", 1) / fmt.SCHEMA_JSON
    _flip_in_place(path, len(path.read_bytes()) // 2, 0x01)
    assert Store(root, create=False).find_version("vae", lineage()) == 1
    assert not fmt.damaged_marker(root, "vae", 1).exists()
    assert path.read_bytes() == (store.root / "vae" / "v1" / fmt.SCHEMA_JSON).read_bytes()


@pytest.mark.parametrize("name", [fmt.MANIFEST, fmt.SCHEMA_JSON, fmt.CHECKSUMS])
def test_metadata_deleted_from_the_nodes_cache_are_fetched_again_from_the_url(pushed: tuple[str, Store], tmp_path: Path,
                                                                             name: str) -> None:
    """A version's metadata file deleted from the node's cache (an over-eager cleanup, a cache folder partly
    wiped), the URL's intact: it was refused as damage (recorded in the cache, every later run on the node refusing
    the version) or, for checksums.json, the version read unchecked. It is fetched again from the URL, checked, as
    a damaged one is, and the version reads back as written."""
    url, store = pushed
    root = local_store(url, ["vae"], tmp_path / "cache")
    vdir = fmt.version_dir(root, "vae", 1)
    (vdir / name).unlink()
    with Store(root, create=False).reader("vae") as reader, store.reader("vae") as local:
        assert reader.keys() == local.keys()
        for k in _one_key_per_shard(local):
            assert _same(reader.tensors(k), local.tensors(k))
    assert not fmt.damaged_marker(root, "vae", 1).exists()
    assert (vdir / name).read_bytes() == (store.root / "vae" / "v1" / name).read_bytes()


def test_a_schema_deleted_from_the_nodes_cache_is_fetched_again_when_a_stage_looks_for_its_version(
        pushed: tuple[str, Store], tmp_path: Path) -> None:
    """`find_version` through the cache (`checked_schema`): a schema.json missing there is fetched again, the
    version found, nothing recorded."""
    from store_samples import lineage

    url, store = pushed
    root = local_store(url, ["vae"], tmp_path / "cache")
    path = fmt.version_dir(root, "vae", 1) / fmt.SCHEMA_JSON
    path.unlink()
    assert Store(root, create=False).find_version("vae", lineage()) == 1
    assert not fmt.damaged_marker(root, "vae", 1).exists()
    assert path.read_bytes() == (store.root / "vae" / "v1" / fmt.SCHEMA_JSON).read_bytes()


def _carry_ready(s3_env, store: Store, tmp_path: Path, whole: bool = False) -> tuple[Path, str]:
    """A version with a feature lineage (what `reusable` carries by), pushed and lazily cached: no shard fetched
    (`whole`: every shard fetched)."""
    from test_reuse_integrity import LINEAGE, _write

    _write(store, "a", range(12))
    url = s3_env.url()
    push(store.root, url)
    return local_store(url, ["vae"], tmp_path / "cache", whole=whole), LINEAGE


def test_samples_carried_from_a_lazily_cached_version_recorded_damaged_are_checked_from_the_url(
        s3_env, store: Store, tmp_path: Path) -> None:
    """A cached version recorded as damaged on the node (by a reader there): a stage run through the
    cache (encode at a URL) checks every version it carries from in full first (`reuse.damage_scan`). That scan
    read each shard file whole from the folder, so a shard not fetched yet was a FileNotFoundError traceback; it is
    fetched (or its samples read by range), checked, and the intact samples carried."""
    from store import integrity
    from store.reuse import reusable
    from store_samples import key_of

    root, lineage = _carry_ready(s3_env, store, tmp_path)
    integrity.record_damage(fmt.version_dir(root, "vae", 1), problems=["found by a reader on this node"])
    found = reusable(Store(root, create=False), "vae", lineage, [key_of(i) for i in range(12)])
    assert sorted(found[1].column("key").to_pylist()) == sorted(key_of(i) for i in range(12))


def test_shard_indexes_and_rank_done_deleted_from_the_nodes_cache_are_fetched_again_by_a_scan(
        s3_env, store: Store, tmp_path: Path) -> None:
    """A full scan of a cached version (`store.repair.scan_table`: what repair and a carry under damage read) found
    a shard index or rank-NN.done deleted from the node's cache (a cleanup) "damaged", to be written afresh in a
    new version: the one decision taken from their absence (a reader and verify need none of them, or fetch them).
    They are fetched again from the URL, checked, and the version needs no repair."""
    from store.repair import scan_table

    root, _ = _carry_ready(s3_env, store, tmp_path, whole=True)  # the shards there: the scan reads them
    vdir = fmt.version_dir(root, "vae", 1)
    assert (vdir / MARKER).is_file() and _shard_files(root)
    derived = sorted(p for p in vdir.iterdir() if p.name.endswith((".index.parquet", ".done")))
    assert len(derived) >= 2 and any(p.name.endswith(".done") for p in derived)
    for p in derived:
        p.unlink()
    plan = scan_table(root, "vae", 1, progress=False)
    assert plan.derived_damaged == [] and not plan.needs_repair and plan.samples == 12
    assert all(p.read_bytes() == (store.root / "vae" / "v1" / p.name).read_bytes() for p in derived)
