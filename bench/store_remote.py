"""Object-storage throughput against a local S3-protocol server (moto on 127.0.0.1), each vs a local baseline
measured in the same run (best of --repeats, interleaved: a busy machine slows every case alike).

sync   `pipeline store push|pull` of a store of realistic tensors (bench/store_read.py's builder: prompt embeds +
       latents, bf16) vs shutil.copytree of the store folder (read + write on this disk).
read   readers of a store URL through the lazy local cache (store/remote_cache.py, store/remote_shards.py), vs
       the same store read locally:
         scan    every tensor of every sample (check-ahead CRC, as train/evaluate/encode read)
         random  --random samples at random keys
       cold = an empty cache (the open fetches the version's metadata; the reads fetch shards whole when they
       scan, byte ranges when they read at random), warm = the cache as the cold pass left it (the open reads
       store.json and checksums.json from the remote, the reads find the shards the cold pass cached). The open is
       reported apart from the reads, and the bytes fetched from the server apart from the bytes read.
ranks  --ranks processes of one node sharing a cold cache, each reading its disjoint share of the samples in its
       own random order (as the ranks of a distributed training read): bytes fetched from the server by all of
       them together vs the store's size, with the node's per-shard fetch lock (store/remote_shards.py) and
       without it (each rank passing the whole-fetch threshold downloads the shard itself, as before the lock).
objects  push, pull and a cold lazy open of a version of --shards-count small shards (a 1M-sample table has ~20k,
       each with its index: two objects per shard, one round trip each), `store.remote.TRANSFERS` objects at a
       time vs one after the other, interleaved.
train  a CPU training run of configs/demo.yaml (its tiny model, its 24 synthetic samples, 60 steps) on the local
       store, on the URL with a warm cache and with a cold one, train.prefetch 0 and 2: the time each step waits
       for its micro-batch (`MicroBatches.next`, timed here) as a share of the step (a cold cache fetches during
       the steps: the prefetch and check-ahead threads overlap those fetches with compute), and the one-off open
       as a share of the run. Steps 1-2 (warm-up) left out.
The server is Python (moto keeps objects in memory) on the same cores, so the remote figures bound the client's own
overhead on this machine; a real S3 endpoint is limited by the network instead.

    python bench/store_remote.py --gb 0.5 --repeats 3            # all three
    python bench/store_remote.py --only read --gb 0.3
    python bench/store_remote.py --only ranks --gb 0.3 --shard-mb 16 --ranks 4
    python bench/store_remote.py --only objects --shards-count 600
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from store_read import build  # noqa: E402  (the same realistic tables as the read benchmark)


def start_s3() -> tuple[subprocess.Popen, str]:
    """moto's S3 server in its own process (its Python request handling must not share this one's GIL)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=endpoint)
    import boto3

    for _ in range(300):  # up to 30 s for the server to listen
        try:
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
            return server, endpoint
        except Exception:  # noqa: BLE001  not listening yet
            time.sleep(0.1)
    server.kill()
    raise SystemExit("moto server did not start")


def store_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def bench_sync(work: Path, gb: float, shard_mb: float, repeats: int, seed: int) -> None:
    from store.remote_pull import pull
    from store.remote_push import push

    src = work / "store"
    build(src, gb, shard_mb, seed)
    nbytes = store_bytes(src)
    best = {"copy": float("inf"), "push": float("inf"), "pull": float("inf")}
    for i in range(repeats):  # interleaved: a busy machine slows all three alike
        t = time.perf_counter()
        shutil.copytree(src, work / f"copy-{i}")
        best["copy"] = min(best["copy"], time.perf_counter() - t)
        shutil.rmtree(work / f"copy-{i}")
        t = time.perf_counter()
        push(src, f"s3://bench/run-{i}")
        best["push"] = min(best["push"], time.perf_counter() - t)
        t = time.perf_counter()
        pull(f"s3://bench/run-{i}", work / f"pulled-{i}")
        best["pull"] = min(best["pull"], time.perf_counter() - t)
        shutil.rmtree(work / f"pulled-{i}")
    mb = nbytes / 1e6
    print(f"== sync: store of {mb:.0f} MB in {len(list(src.rglob('*.tar')))} shards; best of {repeats}")
    for name, secs in best.items():
        print(f"{name:5s} {mb / secs:8.1f} MB/s  ({secs:.2f} s, {best['copy'] / secs:.2f}x copy)")
    shutil.rmtree(src)


