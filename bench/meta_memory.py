"""Peak host memory (max RSS) of reading a few samples' meta, of `evaluate` and of `store verify`, the code of an
earlier commit (--old) against this tree's, each in a fresh process, over a store of N samples that
bench/scale_store.py built (its `evaluate` needs bench/scale_ops.py's `train` op run first: its LoRA).

    python bench/meta_memory.py --samples 100000 [--dir /tmp/scale] [--old REV] [--ops meta,files,evaluate,verify]

  meta      this tree: open the `images` reader, 2 samples' captions by `meta(key)` (every meta column parsed
            and kept: what evaluate did) vs by `meta_of(keys, ["caption"])` (those rows and that column only)
  files     this tree: the same 2 samples' files (evaluate's pictures) by `files(key)` (the whole `files` column
            parsed and kept) vs by `files_of(keys)` (those rows' cells only)
  evaluate  `pipeline run evaluate` as bench/scale_ops.py runs it (2 loss samples, 1 image), old vs new code,
            each into a report folder of its own (removed first: not up to date)
  verify    `pipeline store verify`, old vs new code
  --one-group: the old code's manifest layout against the new one. A copy of the store (`n<N>-onegroup`, shards
            hard-linked) has every manifest rewritten in one parquet row group, as pyarrow's default wrote them
            before `fmt.ROW_GROUP_ROWS` (checksums.json resealed); `verify` then runs the old code on the copy and
            this tree's on the store, and two more ops compare this tree's reads of the two layouts:
  meta_of   2 samples' captions by `meta_of` (`ManifestView.rows_at`), one group vs row groups
  files_of  their files by `files_of`, one group vs row groups
Measured so (old = 28e4be3, peak RSS MB; `cold start` work since cut the imports to ~85 MB):
  N       meta_of 1 group -> groups   files_of (kept after)            verify old 1 group -> new groups
  100k    183 -> 183                  182 -> 185 (19 -> 5 MB kept)     272 -> 250 (-22)   14.3 -> 10.4 s
  200k    197 -> 206 (noise)          198 -> 204 (13 -> 8 MB kept)     371 -> 316 (-55)   23.8 -> 19.4 s
rows_at already streamed within a row group (`iter_batches`), so meta_of / files_of gain no peak memory here: they
now skip (neither decode nor page in) the groups holding no wanted row. verify decoded each column whole.

2-core machine shared with other jobs, peak RSS in MB (old = e9b6352; imports and the tiny model are ~1060 MB of
evaluate's, `plan` in bench/scale_ops.py):
  N       meta(key) -> meta_of   evaluate old -> new     verify old -> new
  100k    801 ->  766 (-35)      1214 -> 1155 (-59)      860 ->  796 (-64)
  300k    864 ->  778 (-86)      1369 -> 1230 (-139)     1262 -> 1098 (-164)
evaluate's part above the imports at 300k: ~310 -> ~170 MB; new evaluate also hashes the manifests for the version
ids as it reads them (Store.version_id read each whole), verify no longer holds the manifest twice.

Then (old = acdce7b; load 7-13 on the 2 cores, times swing 2x): verify streams the manifest (store/verify_manifest.py:
a column at a time, then groups of <=200k rows of the checked columns), evaluate's pictures by `files_of`:
  N       files(key) -> files_of (kept after)   evaluate old -> new     verify old -> new
  100k    744 ->  761 (+17, noise)               1167 -> 1184 (+17)      790 ->  795 (+4)     30 -> 14 s
  300k    784 ->  750 (39 -> 19 MB kept)         1253 -> 1218 (-35)      1102 ->  888 (-215)  93 -> 79 s
verify's part above the ~690 MB of imports (`gc`): ~100 MB either way at 100k (the manifest is small next to a
column's decode scratch), ~410 -> ~200 MB at 300k; it grew with the whole manifest (2572 MB at 1M, bench/scale_ops.py)
and now with the largest column plus two groups. The `files` column is ~28 MB at 300k, ~95 MB at 1M.
"""

from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))  # this checkout's store/ (one_group_copy)

from old_vs_new import old_tree  # noqa: E402
from scale_ops import PY, commands, timed  # noqa: E402

META = """
import sys
from store import Store
r = Store(sys.argv[1], create=False).reader("images")
keys = [r.column("key")[i].as_py() for i in (len(r) // 3, 2 * len(r) // 3)]
got = {k: r.meta(k)["caption"] for k in keys} if sys.argv[2] == "meta" else r.meta_of(keys, ["caption"])
print(got)
"""

