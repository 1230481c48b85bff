"""Train-stage benchmarks, one section per function, all run by `main` in one process.

    /work/venv/bin/python bench/train.py

Padding section: padding efficiency (valid / computed tokens, linear and weighted by seq_len², the attention
cost) of the length-aware sampler vs plain random batching at batch 8, on the realistic Edit / Edit-Plus mix of
DESIGN §5 — target areas 512²/768²/1024² (20/30/50 %), aspect ratios 1, 4:3, 3:4, 16:9, 9:16, 3:2, 2:3,
0/1/2/3 controls (10/50/25/15 %) each at ~1024² with its own aspect ratio, text 20–120 tokens + ~188 per
control image. A token is a 16×16-pixel patch (VAE ×8, 2×2 packing); buckets are multiples of 32 px.
Target: ≥ 0.97 linear for the sampler.

Step-time section: the trainer's optimizer step (store read, per-sample σ/noise/dropout, packing, forward,
backward, clipping, AdamW, LR schedule, TensorBoard, progress bar) as a ratio to a bare
forward/backward/AdamW loop over the same batches, prebuilt on the device, with the same LoRA'd transformer
(a small random one, 3 layers, 4 heads × 32: a CPU step of ~0.1–0.3 s, where overhead would show). Each loop
runs 5 times, alternating; per step the fastest of the runs counts (same batch each time), warm-up steps excluded. Timed in
process CPU time on one thread (this box is shared: wall time swings 10x with other load; wall is printed too).
Target: ratio ≤ 1.05.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.train.sampler import LengthAwareBatchSampler, padding_efficiency, random_batches  # noqa: E402

ASPECTS = [1.0, 4 / 3, 3 / 4, 16 / 9, 9 / 16, 3 / 2, 2 / 3]
TARGET_AREAS = ([512 * 512, 768 * 768, 1024 * 1024], [0.2, 0.3, 0.5])
CONTROL_COUNTS = ([0, 1, 2, 3], [0.10, 0.50, 0.25, 0.15])
VL_TOKENS_PER_CONTROL = 188


def bucket_tokens(area: int, aspect: float, multiple: int = 32) -> int:
    """Image tokens of a bucket with this pixel area and width/height aspect."""
    h = max(multiple, round(math.sqrt(area / aspect) / multiple) * multiple)
    w = max(multiple, round(math.sqrt(area * aspect) / multiple) * multiple)
    return (h // 16) * (w // 16)


def realistic_mix(n: int, seed: int) -> tuple[list[int], list[int], list[int]]:
    """Per sample: (total sequence length, image tokens, text tokens) for the DESIGN §5 mix."""
    rng = random.Random(seed)
    totals, images, texts = [], [], []
    for _ in range(n):
        area = rng.choices(*TARGET_AREAS)[0]
        image = bucket_tokens(area, rng.choice(ASPECTS))
        controls = rng.choices(*CONTROL_COUNTS)[0]
        image += sum(bucket_tokens(1024 * 1024, rng.choice(ASPECTS)) for _ in range(controls))
        text = rng.randint(20, 120) + VL_TOKENS_PER_CONTROL * controls
        totals.append(image + text)
        images.append(image)
        texts.append(text)
    return totals, images, texts


def two_stream_efficiency(batches: list[list[int]], images: list[int], texts: list[int]) -> float:
    """Linear efficiency as the model computes it: image and text are padded separately."""
    valid = sum(images[i] + texts[i] for b in batches for i in b)
    computed = sum(len(b) * (max(images[i] for i in b) + max(texts[i] for i in b)) for b in batches if b)
    return valid / computed


def bench_padding(n: int = 20_000, batch_size: int = 8, window: int = 64, seeds: int = 3) -> dict[str, float]:
    rows = []
    for seed in range(seeds):
        totals, images, texts = realistic_mix(n, seed)
        sampler = LengthAwareBatchSampler(totals, batch_size, seed=seed, window=window)
        ours = [step[0] for step in sampler.global_steps(0)]
        base = random_batches(n, batch_size, seed)
        rows.append(
            (
                *padding_efficiency(base, totals),
                two_stream_efficiency(base, images, texts),
                *padding_efficiency(ours, totals),
                two_stream_efficiency(ours, images, texts),
            )
        )
    mean = [sum(col) / len(col) for col in zip(*rows)]
    keys = ["random_linear", "random_quadratic", "random_two_stream", "sampler_linear", "sampler_quadratic", "sampler_two_stream"]
    result = dict(zip(keys, mean))
    print(f"== padding efficiency: {n} samples x {seeds} seeds, batch {batch_size}, window {window} batches")
    print(f"{'':8s} {'linear':>8s} {'quadratic':>10s} {'two-stream':>11s}")
    print(f"{'random':8s} {result['random_linear']:8.3f} {result['random_quadratic']:10.3f} {result['random_two_stream']:11.3f}")
    print(f"{'sampler':8s} {result['sampler_linear']:8.3f} {result['sampler_quadratic']:10.3f} {result['sampler_two_stream']:11.3f}")
    print(
        f"sampler / random: linear x{result['sampler_linear'] / result['random_linear']:.2f}, "
        f"quadratic x{result['sampler_quadratic'] / result['random_quadratic']:.2f}; "
        f"target sampler linear >= 0.97: {'met' if result['sampler_linear'] >= 0.97 else 'NOT met'}"
    )
    return result


def bench_budget(n: int = 20_000, budgets=(32768, 65536, 98304, 131072), target_budget: int = 98304,
                 window: int = 64, seeds: int = 3) -> dict[int, tuple[float, float, float]]:
    """Token-budget batches on the DESIGN §5 mix: padding efficiency, mean computed tokens / budget, samples per
    batch. The fill is bounded by whole samples: a batch of the longest samples (~17k tokens) holds
    floor(budget / 17k) of them, so fill >= 0.90 needs a budget of several longest samples."""
    from stages.train.budget import TokenBudgetBatchSampler, computed_fill

    out = {}
    print(f"== token-budget batches: {n} samples x {seeds} seeds, window {window} batches")
    print(f"{'budget':>8s} {'linear':>8s} {'quadratic':>10s} {'fill':>6s} {'samples/batch':>14s}")
    for budget in budgets:
        rows = []
        for seed in range(seeds):
            totals, _, _ = realistic_mix(n, seed)
            steps = TokenBudgetBatchSampler(totals, budget, seed=seed, window=window).global_steps(0)
            batches = [s[0] for s in steps]
            rows.append((*padding_efficiency(batches, totals), computed_fill(steps, totals, budget), n / len(batches)))
        lin, quad, fill, per = (sum(c) / len(c) for c in zip(*rows))
        out[budget] = (lin, fill, per)
        print(f"{budget:8d} {lin:8.3f} {quad:10.3f} {fill:6.3f} {per:14.1f}")
    lin, fill, _ = out[target_budget]
    ok = lin >= 0.98 and fill >= 0.90
    print(f"at budget {target_budget}: linear {lin:.3f} (target >= 0.98), fill {fill:.3f} (target >= 0.90): "
          f"{'met' if ok else 'NOT met'}")
    return out


def _step_time_fixture(work: Path) -> tuple[str, Path]:
    """A model folder whose transformer is mid-sized, and a store of `text` + `vae` tables built for it."""
    import torch
    from diffusers import QwenImageTransformer2DModel

    from models.loading import model_fingerprint
    from models.tiny import TINY_TRANSFORMER, make_tiny_model
    from schemas import FieldSpec, Lineage, TableSchema
    from store import Store

    model = work / "model"
    make_tiny_model(model)
    torch.manual_seed(0)
    config = {**TINY_TRANSFORMER, "num_layers": 3, "num_attention_heads": 4, "attention_head_dim": 32,
              "axes_dims_rope": (8, 12, 12)}
    QwenImageTransformer2DModel(**config).save_pretrained(model / "transformer")
    c, d = TINY_TRANSFORMER["in_channels"] // 4, TINY_TRANSFORMER["joint_attention_dim"]

    lineage = Lineage("bench", "bench", model_fingerprint(str(model)), {"images": 1}, "bench")
    st = Store(work / "store")
    tw = st.writer("text", TableSchema("text", [FieldSpec("prompt_embeds", "bfloat16", 2),
                                                FieldSpec("empty_embeds", "bfloat16", 2)], lineage))
    vw = st.writer("vae", TableSchema("vae", [FieldSpec("target", "bfloat16", 4),
                                              FieldSpec("control_{i}", "bfloat16", 4)], lineage))
    g = torch.Generator().manual_seed(0)
    sizes = [(24, 24), (24, 32), (32, 24), (20, 36), (36, 20), (32, 32)]  # latent h, w: 144..256 tokens
    for i in range(48):
        key = f"{i:032x}"
        (h, w), (ch, cw) = sizes[i % len(sizes)], sizes[(i // len(sizes)) % len(sizes)]
        text_len = 30 + (i * 7) % 60
        meta = {"split": "train", "img_shapes": [[1, h // 2, w // 2], [1, ch // 2, cw // 2]]}
        tw.add(key, tensors={"prompt_embeds": torch.randn(text_len, d, generator=g).bfloat16(),
                             "empty_embeds": torch.randn(4, d, generator=g).bfloat16()},
               meta={**meta, "length": text_len})
        vw.add(key, tensors={"target": torch.randn(c, 1, h, w, generator=g).bfloat16(),
                             "control_0": torch.randn(c, 1, ch, cw, generator=g).bfloat16()}, meta=meta)
    tw.commit()
    vw.commit()
    return str(model), work / "store"


def _bare_loop(model: str, store: Path, cfg, steps: int) -> tuple[list[float], list[float]]:
    """Forward/backward/AdamW over the trainer's first `steps` batches, everything prebuilt on the device."""
    import time

    import torch

    from models.flow import add_noise, flow_target, per_sample_loss
    from models.lora import lora_parameters
    from models.multires import build_batch, multires_forward, pack_latents, target_outputs
    from models.randomness import draw_noise, draw_sigma
    from stages.train.data import DataStream, load, open_inputs as open_train_tables
    from stages.train.recipe import setup_transformer

    tc, device = cfg.train, torch.device("cpu")
    tables = open_train_tables(store, model)
    transformer = setup_transformer(model, tc, device)
    optimizer = torch.optim.AdamW(lora_parameters(transformer), lr=tc.learning_rate)
    stream = DataStream(LengthAwareBatchSampler(tables.lengths, tc.batch_size, seed=tc.seed, window=tc.sampler_window))
    prepared = []
    for step in range(steps):
        samples = [load(tables, tables.keys[i]) for i in stream.next()[1][0]]
        sigmas = torch.stack([draw_sigma(s, tc.seed, step, tc.sigma) for s in samples])
        x0 = [pack_latents(s.target).float() for s in samples]
        eps = [pack_latents(draw_noise(s, tc.seed, step)) for s in samples]
        batch = build_batch([add_noise(x, e, sg) for x, e, sg in zip(x0, eps, sigmas)],
                            [[c.float() for c in s.controls] for s in samples],
                            [s.prompt_embeds.float() for s in samples], [s.img_shapes for s in samples])
        prepared.append((batch.to(device), sigmas.to(device), [flow_target(x, e).to(device) for x, e in zip(x0, eps)]))
    wall, cpu = [], []
    for batch, sigmas, targets in prepared:
        t0, c0 = time.perf_counter(), time.process_time()
        out = multires_forward(transformer, batch, sigmas)
        per_sample_loss(target_outputs(out, batch), targets).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu


def _timed_epoch(model: str, store: Path, cfg, batches: list[list[int]]) -> tuple[float, int]:
    """Forward/backward/AdamW over the given batches, prebuilt on the device; (process CPU s, target tokens)."""
    import time

    import torch

    from models.flow import flow_loss_of
    from models.lora import lora_parameters
    from stages.train.data import open_inputs as open_train_tables
    from stages.train.prefetch import prepare
    from stages.train.recipe import setup_transformer

    tc, device = cfg.train, torch.device("cpu")
    tables = open_train_tables(store, model)
    transformer = setup_transformer(model, tc, device)
    optimizer = torch.optim.AdamW(lora_parameters(transformer), lr=tc.learning_rate)
    prepared = [prepare(tables, tc, b, step, device, torch.float32) for step, b in enumerate(batches)]
    cpu = 0.0
    for fb in prepared:
        c0 = time.process_time()
        flow_loss_of(transformer, fb).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        cpu += time.process_time() - c0
    return cpu, sum(t.shape[0] for fb in prepared for t in fb.targets)


def bench_bucketed(batch_size: int = 4, repeats: int = 3) -> dict[str, float]:
    """Target tokens / s of one epoch: the length-aware sampler's mixed batches vs other trainers' batching
    (one bucket = one exact set of shapes per batch: samples whose shapes differ go in batches of one)."""
    import shutil
    import tempfile
    from collections import defaultdict

    import torch

    from pipeline.config import load_config
    from stages.train.data import open_inputs as open_train_tables

    work = Path(tempfile.mkdtemp(prefix="bench-bucketed-"))
    try:
        model, store = _step_time_fixture(work)
        cfg = load_config(None, {"train.device": "cpu", "train.lora.rank": 16})
        tables = open_train_tables(store, model)
        ours = [step[0] for step in LengthAwareBatchSampler(tables.lengths, batch_size, seed=0).global_steps(0)]
        buckets: dict[tuple, list[int]] = defaultdict(list)
        for i, key in enumerate(tables.keys):
            shapes = tuple(tuple(s) for s in tables.features(key)[2])
            buckets[shapes].append(i)
        bucketed = [b[j : j + batch_size] for b in buckets.values() for j in range(0, len(b), batch_size)]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        times = {"mixed": [], "bucketed": []}
        for _ in range(repeats):
            for name, batches in (("mixed", ours), ("bucketed", bucketed)):
                cpu, tokens = _timed_epoch(model, store, cfg, batches)
                times[name].append(cpu)
        torch.set_num_threads(threads)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rate = {k: tokens / min(v) for k, v in times.items()}
    print(f"== one epoch ({len(tables.keys)} samples, {len(buckets)} distinct shape sets), CPU, 1 thread, best of {repeats}")
    print(f"mixed-resolution batches of {batch_size}: {len(ours)} steps, {rate['mixed']:.0f} target tokens/s")
    print(f"bucketed (one shape set per batch):  {len(bucketed)} steps, {rate['bucketed']:.0f} target tokens/s")
    print(f"mixed / bucketed throughput: x{rate['mixed'] / rate['bucketed']:.2f} (and {len(bucketed) / len(ours):.1f}x "
          "the optimizer steps per epoch for the bucketed way)")
    return rate