def _random_reads(root: Path, dst, count: int, seed: int) -> float:
    """Seconds to open the table and read `count` samples at random keys (every first read CRC-checked)."""
    import random

    from store import Store

    t0 = time.perf_counter()
    with Store(root).reader("features") as r:
        for key in random.Random(seed).choices(r.keys(), k=count):
            for t in r.get(key)["tensors"].values():
                dst[: t.numel()].copy_(t.reshape(-1))
    return time.perf_counter() - t0


def bench_read(work: Path, gb: float, shard_mb: float, repeats: int, seed: int, count: int) -> dict[str, float]:
    import torch
    from store_read import HIDDEN, store_scan

    from store.remote_cache import local_store
    from store.remote_shards import fetch_stats
    from store.remote_push import push

    src, url = work / "read-store", "s3://bench/read"
    n = build(src, gb, shard_mb, seed)
    push(src, url)
    dst = torch.empty(1100 * HIDDEN, dtype=torch.bfloat16)
    _, tensor_bytes = store_scan(src, dst, "none")  # also warms the page cache for the local baseline
    runs: dict[str, list[float]] = {f"{w} {k}": [] for k in ("scan", "random") for w in ("local", "cold", "warm")}
    opens: dict[str, list[float]] = {k: [] for k in runs}  # of those seconds, the open (list + pull if cold)

    fetched: dict[str, list[int]] = {k: [] for k in runs}  # bytes fetched from the server (shards + ranges)

    def via_cache(name: str, cache: Path, read) -> None:
        before = fetch_stats()
        t0 = time.perf_counter()
        root = local_store(url, ["features"], cache)
        t_open = time.perf_counter() - t0
        runs[name].append(t_open + read(root))
        opens[name].append(t_open)
        after = fetch_stats()
        fetched[name].append(after["shard_bytes"] + after["range_bytes"] - before["shard_bytes"]
                             - before["range_bytes"])

    for i in range(repeats):
        scan = lambda root: store_scan(root, dst, "ahead")[0]  # noqa: E731
        rand = lambda root: _random_reads(root, dst, count, seed + i)  # noqa: E731
        for kind, read in (("scan", scan), ("random", rand)):
            cache = work / f"cache-{kind}-{i}"
            runs[f"local {kind}"].append(read(src))
            opens[f"local {kind}"].append(0.0)
            via_cache(f"cold {kind}", cache, read)
            os.sync()  # the cold pass's writes reach the disk first: a warm read does not compete with writeback
            via_cache(f"warm {kind}", cache, read)
            shutil.rmtree(cache)
    best = {k: min(v) for k, v in runs.items()}
    reads = {k: min(t - o for t, o in zip(runs[k], opens[k])) for k in runs}  # after the open
    read_bytes = {"scan": tensor_bytes, "random": tensor_bytes * count / n}  # ~: random keys, mean sample size
    print(f"== read: {n} samples, {tensor_bytes / 1e9:.2f} GB of tensors in {len(list(src.rglob('*.tar')))} shards "
          f"({store_bytes(src) / 1e9:.2f} GB store); random: {count} samples (~{read_bytes['random'] / 1e6:.0f} MB); "
          f"best of {repeats}; open = store.json + checksums.json (+ the version's metadata when cold), then the "
          "reads; fetched = bytes from the server during open + reads")
    for kind in ("scan", "random"):
        for where in ("local", "cold", "warm"):
            name = f"{kind} {where}"
            secs, after, base = best[f"{where} {kind}"], reads[f"{where} {kind}"], best[f"local {kind}"]
            work_ = tensor_bytes / 1e6 if kind == "scan" else count
            unit = "MB/s" if kind == "scan" else "samples/s"
            got = "" if where == "local" else f"; fetched {min(fetched[f'{where} {kind}']) / 1e6:.0f} MB"
            print(f"{name:13s} {work_ / secs:8.1f} {unit:9s} {base / secs:5.2f}x local  (open {secs - after:.2f} s + "
                  f"reads {after:.2f} s; reads alone {base / after:.2f}x local{got})")
    shutil.rmtree(src)
    return best


