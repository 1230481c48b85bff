"""Requests of rank 0's look at a store URL at the start of every multi-node encode (store/remote_parts.py
`on_remote`: which version numbers this run cannot write, which complete version of its schema it adopts), while
every other rank waits. Old: every object of the table listed (a request per 1,000 objects of every version: at
1,000 versions x 40k objects, ~40k listing pages), then each version's schema.json (and world-size.json) read one
after the other. New: one `/`-delimited listing of `<table>/` (its version folders), then each version's manifest
looked up (HEAD) and the schema.json / world-size.json of the incomplete ones read, 16 versions at a time.

Builds a table on moto's S3 server (tests/s3_server.py, in a child process): --versions folders of --objects tiny
objects each (shards and indexes), most complete with another schema, this run's complete version a few below
the newest, this run's parts at the top; then runs the old look and the new one alternately (--repeat times)
through a counting proxy (tests/store/fault_proxy.py) that waits --latency-ms before relaying each request (a
network's round trip: loopback has none). Prints requests by kind (listing pages, HEAD, GET) and the best wall
time of each, their ratios, and checks both give the same answer.

    python bench/remote_version_look.py                                  # 21 versions x 60 objects, 20 ms
    python bench/remote_version_look.py --versions 40 --objects 1000     # 40k objects: 40+ listing pages
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "store")]  # store/; the tests' proxy

from _common import s3_bucket  # noqa: E402
from store import format as fmt  # noqa: E402
from store.remote import Remote, each_at_once, open_remote  # noqa: E402
from store.remote_parts import OnRemote, _json_of, _rows, _world_of, make_current, on_remote  # noqa: E402
from store.writer_open import WORLD_JSON  # noqa: E402

TABLE, WORLD = "vae", 2
WANT, OTHER = {"lineage": "this run"}, {"lineage": "another run"}


def old_on_remote(url: str, table: str, want: dict, world: int) -> OnRemote:
    """`on_remote` as it was: the table's whole listing, then every schema.json read one after the other."""
    from store.remote_sync import _parse_record, marker_rel

    remote = open_remote(url)
    names = Remote(remote.url, remote.fs, remote.path(table)).listing()
    versions: dict[int, set[str]] = {}
    for rel in names:
        head, _, name = rel.partition("/")
        if (m := fmt.VERSION_RE.fullmatch(head)) and name:
            versions.setdefault(int(m.group(1)), set()).add(name)
    schemas = {v: _json_of(remote.read(f"{table}/v{v}/{fmt.SCHEMA_JSON}"))
               for v, files in versions.items() if fmt.SCHEMA_JSON in files}
    taken = set()
    for v, files in versions.items():
        if fmt.MANIFEST in files or schemas.get(v) != want or WORLD_JSON not in files or \
                _world_of(remote.read(f"{table}/v{v}/{WORLD_JSON}")) != world:
            taken.add(v)
    entry = _parse_record(remote.read(fmt.STORE_JSON), remote.url)["tables"].get(table)
    current = 0 if entry is None else int(entry["current"])
    for v in sorted(versions, reverse=True):
        if v != current and fmt.MANIFEST in versions[v] and marker_rel(table, v).split("/", 1)[1] not in names \
                and schemas.get(v) == want:
            return OnRemote(taken, v, _rows(remote, f"{table}/v{v}/{fmt.MANIFEST}"), current)
    return OnRemote(taken, current=current)


def _manifest() -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"key": ["a", "b", "c"]}), sink)
    return sink.getvalue().to_pybytes()


def build(url: str, versions: int, objects: int) -> int:
    """The table's folders; how many objects. The top one: this run's parts; three below it: its complete
    version; v1: current; every other one complete with another schema."""
    manifest, objs = _manifest(), {}
    for v in range(1, versions + 1):
        base, mine = f"{TABLE}/v{v}", v in (versions, versions - 3)
        objs[f"{base}/{fmt.SCHEMA_JSON}"] = json.dumps(WANT if mine else OTHER).encode()
        objs[f"{base}/{WORLD_JSON}"] = json.dumps({"world_size": WORLD}).encode()
        for i in range(max(0, objects - 3)):
            objs[f"{base}/shard-r00-{i:06d}.tar"] = b"x"
        if v != versions:
            objs[f"{base}/{fmt.MANIFEST}"] = manifest
    remote = open_remote(url)
    for _ in each_at_once(lambda item: remote.write(*item), list(objs.items())):
        pass
    make_current(remote, TABLE, 1)
    return len(objs)


class Counter:
    """The requests the proxy relayed, by kind; each waits `latency` seconds first."""

    def __init__(self, latency: float) -> None:
        self.latency, self.kinds, self.lock = latency, collections.Counter(), threading.Lock()

    def __call__(self, method: str, path: str) -> None:
        kind = "list" if "list-type" in parse_qs(urlsplit(path).query) else method
        with self.lock:
            self.kinds[kind] += 1
        time.sleep(self.latency)


def measure(look, counter: Counter) -> tuple[float, collections.Counter, OnRemote]:
    counter.kinds = collections.Counter()
    t = time.perf_counter()
    found = look()
    return time.perf_counter() - t, counter.kinds, found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", type=int, default=21)
    ap.add_argument("--objects", type=int, default=60, help="objects per version folder")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="wait before relaying each request")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from fault_proxy import FaultProxy

    with s3_bucket("bench") as endpoint:
        url = "s3://bench/look"
        total = build(url, args.versions, args.objects)
        counter = Counter(args.latency_ms / 1000)
        proxy = FaultProxy(endpoint, counter)
        os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
        looks = {"old": lambda: old_on_remote(url, TABLE, WANT, WORLD),
                 "new": lambda: on_remote(url, TABLE, WANT, WORLD)}
        best: dict[str, tuple[float, collections.Counter, OnRemote]] = {}
        for _ in range(args.repeat):  # alternately: a busy machine slows both alike
            for name, look in looks.items():
                got = measure(look, counter)
                if name not in best or got[0] < best[name][0]:
                    best[name] = got
        proxy.stop()
    assert best["old"][2] == best["new"][2], (best["old"][2], best["new"][2])
    print(f"{url}: table '{TABLE}', {args.versions} versions, {total} objects; {args.latency_ms:.0f} ms a request; "
          f"answer {best['new'][2]}")
    for name, (seconds, kinds, _) in best.items():
        print(f"  {name}  {sum(kinds.values()):6d} requests ({kinds['list']} listing pages, {kinds['HEAD']} HEAD, "
              f"{kinds['GET']} GET)  {seconds:.2f} s")
    old, new = best["old"], best["new"]
    print(f"  old / new: x{sum(old[1].values()) / sum(new[1].values()):.1f} requests, "
          f"x{old[1]['list'] / max(1, new[1]['list']):.0f} listing pages, x{old[0] / new[0]:.1f} time")


if __name__ == "__main__":
    main()
