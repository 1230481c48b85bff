"""Train stage of bench/gpu/proof.py: the 60-layer full-width transformer (random init, built directly on the
device: no 41 GB save/load), LoRA training steps on realistic synthetic samples, one configuration at a time.

Samples (in memory, bf16, like the store's): 1 MP targets of several aspect ratios, 0-3 controls at ~1 MP each
with its own aspect ratio (10/50/25/15 %), prompts of 50-300 tokens + 188 VL tokens per control (Edit-Plus).
Every configuration trains one epoch over the same samples (after one warm-up batch, two with compile), so
`packed`, masked `native` and the anchors' way (bucketed: batches of one exact shape set, batch 1 when shapes
differ) compare target tokens/s on the same work.

Per configuration: s/step (median), samples/s, target tokens/s, MFU (model FLOPs as bench/rehearsal.py counts
them / time / the dense bf16 peak: the H200's 989 TFLOP/s spec sheet figure, and the matmul rate measured in
this process beside it), peak allocated / reserved (torch.cuda.max_memory_*, weights included), data share
(building the batch on the device in-line, timed apart; the trainer overlaps it with `train.prefetch`), and
`pipeline plan`'s prediction (models/memory_plan.train_plan on the same counts) beside the measured peak.
Memory caps emulate smaller cards with torch.cuda.set_per_process_memory_fraction, set after the model is
built, quantised and offloaded (the cap applies to training, not to the one-off random init).
"""

from __future__ import annotations

import gc
import math
import random
import statistics
import time
import traceback
from collections import defaultdict

import torch

H200_DENSE_BF16 = 989e12  # FLOP/s, NVIDIA's H200 SXM datasheet (dense, no sparsity)
ASPECTS = [1.0, 4 / 3, 3 / 4, 16 / 9, 9 / 16, 3 / 2, 2 / 3]
CONTROLS = ([0, 1, 2, 3], [0.10, 0.50, 0.25, 0.15])
VL_TOKENS_PER_CONTROL = 188


def cfg(quantize="none", ckpt=True, attention="packed", batching=("batch", 4), compile=False, offload=False,
        cap_gib=None, masked=False, uncheckpointed: int | str = 0) -> dict:
    # masked: the attention kernel of padded batches even for a batch of one sample (which otherwise takes the
    # stock path): an all-true image mask through multires_forward. uncheckpointed: leading blocks left out of
    # checkpointing (train.uncheckpointed_blocks), or "largest": the most the plan fits (`largest_fitting`)
    return dict(quantize=quantize, checkpointing=ckpt, attention=attention, batching=list(batching), compile=compile,
                offload=offload, cap_gib=cap_gib, masked=masked, uncheckpointed=uncheckpointed)


# Offloaded configurations run batch 1: batch 4 of 1-MP samples holds ~34 GB of checkpointed activations alone
# (measured plan), more than the 24-48 GB cards they emulate.
# In the order README runs them (first call: the comparisons the targets name; second: memory and speed options).
CONFIGS = {
    "bf16-packed": cfg(),
    "bf16-native": cfg(attention="native"),
    "bf16-anchors": cfg(attention="native", batching=("anchors", 4)),
    # packed at batch 1 (forced through the padded-batch path): no padding at all, so beside bf16-anchors
    # (the stock path, dense flash) it isolates varlen_attn and the gather / scatter around it from batch 4's
    # padding (on the H200 batch 4 ran 0.765x the anchors' tokens/s, padding explains 0.853)
    "bf16-packed-b1": cfg(batching=("batch", 1), masked=True),
    # bf16-packed-b1 with the leading blocks that fit left out of checkpointing (not recomputed): the recompute
    # is a third of a checkpointed step's work, each block kept ~2 GiB of activations at these samples
    "bf16-packed-b1-partial": cfg(batching=("batch", 1), masked=True, uncheckpointed="largest"),
    # compile at batch 1: at 1 MP one sample fills the GPU (batch 4 only adds padding), and compile gave batch 4
    # 1.25x (2026-12-04); the likeliest configuration to reach the MFU target
    "bf16-packed-b1-compile": cfg(batching=("batch", 1), masked=True, compile=True),
    "bf16-packed-nockpt": cfg(ckpt=False, batching=("batch", 1)),  # all 60 blocks' activations: one sample
    "bf16-packed-budget": cfg(batching=("budget", 65536)),
    "bf16-packed-compile": cfg(compile=True),
    "int8-packed": cfg(quantize="int8"),
    "fp8-packed": cfg(quantize="fp8"),
    "int8-offload-24g": cfg(quantize="int8", offload=True, cap_gib=24, batching=("batch", 1)),
    "fp8-offload-24g": cfg(quantize="fp8", offload=True, cap_gib=24, batching=("batch", 1)),
    "int8-offload-32g": cfg(quantize="int8", offload=True, cap_gib=32, batching=("batch", 1)),
    "bf16-offload-48g": cfg(offload=True, cap_gib=48, batching=("batch", 1)),
}