RANK = """
import contextlib, json, random, sys, time, types
from store import Store, format as fmt, remote_shards
from store.remote_cache import local_store
url, cache, rank, world, seed, locked = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
if not locked:  # as before the node lock: every process fetches what it passes the threshold of (no cache limit
    # here, so the cache lock this also turns off is never taken)
    remote_shards.fmt = types.SimpleNamespace(**{**vars(fmt), "flock": lambda *a, **k: contextlib.nullcontext()})
root = local_store(url, ["features"], cache, lease=False)
t0 = time.perf_counter()
with Store(root, create=False).reader("features") as r:
    keys = r.keys()[rank::world]
    for k in random.Random(seed + rank).sample(keys, len(keys)):
        r.tensors(k)
print(json.dumps({**remote_shards.fetch_stats(), "seconds": time.perf_counter() - t0}))
"""


def bench_ranks(work: Path, gb: float, shard_mb: float, repeats: int, seed: int, ranks: int) -> None:
    import json

    from store.remote_push import push

    src, url = work / "ranks-store", "s3://bench/ranks"
    n = build(src, gb, shard_mb, seed)
    push(src, url)
    nbytes = sum(p.stat().st_size for p in src.rglob("*.tar"))
    got: dict[bool, list[dict]] = {True: [], False: []}
    for i in range(repeats):
        for locked in (True, False):  # interleaved
            cache = work / f"ranks-cache-{i}-{int(locked)}"
            procs = [subprocess.Popen([sys.executable, "-c", RANK, url, str(cache), str(r), str(ranks), str(seed + i),
                                       str(int(locked))], stdout=subprocess.PIPE, text=True) for r in range(ranks)]
            stats = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
            if any(p.returncode for p in procs):
                raise SystemExit("a rank failed")
            got[locked].append({k: sum(s[k] for s in stats) for k in stats[0] if k != "seconds"}
                               | {"seconds": max(s["seconds"] for s in stats)})
            shutil.rmtree(cache)
    print(f"== ranks: {ranks} processes of one node, one cold cache, {n} samples in "
          f"{len(list(src.rglob('*.tar')))} shards ({nbytes / 1e6:.0f} MB of shards); each rank its 1/{ranks} in "
          f"random order; {repeats} runs each")
    for locked in (True, False):
        runs = got[locked]
        fetched = [(r["shard_bytes"] + r["range_bytes"]) / nbytes for r in runs]
        print(f"{'node lock' if locked else 'no lock':9s}  fetched {min(fetched):.2f}-{max(fetched):.2f}x the "
              f"shards' bytes; whole fetches {min(r['shards'] for r in runs)}-{max(r['shards'] for r in runs)}, "
              f"ranges {min(r['ranges'] for r in runs)}-{max(r['ranges'] for r in runs)}; slowest rank "
              f"{min(r['seconds'] for r in runs):.2f}-{max(r['seconds'] for r in runs):.2f} s")
    shutil.rmtree(src)


