"""Which stored samples a fix changes (schemas/fixes.py), after a code upgrade past one: an encode rerun's reuse
(store/reuse.py `reusable` over each rank's stored rows), encode's "does the fix change any sample of the old
version?" scan (stages/encode/plan.py `_unchanged_by_fixes`) and resize-bucket's over `images`
(stages/resize/earlier_versions.py `_unchanged_by_fixes`, `reusable_renders`; stages/resize/carried.py `carry_samples`).

Builds a synthetic `images` version of --samples rows (bench/encode_carry.py's, resize-bucket's meta columns, in
--dir, reused on reruns) whose `conversions` notes mix an RGBA picture (2%), a turned mask (1%), a mask resized
across an EXIF-turned target (1%) and none, and stored vae-like rows for every sample (two tensors each; 0.1% of
keys the images lack). Measures each path in a fresh process (time, peak RSS growth over the process before the
step), old and new in the same run, after checking both keep the same rows:
  reuse   vae's fixes (own and the images') over the stored rows: old `rows.to_pylist()` and the rule per row
          with each row's whole `images` meta (kept below verbatim), new `changed_rows` (store/row_rule.py: the
          rule once per distinct value of the columns it reads)
  scan    encode's scan of an old version no fix changes (`key`, `length` of the samples without an RGBA picture:
          every row walked): old per row (`images.meta`), new `changed_rows`
  resize  resize-bucket's `reusable_renders` (store/reuse.py `reusable_keys` with its mask rule) over the images
          manifest: old every column `to_pylist()`, the rule per row; new the four columns it reads, `MASK_FIX`
Prints the figures and old / new. 2-core shared dev machine (other jobs running; two runs of the old reuse: 79 s
and 101 s), 1M samples, one process holding every row (world size 1):
  reuse   old 101 s, peak +2.8 GB   new 2.6 s, +356 MB (of it: the filtered copy of the rows, as old; 0.75 s the
                                    key lookup `rows_of_keys`)                              39x
  scan    old 35.3 s, +740 MB       new 0.81 s, +112 MB                                     44x
  resize  old 36.3 s, +3.5 GB       new 0.93 s, +96 MB                                      39x
100k samples: reuse 6.9 s -> 0.51 s, scan 4.4 s -> 0.16 s, resize 5.8 s -> 0.05 s. A rank encodes its share
(1/world of the rows): the reuse path scales with it; the scan and resize's read the whole version.

    python bench/fix_rules.py --samples 1000000
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's store/, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))

from encode_carry import with_notes  # noqa: E402
from schemas.fixes import mask_orientation_changes  # noqa: E402
from stages.encode.plan import changed_rows  # noqa: E402
from stages.encode.vae import FIXES  # noqa: E402
from stages.resize.images_table import MASK_FIX  # noqa: E402
from store import Store  # noqa: E402
from store.manifest import TENSOR_STRUCT  # noqa: E402

NOTES = [[], ["kept with its alpha (RGBA)"], ["mask turned as its target (EXIF 6)"],
         ["EXIF orientation 6 applied", "mask resized to its target"]]
NOTES_P = [0.96, 0.02, 0.01, 0.01]


def mixed(root: Path, n: int) -> None:
    """bench/encode_carry.py's images version, its `conversions` notes mixed (once)."""
    with_notes(root, n, NOTES, NOTES_P, 2, "mixed")


def stored_rows(images) -> pa.Table:
    """A vae-like stored row per sample (two tensors each), 0.1% under keys the images lack, in another order."""
    m = images.manifest
    n = m.num_rows
    rng = np.random.default_rng(3)
    keys = pc.if_else(pa.array(rng.random(n) < 0.001), "gone", m.column("key"))
    # built in Arrow (no Python objects): the process's peak before the step stays that of the tables
    shape = pa.ListArray.from_arrays(pa.array(np.arange(0, 8 * n + 1, 4, dtype=np.int32)),
                                     pa.array(np.tile(np.array([16, 1, 64, 64]), 2 * n)))
    tensor = pa.StructArray.from_arrays(
        [pa.array(np.tile(np.array(["target", "control_0"]), n)), pa.array(np.full(2 * n, 1024)),
         pa.array(np.full(2 * n, 1 << 20)), pa.array(np.full(2 * n, "bfloat16")), shape],
        fields=list(TENSOR_STRUCT))
    tensors = pa.ListArray.from_arrays(pa.array(np.arange(0, 2 * n + 1, 2, dtype=np.int32)), tensor)
    rows = m.select(["shard", "shard_sha256", "shard_nbytes", "sample_offset", "sample_nbytes", "sample_sha256",
                     "files", "shard_crc32c", "sample_crc32c", "split", "img_shapes", "num_controls", "has_mask",
                     "mask_sha256"])
    rows = rows.add_column(0, "key", keys).append_column("tensors", tensors)
    rows = rows.append_column("length", pa.array(rng.integers(10, 2000, n)))
    return rows.take(pa.array(rng.permutation(n)))