def bench_step_time(steps: int = 12, warmup: int = 2, batch_size: int = 4, repeats: int = 5) -> dict[str, float]:
    import shutil
    import tempfile

    import torch

    from pipeline.config import load_config
    from stages.train.recipe import run

    work = Path(tempfile.mkdtemp(prefix="bench-train-"))
    try:
        model, store = _step_time_fixture(work)
        cfg = load_config(None, {"train.device": "cpu", "train.batch_size": batch_size, "train.max_steps": steps,
                                 "train.checkpoint_every": 10 * steps, "train.lora.rank": 16})
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # one thread: process CPU time = the work done, whatever else runs on the box
        times: dict[str, list[list[float]]] = {"bare wall": [], "bare cpu": [], "trainer wall": [], "trainer cpu": [],
                                               "prefetch wall": [], "prefetch cpu": []}
        ahead = cfg.model_copy(update={"train": cfg.train.model_copy(update={"prefetch": 2})})
        for attempt in range(repeats):  # alternate, so load from other processes hits both alike
            wall, cpu = _bare_loop(model, store, cfg, steps)
            result = run(cfg, store, model, work / f"run{attempt}")
            prefetched = run(ahead, store, model, work / f"ahead{attempt}")
            times["bare wall"].append(wall[warmup:])
            times["bare cpu"].append(cpu[warmup:])
            times["trainer wall"].append(result.step_times[warmup:])
            times["trainer cpu"].append(result.step_cpu_times[warmup:])
            times["prefetch wall"].append(prefetched.step_times[warmup:])
            times["prefetch cpu"].append(prefetched.step_cpu_times[warmup:])
        torch.set_num_threads(threads)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # Step k processes the same batch in every run: its fastest time is its least-disturbed time.
    n = steps - warmup
    ms = {k: 1000 * sum(map(min, zip(*v))) / n for k, v in times.items()}
    out = {"bare_cpu_ms": ms["bare cpu"], "trainer_cpu_ms": ms["trainer cpu"],
           "ratio_cpu": ms["trainer cpu"] / ms["bare cpu"], "ratio_wall": ms["trainer wall"] / ms["bare wall"]}
    print(f"== step time: {n} steps at batch {batch_size} (mixed sizes, 1 control), CPU, 1 thread, "
          f"fastest of {repeats} runs per step")
    print(f"{'':34s} {'cpu ms':>8s} {'wall ms':>8s}")
    print(f"{'bare forward/backward/step loop':34s} {ms['bare cpu']:8.1f} {ms['bare wall']:8.1f}")
    print(f"{'trainer (stages.train.recipe.run)':34s} {ms['trainer cpu']:8.1f} {ms['trainer wall']:8.1f}")
    print(f"{'trainer, train.prefetch: 2':34s} {ms['prefetch cpu']:8.1f} {ms['prefetch wall']:8.1f}")
    out["prefetch_ratio_wall"] = ms["prefetch wall"] / ms["bare wall"]
    print(f"prefetch / bare: {out['prefetch_ratio_wall']:.3f} (wall; step CPU time only counts the main thread's "
          "share loosely: the reads run in the prefetch thread of the same process)")
    print(f"trainer / bare: {out['ratio_cpu']:.3f} (CPU time), {out['ratio_wall']:.3f} (wall, disturbed by other load); "
          f"target <= 1.05: {'met' if out['ratio_cpu'] <= 1.05 else 'NOT met'}")
    return out


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["padding", "budget", "step-time", "bucketed"],
                    help="run one section (default: all)")
    args = ap.parse_args()
    if args.only in (None, "padding"):
        bench_padding()
    if args.only in (None, "budget"):
        bench_budget()
    if args.only in (None, "step-time"):
        bench_step_time()
    if args.only in (None, "bucketed"):
        bench_bucketed()


if __name__ == "__main__":
    main()
