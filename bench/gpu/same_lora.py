"""Correctness stage, part two: throughput options that must not change what is trained, and quantised bases.

`run_same_lora`: the real train stage (stages.train.recipe.run) on a small model folder and store
(bench/train.py's step-time fixture), once per variant - plain, plain again (the run-to-run noise of this
device's kernels), block offload (side-stream copies, pinned host weights), the pinned prefetch thread
(train.prefetch 2), regional compile - from the same seed over the same batches; each variant's saved LoRA
against the plain run's (max |a - b| / max |b| over the LoRA tensors).
Gradient checkpointing is on in every variant (offload turns it on), so the plain run is the same math.

`run_quantized`: the correctness-width model in bf16 vs the same weights with the block linears quantised
(int8 / fp8 weight-only, per output channel; nf4 when bitsandbytes is importable) through
models/quantize.py's frozen linear: relative loss deviation on one padded batch, and the LoRA gradients finite.
"""

from __future__ import annotations

import copy
import importlib.util
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
VARIANTS = {
    "plain": {},
    "plain-again": {},  # run-to-run noise: CUDA's flash / efficient attention backwards accumulate atomically
    "offload": {"train.offload": "blocks", "train.offload_blocks_on_device": 0},
    "prefetch": {"train.prefetch": 2},
    "compile": {"train.compile": True},
}
# bf16 base + bf16 autocast on CUDA: offload and prefetch move bytes only (expected bit-identical); compile
# may fuse differently (bf16 rounding of fused ops), so it is judged with a tolerance.
# A variant passes within max(its tolerance, 2 x the plain run's own run-to-run difference).
SAME_LORA_TOL = {"plain": 0.0, "plain-again": 0.0, "offload": 0.0, "prefetch": 0.0, "compile": 5e-2}


def _bench_train_module():
    spec = importlib.util.spec_from_file_location("bench_train_fixture", REPO / "bench" / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_same_lora(device: torch.device, smoke: bool, work: Path, deadline: float, record) -> None:
    from safetensors.torch import load_file

    from models.lora import lora_weight_file
    from pipeline.config import load_config
    from stages.train import recipe

    model, store = _bench_train_module()._step_time_fixture(work)
    steps = 3 if smoke else 6
    base = {"train.device": device.type, "train.max_steps": steps, "train.batch_size": 4,
            "train.checkpoint_every": 10 * steps, "train.lora.rank": 16, "train.gradient_checkpointing": True,
            "train.seed": 0}
    entry = record.setdefault("same_lora", {"steps": steps, "tolerance": SAME_LORA_TOL})
    loras = {}
    for name, extra in VARIANTS.items():
        if smoke and name == "compile":  # ~1 min of tracing on a CPU (tests/stages/test_train_throughput covers it)
            entry.setdefault("skipped_smoke", []).append(name)
            continue
        if time.monotonic() > deadline:
            entry.setdefault("not_run_budget", []).append(name)
            continue
        t0 = time.perf_counter()
        try:
            cfg = load_config(None, {**base, **extra})
            result = recipe.run(cfg, store, model, work / f"run-{name}")
            loras[name] = load_file(str(lora_weight_file(result.lora_dir)))
            entry[name] = {"ran": True, "seconds": time.perf_counter() - t0, "losses": result.losses.tolist()}
        except Exception as e:
            entry[name] = {"ran": False, "error": f"{type(e).__name__}: {str(e)[:400]}",
                           "where": traceback.format_exc(limit=-3)[-800:]}
        record.flush()
    ref = loras.get("plain")

    def diff(lora) -> float:
        return max(((lora[k].double() - ref[k].double()).abs().max() / ref[k].double().abs().max().clamp_min(1e-30)).item()
                   for k in ref)

    noise = diff(loras["plain-again"]) if ref is not None and "plain-again" in loras else None
    entry["run_to_run_noise"] = noise
    for name, lora in loras.items():
        if ref is None or name == "plain":
            continue
        err = diff(lora)
        entry[name].update(max_rel_diff_vs_plain=err, bit_identical=all(torch.equal(lora[k], ref[k]) for k in ref),
                           ok=err <= max(SAME_LORA_TOL[name], 2 * (noise or 0.0)))
    record.flush()


def run_quantized(device: torch.device, smoke: bool, deadline: float, record) -> None:
    from bench.gpu.correctness import dims, make_model, make_samples
    from models.lora import add_lora, lora_parameters
    from models.multires import build_batch, install_multires, multires_forward
    from models.quantize import install_frozen_linear_backward, quantize_rows, quantize_rows_nf4, quantized_weight_names
    from pipeline.config import load_config

    d = dims(smoke)
    samples = make_samples(d, smoke)
    base = make_model(d, torch.bfloat16, device)
    install_multires(base)
    lora_cfg = load_config(None, {}).train.lora
    g = torch.Generator().manual_seed(11)
    sigmas = torch.tensor([0.5, 0.25, 0.75, 0.375, 0.625, 0.125])[: len(samples)].to(device, torch.bfloat16)
    batch = build_batch([s["target"] for s in samples], [s["controls"] for s in samples],
                        [s["prompt"] for s in samples], [s["shapes"] for s in samples]).to(device, torch.bfloat16)
    target = torch.randn(batch.hidden_states.shape, generator=g).to(device)

    def loss_of(model) -> tuple[float, bool]:
        torch.manual_seed(0)
        add_lora(model, lora_cfg)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = multires_forward(model, batch, sigmas)
        m = batch.image_mask[..., None]
        loss = ((out.float() - target) ** 2 * m).sum() / (m.sum() * out.shape[-1])
        loss.backward()
        finite = all(p.grad is not None and torch.isfinite(p.grad).all().item() for p in lora_parameters(model))
        return loss.item(), finite

    entry = record.setdefault("quantized", {})
    ref_loss, ref_finite = loss_of(copy.deepcopy(base))
    entry["bfloat16"] = {"loss": ref_loss, "lora_grads_finite": ref_finite}
    kinds = ["int8", "fp8"]
    if importlib.util.find_spec("bitsandbytes") is not None:
        kinds.append("nf4")
    for kind in kinds:
        if time.monotonic() > deadline:
            entry.setdefault("not_run_budget", []).append(kind)
            continue
        try:
            model = copy.deepcopy(base)
            for name in quantized_weight_names(model):
                owner, _, pname = name.rpartition(".")
                mod = model.get_submodule(owner)
                w = mod.weight.detach()
                q = quantize_rows_nf4(w) if kind == "nf4" else quantize_rows(w, kind)
                mod._parameters[pname] = q if kind == "nf4" else torch.nn.Parameter(q, requires_grad=False)
            install_frozen_linear_backward(model)
            loss, finite = loss_of(model)
            entry[kind] = {"ran": True, "loss": loss, "rel_loss_deviation": abs(loss - ref_loss) / abs(ref_loss),
                           "lora_grads_finite": finite}
        except Exception as e:
            entry[kind] = {"ran": False, "error": f"{type(e).__name__}: {str(e)[:400]}",
                           "where": traceback.format_exc(limit=-3)[-800:]}
        record.flush()
