"""A manifest's rows shard by shard at scale, the old way and the new in the same run, where a pass did one take or
filter per shard over the whole manifest (O(shards x rows)); the manifest as read is also chunked (one chunk per
parquet row group, and pyarrow splits a row group into chunks of at most 128k rows: a 1M-row manifest read whole is
8+ chunks), and a take from a chunked table joins each column's chunks first, every time:
  verify  `store verify` (and `store verify URL`): store/verify_manifest.py `read_manifest_pass` + `shard_rows`,
          each shard's rows turned into Python before its bytes are checked
          old: the former `shard_rows` (`manifest.take(indices)` of the shard's rows, kept below) of the first
          --old-shards shards, the pass extrapolated from their mean; new: every shard's `shard_rows` (a zero-copy
          slice each) + the one take in shard order `_manifest_problems` now makes
  repair  `store repair` linking each intact shard of a damaged version into the repaired one (store/repair.py
          `_carry`): old `manifest.filter(pc.equal(shard, name))` per shard (kept below, of the first --old-shards shards,
          extrapolated); new `store.manifest.rows_by_shard` once, every shard's rows then looked up
Writes a vae-like manifest of each --samples size (locating and checksum columns, two tensors per sample,
img_shapes; --per-shard rows a shard) through fmt.parquet_bytes into --dir (reused on reruns), reads it as verify
and repair do, checks old and new give the same rows for the shards both turned, and prints per size and pass:
row groups (from the footer), chunks as read, shards, the old time a shard and for the pass, the new pass,
old / new. 2-core shared dev machine, 100 rows a shard, manifests then written in one row group (pyarrow's default
up to 1M rows, before `fmt.ROW_GROUP_ROWS`; the "8 row groups" once printed here were the 8 chunks of the read):
  100k rows (1 row group, 1 chunk), 1,000 shards: verify 2.4 s either way (1.0x); repair old 0.9 s, new 0.19 s (4.4x)
  1M rows (1 row group, 8 chunks), 10,000 shards: verify old 84.9 ms a shard, ~14 min for the pass (extrapolated
  from 100 shards), new 19.6 s (43x); repair old 6.6 ms a shard, ~66 s, new 2.5 s (27x)
Manifests are now written in row groups of `fmt.ROW_GROUP_ROWS` (64k) rows: 2 at 100k rows, 16 at 1M (not
re-measured here; a rebuilt --dir is needed, the manifests there are reused).
At ~30k shards (a 1M-sample text table) the old verify pass was ~40 min, on every table of every `store verify`.

    python bench/rows_by_shard.py --samples 100000 1000000
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's store/, not an installed one

from commit_indexes import index_rows  # noqa: E402  (bench/: the same synthetic manifest rows)
from store import format as fmt  # noqa: E402
from store import verify  # noqa: E402
from store.manifest import rows_by_shard  # noqa: E402
from store.manifest_files import read_manifest  # noqa: E402
from store.verify_manifest import checked_columns, read_manifest_pass  # noqa: E402


def old_parts(manifest: pa.Table) -> list[tuple[str, pa.Array]]:
    """(shard, its rows' indices) as `_manifest_problems` grouped them before (store/verify.py at 5cc143b)."""
    order = pc.sort_indices(manifest.column("shard"))
    shards = manifest.column("shard").take(order).to_pylist()
    out, start = [], 0
    for i in range(1, len(shards) + 1):
        if i == len(shards) or shards[i] != shards[start]:
            out.append((str(shards[start]), order[start:i]))
            start = i
    return out


def old_shard_rows(manifest: pa.Table, indices: pa.Array, name: str) -> tuple[list[dict], list[str]]:
    """`shard_rows` before (store/verify.py at 5cc143b), verbatim but for the part's fields passed in."""
    try:
        rows = manifest.take(indices).to_pylist()
    except Exception as e:  # noqa: BLE001
        return [], [f"{name}/{fmt.MANIFEST}: undecodable ({type(e).__name__}: {e})"]
    problems: list[str] = []
    for r in rows:
        try:
            problems += verify._check_columns(r, 2, name)
        except Exception as e:  # noqa: BLE001
            problems.append(f"{name}: key {r.get('key')!r}: columns cannot be checked ({type(e).__name__}: {e})")
    return rows, problems


def build(root: Path, n: int, per_shard: int) -> Path:
    """A version folder holding schema.json and manifest.parquet (no shards: their bytes are not checked here)."""
    vdir = root / f"n{n}" / "vae" / "v1"
    if (vdir / fmt.MANIFEST).is_file():
        return vdir
    manifest = index_rows(n, per_shard).sort_by("key")
    vdir.mkdir(parents=True, exist_ok=True)
    lineage = {"stage": "encode-vae", "config_hash": "bench", "model_fingerprint": "", "upstream": {},
               "code_version": "bench"}
    (vdir / fmt.SCHEMA_JSON).write_text(json.dumps({"table": "vae", "schema_version": 2, "fields": [],
                                                    "lineage": lineage, "attrs": {}}))
    fmt.atomic_write_bytes(vdir / fmt.MANIFEST, fmt.parquet_bytes(manifest))
    return vdir


def measure(vdir: Path, old_shards: int) -> dict:
    manifest = read_manifest(vdir, (vdir / fmt.MANIFEST).read_bytes())
    parts = old_parts(manifest)
    n_old = min(old_shards, len(parts))
    common = {"rows": manifest.num_rows, "row_groups": pq.ParquetFile(vdir / fmt.MANIFEST).metadata.num_row_groups,
              "chunks": manifest.column("key").num_chunks, "shards": len(parts),
              "old_extrapolated": n_old < len(parts)}
    t0 = time.perf_counter()
    old_rows = [old_shard_rows(manifest, idx, "vae/v1")[0] for _, idx in parts[:n_old]]
    t_old = (time.perf_counter() - t0) / n_old
    t0 = time.perf_counter()
    manifest.take(pc.sort_indices(manifest.column("shard")))  # what `_manifest_problems` adds: one take in order
    t_order = time.perf_counter() - t0
    _, by_shard = read_manifest_pass(vdir, "vae/v1", None)
    t0 = time.perf_counter()
    new_rows = [verify.shard_rows(by_shard[shard], "vae/v1")[0] for shard in by_shard]
    t_new = time.perf_counter() - t0 + t_order
    checked = set(checked_columns(manifest.column_names))  # the columns verify's checks read (only those now)
    assert new_rows[:n_old] == [[{c: v for c, v in r.items() if c in checked} for r in rows] for rows in old_rows], \
        "verify: old and new shard rows differ"
    out = {"verify": {**common, "old_ms_a_shard": round(1e3 * t_old, 2), "old_s": round(t_old * len(parts), 1),
                      "new_s": round(t_new, 2), "old_over_new": round(t_old * len(parts) / t_new, 1)}}
    names = [name for name, _ in parts]
    t0 = time.perf_counter()
    old_rows = [manifest.filter(pc.equal(manifest.column("shard"), name)) for name in names[:n_old]]
    t_old = (time.perf_counter() - t0) / n_old
    t0 = time.perf_counter()
    grouped = rows_by_shard(manifest)
    new_rows = [grouped.get(name) for name in names]
    t_new = time.perf_counter() - t0
    assert all(a.equals(b) for a, b in zip(old_rows, new_rows)), "repair: old and new shard rows differ"
    out["repair"] = {**common, "old_ms_a_shard": round(1e3 * t_old, 2), "old_s": round(t_old * len(parts), 1),
                     "new_s": round(t_new, 2), "old_over_new": round(t_old * len(parts) / t_new, 1)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--per-shard", type=int, default=100)
    ap.add_argument("--old-shards", type=int, default=100, help="shards the old way turns at most (then extrapolated)")
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm/verify-shard-rows"))
    a = ap.parse_args()
    for n in a.samples:
        t0 = time.perf_counter()
        vdir = build(a.dir, n, a.per_shard)
        print(f"built/found {n} rows in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        for name, figures in measure(vdir, a.old_shards).items():
            print(name, json.dumps(figures))


if __name__ == "__main__":
    main()
