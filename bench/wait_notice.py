"""The long wait's notice (models/collective/arrive.py `_wait_notice`: who the arrived ranks still wait for, every
WAIT_NOTICE_SECONDS) at launch scale, on one real TCPStore served on 127.0.0.1: W ranks of which the lowest M have
not arrived. The old way (each arrived rank asks each lower rank's mark until one arrived; the lowest arrived asks
every rank's) and the new (the first arrival reads every arrival at once: one `get`; the others ask nothing), in the
same run, each arrived rank's look run on one of --threads client connections. Prints the store calls of one
notice round (every arrived rank's look) and its wall time, then old / new ratios.

    python bench/wait_notice.py --ranks 512 --missing 1 256 [--threads 16]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch.distributed as dist  # noqa: E402

from models.collective.arrive import _wait_notice  # noqa: E402


def _old_wait_notice(call, key: str, world: int, rank: int) -> None:
    """The look before one `get`: a check of each lower rank's mark up to the first arrived; the lowest arrived
    checks every rank's."""
    for r in range(rank):
        if call(lambda c: c.check([f"{key}/{r}"])):
            return
    [r for r in range(rank + 1, world) if not call(lambda c: c.check([f"{key}/{r}"]))]


def _client(port: int):
    return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=60))


def round_of(port: int, way: str, world: int, missing: int, threads: int) -> tuple[int, float]:
    """One notice round: every arrived rank's look, spread over `threads` connections; (store calls, wall s)."""
    key, arrived = f"{way}/{world}/{missing}", list(range(missing, world))
    setup = _client(port)
    for r in arrived:  # as `arrive_together` marks each arrival
        setup.set(f"{key}/{r}", "1")
        setup.append(f"{key}/ranks", f"{r},")
    counts, clients = [0] * threads, [_client(port) for _ in range(threads)]  # connected before the clock

    def run(i: int) -> None:
        def call(op):
            counts[i] += 1
            return op(clients[i])

        for r in arrived[i::threads]:
            if way == "old":
                _old_wait_notice(call, key, world, r)
            elif r == arrived[0]:  # the first arrival; the others ask nothing
                _wait_notice(call, key, world, 600.0, "bench")

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    began = time.monotonic()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return sum(counts), time.monotonic() - began


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=512)
    ap.add_argument("--missing", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--threads", type=int, default=16)
    args = ap.parse_args()
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    print(f"{'W':>5} {'missing':>7} {'way':>4} {'calls':>8} {'wall s':>8}")
    for missing in args.missing:
        figures = {way: round_of(master.port, way, args.ranks, missing, args.threads) for way in ("old", "new")}
        for way, (calls, wall) in figures.items():
            print(f"{args.ranks:>5} {missing:>7} {way:>4} {calls:>8} {wall:>8.3f}")
        (old_calls, old_wall), (new_calls, new_wall) = figures["old"], figures["new"]
        print(f"{args.ranks:>5} {missing:>7} old/new: calls x{old_calls / new_calls:.0f}, "
              f"wall x{old_wall / new_wall:.1f}", flush=True)


if __name__ == "__main__":
    main()