# --smoke (the CPU test): one configuration per code path (packed / native / anchors / budget / quantised /
# offload under a cap).
SMOKE_CONFIGS = ["bf16-packed", "bf16-native", "bf16-anchors", "bf16-packed-b1", "bf16-packed-b1-partial",
                 "bf16-packed-budget", "int8-packed", "int8-offload-24g"]
# "largest" plans against this share of the card: the plan's own accuracy target is 10 % (it measured 0.97-0.99
# of the peak allocated on the H200, and the allocator reserves more than it allocates)
PLAN_HEADROOM = 0.9


def patches(area_px: int, aspect: float, multiple: int = 32) -> tuple[int, int]:
    h = max(multiple, round(math.sqrt(area_px / aspect) / multiple) * multiple)
    w = max(multiple, round(math.sqrt(area_px * aspect) / multiple) * multiple)
    return h // 16, w // 16


def make_samples(n: int, area_px: int, joint_dim: int, channels: int, seed: int = 0, text_range=(50, 300)):
    from models.sample import TrainSample

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        shapes = [patches(area_px, rng.choice(ASPECTS))]
        shapes += [patches(area_px, rng.choice(ASPECTS)) for _ in range(rng.choices(*CONTROLS)[0])]
        text = rng.randint(*text_range) + VL_TOKENS_PER_CONTROL * (len(shapes) - 1) * (area_px >= 2**18)
        lat = [torch.randn(channels, 1, 2 * h, 2 * w, generator=g).bfloat16() for h, w in shapes]
        out.append(TrainSample(key=f"{i:032x}", target=lat[0], controls=lat[1:],
                               prompt_embeds=torch.randn(text, joint_dim, generator=g).bfloat16(),
                               empty_embeds=torch.randn(4, joint_dim, generator=g).bfloat16(),
                               img_shapes=[(1, h, w) for h, w in shapes]))
    return out


def seq_len(s) -> int:
    return sum(math.prod(x) for x in s.img_shapes) + s.prompt_embeds.shape[0]


def batches_for(samples, batching: list) -> list[list[int]]:
    from stages.train.budget import make_sampler

    kind, size = batching
    lengths = [seq_len(s) for s in samples]
    if kind == "anchors":  # one exact shape set per batch (other trainers' buckets); batch 1 when shapes differ
        buckets = defaultdict(list)
        for i, s in enumerate(samples):
            buckets[tuple(s.img_shapes)].append(i)
        return [b[j : j + size] for b in buckets.values() for j in range(0, len(b), size)]
    sampler = make_sampler(lengths, size if kind == "batch" else 1, size if kind == "budget" else None, 0, 64, 1)
    return [step[0] for step in sampler.global_steps(0)]


def build_model(d: dict, device: torch.device, seed: int = 0):
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):  # random init where it runs: no host copy of 41 GB
            return QwenImageTransformer2DModel(**d)
    finally:
        torch.set_default_dtype(old)


def counts_of(model):
    from models.memory_plan import counts_from_model

    return counts_from_model(model)


def quantize_in_place(model, kind: str) -> None:
    from models.quantize import install_frozen_linear_backward, quantize_rows, quantized_weight_names

    for name in quantized_weight_names(model):
        owner, _, pname = name.rpartition(".")
        mod = model.get_submodule(owner)
        q = quantize_rows(mod.weight.detach(), kind)
        mod._parameters[pname] = torch.nn.Parameter(q, requires_grad=False)
    install_frozen_linear_backward(model)


