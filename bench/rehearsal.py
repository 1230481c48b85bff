"""Full-size rehearsal: the real component widths, N layers, a realistic mixed store, encode + train per
configuration; step time, throughput, peak memory and MFU.

    PYTHONPATH=. python bench/rehearsal.py --layers 2 --area 65536 --out rehearsal.json
    PYTHONPATH=. python bench/rehearsal.py --device cuda --out h100.json          # 60 layers, 1024² (GPU)

1. `pipeline make-tiny-model --full-width --layers N` (edit-plus; or --model DIR to reuse one).
2. A source dataset of realistic mixed samples: targets of several aspect ratios at --area pixels, 0-3
   controls each at ~--area with its own aspect ratio, captions of 50-300 tokens; then the real
   resize-bucket, encode-text and encode-vae stages (VL views scaled like Edit-Plus: 384² per 1024²).
3. Per configuration (quantize x offload x gradient checkpointing x batch size) a fresh process runs the
   real train stage (`stages.train.recipe.run`, bf16 base + bf16 autocast) for --steps steps and reports
   s/step (median of the steps after the first), samples/s, tokens/s (valid tokens, mean sequence length x
   batch / s_per_step), peak device bytes (torch.cuda.max_memory_allocated; null on CPU), peak host RSS
   (VmHWM of that process), baseline RSS (after imports, before any model is loaded) and MFU.
   MFU = model FLOPs per step / s_per_step / the dense bf16 matmul throughput measured in the same process
   right after its steps (a CPU has no spec sheet figure; on a GPU this is the achieved, not the datasheet,
   peak).
   Model FLOPs per token and block: 2 x the linear params the token passes (its stream's attention and
   MLP; the modulation linears run once per sample) for the forward, 2x again for the backward (input
   gradients only: the base is frozen), 2x more when gradient checkpointing recomputes; attention
   4 x T x width per token, with the same multipliers.

The JSON list written to --out holds one object per run (keys in `RUN_KEYS`). Memory ratios between runs
(int8 vs bf16 ...) are the figures to read; each run is its own process, so peaks do not leak across runs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RUN_KEYS = ("quantize", "offload", "gradient_checkpointing", "batch_size", "layers", "device", "s_per_step",
            "samples_per_s", "tokens_per_s", "peak_device_bytes", "peak_host_rss_bytes", "baseline_rss_bytes",
            "mfu")

# glibc's dynamic mmap threshold rises to the largest block freed so far, after which freed weight-sized
# temporaries stay in the heap and RSS keeps them: a fixed threshold lets RSS follow live memory, the same
# for every configuration (measured, 1 layer: bf16 1.08 -> 0.95 GiB, int8 1.15 -> 0.92 GiB over baseline).
CHILD_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}

# A Qwen-Image-2.1 model (`--variant qwen-image-2.1`) gets configs/qwen-image-2.1.yaml's settings: sides a
# multiple of 32 (one Qwen3-VL token = 2x2 latent tokens), up to 10 references, the 2.1 timestep shift.
OVERRIDES_21 = {"resize.multiple": 32, "resize.max_controls": 10, "sigma.sampling": "dynamic_shift",
                "sigma.base_shift": 0.5, "sigma.max_shift": 1.15, "sigma.base_image_seq_len": 256,
                "sigma.max_image_seq_len": 4096}


def variant_overrides(model: str) -> dict:
    from models.loading import model_variant

    if model_variant(model) != "qwen-image-2.1":
        return {}
    return {k if k.startswith("resize.") else f"train.{k}": v for k, v in OVERRIDES_21.items()}


_WORDS = ("make the square red and turn the background into a soft sunset while keeping the circle where it "
          "is then add a small hat rotate the scene mirror it replace the car with a bicycle brighter colour "
          "texture shape object picture").split()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """This process's RSS high-water mark (VmHWM). Not getrusage's ru_maxrss: Linux carries that across
    execve from the process that spawned this one (subprocess's vfork shares the driver's memory until the
    exec), so a child started by a driver holding the encoders read the driver's 4.3 GB as its own peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status")


