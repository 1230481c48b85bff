"""Correctness stage of bench/gpu/proof.py: the padded mixed-resolution path on this device's kernels vs each
sample alone through the unmodified diffusers transformer (what tests/models/test_multires.py proves on the CPU).

Per precision (float32 with TF32 off; bfloat16) and per attention backend that runs here: the forward, the
input gradients (image and text tokens) and the weight gradients of one padded batch against the stock model
run sample by sample at batch 1 (its own img_shapes, unpadded text, no mask), and padded outputs / padded
input gradients exactly 0. Errors are max |a - b| / max |b| per tensor (weight gradients: the worst tensor).
bfloat16 is judged against a float32 stock reference, beside the error of the stock model itself in bf16
(`floor`): the batched path should add nothing above that floor.
"""

from __future__ import annotations

import copy
import math
import time
import traceback

import torch

# Backends tried on CUDA (each recorded as ran / its error); on the CPU the ones that exist there.
CUDA_BACKENDS = ["native", "_native_math", "_native_efficient", "_native_cudnn", "flex", "packed", "flash_varlen",
                 "_flash_varlen_3"]
CPU_BACKENDS = ["native", "_native_math", "packed", "flex"]
# Backends that need a package this machine may lack: reported as not installed instead of being run
# (diffusers binds the kernel to None when the import fails, so a call says only "'NoneType' object is not
# callable"). The check is diffusers' own.
NEEDS_PACKAGE = {"flash_varlen": ("flash-attn", "is_flash_attn_available"),
                 "_flash_varlen_3": ("flash-attn 3", "is_flash_attn_3_available")}
# Kernels that take bf16/fp16 only: in float32 they fail by design (recorded as expected, with the error).
NO_FLOAT32_KERNEL = {"_native_cudnn": "cuDNN attention", "packed": "varlen_attn (flash / cuDNN)"}
# float32 (TF32 off): reductions in another order over ~1e4 terms; bf16: relative to the stock-bf16 floor.
FP32_TOL = 1e-4
BF16_FLOOR_FACTOR = 2.0
BF16_MIN_TOL = 2e-2


def dims(smoke: bool) -> dict:
    if smoke:
        return dict(heads=2, head_dim=32, axes=(8, 12, 12), joint=32, layers=1, channels=4)
    return dict(heads=24, head_dim=128, axes=(16, 56, 56), joint=3584, layers=2, channels=16)


def sample_spec(smoke: bool) -> list:
    """(target (h, w) in patches, control sizes, text length): different sizes and aspect ratios, 0-3 controls,
    text lengths that differ (both streams padded)."""
    if smoke:
        return [((4, 6), [(6, 4)], 5), ((6, 4), [], 9), ((2, 4), [(4, 6), (2, 2), (6, 6)], 3)]
    # ~1/4 MP targets (32 x 32 patches = 512² px): the full 1 MP sequence in fp32 at 3072 wide would spend
    # the call's minutes on one backend; the kernels and the layout are the same.
    return [((32, 32), [(32, 32)], 120), ((24, 40), [], 300), ((40, 24), [(24, 40), (16, 16), (32, 32)], 57)]


def make_model(d: dict, dtype: torch.dtype, device: torch.device, seed: int = 0):
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    with torch.device(device):
        model = QwenImageTransformer2DModel(
            patch_size=2, in_channels=4 * d["channels"], out_channels=d["channels"], num_layers=d["layers"],
            attention_head_dim=d["head_dim"], num_attention_heads=d["heads"], joint_attention_dim=d["joint"],
            axes_dims_rope=d["axes"]).to(dtype)
    # Random init leaves the output projection and modulations ~0: give every weight some size (scaled to
    # its fan-in, so 3072-wide activations stay finite) so masking / position mistakes show far above noise.
    g = torch.Generator(device).manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            scale = 1 / math.sqrt(p.shape[-1]) if p.ndim == 2 else 0.05
            p.add_(torch.randn(p.shape, generator=g, device=device, dtype=torch.float32).to(p.dtype) * scale)
    return model.eval()


