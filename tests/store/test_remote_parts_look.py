"""Rank 0's look at a store URL before a multi-node encode (store/remote_parts.py `on_remote`, and
`committed_on_remote` for a cache that opens a complete version): which version numbers this run cannot write,
which complete version of its schema it adopts. The same answer on every kind of version folder - complete,
retired by `store repair`, current, parts of this run, of another schema, of another number of ranks, without a
record, damaged - on S3 and on a file:// folder; and on S3 from one listing of the table's folder level (never of
the versions' objects: ~40k each at 1M samples, a request per 1,000) plus lookups run several at a time."""

from __future__ import annotations

import json
import threading
from urllib.parse import parse_qs, urlsplit

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from store import remote as remote_mod
from store.remote_parts import committed_on_remote, make_current, on_remote
from store_samples import vae_schema

A, B = vae_schema("a").to_dict(), vae_schema("b").to_dict()
ROWS = 3


def _manifest() -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"key": [f"k{i}" for i in range(ROWS)]}), sink)
    return sink.getvalue().to_pybytes()


# version -> its objects: (schema, ranks that wrote it, complete); None: that file is not there
FOLDERS = {
    1: (A, 2, True),  # complete, this schema: adopted
    2: (B, 2, True),  # complete, another schema
    3: (A, 2, True),  # complete, this schema, retired by `store repair` (its marker beside it)
    4: (A, 2, False),  # this run's parts (2 ranks): resumed
    5: (A, 3, False),  # this schema's parts written by 3 ranks
    6: (A, None, False),  # this schema's parts without the record of their ranks
    7: (B, 2, False),  # another schema's parts
    8: (None, 2, False),  # parts without schema.json
    9: (b"{not json", 2, False),  # a damaged schema.json
    10: (A, 2, True),  # complete, this schema, current
    12: (B, 2, True),  # the newest complete one, another schema
}


def _filled(remote) -> None:
    """The table's folders (FOLDERS), each with a shard and an index besides, a marker retiring v3, a folder set
    aside and a stray file beside them; v10 current."""
    objects = {"vae/v3.damaged.json": b"{}", "vae/notes.txt": b"x", "vae/v11.damaged/manifest.parquet": _manifest()}
    for v, (schema, ranks, complete) in FOLDERS.items():
        base = f"vae/v{v}"
        objects.update({f"{base}/shard-r00-000000.tar": b"t", f"{base}/shard-r00-000000.index.parquet": b"i"})
        if schema is not None:
            objects[f"{base}/schema.json"] = schema if isinstance(schema, bytes) else json.dumps(schema).encode()
        if ranks is not None:
            objects[f"{base}/world-size.json"] = json.dumps({"world_size": ranks}).encode()
        if complete:
            objects[f"{base}/manifest.parquet"] = _manifest()
    for rel, data in objects.items():
        remote.write(rel, data)
    make_current(remote, "vae", 10)


@pytest.fixture(params=["s3", "file"])
def url(request, tmp_path) -> str:
    if request.param == "s3":
        found = request.getfixturevalue("s3_env").url("look")
    else:
        found = f"file://{tmp_path / 'remote'}"
    _filled(remote_mod.open_remote(found))
    return found


def test_the_numbers_taken_and_the_version_adopted_on_every_kind_of_folder(url, tmp_path) -> None:
    every = set(FOLDERS)
    assert on_remote(url, "vae", A, 2) == ({*every} - {4}, 1, ROWS, 10)
    assert on_remote(url, "vae", A, 3) == ({*every} - {5}, 1, ROWS, 10)
    assert on_remote(url, "vae", B, 2) == ({*every} - {7}, 12, ROWS, 10)
    assert on_remote(url, "vae", A, 2, same=lambda schema: False) == ({*every} - {4}, 0, 0, 10)
    assert committed_on_remote(url, "vae", lambda schema: schema == A) == 1
    assert committed_on_remote(url, "vae", lambda schema: schema == B) == 12
    assert committed_on_remote(url, "vae", lambda schema: schema is None) == 0  # complete ones all have theirs
    assert on_remote(url, "other", A, 2) == (set(), 0, 0, 0)  # a table the remote does not hold
    assert committed_on_remote(url, "other", lambda schema: True) == 0


