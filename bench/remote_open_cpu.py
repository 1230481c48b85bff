"""CPU time of one remote open of an s3:// store (store.remote.open_remote and its client's creation, as every lease
write, push, pull, inspect does) with one parse of S3's service model per process (store/s3_models.py) vs a parse
per open (botocore's own way: each open's new session has a new loader), measured in the same run, each way in its
own fresh process, interleaved. No request is sent (the endpoint is never reached): this is the client's cost alone.

    python bench/remote_open_cpu.py --opens 20 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import json, os, sys, time
from fsspec.asyn import sync
from store import s3_models
if sys.argv[1] == "per-open":
    s3_models.share = lambda: None  # botocore's own way
from store.remote import open_remote
times = []
for _ in range(int(sys.argv[2])):
    t = time.process_time()
    r = open_remote("s3://bench-bucket/store")
    sync(r.fs.loop, r.fs.set_session)  # the client, as the first request creates it
    times.append(time.process_time() - t)
print(json.dumps(times))
"""


def run(way: str, opens: int) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_ENDPOINT_URL": "http://127.0.0.1:1", "AWS_DEFAULT_REGION": "us-east-1"}
    out = subprocess.run([sys.executable, "-c", CHILD, way, str(opens)], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--opens", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    got: dict[str, list[float]] = {"per-open": [], "shared": []}
    for _ in range(a.repeats):
        for way in got:  # interleaved: a busy machine slows both alike
            got[way] += run(way, a.opens)[1:]  # the first open parses in both ways
    med = {way: statistics.median(t) for way, t in got.items()}
    for way, t in got.items():
        print(f"{way:9s} CPU per open after the first: median {med[way] * 1e3:7.1f} ms  "
              f"(min {min(t) * 1e3:.1f}, max {max(t) * 1e3:.1f}, {len(t)} opens)")
    print(f"ratio per-open / shared: {med['per-open'] / med['shared']:.1f}x")


if __name__ == "__main__":
    main()