def make_samples(d: dict, smoke: bool, seed: int = 1) -> list[dict]:
    from models.multires import pack_latents

    g = torch.Generator().manual_seed(seed)
    c = d["channels"]
    out = []
    for (h, w), controls, text_len in sample_spec(smoke):
        out.append(dict(
            target=pack_latents(torch.randn(c, 1, 2 * h, 2 * w, generator=g)),
            controls=[torch.randn(c, 1, 2 * a, 2 * b, generator=g) for a, b in controls],
            prompt=torch.randn(text_len, d["joint"], generator=g),
            shapes=[(1, h, w)] + [(1, a, b) for a, b in controls],
        ))
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def stock_reference(stock, samples, sigmas, weights, device) -> dict:
    """Each sample alone through the unmodified model: outputs, input grads, summed weight grads."""
    from models.multires import pack_latents

    dtype = next(stock.parameters()).dtype
    stock.zero_grad(set_to_none=True)
    outs, gh, gt = [], [], []
    for i, s in enumerate(samples):
        hidden = torch.cat([s["target"]] + [pack_latents(c) for c in s["controls"]]).to(device, dtype)
        hidden = hidden.detach().clone().requires_grad_(True)  # a fresh leaf (never the sample's own tensor)
        prompt = s["prompt"].to(device, dtype).detach().clone().requires_grad_(True)
        out = stock(hidden_states=hidden[None], encoder_hidden_states=prompt[None], timestep=sigmas[i : i + 1].to(device, dtype),
                    img_shapes=[s["shapes"]], return_dict=False)[0][0]
        (out.float() * weights[i][: out.shape[0]].to(device)).sum().backward()
        outs.append(out.detach().float().cpu())
        gh.append(hidden.grad.float().cpu())
        gt.append(prompt.grad.float().cpu())
    return {"out": outs, "grad_hidden": gh, "grad_text": gt, "grad_w": {k: v.float().cpu() for k, v in _grads(stock).items()}}


def batched(multi, samples, sigmas, weights, device, backend: str) -> dict:
    from models.attention import set_backend
    from models.multires import build_batch, multires_forward

    dtype = next(multi.parameters()).dtype
    set_backend(multi, backend)
    multi.zero_grad(set_to_none=True)
    batch = build_batch([s["target"] for s in samples], [s["controls"] for s in samples],
                        [s["prompt"] for s in samples], [s["shapes"] for s in samples]).to(device, dtype)
    hidden = batch.hidden_states.detach().clone().requires_grad_(True)
    text = batch.encoder_hidden_states.detach().clone().requires_grad_(True)
    batch.hidden_states, batch.encoder_hidden_states = hidden, text
    out = multires_forward(multi, batch, sigmas.to(device, dtype))
    w = torch.zeros(out.shape, dtype=torch.float32)
    for i, wi in enumerate(weights):
        w[i, : wi.shape[0]] = wi
    (out.float() * w.to(device)).sum().backward()
    im, em = batch.image_mask.cpu(), batch.encoder_mask.cpu()
    return {"out": out.detach().float().cpu(), "grad_hidden": hidden.grad.float().cpu(),
            "grad_text": text.grad.float().cpu(), "grad_w": {k: v.float().cpu() for k, v in _grads(multi).items()},
            "image_mask": im, "encoder_mask": em}


def compare(ours: dict, ref: dict) -> dict:
    im, em = ours["image_mask"], ours["encoder_mask"]
    fwd = gh = gt = 0.0
    for i in range(len(ref["out"])):
        n, t = int(im[i].sum()), int(em[i].sum())
        fwd = max(fwd, rel(ours["out"][i, :n], ref["out"][i]))
        gh = max(gh, rel(ours["grad_hidden"][i, :n], ref["grad_hidden"][i]))
        gt = max(gt, rel(ours["grad_text"][i, :t], ref["grad_text"][i]))
    keys = [k for k in ref["grad_w"] if ref["grad_w"][k].abs().max() > 0]
    missing = sorted(set(keys) - set(ours["grad_w"]))
    gw = max((rel(ours["grad_w"][k], ref["grad_w"][k]) for k in keys if k in ours["grad_w"]), default=0.0)
    zero = lambda t: bool(torch.equal(t, torch.zeros_like(t)))  # noqa: E731
    return {
        "forward": fwd, "grad_input_image": gh, "grad_input_text": gt, "grad_weights": gw,
        "missing_weight_grads": missing,
        "padded_out_exact_zero": zero(ours["out"][~im]),
        "padded_grad_image_exact_zero": zero(ours["grad_hidden"][~im]),
        "padded_grad_text_exact_zero": zero(ours["grad_text"][~em]),
    }