def setup(d: dict, c: dict, device: torch.device, smoke: bool):
    """The train stage's setup_transformer, on a model built in memory (same order of operations)."""
    from models.attention import use_attention_backend
    from models.lora import add_lora, lora_parameters
    from models.multires import install_multires
    from pipeline.config import load_config
    from stages.train import build

    model = build_model(d, device)
    counts = counts_of(model)
    install_multires(model)
    backend = use_attention_backend(model, c["attention"], "proof train.attention_backend", device, torch.bfloat16)
    model.requires_grad_(False)
    if c["quantize"] != "none":
        quantize_in_place(model, c["quantize"])
    torch.manual_seed(0)
    add_lora(model, load_config(None, {}).train.lora)
    if c["checkpointing"] or c["offload"]:
        from models.checkpointing import enable_checkpointing

        enable_checkpointing(model, c["uncheckpointed"])
    if c["compile"]:
        model.compile_repeated_blocks(dynamic=True, **build.COMPILE_OPTIONS)
    if c["offload"]:
        from models.offload import offload_blocks

        offload_blocks(model, device, keep=0)
    model.train()
    return model, lora_parameters(model), counts, backend


def matmul_rate(device: torch.device, smoke: bool) -> float:
    n = 512 if smoke else 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    best = float("inf")
    for _ in range(4):
        _sync(device)
        t = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _alloc_retries(device: torch.device) -> int:
    """How often the caching allocator found no block, freed its cache and asked CUDA again: each one is a
    device-wide sync. A run at the card's edge (2026-12-04: partial checkpointing, 138.8 of 139.8 GiB reserved,
    no speed-up where 1.28x was expected) shows it here."""
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if device.type == "cuda" else 0


def run_config(name: str, c: dict, d: dict, samples, batches: list[list[int]], plan: dict, device: torch.device,
               smoke: bool, deadline: float) -> dict:
    from bench.rehearsal import model_flops_per_step
    from models.flow import flow_loss_of, prepare_flow_batch
    from models.randomness import draw_noise

    cuda = device.type == "cuda"
    model, params, counts, backend = setup(d, c, device, smoke)
    opt = torch.optim.AdamW(params, lr=1e-4)
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        # before the cap and the first step, kept in `plan` so a failed configuration reports it too: under
        # offload it tells weights left on the device at setup from memory a step gains (2026-12-04: int8 +
        # offload ran out at 22.7 GiB of a 24 GiB cap, planned 10.3: recomputed blocks kept their weights)
        plan["allocated_after_setup"] = torch.cuda.memory_allocated(device)
        if c["cap_gib"]:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, c["cap_gib"] * 2**30 / total), _index(device))
        torch.cuda.reset_peak_memory_stats(device)
    warm = 2 if c["compile"] else 1
    g = torch.Generator().manual_seed(0)
    rows, partial = [], False
    offloader = getattr(model, "_block_offloader", None)
    try:
        for step, b in enumerate(batches[:warm] + batches):
            if time.monotonic() > deadline:
                partial = True
                break
            _sync(device)
            retries = _alloc_retries(device)
            t0 = time.perf_counter()
            picked = [samples[i] for i in b]
            sig = torch.rand(len(b), generator=g) * 0.9 + 0.05
            fb = prepare_flow_batch(picked, sig, [draw_noise(s, 0, step) for s in picked], None, (1.0, 1.0), device,
                                    torch.bfloat16)
            _sync(device)
            t1 = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = (masked_loss(model, fb) if c.get("masked") else flow_loss_of(model, fb)).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            t2 = time.perf_counter()
            if step >= warm:
                rows.append(dict(seconds=t2 - t0, data_seconds=t1 - t0, samples=len(b), loss=loss.item(),
                                 alloc_retries=_alloc_retries(device) - retries,
                                 target_tokens=sum(s.target_tokens for s in picked),
                                 lengths=[seq_len(s) for s in picked], padded_tokens=padded_tokens(picked)))
    finally:  # in `plan` so a configuration that runs out of memory reports it too
        if offloader is not None:  # blocks whose device weights are alive: 1 at a time when offload works
            plan["offload_most_live_blocks"] = offloader.most_live
            plan["offload_live_blocks_at_end"] = sorted(offloader.live)
            plan["offload_unhidden_onloads"] = [offloader.unhidden, offloader.onloads]  # waited for, of all
    out = {"config": c, "attention_backend": backend, "steps": len(rows), "partial": partial,
           "batches_per_epoch": len(batches), **plan, "rows": rows}
    if rows:
        total = sum(r["seconds"] for r in rows)
        flops = sum(model_flops_per_step(counts.token_linear_params, counts.blocks, counts.width, r["lengths"],
                                         c["checkpointing"] or c["offload"], c["uncheckpointed"]) for r in rows)
        peak_rate = H200_DENSE_BF16 if cuda else None
        measured_rate = matmul_rate(device, smoke)
        out.update(
            s_per_step=statistics.median(r["seconds"] for r in rows),
            samples_per_s=sum(r["samples"] for r in rows) / total,
            target_tokens_per_s=sum(r["target_tokens"] for r in rows) / total,
            data_share=sum(r["data_seconds"] for r in rows) / total,
            model_flops=flops,
            mfu_vs_spec=flops / total / peak_rate if peak_rate else None,
            peak_flops_spec=peak_rate,
            mfu_vs_measured_matmul=flops / total / measured_rate,
            measured_matmul_flops=measured_rate,
            losses=[r["loss"] for r in rows],
            alloc_retries=sum(r["alloc_retries"] for r in rows),
        )
    if cuda:
        out.update(peak_allocated=torch.cuda.max_memory_allocated(device), peak_reserved=torch.cuda.max_memory_reserved(device))
    if cuda and out.get("peak_allocated"):
        out["plan_over_measured"] = plan["plan_bytes"] / out["peak_allocated"]
    del model, params, opt
    if cuda:  # the device memory the next configuration's cap needs; on the CPU (the smoke) 0.3-2 s per call
        gc.collect()
        torch.cuda.set_per_process_memory_fraction(1.0, _index(device))
        torch.cuda.empty_cache()
    return out