# what matters is what stays held while evaluate's model runs: the resident memory the call leaves ("kept")
FILES = """
import sys
from store import Store
from store.arrow_columns import release_memory
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
r = Store(sys.argv[1], create=False).reader("images")
keys = [r.column("key")[i].as_py() for i in (len(r) // 3, 2 * len(r) // 3)]
release_memory()
before = resident()
got = {k: r.files(k) for k in keys} if sys.argv[2] == "files" else r.files_of(keys)
release_memory()
print({k: sorted(v) for k, v in got.items()})
print(f"kept {resident() - before:.0f} MB")
"""


def one_group_copy(store: Path) -> Path:
    """`store` as the old code wrote it: every manifest in one row group (pyarrow's default up to 1M rows), the
    rest hard-linked; made once (`<store>-onegroup`)."""
    import pyarrow.parquet as pq

    from store import format as fmt
    from store.checksum import crc_hex, seal, unseal

    out = store.with_name(store.name + "-onegroup")
    if out.is_dir():
        return out
    tmp = store.with_name(store.name + "-onegroup.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run(["cp", "-al", str(store), str(tmp)], check=True)
    for manifest in sorted(tmp.glob(f"*/v*/{fmt.MANIFEST}")):
        table = pq.read_table(manifest)
        manifest.unlink()  # a hard link: the store's own file stays
        buf = io.BytesIO()
        pq.write_table(table, buf)  # the old `fmt.parquet_bytes`
        data = buf.getvalue()
        manifest.write_bytes(data)
        sums = manifest.parent / fmt.CHECKSUMS
        record = unseal(sums.read_bytes())
        record["files"][fmt.MANIFEST] = {**record["files"][fmt.MANIFEST], "crc32c": crc_hex(data), "nbytes": len(data)}
        sums.unlink()
        sums.write_bytes(seal(record))
        print(f"{manifest.relative_to(tmp)}: {pq.ParquetFile(manifest).metadata.num_row_groups} row group(s), "
              f"{pq.ParquetFile(store / manifest.relative_to(tmp)).metadata.num_row_groups} in {store.name}",
              flush=True)
    tmp.rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/scale"))
    ap.add_argument("--old", default="HEAD~1", help="the commit whose code is 'old'")
    ap.add_argument("--ops", default="meta,files,evaluate,verify")
    ap.add_argument("--one-group", action="store_true", help="old code / reads on a one-row-group copy of the store")
    args = ap.parse_args()
    store, seed, run = args.dir / f"n{args.samples}", args.dir / "seed", args.dir / f"run-n{args.samples}"
    log = args.dir / f"meta-memory-n{args.samples}.log"
    rows = []
    grouped = one_group_copy(store) if args.one_group else store  # what the old code reads
    with tempfile.TemporaryDirectory() as tmp:
        old = old_tree(args.old, Path(tmp))
        for op in args.ops.split(","):
            if op in ("meta_of", "files_of"):
                code = META if op == "meta_of" else FILES
                runs = [("one group", [PY, "-c", code, str(grouped), op], ROOT),
                        ("row groups", [PY, "-c", code, str(store), op], ROOT)]
            elif op == "verify" and args.one_group:
                runs = [(f"old {args.old} 1 group", commands(grouped, seed, run, run)[op], old),
                        ("new row groups", commands(store, seed, run, run)[op], ROOT)]
            elif op == "meta":
                runs = [("meta(key)", [PY, "-c", META, str(store), "meta"], ROOT),
                        ("meta_of", [PY, "-c", META, str(store), "meta_of"], ROOT)]
            elif op == "files":
                runs = [("files(key)", [PY, "-c", FILES, str(store), "files"], ROOT),
                        ("files_of", [PY, "-c", FILES, str(store), "files_of"], ROOT)]
            else:
                runs = []
                for label, code in ((f"old {args.old}", old), ("new", ROOT)):
                    report = args.dir / f"meta-memory-report-{len(runs)}"
                    shutil.rmtree(report, ignore_errors=True)
                    runs.append((label, commands(store, seed, run, report)[op], code))
            for label, cmd, code in runs:
                secs, mb, rc = timed(cmd, log, code)
                rows.append((op, label, secs, mb))
                kept = [ln for ln in log.read_text().splitlines() if ln.startswith("kept ")][-1:] \
                    if op.startswith("files") else []
                print(f"N={args.samples:,} {op:9s} {label:22s} {secs:7.1f} s {mb:7.0f} MB"
                      + (f" ({kept[0]} after the call)" if kept else "")
                      + (f"  exit {rc} (see {log})" if rc else ""), flush=True)
            first, second = rows[-2][3], rows[-1][3]
            print(f"N={args.samples:,} {op:9s} peak RSS new / old: {second / first:.2f} ({second - first:+.0f} MB)",
                  flush=True)


if __name__ == "__main__":
    main()