def run_equivalence(device: torch.device, smoke: bool, deadline: float, record) -> None:
    """Fills record['equivalence'][precision][backend]; record() is called after each backend (partial
    results survive a kill)."""
    from models.multires import install_multires

    d = dims(smoke)
    backends = CUDA_BACKENDS if device.type == "cuda" else CPU_BACKENDS
    samples = make_samples(d, smoke)
    g = torch.Generator().manual_seed(7)
    # exact in bf16: a rounded sigma moves the sinusoidal timestep embedding far more than any kernel does
    sigmas = torch.tensor([0.5, 0.25, 0.75, 0.375, 0.625, 0.125])[: len(samples)]
    weights = [torch.randn(s["target"].shape[0] + sum(c.shape[-1] * c.shape[-2] // 4 for c in s["controls"]),
                           4 * d["channels"], generator=g) for s in samples]
    result = record.setdefault("equivalence", {"dims": {**d, "axes": list(d["axes"])},
                                               "samples": [[list(s) for s in x["shapes"]] + [x["prompt"].shape[0]] for x in samples]})
    for precision in ("float32", "bfloat16"):
        if device.type == "cuda":  # TF32 off for the fp32 proof (it would be tf32 vs fp32, ~3e-4)
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        dtype = getattr(torch, precision)
        stock32 = make_model(d, torch.float32, device)
        ref32 = stock_reference(stock32, samples, sigmas, weights, device)
        entry = result.setdefault(precision, {})
        if dtype is torch.bfloat16:
            stock = copy.deepcopy(stock32).to(dtype)
            floor = compare_stock(stock_reference(stock, samples, sigmas, weights, device), ref32)
            entry["stock_bf16_vs_fp32"] = floor
            tol = {k: max(BF16_MIN_TOL, BF16_FLOOR_FACTOR * v) for k, v in floor.items()}
        else:
            stock = stock32
            tol = {k: FP32_TOL for k in ("forward", "grad_input_image", "grad_input_text", "grad_weights")}
        entry["tolerance"] = tol
        multi = copy.deepcopy(stock)
        install_multires(multi)
        del stock32, stock
        for backend in backends:
            if time.monotonic() > deadline:
                entry.setdefault("not_run_budget", []).append(backend)
                continue
            if (absent := missing_package(backend)) is not None:
                entry[backend] = {"ran": False, "skipped": f"not installed ({absent} absent)"}
                record.flush()
                continue
            t0 = time.perf_counter()
            try:
                errs = compare(batched(multi, samples, sigmas, weights, device, backend), ref32)
                ok = (all(errs[k] <= tol[k] for k in tol) and not errs["missing_weight_grads"]
                      and errs["padded_out_exact_zero"] and errs["padded_grad_image_exact_zero"]
                      and errs["padded_grad_text_exact_zero"])
                entry[backend] = {"ran": True, "ok": ok, **errs, "seconds": time.perf_counter() - t0}
            except Exception as e:  # a backend this build / device lacks: recorded, never silent
                entry[backend] = {"ran": False, "error": f"{type(e).__name__}: {str(e)[:400]}",
                                  "where": traceback.format_exc(limit=-2)[-600:]}
                if dtype is torch.float32 and backend in NO_FLOAT32_KERNEL:
                    entry[backend]["expected"] = f"no float32 kernel ({NO_FLOAT32_KERNEL[backend]} takes bf16/fp16)"
            record.flush()
        del multi
        if device.type == "cuda":
            torch.cuda.empty_cache()


def missing_package(backend: str) -> str | None:
    """The package a backend needs when it is not importable here, else None."""
    if backend not in NEEDS_PACKAGE:
        return None
    import diffusers.utils

    package, check = NEEDS_PACKAGE[backend]
    return None if getattr(diffusers.utils, check)() else package


def did_not_run(r: dict) -> str:
    """One line for a backend that did not run: absent package, expected (no float32 kernel), or the error."""
    if "skipped" in r:
        return r["skipped"]
    if "expected" in r:
        return f"{r['expected']}, expected"
    return f"did not run: {r['error'][:90]}"


def compare_stock(ours: dict, ref: dict) -> dict:
    """Error of the stock model in bf16 vs fp32, sample by sample: the floor the batched bf16 path is judged by."""
    out = max(rel(a, b) for a, b in zip(ours["out"], ref["out"]))
    gh = max(rel(a, b) for a, b in zip(ours["grad_hidden"], ref["grad_hidden"]))
    gt = max(rel(a, b) for a, b in zip(ours["grad_text"], ref["grad_text"]))
    keys = [k for k in ref["grad_w"] if ref["grad_w"][k].abs().max() > 0]
    gw = max(rel(ours["grad_w"][k], ref["grad_w"][k]) for k in keys)
    return {"forward": out, "grad_input_image": gh, "grad_input_text": gt, "grad_weights": gw}
