"""Prove the real-size path on a GPU: one entry, stages selectable, results in one JSON file.

    python3 bench/gpu/proof.py --stage correctness --out $OUT/proof.json --budget-s 540
    python3 bench/gpu/proof.py --stage train --configs bf16-packed,bf16-native,bf16-anchors --out ... --budget-s 540
    python3 bench/gpu/proof.py --stage all --smoke --out /tmp/smoke.json        # every stage, tiny, on the CPU

Stages (bench/gpu/README.md says which call runs which; docs/gpu.md what each measures):
- correctness: padded mixed-resolution batches vs each sample alone through the unmodified diffusers
  transformer at the real width (bench/gpu/correctness.py), fp32 TF32-off and bf16, every attention backend
  that runs; offload / prefetch / compile give the same LoRA, int8 / fp8 (/ nf4) base vs bf16 loss
  (bench/gpu/same_lora.py); the quantised linear's speed per dequantisation chunk (bench/gpu/quantized_linear.py);
- train: the 60-layer full-width transformer per configuration (bench/gpu/fullsize.py);
- encode: encode-text / encode-vae vs the stock pipeline per sample (bench/gpu/encode_speed.py).

The JSON (`--out`, default proof.json) holds {"env": ..., "stages": {name: entry}}; it is rewritten after every
unit of work (a backend, a configuration), so a command killed at its limit leaves everything done so far. A
rerun of a stage replaces that stage's entry, except that `--configs` reruns only the named train
configurations and keeps the others, and `--parts` reruns only the named correctness parts and keeps the
others. `--budget-s`: no new unit of work starts after this many seconds from
the start (the unit in flight finishes, the rest are listed under `not_run_budget`): set it ~60 s under the
call's limit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

STAGES = ("correctness", "train", "encode")
CORRECTNESS_PARTS = ("equivalence", "quantized", "quantized_linear", "same_lora")


class StageRecord(dict):
    """One stage's entry; flush() rewrites the whole results file (atomically) with it in place."""

    def __init__(self, results: "Results", name: str):
        super().__init__()
        self.results, self.name = results, name

    def flush(self) -> None:
        self.results.write()


class Results:
    def __init__(self, path: Path):
        self.path = path
        self.data = json.loads(path.read_text()) if path.is_file() else {}
        self.data.setdefault("stages", {})

    def stage(self, name: str, keep: tuple[str, ...] = ()) -> StageRecord:
        """A fresh record of the stage, with the earlier record's `keep` entries (what this call does not rerun)."""
        rec = StageRecord(self, name)
        old = self.data["stages"].get(name) or {}
        for key in keep:
            if key in old:
                rec[key] = dict(old[key]) if isinstance(old[key], dict) else old[key]
        self.data["stages"][name] = rec
        return rec

    def write(self) -> None:
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_jsonable) + "\n")
        os.replace(tmp, self.path)


def _jsonable(x):
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "tolist"):
        return x.tolist()
    return repr(x)


def environment(device) -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device),
           "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for pkg in ("diffusers", "transformers", "peft", "torchao", "accelerate", "bitsandbytes"):
        try:
            env[pkg] = __import__(pkg).__version__
        except Exception as e:  # noqa: BLE001  (absent: recorded)
            env[pkg] = f"absent ({type(e).__name__})"
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, gpu_memory_bytes=p.total_memory, capability=f"{p.major}.{p.minor}",
                   cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    return env


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", default="all", choices=[*STAGES, "all"])
    ap.add_argument("--out", type=Path, default=Path("proof.json"))
    ap.add_argument("--smoke", action="store_true", help="every stage on the CPU with tiny dimensions")
    ap.add_argument("--budget-s", type=float, default=540.0, help="start no new unit of work after this many s")
    ap.add_argument("--configs", default=None, help="train: comma-separated configuration names (default: all)")
    ap.add_argument("--layers", type=int, default=None, help="train: transformer blocks (default 60; smoke 2: a kept and a checkpointed one)")
    ap.add_argument("--samples", type=int, default=None, help="train / encode: samples (default 8 / 16)")
    ap.add_argument("--parts", default=",".join(CORRECTNESS_PARTS),
                    help="correctness: which parts (equivalence, quantized, quantized_linear, same_lora)")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp dir)")
    args = ap.parse_args(argv)

    import torch

    start = time.monotonic()
    deadline = start + args.budget_s
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if not args.smoke and device.type == "cpu":
        print("proof: no CUDA device; run with --smoke for the CPU check", file=sys.stderr)
        raise SystemExit(2)
    from models.attention import report_choice

    results = Results(args.out)
    results.data["env"] = environment(device)
    results.data["env"]["smoke"] = args.smoke
    results.data["env"]["default_attention"] = report_choice(device, torch.bfloat16)
    results.write()
    own_work = args.work is None  # a scratch folder this call made is removed at its end (~1 GB per call)
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-proof-"))
    try:
        return _run_stages(args, ap, device, results, work, start, deadline)
    finally:
        if own_work:
            shutil.rmtree(work, ignore_errors=True)


