"""evaluate's held-out losses against a reference computed apart from the product's loss code: the unmodified
diffusers transformer (no multires install, one sample per forward), the LoRA loaded by diffusers' own reader
(`load_lora_weights`, peft), the flow arithmetic written out here. The same samples, noise (seed, key) and σ; the
report's per-sample, overall, inside / outside the mask and paired numbers then follow from those losses by numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.randomness import eval_noise
from lora_writer import add_random_b_lora
from schemas.config import EvaluateConfig
from train_store import make_train_store, mixed_specs, open_split

SEEDS, SIGMAS = [0, 3], [0.25, 0.8]


@pytest.fixture(scope="module")
def setup(tiny_edit_model, tmp_path_factory):
    from models.loading import load_component
    from models.lora import save_lora

    root = tmp_path_factory.mktemp("reference")
    make_train_store(root / "store", tiny_edit_model, mixed_specs(1, 5, masks=True))
    transformer = load_component(tiny_edit_model, "transformer")
    add_random_b_lora(transformer)  # alpha != rank: the scale must be read
    save_lora(transformer, root / "lora")
    return root


def _pack(latent: torch.Tensor) -> torch.Tensor:
    """diffusers' own packing of a [C, 1, h, w] latent into [1, h/2 * w/2, 4C] tokens."""
    from diffusers import QwenImageEditPipeline

    c, _, h, w = latent.shape
    return QwenImageEditPipeline._pack_latents(latent[:, 0][None].float(), 1, c, h, w)


def _row(transformer, sample, seed: int, sigma: float) -> tuple[float, float, float]:
    """One (sample, seed, σ) row: the loss over all target tokens, inside and outside its mask (NaN without)."""
    x0 = _pack(sample.target)
    eps = _pack(eval_noise(sample, seed))
    x_t = (1 - sigma) * x0 + sigma * eps
    hidden = torch.cat([x_t] + [_pack(c) for c in sample.controls], dim=1)
    prompt = sample.prompt_embeds[None].float()
    pred = transformer(hidden_states=hidden, timestep=torch.tensor([sigma]), encoder_hidden_states=prompt,
                       encoder_hidden_states_mask=torch.ones(prompt.shape[:2], dtype=torch.long),
                       img_shapes=[list(sample.img_shapes)],
                       return_dict=False)[0][:, : x0.shape[1]]
    se = (pred - (eps - x0)).pow(2).mean(dim=-1)[0].double()  # per target token
    m = sample.mask_weight.double().clamp(0, 1) if sample.mask_weight is not None else None
    if m is None or not 0 < float(m.sum()) < m.numel():  # one region empty: no inside / outside loss
        return float(se.mean()), np.nan, np.nan
    return float(se.mean()), float((se * m).sum() / m.sum()), float((se * (1 - m)).sum() / (1 - m).sum())


def _reference_grids(model: str, store, lora) -> tuple[list, np.ndarray, np.ndarray]:
    """(samples, base grid, LoRA grid) [sample, seed, σ, region] by the hand loop."""
    from diffusers import QwenImageEditPipeline

    from stages.train.data import load

    tables = open_split(store, model, split="val", section="evaluate")
    samples = [load(tables, k) for k in tables.keys]
    pipe = QwenImageEditPipeline.from_pretrained(model, torch_dtype=torch.float32)
    grids = []
    with torch.no_grad():
        for with_lora in (False, True):
            if with_lora:
                pipe.load_lora_weights(str(lora))
            grids.append(np.array([[[_row(pipe.transformer, s, k, t) for t in SIGMAS] for k in SEEDS]
                                   for s in samples]))
    return samples, grids[0], grids[1]


