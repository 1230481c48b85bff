"""Bytes `store push` uploads for a store with several superseded versions (a table re-encoded --versions times,
each version a newer current one replaced), against a local S3-protocol server (moto in a child process), in one
run: the rule before (every complete version but those switched away from: here all of them) vs now (what the
store's gc keeps: store/gc.py `keep_rule`, `not_kept`). Each push into a fresh prefix; then a pull of the pushed
prefix and a read of every sample of the current version, to show the copy has what it needs.

    python bench/store_push_superseded.py --versions 4 --samples 64 --kb 256
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "store")]

from _common import s3_bucket  # noqa: E402  (a local S3 server)


def build(root: Path, versions: int, samples: int, kb: float) -> None:
    import torch

    from store import Store
    from store_samples import key_of, vae_schema

    store = Store(root)
    side = max(1, int((kb * 1024 / 2 / 4) ** 0.5))  # bf16, 4 channels: ~kb KiB per sample
    for v in range(versions):
        w = store.writer("vae", vae_schema(f"v{v}"), shard_size_mb=8)
        g = torch.Generator().manual_seed(v)
        for i in range(samples):
            w.add(key_of(i), tensors={"target": torch.randn(4, 1, side, side, generator=g).bfloat16()},
                  meta={"split": "train", "img_shapes": [[1, side // 2, side // 2]]})
        w.commit()


def push_into(src: Path, url: str, old_rule: bool):
    from store import gc
    from store.remote_push import push

    # the rule before: every complete version not switched away from (none is here), so every version
    with mock.patch.object(gc, "not_kept", lambda *a, **k: (set(), [])) if old_rule else contextlib.nullcontext():
        t = time.perf_counter()
        summary = push(src, url)
        return summary, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--versions", type=int, default=4)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--kb", type=float, default=256)
    args = ap.parse_args()
    with s3_bucket("bench-push"):
        from store import Store
        from store.remote_pull import pull

        with tempfile.TemporaryDirectory(prefix="bench-push-") as tmp:
            src = Path(tmp) / "store"
            build(src, args.versions, args.samples, args.kb)
            size = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
            print(f"store: {args.versions} versions of vae ({args.versions - 1} superseded), {args.samples} samples "
                  f"each, {size / 2**20:.1f} MiB on disk")
            for name, old in (("before", True), ("now", False)):
                url = f"s3://bench-push/{name}"
                summary, secs = push_into(src, url, old)
                copy = Path(tmp) / f"pulled-{name}"
                pull(url, copy)
                reader = Store(copy, create=False).reader("vae")
                read = sum(1 for k in reader.keys() if reader.get(k)["tensors"]["target"].numel())
                print(f"{name:7s} uploaded {summary.bytes_sent / 2**20:7.2f} MiB in {summary.objects_sent:4d} "
                      f"objects, {secs:5.2f} s; copied {', '.join(summary.copied)}; pulled copy reads v"
                      f"{reader.version}: {read}/{args.samples} samples")


if __name__ == "__main__":
    main()
