"""encode-vae's search for the stored rows of samples whose mask alone changed (stages/encode/mask_only.py),
run after the search for carriable rows (stages/encode/output.py `_carried_forward`) on every rerun that finds an
edited mask. Before, `recompute_masks` ran `store.reuse.reusable` again over every key not carried whole (the
edited masks' and brand-new samples', whose keys no version holds, so every version's manifest was read again);
now it takes the rows the first search found.

A synthetic store (tests/store/store_samples.py's tiny vae samples) of --samples keys over --versions complete
versions of one feature lineage (disjoint shares), built once into --dir; the rerun asks for them all plus
--new brand-new keys, of which --edited stored ones are left over (their mask changed). Old (a second `reusable`)
and new (the first search's rows filtered) interleaved in one process, best of --repeat: seconds of the mask
step alone, and the manifests read over both searches (`reuse._wanted_rows` finding a version of the lineage).

    PYTHONPATH=. python bench/mask_only_rows.py [--samples 100000 --versions 4 --new 10000 --edited 1000]

2-core shared machine, defaults (100k stored keys over 4 versions, 10k new, 1k edited masks), best of 3:
  old 0.162 s, 8 manifest reads over both searches   new 0.0085 s, 4 manifest reads (the same 1,000 rows)
(old: every version of the lineage read again while a key asked is in none, as a brand-new sample is)
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "store")]

import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402

from store import Store  # noqa: E402
from store import reuse  # noqa: E402

LINEAGE = "feat-bench-mask-only"


def build(root: Path, samples: int, versions: int) -> Store:
    """The store, written once (reused when complete)."""
    from store_samples import sample, vae_schema

    store = Store(root, create=True)
    have = len(store.versions("vae"))  # a build cut short: remove --dir's folder
    per = samples // versions
    for v in range(have, versions):
        s = vae_schema(f"v{v}")
        w = store.writer("vae", replace(s, attrs={**s.attrs, reuse.FEATURE_LINEAGE_ATTR: LINEAGE}), shard_size_mb=4)
        for i in range(v * per, (v + 1) * per):
            one = sample(i)
            w.add(one["key"], tensors=one["tensors"], files=one["files"], meta=one["meta"])
        w.commit()
    return store


def counted(real, reads: list[int]):
    """`reuse._wanted_rows` noting each version of the lineage whose manifest rows it read."""
    def wanted_rows(*a):
        found = real(*a)
        reads.append(found is not None)
        return found
    return wanted_rows


def old_step(store: Store, left: list[str], found: dict) -> dict[int, pa.Table]:
    return reuse.reusable(store, "vae", (LINEAGE,), left)


def new_step(store: Store, left: list[str], found: dict) -> dict[int, pa.Table]:
    wanted = pa.array(sorted(left), pa.string())
    return {v: rows.filter(pc.is_in(rows.column("key"), value_set=wanted)) for v, rows in found.items()}


def main() -> None:
    from store_samples import key_of

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--versions", type=int, default=4)
    ap.add_argument("--new", type=int, default=10_000)
    ap.add_argument("--edited", type=int, default=1_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/mask_only_rows"))
    args = ap.parse_args()
    root = args.dir / f"n{args.samples}-v{args.versions}"
    t0 = time.perf_counter()
    store = build(root, args.samples, args.versions)
    print(f"store {root} ready in {time.perf_counter() - t0:.0f} s", flush=True)
    stored = [key_of(i) for i in range(args.samples // args.versions * args.versions)]
    new = [f"new-{i:08d}" for i in range(args.new)]
    edited = stored[:: max(1, len(stored) // args.edited)][: args.edited]
    left = edited + new  # not carried whole: what the mask step is asked of
    best: dict[str, tuple[float, int, int]] = {}
    real = reuse._wanted_rows
    for _ in range(args.repeat):
        for name, step in (("old", old_step), ("new", new_step)):
            reads: list[int] = []
            reuse._wanted_rows = counted(real, reads)
            try:
                found = reuse.reusable(store, "vae", (LINEAGE,), stored + new)  # the carry search (both)
                t = time.perf_counter()
                rows = step(store, left, found)
                seconds = time.perf_counter() - t
            finally:
                reuse._wanted_rows = real
            n = sum(r.num_rows for r in rows.values())
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, sum(reads), n)
    (os_, or_, on), (ns, nr, nn) = best["old"], best["new"]
    if on != nn:
        raise SystemExit(f"old and new found different rows ({on} vs {nn})")
    print(f"{len(stored):,} stored keys over {args.versions} versions, {args.new:,} new, {len(edited):,} edited masks "
          f"({nn:,} rows found): mask step old {os_:.3f} s ({or_} manifest reads over both searches)   "
          f"new {ns:.4f} s ({nr} manifest reads)", flush=True)


if __name__ == "__main__":
    main()