def masked_loss(model, fb):
    """flow_loss_of with the image mask always passed: the padded-batch attention path even at batch 1."""
    from models.flow import per_sample_loss
    from models.multires import multires_forward, target_outputs

    out = multires_forward(model, fb.batch, fb.sigmas.to(model.dtype), attention_kwargs={"image_mask": fb.batch.image_mask})
    return per_sample_loss(target_outputs(out, fb.batch), fb.targets, fb.weights)


def padded_tokens(picked) -> int:
    """Tokens the batch's linears process: every sample padded to the batch's longest image sequence and its
    longest text (build_batch pads the two streams apart)."""
    img = max(sum(math.prod(x) for x in s.img_shapes) for s in picked)
    return len(picked) * (img + max(s.prompt_embeds.shape[0] for s in picked))


def plan_of(c: dict, samples, batches: list[list[int]], counts) -> dict:
    """`pipeline plan`'s prediction for this configuration (models/memory_plan.train_plan on the model's counts,
    the longest padded sample x the largest batch), and the epoch's padding (padded / real tokens): known before
    the configuration runs, so a failed or skipped one still has them."""
    from models.memory_plan import train_plan

    plan_batch = max(len(b) for b in batches)
    plan_tokens = max(max(seq_len(samples[i]) for i in b) for b in batches)
    plan = train_plan("", "bfloat16", c["quantize"], plan_batch, plan_tokens, c["checkpointing"] or c["offload"], 16,
                      "blocks" if c["offload"] else "none", 0, counts=counts, uncheckpointed_blocks=c["uncheckpointed"])
    real = sum(seq_len(samples[i]) for b in batches for i in b)
    padded = sum(padded_tokens([samples[i] for i in b]) for b in batches)
    return dict(plan_bytes=plan.total, plan_parts=plan.parts, plan_batch=plan_batch, plan_tokens_per_sample=plan_tokens,
                padding_share=padded / real)


