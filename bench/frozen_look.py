"""The frozen-peer check's look (models/collective/frozen.py `frozen_peers`) at launch scale: W ranks all stalled at
once (a checkpoint write, a validation, a first compiled step longer than LIVENESS_SECONDS), each reading every
other rank's sign of life, on one real TCPStore served on 127.0.0.1 (as rank 0 or torchrun's agent serves a
launch's). The ranks are client threads, one connection each, spread over --procs worker processes (real ranks are
processes; one process's GIL would be the bottleneck). For each W, the old way (one `add(key, 0)` per peer) and the
new (`signs_of_life`: one `check` and one `multi_get`), in the same run. Prints per round (every rank's one look,
started together: the worst case, real ranks stall at different times): the store calls, the round's wall time, a
rank's look time (median / max: its watch thread, inline, neither counts its sign of life nor polls for a failure
meanwhile), and the latency of another connection's `add` meanwhile (median / max), then old / new ratios.

    python bench/frozen_look.py --ranks 64 256 512 [--procs 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TORCHELASTIC_RUN_ID", "bench-frozen-look")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # the server's warning per connection it cannot name

import torch.distributed as dist  # noqa: E402

from models.collective import frozen  # noqa: E402
from models.collective.store_client import _alive_key, _call  # noqa: E402


def _old_frozen_peers(call, world: int, me: int, seen: dict) -> list[int]:
    """The look before `signs_of_life`: one store call per peer (its `add(key, 0)`); what is judged is the same."""
    now, lost = time.monotonic(), []
    for r in range(world):
        if r == me:
            continue
        beats = call(lambda c: c.add(_alive_key(r), 0))
        if r not in seen or seen[r][0] != beats:
            seen[r] = (beats, now)
    return lost


def _client(port: int):
    return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=60))


def _rank(port: int, way: str, world: int, me: int, tag: str, out: list) -> None:
    """One rank: its connection, ready, then its one look once every rank is ready (`go`)."""
    client, calls = _client(port), [0]
    client.add(f"{tag}/ready", 1)
    client.wait([f"{tag}/go"])

    def call(op):
        calls[0] += 1
        return _call(client, op)

    look = _old_frozen_peers if way == "old" else frozen.frozen_peers
    began = time.monotonic()
    look(call, world, me, {})
    out.append({"rank": me, "calls": calls[0], "began": began, "ended": time.monotonic()})


def worker(port: int, way: str, world: int, lo: int, hi: int, tag: str) -> None:
    """Ranks lo..hi-1 as threads; their figures as one JSON line."""
    out: list = []
    threads = [threading.Thread(target=_rank, args=(port, way, world, r, tag, out)) for r in range(lo, hi)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(out), flush=True)


def _probe(port: int, stop: threading.Event, latencies: list) -> None:
    """Another connection's `add` (a heartbeat, a failure poll) every 10 ms while the round runs."""
    client = _client(port)
    while not stop.is_set():
        t = time.monotonic()
        client.add("probe", 1)
        latencies.append((t, time.monotonic() - t))
        stop.wait(0.01)


def round_of(master, port: int, way: str, world: int, procs: int) -> dict:
    """Every rank's one look, started together; the figures."""
    tag = f"{way}/{world}"
    for r in range(world):  # every rank counted once, as running ranks' watch threads have
        master.add(_alive_key(r), 1)
    bounds = [world * i // procs for i in range(procs + 1)]
    workers = [subprocess.Popen([sys.executable, __file__, "--worker", str(port), way, str(world), str(lo), str(hi),
                                 tag], stdout=subprocess.PIPE, text=True, cwd=ROOT)
               for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
    while master.add(f"{tag}/ready", 0) < world:
        time.sleep(0.05)
    stop, latencies = threading.Event(), []
    probe = threading.Thread(target=_probe, args=(port, stop, latencies))
    probe.start()
    go = time.monotonic()
    master.set(f"{tag}/go", "1")
    ranks = [r for w in workers for r in json.loads(w.communicate()[0])]
    stop.set()
    probe.join()
    looks, end = sorted(r["ended"] - r["began"] for r in ranks), max(r["ended"] for r in ranks)
    during = [took for t, took in latencies if go <= t <= end] or [0.0]  # the probe's calls made during the round
    return {"calls": sum(r["calls"] for r in ranks), "wall": end - go,
            "look_p50": statistics.median(looks), "look_max": looks[-1],
            "beat_p50": statistics.median(during), "beat_max": max(during)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--procs", type=int, default=min(os.cpu_count() or 1, 8))
    args = ap.parse_args()
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    print(f"{'W':>5} {'way':>4} {'calls':>8} {'wall s':>7} {'look p50':>9} {'look max':>9} {'add p50':>9} "
          f"{'add max':>9}")
    for world in args.ranks:
        figures = {way: round_of(master, master.port, way, world, args.procs) for way in ("old", "new")}
        for way, f in figures.items():
            print(f"{world:>5} {way:>4} {f['calls']:>8} {f['wall']:>7.2f} {f['look_p50']:>9.3f} "
                  f"{f['look_max']:>9.3f} {f['beat_p50'] * 1e3:>7.1f}ms {f['beat_max'] * 1e3:>7.1f}ms")
        old, new = figures["old"], figures["new"]
        print(f"{world:>5} old/new: calls x{old['calls'] / new['calls']:.0f}, wall x{old['wall'] / new['wall']:.1f}, "
              f"look max x{old['look_max'] / new['look_max']:.1f}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        port, way, world, lo, hi, tag = sys.argv[2:8]
        worker(int(port), way, int(world), int(lo), int(hi), tag)
    else:
        main()
