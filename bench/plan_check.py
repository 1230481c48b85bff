"""`pipeline plan`'s memory model against rehearsal measurements (bench/rehearsal.py --out JSON files).

    PYTHONPATH=. python bench/plan_check.py /tmp/r1/rehearsal.json /tmp/r2/rehearsal.json --model-dir-key model

For each run: the predicted train-stage peak (models/memory_plan.train_plan, at the longest sample of the
store, the run's quantisation, checkpointing and batch) vs the measured peak. On a GPU the measured figure is
`peak_device_bytes`; on the CPU it is `peak_host_rss_bytes - baseline_rss_bytes` and the plan is asked for
host RSS (`host=True`: also the loading peak, one shard read while the weights fill in, and the bf16 copy
torchao's weight-only linear dequantises on the fly). Target: |predicted / measured - 1| <= 0.15.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.memory_plan import gib, train_plan  # noqa: E402


def check(runs: list[dict], model: str) -> list[dict]:
    rows = []
    for r in runs:
        host = r["peak_device_bytes"] is None
        measured = r["peak_host_rss_bytes"] - r["baseline_rss_bytes"] if host else r["peak_device_bytes"]
        plan = train_plan(model, "bfloat16", r["quantize"], r["batch_size"], r["max_tokens_per_sample"],
                          r["gradient_checkpointing"] or r["offload"] != "none", 16, r["offload"],
                          r.get("blocks_on_device") or 0, host=host)
        rows.append({"layers": r["layers"], "quantize": r["quantize"], "offload": r["offload"],
                     "gradient_checkpointing": r["gradient_checkpointing"], "batch_size": r["batch_size"],
                     "measured_bytes": measured, "predicted_bytes": plan.total,
                     "ratio": plan.total / measured, "parts": plan.parts})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", type=Path, help="rehearsal JSON files (their model folder: --model)")
    ap.add_argument("--model", action="append", help="model folder per JSON file (default: JSON's folder/model)")
    args = ap.parse_args()
    worst = 0.0
    for i, path in enumerate(args.runs):
        model = args.model[i] if args.model else str(path.parent / "model")
        for row in check(json.loads(path.read_text()), model):
            worst = max(worst, abs(row["ratio"] - 1))
            print(f"layers {row['layers']} {row['quantize']:5s} offload={row['offload']:6s} "
                  f"ckpt={int(row['gradient_checkpointing'])} batch {row['batch_size']}: measured "
                  f"{gib(row['measured_bytes'])}, plan {gib(row['predicted_bytes'])} "
                  f"({row['ratio']:.3f}x)  [{', '.join(f'{k} {gib(v)}' for k, v in row['parts'].items())}]")
    print(f"worst |plan / measured - 1| = {worst:.3f} (target <= 0.15)")


if __name__ == "__main__":
    main()