def largest_fitting(c: dict, samples, batches: list[list[int]], counts, card_bytes: int | None) -> dict:
    """`c` with uncheckpointed "largest" resolved: the most leading blocks `pipeline plan` fits in
    PLAN_HEADROOM of the card (models/memory_plan.largest_uncheckpointed; 0 when not even full checkpointing
    fits); without a card (the CPU smoke) half the blocks, so both kinds of block run."""
    from models.memory_plan import largest_uncheckpointed

    if c["uncheckpointed"] != "largest":
        return c
    if card_bytes is None:
        return {**c, "uncheckpointed": counts.blocks // 2}
    n = largest_uncheckpointed(lambda k: plan_of({**c, "uncheckpointed": k}, samples, batches, counts)["plan_bytes"],
                               counts.blocks, PLAN_HEADROOM * card_bytes)
    return {**c, "uncheckpointed": n or 0}


def over_limit(plan_bytes: int, c: dict, card_bytes: int | None) -> str | None:
    """Why a configuration is not run: its plan exceeds the memory cap it emulates, or the card, by more than
    10 % (plan's own accuracy target), so it would only spend GPU minutes reaching an out-of-memory error."""
    if c["cap_gib"]:
        limit, what = c["cap_gib"] * 2**30, f"the {c['cap_gib']:g} GiB cap"
    else:
        limit, what = card_bytes, "the card's " + (f"{card_bytes / 2**30:.1f} GiB" if card_bytes else "memory")
    if limit is None or plan_bytes <= 1.1 * limit:
        return None
    return f"plan {plan_bytes / 2**30:.3g} GiB exceeds {what} by more than 10 %"


def meta_counts(d: dict):
    """The transformer's counts from a model built on the meta device (no memory, no time)."""
    from diffusers import QwenImageTransformer2DModel

    with torch.device("meta"):
        return counts_of(QwenImageTransformer2DModel(**d))


def _index(device: torch.device) -> int:
    # set_per_process_memory_fraction wants an index; "cuda" alone is refused
    return device.index if device.index is not None else torch.cuda.current_device()


def run_train(device: torch.device, smoke: bool, deadline: float, record, names: list[str] | None,
              layers: int | None, n_samples: int | None) -> None:
    from models.full_width import FULL_TRANSFORMER

    if smoke:
        d = dict(patch_size=2, in_channels=16, out_channels=4, attention_head_dim=32, num_attention_heads=2,
                 joint_attention_dim=32, axes_dims_rope=(8, 12, 12), num_layers=layers or 2)
        samples = make_samples(n_samples or 4, 64 * 64, 32, 4, text_range=(3, 12))
    else:
        d = dict(FULL_TRANSFORMER, num_layers=layers or 60)
        samples = make_samples(n_samples or 8, 1024 * 1024, FULL_TRANSFORMER["joint_attention_dim"], 16)
    record.setdefault("samples", [dict(shapes=[list(x) for x in s.img_shapes], text=s.prompt_embeds.shape[0])
                                  for s in samples])
    record["layers"] = d["num_layers"]
    configs = record.setdefault("configs", {})
    counts = meta_counts(d)
    card = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    for name in names or list(CONFIGS):
        if smoke and name not in SMOKE_CONFIGS:  # one of each code path; compile: a minute of tracing on a CPU
            record.setdefault("skipped_smoke", []).append(name)
            continue
        if time.monotonic() > deadline:
            record.setdefault("not_run_budget", []).append(name)
            record.flush()
            continue
        began = time.monotonic()  # the build included: what the configuration costs a lease (planning the next)
        batches = batches_for(samples, CONFIGS[name]["batching"])
        c = largest_fitting(CONFIGS[name], samples, batches, counts, card)
        plan = plan_of(c, samples, batches, counts)
        if (why := over_limit(plan["plan_bytes"], c, card)) is not None:
            configs[name] = {"config": c, **plan, "skipped": why}
            record.flush()
            continue
        failed = False
        try:
            configs[name] = run_config(name, c, d, samples, batches, plan, device, smoke, deadline)
        except Exception as e:  # out of memory under a cap, a kernel this build lacks: recorded, and on to the next
            configs[name] = {"config": c, **plan, "error": f"{type(e).__name__}: {str(e)[:400]}",
                             "where": traceback.format_exc(limit=-3)[-800:]}
            failed = True
        if failed:  # after the except block: its traceback held the failed configuration's model alive
            gc.collect()
            if device.type == "cuda":
                torch.cuda.set_per_process_memory_fraction(1.0, _index(device))
                torch.cuda.empty_cache()
        configs[name]["wall_seconds"] = time.monotonic() - began
        record.flush()