def test_held_out_losses_equal_a_hand_loop_over_the_stock_transformer_and_peft(setup, tiny_edit_model, tmp_path):
    from stages.evaluate.stage import run

    cfg = EvaluateConfig(noise_seeds=SEEDS, timesteps=SIGMAS, batch_size=3, num_samples=0, device="cpu",
                         dtype="float32")
    loss = run(cfg, setup / "store", tiny_edit_model, setup / "lora", tmp_path / "report").metrics["loss"]
    samples, base, lora = _reference_grids(tiny_edit_model, setup / "store", setup / "lora")
    assert np.abs(lora - base)[..., 0].max() > 1e-3  # the LoRA changes the losses: its scale is tested
    for i, s in enumerate(samples):
        for name, grid in (("base", base), ("lora", lora)):
            np.testing.assert_allclose(loss["per_sample"][s.key][name], grid[i, ..., 0].mean(), rtol=2e-5)
    for name, grid in (("base", base), ("lora", lora)):
        np.testing.assert_allclose(loss["overall"][name], grid[..., 0].mean(), rtol=2e-5)
        masked = [i for i in range(len(samples)) if np.isfinite(grid[i, 0, 0, 1])]
        assert masked and loss["mask"]["inside"]["n"] == len(masked)
        for r, region in ((1, "inside"), (2, "outside")):
            np.testing.assert_allclose(loss["mask"][region][name], grid[masked, ..., r].mean(), rtol=2e-5)
    d = lora[..., 0].mean(axis=(1, 2)) - base[..., 0].mean(axis=(1, 2))  # paired per sample
    np.testing.assert_allclose(loss["lora_minus_base"]["difference"], d.mean(), rtol=1e-4)
    np.testing.assert_allclose(loss["lora_minus_base"]["standard_error"], d.std(ddof=1) / np.sqrt(d.size), rtol=1e-3)


def test_qwen21_held_out_losses_equal_a_hand_loop_over_the_stock_21_transformer(tiny_21_model, tmp_path):
    """The same on Qwen-Image-2.1: 0..3 references of different sizes, the stock `QwenImage21Pipeline.transformer`
    one sample per forward (references first, then the noised target, σ as the timestep) with the LoRA loaded by
    its own `load_lora_weights`."""
    from diffusers import QwenImage21Pipeline

    from models.loading import load_component, model_fingerprint
    from models.lora import save_lora
    from models.qwen21_multires import joint_image_mask, latent_tokens
    from pipeline.config import load_config
    from stages.encode import text as encode_text
    from stages.encode import vae as encode_vae
    from stages.evaluate.stage import run
    from stages.train.data import load
    from test_qwen21_stages import F32, MIXED, write_store21

    store = write_store21(tmp_path / "store", MIXED, val=range(len(MIXED)))
    encode_text.run(load_config(None, F32), store, tiny_21_model)
    encode_vae.run(load_config(None, F32), store, tiny_21_model)
    transformer = load_component(tiny_21_model, "transformer").float()
    add_random_b_lora(transformer)
    save_lora(transformer, tmp_path / "lora", base_fingerprint=model_fingerprint(tiny_21_model))

    cfg = EvaluateConfig(noise_seeds=SEEDS, timesteps=SIGMAS, batch_size=3, num_samples=0, device="cpu",
                         dtype="float32")
    loss = run(cfg, store, tiny_21_model, tmp_path / "lora", tmp_path / "report").metrics["loss"]
    tables = open_split(store, tiny_21_model, split="val", section="evaluate")
    samples = [load(tables, k) for k in tables.keys]
    assert sorted(len(s.controls) for s in samples) == [0, 1, 1, 2, 3]
    pipe = QwenImage21Pipeline.from_pretrained(tiny_21_model, torch_dtype=torch.float32)

    def row(s, seed: int, sigma: float) -> float:
        x0, eps = latent_tokens(s.target).float(), latent_tokens(eval_noise(s, seed))
        x_t = (1 - sigma) * x0 + sigma * eps
        slots, _ = joint_image_mask(s.slot_mask, x_t.shape[0])
        hw = tuple(int(v) for v in s.img_shapes[0][1:])
        out = pipe.transformer(
            hidden_states=torch.cat([latent_tokens(c).float() for c in s.controls] + [x_t])[None],
            encoder_hidden_states=s.prompt_embeds.float()[None], timestep=torch.tensor([sigma]), img_mask=slots[None],
            img_shapes=[[(1, c.shape[-2], c.shape[-1]) for c in s.controls] + [(1, *hw)]], return_dict=False)[0]
        return float((out[0, -x_t.shape[0]:] - (eps - x0)).pow(2).mean())

    grids = {}
    with torch.no_grad():
        for name in ("base", "lora"):
            if name == "lora":
                pipe.load_lora_weights(tmp_path / "lora")
            grids[name] = np.array([[[row(s, k, t) for t in SIGMAS] for k in SEEDS] for s in samples])
    assert np.abs(grids["lora"] - grids["base"]).max() > 1e-3
    for name, grid in grids.items():
        for i, s in enumerate(samples):
            np.testing.assert_allclose(loss["per_sample"][s.key][name], grid[i].mean(), rtol=2e-5)
        np.testing.assert_allclose(loss["overall"][name], grid.mean(), rtol=2e-5)



