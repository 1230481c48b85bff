"""What the key-lookup benches (encode_input_rows.py, encode_refused_controls.py) share: their flags and their
synthetic keys. Not a bench itself; the benches run as `python bench/X.py`, so this folder is on sys.path."""

from __future__ import annotations

import argparse
import hashlib
import random


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