# ------------------------------------------------------------------------------------------------ data


def write_source(out: Path, n: int, area: int, seed: int, tokenizer) -> None:
    """Demo-data scenes (mixed aspects, 0-3 controls), resized by resize-bucket to --area; captions of
    50-300 tokens (counted with the model's tokenizer)."""
    from pipeline.demo_data import generate_samples, write_folder

    rng = random.Random(seed)
    samples = generate_samples(n=n, max_controls=3, seed=seed, with_masks=False)
    long = []
    for s in samples:
        want = rng.randint(50, 300)
        words = [s.caption]
        while len(tokenizer(" ".join(words))["input_ids"]) < want:
            words.append(rng.choice(_WORDS))
        long.append(replace(s, caption=" ".join(words)))
    out.mkdir(parents=True)
    write_folder(out, long)


def build_store(work: Path, model: str, area: int, n: int, device: str, seed: int = 0) -> Path:
    from models.loading import load_component
    from pipeline.config import load_config
    from stages.encode import text as encode_text, vae as encode_vae
    from stages.resize import stage as resize_bucket

    store = work / "store"
    if (store / ".rehearsal-done").is_file():
        return store
    overrides = variant_overrides(model)
    # 2.1 keeps its tokenizer inside the Qwen3-VL processor folder
    tokenizer = load_component(model, "processor").tokenizer if overrides else load_component(model, "tokenizer")
    write_source(work / "source", n, area, seed, tokenizer)
    cfg = load_config(None, {
        "resize.target_area": area, "resize.control_vae_area": area,
        "resize.control_vl_area": max(3136, area * 384 * 384 // (1024 * 1024)), "resize.val_fraction": 0.0,
        "encode_text.device": device, "encode_vae.device": device,
        "encode_text.batch_size": 1, "encode_vae.batch_size": 1,
        **{k: v for k, v in overrides.items() if k.startswith("resize.")},
    })
    resize_bucket.run(cfg, work / "source", store)
    encode_text.run(cfg, store, model)
    encode_vae.run(cfg, store, model)
    (store / ".rehearsal-done").write_text("ok\n")
    return store


# ------------------------------------------------------------------------------------------------ FLOPs


def matmul_flops_per_s(device: str, dtype_name: str = "bfloat16", n: int | None = None,
                       repeats: int | None = None) -> float:
    """Dense matmul throughput of this device (best of a few runs): the MFU denominator. On a CPU one 1024^2 run
    after a warm-up: a CPU without native bfloat16 (AVX2 only: this project's AMD EPYC machine on 2026-11-25)
    multiplies bfloat16 at 0.48 GFLOP/s (float32: 29), so four 2048^2 runs took ~140 s of each rehearsal."""
    import torch

    cuda = device.startswith("cuda")
    n = n or (2048 if cuda else 1024)
    repeats = repeats or (3 if cuda else 1)

    dtype = getattr(torch, dtype_name)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        (a @ b).sum().item()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def model_flops_per_step(linear_params_per_block: int, blocks: int, width: int, lengths: list[int],
                         checkpointing: bool, uncheckpointed: int = 0) -> float:
    """Forward + input-gradient backward (+ recompute) of the transformer blocks over these sequences; with
    checkpointing the first `uncheckpointed` blocks are not recomputed (`train.uncheckpointed_blocks`)."""
    # forward, backward (input grads only: the base is frozen), recompute of the checkpointed blocks
    block_passes = 2 * blocks + (blocks - min(blocks, uncheckpointed) if checkpointing else 0)
    flops = 0.0
    for t in lengths:
        flops += block_passes * (2 * linear_params_per_block * t + 4 * t * t * width)
    return flops


# ------------------------------------------------------------------------------------------------ one run (child)


def child(spec: dict) -> dict:
    """One training configuration in this (fresh) process."""
    import torch  # noqa: F401  (imports are part of the baseline)
    import diffusers  # noqa: F401
    import peft  # noqa: F401
    import torchao  # noqa: F401
    import transformers  # noqa: F401
    from accelerate import Accelerator  # noqa: F401
    from torch.utils.tensorboard import SummaryWriter  # noqa: F401  (imported by the train stage)

    from pipeline.config import load_config
    from stages.train import recipe as train
    from stages.train.data import open_inputs as open_train_tables

    baseline = rss_bytes()
    overrides = {
        "train.device": spec["device"], "train.dtype": "bfloat16", "train.max_steps": spec["steps"],
        "train.batch_size": spec["batch_size"], "train.gradient_checkpointing": spec["gradient_checkpointing"],
        "train.quantize_base": spec["quantize"], "train.checkpoint_every": 10_000, "train.lora.rank": 16,
        "train.sampler_window": 1,
        **{k: v for k, v in variant_overrides(spec["model"]).items() if k.startswith("train.")},
    }
    if spec["offload"] != "none":
        overrides.update({"train.offload": spec["offload"], "train.offload_blocks_on_device": spec["blocks_on_device"]})
    cfg = load_config(None, overrides)
    if spec["device"].startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    base_bytes = []
    setup = train.setup_transformer

    def measured_setup(*a, **k):  # the frozen base's stored bytes, as loaded (checks `pipeline plan`)
        from models.quantize import stored_bytes

        t = setup(*a, **k)
        base_bytes.append(sum(stored_bytes(p) for n, p in t.named_parameters() if ".lora_" not in n))
        return t

    train.setup_transformer = measured_setup
    result = train.run(cfg, spec["store"], spec["model"], spec["run_dir"])
    peak_device = torch.cuda.max_memory_allocated() if spec["device"].startswith("cuda") else None
    peak = peak_rss_bytes()
    # in this process, right after its steps: on a shared CPU the rate drifts with the load, and a rate taken
    # once at the start gave an MFU above 1 for a run that happened to step while the machine was quiet
    peak_flops = matmul_flops_per_s(spec["device"])

    tables = open_train_tables(spec["store"], spec["model"], split="train")
    lengths = tables.lengths.tolist()  # numbers (numpy at the join) -> JSON-able ints
    times = result.step_times[1:] if len(result.step_times) > 1 else result.step_times
    s_per_step = statistics.median(times)
    tokens_per_sample = statistics.mean(lengths)
    from models.memory_plan import transformer_counts

    counts = transformer_counts(spec["model"])
    flops = model_flops_per_step(counts.token_linear_params, counts.blocks, counts.width,
                                 [tokens_per_sample] * spec["batch_size"], spec["gradient_checkpointing"])
    return {
        **{k: spec[k] for k in ("quantize", "offload", "gradient_checkpointing", "batch_size", "layers", "device")},
        "blocks_on_device": spec.get("blocks_on_device") if spec["offload"] != "none" else None,
        "steps": len(result.step_times),
        "s_per_step": s_per_step,
        "step_times": result.step_times.tolist(),
        "samples_per_s": spec["batch_size"] / s_per_step,
        "tokens_per_s": tokens_per_sample * spec["batch_size"] / s_per_step,
        "mean_tokens_per_sample": tokens_per_sample,
        "max_tokens_per_sample": max(lengths),
        "peak_device_bytes": peak_device,
        "peak_host_rss_bytes": peak,
        "baseline_rss_bytes": baseline,
        "peak_over_baseline_bytes": peak - baseline,
        "base_weight_bytes": base_bytes[0],
        "model_flops_per_step": flops,
        "device_matmul_flops_per_s": peak_flops,
        "mfu": flops / s_per_step / peak_flops,
        "losses": result.losses.tolist(),
    }


# ------------------------------------------------------------------------------------------------ driver


def _child_path() -> str:
    """The repo, then this process's PYTHONPATH: a stack installed with `pip --target` (the GPU machine's,
    bench/gpu/rehearse) has its libraries only there."""
    return os.pathsep.join([str(REPO), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=None, help="layers per stack (default: the real counts)")
    ap.add_argument("--area", type=int, default=1024 * 1024, help="target/control pixel area")
    ap.add_argument("--out", type=Path, default=None, help="JSON list of runs (required)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--variant", default="edit-plus", choices=["edit", "edit-plus", "qwen-image-2.1"])
    ap.add_argument("--model", default=None, help="reuse a full-width model folder")
    ap.add_argument("--work", type=Path, default=None, help="working folder (model, store, runs); default: temp")
    ap.add_argument("--minimal-text-encoder", action="store_true",
                    help="tests: a 1-layer narrow-MLP text encoder (output width still 3584)")
    ap.add_argument("--samples", type=int, default=6)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--quantize", default="none,int8,fp8,nf4")
    ap.add_argument("--offload", default="none", help="none,blocks")
    ap.add_argument("--blocks-on-device", type=int, default=0)
    ap.add_argument("--gradient-checkpointing", default="off", help="off,on")
    ap.add_argument("--batch-size", default="1")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("REHEARSAL-RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return []
    if args.out is None:
        ap.error("--out FILE.json is required")

    work = args.work or Path(tempfile.mkdtemp(prefix="rehearsal-"))
    work.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from models.full_width import make_full_width_model

        model = str(work / "model")
        if not (Path(model) / "model_index.json").is_file():
            print(f"building the full-width model ({args.layers or 'real'} layers) in {model}", flush=True)
            make_full_width_model(model, args.variant, args.layers, minimal_text_encoder=args.minimal_text_encoder)
    print("writing and encoding the rehearsal store", flush=True)
    store = build_store(work, model, args.area, args.samples, args.device)

    combos = itertools.product(args.quantize.split(","), args.offload.split(","),
                               [g == "on" for g in args.gradient_checkpointing.split(",")],
                               [int(b) for b in args.batch_size.split(",")])
    runs = []
    for i, (q, off, gc, bs) in enumerate(combos):
        spec = {"quantize": q, "offload": off, "gradient_checkpointing": gc, "batch_size": bs,
                "layers": args.layers, "device": args.device, "steps": args.steps, "store": str(store),
                "model": model, "run_dir": str(work / f"run-{i}-{q}-{off}-{int(gc)}-{bs}"),
                "blocks_on_device": args.blocks_on_device}
        shutil.rmtree(spec["run_dir"], ignore_errors=True)  # a fresh run, never a resume of an earlier one
        print(f"run {i}: quantize={q} offload={off} gradient_checkpointing={gc} batch_size={bs}", flush=True)
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True,
                              text=True, env={**CHILD_ENV, **os.environ, "PYTHONPATH": _child_path()})
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REHEARSAL-RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"run {i} failed (exit {proc.returncode})")
        run = json.loads(lines[-1].removeprefix("REHEARSAL-RESULT "))
        runs.append(run)
        print(f"  {run['s_per_step']:.2f} s/step, {run['tokens_per_s']:.1f} tokens/s, peak RSS over baseline "
              f"{run['peak_over_baseline_bytes'] / 2**30:.2f} GiB, MFU {run['mfu']:.3f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(runs, indent=2) + "\n")
    base = next((r for r in runs if r["quantize"] == "none"), None)
    if base:
        for r in runs:
            if r is not base and r["offload"] == base["offload"] and r["gradient_checkpointing"] == base["gradient_checkpointing"]:
                print(f"{r['quantize']}: peak RSS over baseline {r['peak_over_baseline_bytes'] / base['peak_over_baseline_bytes']:.3f}x of bf16's")
    print(f"wrote {args.out}")
    return runs


if __name__ == "__main__":
    main()
