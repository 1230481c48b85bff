"""The requests of a multi-part encode's small reads on S3 (store/remote_parts.py): each small object fetched - a
rank's uploaded index its replaced node adopts (a rank's share of ~20k at 1M samples), another rank's index,
rank-done file, schema.json, world-size.json at the commit - and store.json, checksums.json and quarantine.parquet
a pull reads, is one GET, never a HEAD asking its size first (s3fs from 2026.3 sizes a whole-object read to split
a large one, unless a listing in the same process left the size behind)."""

from __future__ import annotations

import shutil
from collections import Counter
from contextlib import contextmanager
from urllib.parse import parse_qs, urlsplit

from store import Store
from store.remote_pull import pull
from store_samples import rank_writer, vae_schema

N = 12


@contextmanager
def _requests(s3_env, monkeypatch):
    """[(method, object name)] of every request but a listing, while the block runs."""
    from fault_proxy import FaultProxy

    asked: list[tuple[str, str]] = []
    proxy = FaultProxy(s3_env.endpoint, lambda method, path: asked.append((method, path)))
    got: list[tuple[str, str]] = []
    try:
        with monkeypatch.context() as m:
            m.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
            yield got
    finally:
        proxy.stop()
    got.extend((method, urlsplit(path).path.rsplit("/", 1)[1]) for method, path in asked
               if "list-type" not in parse_qs(urlsplit(path).query))


SMALL = ("store.json", "checksums.json", "quarantine.parquet", "schema.json", "world-size.json", ".done",
         ".index.parquet")


def _heads_of_fetched(asked: list[tuple[str, str]]) -> list[str]:
    """The small objects fetched that were asked their size first (a shard's or manifest's download is streamed
    in pieces: its HEAD is its own)."""
    fetched = {name for method, name in asked if method == "GET" and name.endswith(SMALL)}
    return [name for method, name in asked if method == "HEAD" and name in fetched]


def _finished(cache, url: str, rank: int) -> None:
    with rank_writer(cache, url, rank, N, shard_size_mb=0.005) as w:
        w.finish_rank()


def test_a_replaced_node_adopts_each_uploaded_index_with_one_get(s3_env, tmp_path, monkeypatch) -> None:
    """Before: a HEAD and a GET per index (two requests per index)."""
    url = s3_env.url("adopt")
    _finished(tmp_path / "node1", url, 1)
    shutil.rmtree(tmp_path / "node1")
    with _requests(s3_env, monkeypatch) as asked:
        with Store(tmp_path / "node1-new").writer("vae", vae_schema(), rank=1, world_size=2, shard_size_mb=0.005,
                                                  version=1, remote_url=url) as w:
            assert len(w.done_keys) == N // 2
    indexes = {name for method, name in asked if name.endswith(".index.parquet")}
    assert len(indexes) > 1 and _heads_of_fetched(asked) == [], sorted(Counter(asked).items())


def test_a_commit_and_its_pull_read_each_small_object_with_one_get(s3_env, tmp_path, monkeypatch) -> None:
    url = s3_env.url("asked")
    _finished(tmp_path / "node1", url, 1)
    zero = rank_writer(tmp_path / "node0", url, 0, N, shard_size_mb=0.005)
    zero.finish_rank()
    with _requests(s3_env, monkeypatch) as asked:
        assert zero.commit() == 1
    assert {"rank-01.done", "schema.json", "world-size.json"} <= {name for method, name in asked if method == "GET"}
    assert _heads_of_fetched(asked) == [], sorted(Counter(asked).items())
    with _requests(s3_env, monkeypatch) as asked:
        pull(url, tmp_path / "pulled")
    assert {"store.json", "checksums.json"} <= {name for method, name in asked if method == "GET"}
    assert _heads_of_fetched(asked) == [], sorted(Counter(asked).items())
