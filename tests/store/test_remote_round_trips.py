"""Round trips a store URL makes once per object - a HEAD per object a resumed push finds there, a GET per index
at a multi-node commit, a PUT per file of a rank's part - run several at a time, as push and pull's transfers do
(`store.remote.each_at_once`): at ~20k shards one after the other, the latency was the whole cost (tens of
minutes at 30-50 ms, every other rank waiting at the commit). Checked without timing: the first calls wait until
two are running at once (a barrier); calls made one after the other break it."""

from __future__ import annotations

import threading

from store import Store
from store import remote as remote_mod
from store.remote_pull import pull
from store.remote_push import push
from store.verify import verify_store
from store_samples import fill, key_of, rank_writer

N = 24


def _writer(cache, url: str, rank: int):
    """Rank `rank` of 2 writing its half of N samples, several shards each (tests/store/test_remote_parts.py)."""
    return rank_writer(cache, url, rank, N, shard_size_mb=0.004)


def _finished(cache, url: str, rank: int) -> None:
    """A rank's part written and marked done, its writer closed: its rank lock let go now (left to the garbage
    collector, a reference cycle could keep it held past the next writer of that rank: "being written by pid N")."""
    with _writer(cache, url, rank) as w:
        w.finish_rank()


class Overlap:
    """Wraps `real`: the first `n` calls (of those `only` selects) meet at a barrier before going on; `overlapped`
    says whether they did."""

    def __init__(self, real, n: int = 2, timeout: float = 60.0, only=lambda *args: True) -> None:
        self.real, self.n, self.only = real, n, only
        self.barrier = threading.Barrier(n, timeout=timeout)
        self.lock, self.calls, self.overlapped = threading.Lock(), 0, True

    def __call__(self, *args, **kwargs):
        if not self.only(*args):
            return self.real(*args, **kwargs)
        with self.lock:
            i, self.calls = self.calls, self.calls + 1
        if i < self.n:
            try:
                self.barrier.wait()
            except threading.BrokenBarrierError:  # the calls came one after the other
                self.overlapped = False
        return self.real(*args, **kwargs)


def test_a_resumed_push_checks_the_objects_there_several_at_a_time(s3_env, store: Store, tmp_path, monkeypatch):
    fill(store, 12)
    url = s3_env.url()
    first = push(store.root, url)
    s3_env.client().delete_object(Bucket=s3_env.bucket, Key="store/vae/v1/manifest.parquet")  # killed before it
    gate = Overlap(remote_mod.Remote.recorded_crc)
    monkeypatch.setattr(remote_mod.Remote, "recorded_crc", lambda self, rel: gate(self, rel))
    again = push(store.root, url)
    assert gate.overlapped and gate.calls == first.objects_sent - 1
    assert again.objects_sent == 1 and again.objects_skipped == first.objects_sent - 1  # the manifest alone
    pull(url, tmp_path / "pulled")
    assert verify_store(tmp_path / "pulled", progress=False) == []


def test_a_ranks_upload_and_the_commits_index_reads_run_several_at_a_time(s3_env, tmp_path, monkeypatch):
    url = s3_env.url("parts")
    uploads = Overlap(remote_mod.Remote.upload)
    with monkeypatch.context() as m:
        m.setattr(remote_mod.Remote, "upload", lambda self, *a: uploads(self, *a))
        _finished(tmp_path / "node1", url, 1)
    assert uploads.overlapped and uploads.calls > 4
    reads = Overlap(remote_mod.Remote.read, only=lambda self, rel, *_: rel.endswith(".index.parquet"))
    monkeypatch.setattr(remote_mod.Remote, "read", lambda self, rel, small=False: reads(self, rel, small))
    assert _writer(tmp_path / "node0", url, 0).commit() == 1
    assert reads.overlapped and reads.calls > 2
    pulled = tmp_path / "pulled"
    pull(url, pulled)
    r = Store(pulled).reader("vae")
    assert r.keys() == sorted(key_of(i) for i in range(N)) and r.manifest.num_rows == N
    r.close()
    assert verify_store(pulled, progress=False) == []


def test_a_node_that_lost_its_cache_adopts_its_uploaded_indexes_several_at_a_time(s3_env, tmp_path, monkeypatch,
                                                                                    capfd):
    """A replaced node's rank fetches the indexes of the shards it had uploaded (one GET each) several at a time,
    under a progress bar (~2.5k per rank at 1M samples)."""
    import shutil

    from store_samples import vae_schema

    url = s3_env.url("adopt")
    _finished(tmp_path / "node1", url, 1)
    shutil.rmtree(tmp_path / "node1")
    reads = Overlap(remote_mod.Remote.read, only=lambda self, rel, *_: rel.endswith(".index.parquet"))
    monkeypatch.setattr(remote_mod.Remote, "read", lambda self, rel, small=False: reads(self, rel, small))
    fresh = Store(tmp_path / "node1-new").writer("vae", vae_schema(), rank=1, world_size=2, shard_size_mb=0.004,
                                                  version=1, remote_url=url)
    assert fresh.done_keys == {key_of(i) for i in range(1, N, 2)}
    fresh.close()
    assert reads.overlapped and reads.calls > 2
    assert f"rank 1: its uploaded indexes from {url}" in capfd.readouterr().err


def test_push_lists_only_the_versions_it_pushes_not_the_whole_prefix(s3_env, store: Store, tmp_path,
                                                                     monkeypatch) -> None:
    """A URL holding other tables and old versions no gc removed (~40k objects a version at 1M samples, thousands
    of versions): push listed the whole prefix, a request per 1000 objects of all of them, on every push and every
    stage's push back. Now it lists each version of its own store (`<table>/v<N>/`, one request per 1000 objects
    of that version): the requests do not grow with what else the URL holds."""
    from urllib.parse import parse_qs, urlsplit

    from fault_proxy import FaultProxy

    client = s3_env.client()
    for v in range(1, 21):  # another table's versions, never gc'd
        client.put_object(Bucket=s3_env.bucket, Key=f"store/old/v{v}/manifest.parquet", Body=b"x")
    fill(store, 12)
    listed: list[str] = []

    def record(method: str, path: str) -> None:
        query = parse_qs(urlsplit(path).query)
        if "list-type" in query:
            listed.append(query.get("prefix", [""])[0])

    proxy = FaultProxy(s3_env.endpoint, record)
    try:
        with monkeypatch.context() as m:
            m.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
            push(store.root, s3_env.url())
    finally:
        proxy.stop()
    assert listed and all(p.startswith(("store/vae/v1/", "store/store.json/")) for p in listed), listed
    pull(s3_env.url(), tmp_path / "pulled", tables=["vae"])
    assert verify_store(tmp_path / "pulled", progress=False) == []