def _checkpoint(model: str, folder, seed: int, std: float) -> None:
    """A LoRA (rank 4, alpha 8) with lora_B ~ N(0, std) drawn under `seed`, at FOLDER/lora with the resume.json
    that marks a committed checkpoint."""
    from models.loading import load_component
    from models.lora import save_lora

    transformer = load_component(model, "transformer")
    add_random_b_lora(transformer, seed, std)
    save_lora(transformer, folder / "lora")
    (folder / "resume.json").write_text("{}")


def test_best_checkpoint_picked_and_confirmed_on_halves_equals_the_hand_loop(setup, tiny_edit_model, tmp_path):
    """`evaluate --all-checkpoints` over two checkpoints against the stock transformer + peft hand loop: the halves
    of the val samples made here from their keys (sha256 order: even positions select, odd ones confirm), the
    best = the lower mean loss over the selecting half, its difference to the base and the other checkpoint's to
    it paired over the confirming half by numpy."""
    import hashlib

    from stages.evaluate import checkpoints as ev

    steps = {10: (1, 0.2), 20: (2, 0.05)}
    ckpts = []
    for step, (seed, std) in steps.items():
        folder = tmp_path / "run" / "checkpoints" / f"step-{step}"
        _checkpoint(tiny_edit_model, folder, seed, std)
        ckpts.append((step, folder / "lora"))
    cfg = EvaluateConfig(noise_seeds=SEEDS, timesteps=SIGMAS, batch_size=3, num_samples=0, device="cpu",
                         dtype="float32")
    c = ev.run(cfg, setup / "store", tiny_edit_model, ckpts, tmp_path / "report").metrics["checkpoints"]

    grids = {}
    for step, path in ckpts:
        samples, base, grids[step] = _reference_grids(tiny_edit_model, setup / "store", path)
    keys = [s.key for s in samples]
    order = sorted(range(len(keys)), key=lambda i: hashlib.sha256(keys[i].encode()).hexdigest())
    select = np.zeros(len(keys), dtype=bool)
    select[order[0::2]] = True
    confirm = ~select
    per = {step: g[..., 0].mean(axis=(1, 2)) for step, g in grids.items()}  # [sample]
    b = base[..., 0].mean(axis=(1, 2))
    assert abs(per[10][select].mean() - per[20][select].mean()) > 1e-4  # the pick is not a tie

    sel = c["selection"]
    assert sel["how"] == "split" and sel["optimistic"] is False
    assert sorted(sel["selected_on"]) == sorted(k for k, s in zip(keys, select) if s)
    assert sorted(sel["confirmed_on"]) == sorted(k for k, s in zip(keys, confirm) if s)
    for i, step in enumerate(c["steps"]):
        np.testing.assert_allclose(c["per_step"][i]["overall"], grids[step][..., 0].mean(), rtol=2e-5)
        np.testing.assert_allclose(c["per_step"][i]["selecting"], per[step][select].mean(), rtol=2e-5)
    best = min(steps, key=lambda step: (per[step][select].mean(), step))
    other = 30 - best
    assert c["best"]["step"] == best and c["best"]["runner_up"]["step"] == other
    for got, d in ((c["best"]["vs_base"], per[best] - b), (c["best"]["runner_up"], per[other] - per[best])):
        d = d[confirm]
        assert got["n"] == int(confirm.sum()) == 2
        np.testing.assert_allclose(got["difference"], d.mean(), rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(got["standard_error"], d.std(ddof=1) / np.sqrt(d.size), rtol=1e-3, atol=1e-7)