def test_a_folder_a_gc_emptied_is_no_version(tmp_path) -> None:
    """A file system keeps the folder whose files a gc removed: no number taken by it (as S3, which has none)."""
    url = f"file://{tmp_path / 'remote'}"
    _filled(remote_mod.open_remote(url))
    (tmp_path / "remote" / "vae" / "v13").mkdir()
    assert on_remote(url, "vae", A, 2).taken == set(FOLDERS) - {4}


def test_the_look_lists_the_table_folder_level_once_and_never_the_versions_objects(s3_env, monkeypatch) -> None:
    """Before: every object of the table listed (a request per 1,000 objects of every version there), then each
    version's schema.json read one after the other. Now: one `/`-delimited listing of `<table>/`, and a few
    lookups of each version's own files."""
    from fault_proxy import FaultProxy

    url = s3_env.url("look")
    _filled(remote_mod.open_remote(url))
    asked: list[tuple[str, str, dict]] = []
    proxy = FaultProxy(s3_env.endpoint, lambda method, path: asked.append(
        (method, urlsplit(path).path, parse_qs(urlsplit(path).query))))
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        assert on_remote(url, "vae", A, 2).committed == 1
        listings = [(q.get("prefix"), q.get("delimiter")) for _, _, q in asked if "list-type" in q]
        assert listings == [(["look/vae/"], ["/"])], listings
        objects = [path.rsplit("/", 1)[1] for method, path, q in asked if "list-type" not in q]
        assert not [name for name in objects if name.startswith("shard-")], objects  # a version's own objects
        assert len(objects) <= 3 * len(FOLDERS) + 4, objects  # + store.json and the adopted manifest's footer
        asked.clear()
        assert committed_on_remote(url, "vae", lambda schema: schema == A) == 1
        assert [(q.get("prefix"), q.get("delimiter")) for _, _, q in asked if "list-type" in q] == listings
    finally:
        proxy.stop()


def test_the_versions_are_looked_at_several_at_a_time(s3_env, monkeypatch) -> None:
    """Each version's lookups are a round trip or three: one version after the other, the latency is the whole
    cost while every other rank waits. The first two lookups meet at a barrier: one after the other, they never
    would."""
    url = s3_env.url("look")
    _filled(remote_mod.open_remote(url))
    barrier, lock, calls, met = threading.Barrier(2, timeout=10), threading.Lock(), [], []
    real = remote_mod.Remote.read

    def read(self, rel, small=False):
        with lock:  # the versions' files (store.json is read before them)
            if rel.startswith("vae/v"):
                calls.append(rel)
            first = rel.startswith("vae/v") and len(calls) <= 2
        try:
            if first:
                barrier.wait()
                met.append(rel)
        except threading.BrokenBarrierError:  # the second never came while the first waited
            pass
        return real(self, rel, small)

    monkeypatch.setattr(remote_mod.Remote, "read", read)
    assert on_remote(url, "vae", A, 2).committed == 1
    assert len(met) == 2


def test_the_look_works_with_an_s3fs_whose_cat_file_takes_no_concurrency(s3_env, monkeypatch) -> None:
    """s3fs before 2026.3 (pyproject allows 2024.3 on) reads an object with one GET and takes no `max_concurrency`:
    a small read asks for one GET only where it is taken. Before, every look at a store URL on such an s3fs stopped
    with a TypeError (an unexpected keyword argument)."""
    import s3fs

    url = s3_env.url("look")
    _filled(remote_mod.open_remote(url))
    real = s3fs.S3FileSystem._cat_file

    async def old_cat_file(self, path, version_id=None, start=None, end=None):  # s3fs 2024.3 - 2026.2
        return await real(self, path, version_id=version_id, start=start, end=end)

    monkeypatch.setattr(s3fs.S3FileSystem, "_cat_file", old_cat_file)
    assert on_remote(url, "vae", A, 2) == (set(FOLDERS) - {4}, 1, ROWS, 10)
    assert committed_on_remote(url, "vae", lambda schema: schema == A) == 1
