"""A real store of N samples with tiny features, written through the store writer (`TableWriter`), for timing
the non-GPU paths at dataset scale (bench/scale_ops.py).

A seed store made by the real stages on a tiny model (`pipeline run resize-bucket / encode-text / encode-vae` over
`make-demo-data --n 16`: mixed buckets, 0..2 controls) gives each table's schema and 16 template samples (tensors,
files, meta). The scaled store has `images`, `text` and `vae` v1 of N samples each: sample i is template i % 16
under its own key (32 hex, as resize-bucket's content keys), with its own caption and source, 5% of them val.
Its `text` / `vae` schemas are the seed's with the lineage pointing at the scaled `images` (its version id in
config_hash), so a rerun of the encode stages with the seed's config finds them up to date, as after a real run.

    python bench/scale_store.py --samples 100000 --dir /tmp/scale   # -> /tmp/scale/n100000 (reused when there)

~6 KB per sample per table on disk (1M samples: ~20 GB); --shard-mb 1 gives ~10k shards per table at 1M (a
real 256 MB-shard store of 1M samples has ~20-30k). Writing runs at ~1-2k samples/s per table on a shared core.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from schemas.table import TableSchema  # noqa: E402
from store import Store  # noqa: E402
from store import format as fmt  # noqa: E402

TABLES = ("images", "text", "vae")


def _cli(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([sys.executable, "-m", "pipeline.cli", *args], check=True, env=env, cwd=ROOT,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def seed(base: Path) -> Path:
    """The seed folder (model, data, config.yaml, store): made once by the real stages."""
    s = base / "seed"
    if (s / "store" / "vae" / "v1" / fmt.MANIFEST).is_file():
        return s
    shutil.rmtree(s, ignore_errors=True)
    s.mkdir(parents=True)
    _cli("make-tiny-model", str(s / "model"), "--variant", "edit-plus")
    _cli("make-demo-data", str(s / "data"), "--n", "16", "--max-controls", "2")
    cfg = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    cfg["paths"] = {k: str(s / k) for k in ("store", "model", "run", "report")} | {"source": str(s / "data")}
    (s / "config.yaml").write_text(yaml.safe_dump(cfg))
    for stage in ("resize-bucket", "encode-text", "encode-vae"):
        _cli("run", stage, "--config", str(s / "config.yaml"))
    return s


def key_of(i: int) -> str:
    return hashlib.sha256(f"scale-{i}".encode()).hexdigest()[:32]


def _templates(seed_store: Path) -> dict[str, list[dict]]:
    st = Store(seed_store, create=False)
    out = {}
    for t in TABLES:
        r = st.reader(t)
        out[t] = [{"tensors": r.tensors(k), "files": r.files(k), "meta": r.meta(k)} for k in sorted(r.keys())]
        r.close()
    return out


def build(base: Path, n: int, shard_mb: float = 1.0) -> Path:
    """The scaled store `base/n<N>` (reused when complete). Returns its path."""
    root = base / f"n{n}"
    if (root / "vae" / "v1" / fmt.MANIFEST).is_file():
        return root
    shutil.rmtree(root, ignore_errors=True)
    s = seed(base)
    tpl = _templates(s / "store")
    seed_st = Store(s / "store", create=False)
    seed_images_id = seed_st.version_id("images", 1)
    st = Store(root)
    images_id = None
    for t in TABLES:
        d = json.loads((s / "store" / t / "v1" / fmt.SCHEMA_JSON).read_text())
        if images_id is not None:  # the lineage of the scaled images, as the encode stage would write it
            d["lineage"]["config_hash"] = d["lineage"]["config_hash"].replace(seed_images_id, images_id)
        w = st.writer(t, TableSchema.from_dict(d), shard_size_mb=shard_mb)
        w.given = n
        t0 = time.perf_counter()
        for i in range(n):
            x = tpl[t][i % len(tpl[t])]
            meta = dict(x["meta"], split="val" if i % 20 == 0 else "train")
            if t == "images":
                meta.update(caption=f"{meta['caption']} #{i}", source=f"/data/target/sample_{i:07d}.png")
            w.add(key_of(i), tensors=x["tensors"], files=x["files"], meta=meta)
        t1 = time.perf_counter()
        w.commit()
        print(f"  {t}: {n} samples in {time.perf_counter() - t0:.0f} s (commit {time.perf_counter() - t1:.1f} s)",
              file=sys.stderr)
        if t == "images":
            images_id = st.version_id("images", 1)
    return root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/scale"))
    ap.add_argument("--shard-mb", type=float, default=1.0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    print(build(args.dir, args.samples, args.shard_mb), f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
