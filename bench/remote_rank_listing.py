"""What one rank of a multi-node encode lists of the version it writes on a store URL (store/remote_parts.py): its
open (`adopt_uploaded`) and its upload (`upload_rank`) each list once. Before, each listed the whole
`<table>/v<N>/` (every rank's shards and indexes: ~40k objects at 1M samples, by each of 64 ranks); now each lists
its own shards' prefix (`shard-rRR-`, by the server on S3) and looks up its few other files alone.

Builds the parts of one version on the remote - --ranks ranks x --shards shards each (a 1-byte object per shard
and per index), schema.json, world-size.json, a rank-done file per rank - then, for rank 1, in the same run:
  old  the objects the whole-version listing returns (the former `_listing`, for the open and for the upload)
  new  the objects the rank's prefix listing returns (`_rank_listing`), and the rank's shards among them
Prints objects listed per encode and old / new (their ratio ~ the number of ranks), the time of each as an aside.

    python bench/remote_rank_listing.py --ranks 64 --shards 20            # a file:// remote
    python bench/remote_rank_listing.py --ranks 64 --shards 20 --s3       # moto's S3 server on 127.0.0.1
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's store/, not an installed one

from store import format as fmt  # noqa: E402
from store.remote import each_at_once, open_remote  # noqa: E402
from store.remote_parts import _listing, _rank_listing  # noqa: E402

RANK = 1
TABLE, VERSION = "vae", 1


def build(remote, ranks: int, shards: int) -> int:
    """The parts of one version, tiny objects; how many."""
    base = f"{TABLE}/v{VERSION}"
    names = [fmt.SCHEMA_JSON, "world-size.json"]
    for r in range(ranks):
        names.append(fmt.rank_done_name(r))
        for i in range(shards):
            shard = fmt.shard_name(r, i)
            names += [shard, fmt.index_name(shard)]
    for _ in each_at_once(lambda name: remote.write(f"{base}/{name}", b"x"), names):
        pass
    return len(names)


def best(fn, repeats: int) -> tuple[float, object]:
    times, got = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        got = fn()
        times.append(time.perf_counter() - t0)
    return min(times), got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--shards", type=int, default=20, help="shards per rank (each with its index)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--s3", action="store_true", help="moto's S3 server instead of a file:// folder")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="rank-listing-bench-"))
    server = None
    try:
        if args.s3:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from store_remote import start_s3

            server, _ = start_s3()
            url = "s3://bench/rank-listing"
        else:
            url = f"file://{work / 'remote'}"
        remote = open_remote(url)
        total = build(remote, args.ranks, args.shards)
        t_old, old = best(lambda: _listing(remote, TABLE, VERSION), args.repeats)
        t_new, new = best(lambda: _rank_listing(remote, TABLE, VERSION, RANK), args.repeats)
        own = sum(1 for rel in new if rel.rsplit("/", 1)[1].startswith(fmt.shard_prefix(RANK)))
        assert own == len(new) == 2 * args.shards, (own, len(new))
        print(f"{url}: {total} objects in v{VERSION} ({args.ranks} ranks x {args.shards} shards); rank {RANK}'s "
              f"open + upload list:")
        print(f"  old  {2 * len(old):7d} objects  ({t_old * 1e3:.1f} ms a listing)")
        print(f"  new  {2 * len(new):7d} objects  ({t_new * 1e3:.1f} ms a listing), all its own")
        print(f"  old / new: x{len(old) / len(new):.1f} objects listed"
              + (f", x{t_old / t_new:.1f} time" if t_new > 0 else ""))
    finally:
        if server is not None:
            server.terminate()
            server.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
