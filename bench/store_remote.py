"""Push / pull throughput of `pipeline store push|pull` against a local S3-protocol server, vs a local copy.

Builds a store of realistic tensors (bench/store_read.py's builder: prompt embeds + latents, bf16), starts moto's
S3 server on 127.0.0.1 (the test extra) in a subprocess, and measures in the same run, best of --repeats:
  copy   shutil.copytree of the store folder (read + write on this disk: the baseline)
  push   store.remote_sync.push into an empty prefix (local CRC check of every file, then upload)
  pull   store.remote_sync.pull into an empty folder (download, every file's CRC32C checked, rename)
Prints MB/s and the ratio to the copy. The server is Python (moto keeps objects in memory) on the same cores, so the
figures bound the client's own overhead on this machine; a real S3 endpoint is limited by the network instead.

    python bench/store_remote.py --gb 0.5 --repeats 3
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=0.5)
    ap.add_argument("--shard-mb", type=float, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from store.remote_sync import pull, push

    work = Path(tempfile.mkdtemp(prefix="store-remote-bench-"))
    server, _ = start_s3()
    try:
        src = work / "store"
        build(src, args.gb, args.shard_mb, args.seed)
        nbytes = store_bytes(src)
        best = {"copy": float("inf"), "push": float("inf"), "pull": float("inf")}
        for i in range(args.repeats):  # interleaved: a busy machine slows all three alike
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
        print(f"store: {mb:.0f} MB in {len(list(src.rglob('*.tar')))} shards; best of {args.repeats}")
        for name, secs in best.items():
            print(f"{name:5s} {mb / secs:8.1f} MB/s  ({secs:.2f} s, {best['copy'] / secs:.2f}x copy)")
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