def old_changed_by(images, fixes, own: bool, images_fix: bool):
    """stages/encode/plan.py `_lineages_before_fixes.changed_by` before store/row_rule.py, verbatim (but the
    images' rules, a list per images revision since: every one here)."""
    def changed(row):
        if row["key"] not in images:
            return True
        meta = images.meta(row["key"])
        return (own and any(rule(meta, row) for _, rule in fixes.own)) or \
            (images_fix and any(rule(meta, row) for _, rule in fixes.by_images))
    return changed


def old_unchanged(rows: pa.Table, changed) -> pa.Table:
    """store/reuse.py `_unchanged` before store/row_rule.py, verbatim."""
    return rows.filter(pa.array([not changed(r) for r in rows.to_pylist()], pa.bool_()))


def step(how: str, images, rows: pa.Table, manifest: pa.Table):
    """One path, old or new: what it keeps (a table) or answers."""
    path, old = how.split(":")[0], how.endswith(":old")
    if path == "reuse":
        if old:
            return old_unchanged(rows, old_changed_by(images, FIXES, True, True))
        return rows.filter(pa.array(~changed_rows(images, FIXES, rows, 1, 1)))
    if path == "scan":
        if old:  # stages/encode/plan.py `_unchanged_by_fixes.none_changed` before, verbatim but its read
            scanned = rows.to_pylist()
            return not any(r["key"] not in images or any(rule(images.meta(r["key"]), r) for _, rule in FIXES.own)
                           for r in scanned)
        return not changed_rows(images, FIXES, rows, own_since=1, images_since=None).any()
    if old:  # store/reuse.py `reusable_keys` before: every column read, the rule per row
        return old_unchanged(manifest, mask_orientation_changes)
    read = manifest.select(["key", "mask_sha256", *MASK_FIX.columns])  # what `reusable_keys` reads now
    return read.filter(pa.array(~MASK_FIX(read)))


def measure(root: Path, how: str) -> dict:
    images = Store(root, create=False).reader("images")
    rows = stored_rows(images) if how.startswith("reuse") else None
    if how.startswith("scan"):  # a version no fix changes (stays current): the walk goes through every row
        alpha = np.random.default_rng(2).choice(len(NOTES), len(images), p=NOTES_P) == 1  # (as `mixed` drew)
        kept = images.manifest.column("key").filter(pa.array(~alpha))
        rows = pa.table({"key": kept, "length": pa.array(np.random.default_rng(4).integers(10, 2000, len(kept)))})
    manifest = images.manifest if how.startswith("resize") else None
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    got = step(how, images, rows, manifest)
    seconds = time.perf_counter() - t0
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    digest = repr(got) if isinstance(got, bool) else \
        hashlib.sha256("\n".join(got.column("key").to_pylist()).encode()).hexdigest()[:16] + f" {got.num_rows}"
    return {"s": seconds, "peak_mb": peak, "result": digest}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm/fix-rules"))
    ap.add_argument("--paths", default="reuse,scan,resize")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    root = a.dir / f"n{a.samples}"
    if a.one:
        print(json.dumps(measure(root, a.one)))
        return
    t0 = time.perf_counter()
    mixed(root, a.samples)
    print(f"built/found {a.samples} images rows in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    def run(how: str) -> dict:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--one", how]
        return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)

    out: dict = {"samples": a.samples}
    for path in a.paths.split(","):
        old, new = run(f"{path}:old"), run(f"{path}:new")
        assert old["result"] == new["result"], f"{path}: old and new disagree ({old['result']} / {new['result']})"
        out[path] = {"kept": old["result"], "old_s": round(old["s"], 2), "new_s": round(new["s"], 3),
                     "old_peak_mb": round(old["peak_mb"]), "new_peak_mb": round(new["peak_mb"]),
                     "s_old_over_new": round(old["s"] / new["s"], 1),
                     "peak_old_over_new": round(old["peak_mb"] / max(new["peak_mb"], 1), 1)}
        print(json.dumps({path: out[path]}), file=sys.stderr)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
