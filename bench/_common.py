"""What benches share: the key-lookup benches' (encode_input_rows.py, encode_refused_controls.py) flags and
synthetic keys; the S3 benches' (store_push_superseded.py, store_transfer_memory.py) local server. Not a bench
itself; the benches run as `python bench/X.py`, so this folder is on sys.path."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_S3_SERVER = ("import sys, time; sys.path.insert(0, 'tests'); from s3_server import start_server; "
              "s, e = start_server(); print(e, flush=True); time.sleep(3600)")


def samples_and_repeat() -> argparse.Namespace:
    """--samples (how many keys) and --repeat (best of how many runs)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    return ap.parse_args()


def synthetic_keys(samples: int) -> tuple[list[str], list[str]]:
    """`samples` sorted 64-hex-digit keys (content hashes, as the `images` table's) and the same keys in a shuffled
    order (seed 0: the order a rank asks them in)."""
    keys = sorted(hashlib.sha256(str(i).encode()).hexdigest() for i in range(samples))
    asked = keys[:]
    random.Random(0).shuffle(asked)
    return keys, asked


@contextlib.contextmanager
def s3_bucket(bucket: str):
    """A local S3-protocol server (tests/s3_server.py's moto, in a child process: its copies of the objects are
    not this process's memory) holding an empty `bucket`, the AWS_* variables set to reach it; yields its URL."""
    server = subprocess.Popen([sys.executable, "-c", _S3_SERVER], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        endpoint = server.stdout.readline().strip()
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                          AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=endpoint)
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        server.kill()