def _run_stages(args, ap, device, results, work: Path, start: float, deadline: float) -> dict:
    stages = STAGES if args.stage == "all" else (args.stage,)
    names = args.configs.split(",") if args.configs else None
    from bench.gpu.fullsize import CONFIGS

    unknown = [n for n in names or [] if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown --configs {unknown}; known: {', '.join(CONFIGS)}")
    bad_parts = [p for p in args.parts.split(",") if p not in CORRECTNESS_PARTS]
    if bad_parts:  # a typo would otherwise run nothing and still replace nothing: a wasted device call
        ap.error(f"unknown --parts {bad_parts}; known: {', '.join(CORRECTNESS_PARTS)}")
    for stage in stages:
        rec = results.stage(stage, keep=_kept(stage, names, args.parts))
        rec["started_s"] = time.monotonic() - start
        rec.flush()
        if stage == "correctness":
            from bench.gpu.correctness import run_equivalence
            from bench.gpu.same_lora import run_quantized, run_same_lora

            parts = args.parts.split(",")
            if "equivalence" in parts:
                run_equivalence(device, args.smoke, deadline, rec)
            if "quantized" in parts:
                run_quantized(device, args.smoke, deadline, rec)
            if "quantized_linear" in parts:
                from bench.gpu.quantized_linear import run_quantized_linear

                run_quantized_linear(device, args.smoke, deadline, rec)
            if "same_lora" in parts:
                run_same_lora(device, args.smoke, work / "same-lora", deadline, rec)
        elif stage == "train":
            from bench.gpu.fullsize import run_train

            run_train(device, args.smoke, deadline, rec, names, args.layers, args.samples)
        else:
            from bench.gpu.encode_speed import run_encode

            run_encode(device, args.smoke, work / "encode", deadline, rec, args.samples)
        rec["seconds"] = time.monotonic() - start - rec["started_s"]
        rec["complete"] = not _budget_cut(rec)
        rec.flush()
        print(summary(stage, rec), flush=True)
    return results.data


def _kept(stage: str, names: list[str] | None, parts: str) -> tuple[str, ...]:
    """What a rerun keeps from the stage's earlier record: train with --configs its other configurations (merged
    per name), correctness with --parts the parts it does not rerun (an H200 call's equivalence results must not
    vanish when only same_lora is rerun)."""
    if stage == "train" and names is not None:
        return ("configs",)
    if stage == "correctness":
        return tuple(p for p in CORRECTNESS_PARTS if p not in parts.split(","))
    return ()


def _budget_cut(rec: dict) -> bool:
    if any(k == "not_run_budget" for k in rec):
        return True
    return any(isinstance(v, dict) and (_budget_cut(v) or v.get("partial")) for v in rec.values())


def _offload_note(r: dict) -> str:
    """What says whether offload held one block at a time (2026-12-04: every recomputed block stayed)."""
    if "offload_most_live_blocks" not in r:
        return ""
    waited, onloads = r.get("offload_unhidden_onloads") or (None, None)
    setup = r.get("allocated_after_setup")
    return (f", live blocks at most {r['offload_most_live_blocks']}, onloads waited for {waited} of {onloads}"
            + (f", {setup / 2**30:.1f} GiB after setup" if setup is not None else ""))


def summary(stage: str, rec: dict) -> str:
    """A short table for the end of the call's output (the reply carries the tail)."""
    lines = [f"== {stage}: {rec.get('seconds', 0):.0f} s, complete={rec.get('complete')}"]
    if stage == "correctness":
        from bench.gpu.correctness import did_not_run

        for prec in ("float32", "bfloat16"):
            for name, r in rec.get("equivalence", {}).get(prec, {}).items():
                if isinstance(r, dict) and "ran" in r:
                    lines.append(f"{prec:9s} {name:18s} " + (
                        f"ok={r['ok']} fwd {r['forward']:.1e} dx {r['grad_input_image']:.1e} dW {r['grad_weights']:.1e}"
                        if r["ran"] else did_not_run(r)))
        for name, r in rec.get("same_lora", {}).items():
            if isinstance(r, dict) and "ran" in r:
                lines.append(f"same LoRA {name:9s} " + (f"diff {r.get('max_rel_diff_vs_plain', 0):.1e} ok={r.get('ok', True)}"
                                                        if r["ran"] else f"failed: {r['error'][:90]}"))
        for name, r in rec.get("quantized", {}).items():
            if isinstance(r, dict) and r.get("ran"):
                lines.append(f"quantized {name:5s} loss deviation {r['rel_loss_deviation']:.2e}")
        for shape, r in rec.get("quantized_linear", {}).items():
            for kind in ("int8", "fp8"):
                per = r.get(kind) if isinstance(r, dict) else None
                if not isinstance(per, dict):
                    continue
                timed = " ".join(f"{c}={v['x_bfloat16']:.2f}" for c, v in per.items() if isinstance(v, dict))
                lines.append(f"linear {shape:11s} {kind} x bf16 by chunk: {timed}"
                             + (f" failed: {per['error'][:90]}" if "error" in per else ""))
    elif stage == "train":
        for name, r in rec.get("configs", {}).items():
            plan = f"plan {r['plan_bytes'] / 2**30:.1f} GiB" if "plan_bytes" in r else ""
            pad = f"pad {r['padding_share']:.3f}" if "padding_share" in r else ""
            wall = f", wall {r['wall_seconds']:.0f} s" if "wall_seconds" in r else ""  # the build included
            wall += _offload_note(r)
            if "skipped" in r:
                lines.append(f"{name:22s} skipped: {r['skipped']}")
            elif "error" in r:
                lines.append(f"{name:22s} error: {r['error'][:90]} ({plan}{wall})")
            elif "s_per_step" in r:
                mfu = r.get("mfu_vs_spec") or r.get("mfu_vs_measured_matmul")
                peak = r.get("peak_allocated")
                lines.append(f"{name:22s} {r['s_per_step']:7.2f} s/step {r['target_tokens_per_s']:9.0f} tgt tok/s "
                             f"MFU {mfu:.2f} data {r['data_share']:.1%} {pad} "
                             + (f"uncheckpointed {kept} " if (kept := r.get("config", {}).get("uncheckpointed")) else "")
                             + (f"peak {peak / 2**30:.1f} GiB " if peak else "")
                             + (f"alloc retries {n} " if (n := r.get("alloc_retries")) else "") + plan + wall)
            elif "steps" in r:  # built, but no timed step: the deadline came first, or every batch warmed up
                why = "the deadline came first" if r.get("partial") else "every batch was a warm-up one"
                lines.append(f"{name:22s} no timed step, {why} ({plan}{wall})")
    else:
        for name in ("encode_text", "encode_vae", "encode_text_padded"):
            r, first = rec.get(name, {}), rec.get("first_pass", {}).get(name, {})
            if "samples_per_s" in r:
                lines.append(f"{name:18s} {r['samples_per_s']:.2f} samples/s, x{r.get('x_stock', float('nan')):.2f} stock "
                             f"(steady state; batch {r.get('mean_batch', float('nan')):.1f})"
                             + (f", first pass x{first.get('x_stock_first_pass', float('nan')):.2f}" if first else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
