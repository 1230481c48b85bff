"""A read lease's start (store/lease.py `hold`) in a `.leases/` folder full of other hosts' leases (64 ranks x many
processes on a shared file system): the stat calls its clean-up of dead leases (`_remove_dead_met`) makes, and its
time. The old way stat'ed every other host's lease file (its age: stale after 15 min) at every start, under the store
lock, so the starts of a launch made ~N^2 metadata round trips one after the other; the new one judges only this
host's leases (by pid, from the file's name) and leaves the others to gc. Both ways in the same run, on --others
other-host lease files, --starts starts each; --stat-ms adds that many ms to each stat of a lease file (a shared file
system's metadata round trip, modelled: this machine's stat is local).

    python bench/lease_start_stats.py [--others 448] [--starts 64] [--stat-ms 0.5]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "store"))

from store import Store, lease  # noqa: E402
from store_samples import fill  # noqa: E402


def _old_remove_dead_met(root: Path) -> None:
    """The start's clean-up before: every lease file's age from a stat unless its name's pid is gone here."""
    dead, asides, now, me = [], False, time.time(), lease.socket.gethostname()
    with os.scandir(root / lease.LEASES_DIR) as listing:
        for entry in listing:
            asides |= lease.ASIDE in entry.name
            if entry.name.endswith(".json") and (lease._gone_here(entry.name, me)
                                                 or entry.stat().st_mtime < now - lease.STALE_SECONDS):
                found = lease._judged_file(Path(entry.path))
                dead += [found] if found is not None and not found.live else []
    if dead or asides:
        lease.remove_dead(root, dead)


def run(root: Path, way, starts: int, stat_ms: float) -> tuple[float, int]:
    """(seconds, stats of lease files) of `starts` lease starts (each released) with `way` as the clean-up."""
    stats, scandir, kept = [0], os.scandir, lease._remove_dead_met

    class Entry:
        def __init__(self, entry):
            self.entry, self.name, self.path = entry, entry.name, entry.path

        def stat(self, **kw):
            stats[0] += 1
            if stat_ms:
                time.sleep(stat_ms / 1e3)
            return self.entry.stat(**kw)

    class Listing:
        def __init__(self, path):
            self.listing = scandir(path)

        def __enter__(self):
            return (Entry(e) for e in self.listing.__enter__())

        def __exit__(self, *exc):
            return self.listing.__exit__(*exc)

    os.scandir, lease._remove_dead_met = Listing, way
    try:
        t0 = time.perf_counter()
        for _ in range(starts):
            lease.hold(root, {"vae": 1}, "bench").release()
        return time.perf_counter() - t0, stats[0]
    finally:
        os.scandir, lease._remove_dead_met = scandir, kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--others", type=int, default=448)
    ap.add_argument("--starts", type=int, default=64)
    ap.add_argument("--stat-ms", type=float, default=0.5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp))
        fill(store, 6)
        held = lease.hold(store.root, {"vae": 1}, "bench")
        mine = held.record()
        held.release()
        for n in range(args.others):  # other hosts' live leases, refreshed now
            path = store.root / lease.LEASES_DIR / f"node{n % 7}x{n}-{100 + n}-0badf00d.json"
            path.write_bytes(lease.record_bytes({**mine, "host": f"node{n}", "boot_id": f"k{n}", "pid": 100 + n}))
        figures = {label: run(store.root, way, args.starts, args.stat_ms)
                   for label, way in (("old", _old_remove_dead_met), ("new", lease._remove_dead_met))}
    print(f"{args.starts} starts, {args.others} other hosts' leases, {args.stat_ms} ms a stat")
    for label, (secs, stats) in figures.items():
        print(f"{label}: {secs:6.2f} s, {stats} stats of lease files")
    (old_s, old_n), (new_s, new_n) = figures["old"], figures["new"]
    print(f"old / new: {old_s / new_s:.1f}x time, stats {old_n} -> {new_n}")


if __name__ == "__main__":
    main()