def bench_objects(work: Path, shards: int, repeats: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "store"))
    from store_samples import fill  # tiny samples: the objects' count matters here, not their bytes

    from store import Store, remote
    from store.remote_cache import local_store
    from store.remote_pull import pull
    from store.remote_push import push

    src = Store(work / "objects-store")
    fill(src, shards * 3 // 2, shard_size_mb=0.004)  # ~1.5 samples (~4 KB each) per shard
    n = len(list(src.root.rglob("*.tar")))
    default = remote.TRANSFERS
    best = {(what, k): float("inf") for what in ("push", "resume", "pull", "open") for k in (1, default)}
    try:
        for i in range(repeats):
            for at_once in (1, default):  # interleaved
                remote.TRANSFERS = at_once
                url = f"s3://bench/objects-{i}-{at_once}"
                for what, run in (("push", lambda: push(src.root, url)),
                                  ("resume", lambda: _killed_before_manifest(url) or push(src.root, url)),
                                  ("pull", lambda: pull(url, work / "pulled")),
                                  ("open", lambda: local_store(url, ["vae"], work / "cache", lease=False))):
                    t = time.perf_counter()
                    run()
                    best[what, at_once] = min(best[what, at_once], time.perf_counter() - t)
                shutil.rmtree(work / "pulled")
                shutil.rmtree(work / "cache")
    finally:
        remote.TRANSFERS = default
    print(f"== objects: a version of {n} shards ({2 * n + 3} objects: shards, their indexes, manifest, schema, "
          f"checksums); push, a resumed push (every object there but the manifest: one HEAD each), pull, cold lazy "
          f"open (metadata only: {n + 3} objects); best of {repeats}")
    for what in ("push", "resume", "pull", "open"):
        one, many = best[what, 1], best[what, default]
        print(f"{what:5s} one at a time {one:6.2f} s, {default} at a time {many:6.2f} s ({one / many:.2f}x)")
    shutil.rmtree(src.root)


def _killed_before_manifest(url: str) -> None:
    """The remote as a push killed right before its manifest leaves it (the resumed push then checks the rest)."""
    from store.remote import open_remote

    open_remote(url).delete(["vae/v1/manifest.parquet"])


def _demo_stores(work: Path, url: str):
    """configs/demo.yaml's model, data and `text` + `vae` tables (built as `pipeline demo` does), pushed to `url`."""
    from pipeline.commands.demo import DEMO_CONFIG, prepare_inputs
    from pipeline.config import load_config
    from stages.encode import text as encode_text, vae as encode_vae
    from stages.resize import stage as resize
    from store.remote_push import push

    paths = {"source": work / "data", "store": work / "demo-store", "model": work / "tiny-model"}
    cfg = load_config(DEMO_CONFIG, {f"paths.{k}": str(v) for k, v in paths.items()})
    prepare_inputs(paths["model"], paths["source"], cfg.resize.max_controls)
    resize.run(cfg, paths["source"], paths["store"])
    encode_text.run(cfg, paths["store"], str(paths["model"]))
    encode_vae.run(cfg, paths["store"], str(paths["model"]))
    push(paths["store"], url)
    return cfg, paths["store"], str(paths["model"])


WAITS: list[float] = []  # seconds each MicroBatches.next() took in the current run


def _timed_next():
    """MicroBatches.next, timed (bench instrumentation only)."""
    from stages.train import prefetch

    real = prefetch.MicroBatches.next

    def next_(self):
        t0 = time.perf_counter()
        out = real(self)
        WAITS.append(time.perf_counter() - t0)
        return out

    prefetch.MicroBatches.next = next_


def bench_train(work: Path, repeats: int, warmup: int = 2) -> None:
    from stages.train.recipe import run
    from store.remote_cache import local_store
    from store.remote_shards import fetch_stats

    url = "s3://bench/demo"
    cfg, store, model = _demo_stores(work, url)
    _timed_next()
    cases = [("local", 0), ("local", 2), ("warm", 0), ("warm", 2), ("cold", 0), ("cold", 2)]
    waits: dict[tuple, list[float]] = {c: [] for c in cases}  # share of step time waiting for data, per run
    waits_all: dict[tuple, list[float]] = {c: [] for c in cases}  # the same over every step (warm-up included)
    opened: dict[tuple, list[tuple[float, float]]] = {c: [] for c in cases}  # (open s, run s)
    fetched: dict[tuple, list[int]] = {c: [] for c in cases}
    k = 0
    for i in range(repeats):
        for where, depth in cases:
            k += 1
            c = cfg.model_copy(update={"train": cfg.train.model_copy(update={"prefetch": depth})})
            cache = work / f"train-cache-{where}-{i}-{depth}"
            if where == "warm":  # filled by a training before the measured run
                c0 = cfg.model_copy(update={"train": cfg.train.model_copy(update={"prefetch": 0})})
                run(c0, local_store(url, ["text", "vae"], cache), model, work / f"fill-{k}")
                shutil.rmtree(work / f"fill-{k}")
            stats = fetch_stats()
            t0 = time.perf_counter()
            root = store if where == "local" else local_store(url, ["text", "vae"], cache)
            t_open = time.perf_counter() - t0
            WAITS.clear()
            result = run(c, root, model, work / f"run-{k}")
            steps = result.step_times[warmup:]
            waits[(where, depth)].append(sum(WAITS[warmup:len(result.step_times)]) / sum(steps))
            waits_all[(where, depth)].append(sum(WAITS[:len(result.step_times)]) / sum(result.step_times))
            opened[(where, depth)].append((t_open, time.perf_counter() - t0))
            now = fetch_stats()
            fetched[(where, depth)].append(sum(now[x] - stats[x] for x in ("shard_bytes", "range_bytes")))
            shutil.rmtree(work / f"run-{k}")
            shutil.rmtree(cache, ignore_errors=True)
    steps_ms = 1000 * sum(steps) / len(steps)
    total = store_bytes(store)
    print(f"== train: configs/demo.yaml on the CPU, {cfg.train.max_steps} steps of batch {cfg.train.batch_size} "
          f"(~{steps_ms:.0f} ms a step), data wait = time in MicroBatches.next / step time, steps {warmup + 1}+; "
          f"best of {repeats}")
    for where, depth in cases:
        share = min(waits[(where, depth)])
        t_open, t_run = min(opened[(where, depth)])
        share_open = (f"; open {t_open:.2f} s = {100 * t_open / t_run:.1f}% of the run ({t_run:.1f} s); fetched "
                      f"{min(fetched[(where, depth)]) / 1e6:.1f} of the store's {total / 1e6:.1f} MB")
        extra = "" if where == "local" else share_open
        label = "local store" if where == "local" else f"URL, {where} cache"
        print(f"{label:15s}, prefetch {depth}: data wait {100 * share:5.2f}% of a step ({100 * min(waits_all[(where, depth)]):.2f}% "
              f"over every step){extra}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["sync", "read", "ranks", "objects", "train"], default=None)
    ap.add_argument("--gb", type=float, default=0.5)
    ap.add_argument("--shard-mb", type=float, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--random", type=int, default=300, help="random reads per pass")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ranks", type=int, default=4, help="processes of one node (ranks)")
    ap.add_argument("--shards-count", type=int, default=600, help="shards of the `objects` case's version")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="store-remote-bench-"))
    server, _ = start_s3()
    try:
        if args.only in (None, "sync"):
            bench_sync(work, args.gb, args.shard_mb, args.repeats, args.seed)
        if args.only in (None, "read"):
            bench_read(work, args.gb, args.shard_mb, args.repeats, args.seed, args.random)
        if args.only in (None, "ranks"):
            bench_ranks(work, args.gb, args.shard_mb, args.repeats, args.seed, args.ranks)
        if args.only in (None, "objects"):
            bench_objects(work, args.shards_count, args.repeats)
        if args.only in (None, "train"):
            bench_train(work, args.repeats)
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
