"""Wall time and peak memory of the non-GPU paths over stores of N samples (bench/scale_store.py builds them):
each operation in a fresh process under /usr/bin/time (%e s, %M max RSS), as a user runs it.

    python bench/scale_ops.py --samples 100000 300000 [--dir /tmp/scale] [--ops inspect,verify,...]

Operations (the store's current `images`, `text`, `vae` v1; the seed's config from bench/scale_store.py, its tiny
model on the CPU):
  open          a reader of each table, its length and one key lookup (Python, no CLI)
  inspect       `pipeline store inspect`            inspect_json  the same with --json
  verify        `pipeline store verify`             gc            `pipeline store gc` (nothing to remove)
  encode_text   `pipeline run encode-text` rerun: up to date (lineage, left-out check), nothing written
  encode_vae    the same for encode-vae
  train         `pipeline run train`, token budget, 2 steps, a checkpoint at step 2 (epoch plan, join, lengths)
  train_resume  the same run to 4 steps: resumes at step 2 (data position restored)
  evaluate      `pipeline run evaluate` of that LoRA: held-out loss on 2 samples, 1 image (val selection)
  plan          `pipeline plan` (reads no store: a constant)
  relabel       (--ops only; changes the store) images v2 with relabelled splits, carried forward from v1
  encode_text_carry, encode_vae_carry   the encode reruns after it: every sample carried forward (hard links)
Prints one line per operation and N, and the growth from the smallest N to the largest (time ratio / size ratio:
1.0 = linear; most commands are ~5-8 s of imports and model loading, so their growth reads low).

2-core machine shared with other jobs (load 1-4; the figures swing by 2x), stores on ext4 (1M: 16 GB, 23 GB RAM),
after the verify and inspect fixes:
  operation      N=100k            N=300k            N=1M
  open            4.4 s  746 MB     2.2 s  777 MB     3.5 s 1029 MB
  inspect         3.6 s  824 MB     2.4 s  895 MB     6.5 s 1029 MB   (before: 33 s at 300k, loaded)
  verify         14.3 s  853 MB    42.1 s 1263 MB   196 s  2572 MB   (before: 62 s at 100k, loaded)
  gc              2.2 s  688 MB     1.8 s  690 MB     1.8 s  690 MB
  encode_text    10.9 s 1117 MB     7.6 s 1101 MB     7.9 s 1373 MB
  encode_vae      6.2 s  934 MB     6.1 s  921 MB     4.3 s 1173 MB
  train          10.0 s 1179 MB    22.7 s 1177 MB    12.0 s 1526 MB
  train_resume   12.0 s 1183 MB    22.3 s 1198 MB    13.0 s 1541 MB
  evaluate       11.9 s 1203 MB    18.7 s 1355 MB    11.7 s 2126 MB
  plan            8.1 s 1061 MB     9.5 s 1061 MB     7.3 s 1061 MB
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

OPEN = """
import sys
from store import Store
st = Store(sys.argv[1], create=False)
for t in ("images", "text", "vae"):
    r = st.reader(t)
    n = len(r)
    r.row_of(r.column("key")[n // 2].as_py())
"""

# images v2: the splits relabelled (every 7th sample's flipped), its shards carried forward from v1 by hard links
# (store/reuse.carry_forward, as resize-bucket's relabel does); the encode stages then carry every sample forward
RELABEL = """
import sys
from dataclasses import replace
from schemas.table import TableSchema
from store import Store
from store.manifest_files import checked_manifest
from store.reuse import carry_forward
st = Store(sys.argv[1], create=False)
schema = st.reader("images", 1).schema
schema = replace(schema, lineage=replace(schema.lineage, config_hash=schema.lineage.config_hash + "-relabelled"))
rows = checked_manifest(st.version_dir("images", 1))
split = {k: ("val" if s == "train" else "train") if i % 7 == 0 else s
         for i, (k, s) in enumerate(zip(rows.column("key").to_pylist(), rows.column("split").to_pylist()))}
w = st.writer("images", schema)
w.given = rows.num_rows
carry_forward(w, 1, rows, {"split": split})
w.commit()
"""


def commands(store: Path, seed: Path, run: Path, report: Path) -> dict[str, list[str]]:
    cli = [PY, "-m", "pipeline.cli"]
    cfg = ["--config", str(seed / "config.yaml"), "--set", f"paths.store={store}", "--set", f"paths.run={run}",
           "--set", f"paths.report={report}"]
    train = [*cli, "run", "train", *cfg, "--set", "train.max_tokens_per_batch=2048", "--set", "train.checkpoint_every=2",
             "--set", "train.sample_every=null"]
    return {
        "open": [PY, "-c", OPEN, str(store)],
        "inspect": [*cli, "store", "inspect", str(store)],
        "inspect_json": [*cli, "store", "inspect", str(store), "--json"],
        "verify": [*cli, "store", "verify", str(store)],
        "gc": [*cli, "store", "gc", str(store)],
        "encode_text": [*cli, "run", "encode-text", *cfg],
        "encode_vae": [*cli, "run", "encode-vae", *cfg],
        "train": [*train, "--set", "train.max_steps=2"],
        "train_resume": [*train, "--set", "train.max_steps=4", "--resume"],
        "evaluate": [*cli, "run", "evaluate", *cfg, "--set", "evaluate.num_samples=1", "--set",
                     "evaluate.num_inference_steps=2", "--set", "evaluate.noise_seeds=[0]", "--set",
                     "evaluate.timesteps=[0.5]", "--set", "evaluate.max_loss_samples=2"],
        "plan": [*cli, "plan", *cfg],
        "relabel": [PY, "-c", RELABEL, str(store)],
        "encode_text_carry": [*cli, "run", "encode-text", *cfg],
        "encode_vae_carry": [*cli, "run", "encode-vae", *cfg],
    }


def timed(cmd: list[str], log: Path, root: Path = ROOT) -> tuple[float, float, int]:
    """(seconds, peak RSS in MB, exit code) of one command in a fresh process, running the code of `root`."""
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.NamedTemporaryFile("r") as tf, log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        rc = subprocess.run(["/usr/bin/time", "-o", tf.name, "-f", "%e %M", *cmd], env=env, cwd=root, stdout=out,
                            stderr=subprocess.STDOUT).returncode
        secs, kb = tf.read().split()[-2:]
    return float(secs), int(kb) / 1024, rc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, nargs="+", default=[100_000, 300_000])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/scale"))
    ap.add_argument("--ops", default="open,inspect,inspect_json,verify,gc,encode_text,encode_vae,train,train_resume,"
                                     "evaluate,plan")
    args = ap.parse_args()
    ops = args.ops.split(",")
    seed = args.dir / "seed"
    results: dict[str, dict[int, tuple[float, float, int]]] = {op: {} for op in ops}
    for n in args.samples:
        store, run, report = args.dir / f"n{n}", args.dir / f"run-n{n}", args.dir / f"report-n{n}"
        if "train" in ops:
            subprocess.run(["rm", "-rf", str(run), str(report)], check=True)
        cmds = commands(store, seed, run, report)
        log = args.dir / f"ops-n{n}.log"
        for op in ops:
            results[op][n] = r = timed(cmds[op], log)
            print(f"N={n:>9,} {op:13s} {r[0]:7.1f} s {r[1]:7.0f} MB" + (f"  exit {r[2]} (see {log})" if r[2] else ""),
                  flush=True)
    lo, hi = min(args.samples), max(args.samples)
    print(f"\n{'operation':13s} " + " ".join(f"{'N=' + format(n, ','):>22s}" for n in args.samples) + "  growth")
    for op in ops:
        cells = " ".join(f"{results[op][n][0]:9.1f} s {results[op][n][1]:6.0f} MB" for n in args.samples)
        t_lo, t_hi = results[op][lo][0], results[op][hi][0]
        growth = f"{(t_hi / t_lo) / (hi / lo):.2f}" if lo != hi and t_lo > 0 else "-"
        print(f"{op:13s} {cells}  {growth}")


if __name__ == "__main__":
    main()
