"""Builds `text` + `vae` tables for train tests with the store writer directly (what the encode stages write).

Latents have a learnable structure (the target is a smooth function of the first control plus a per-sample
offset), so a LoRA can lower the flow-matching loss on held-out samples.
"""

from __future__ import annotations

import contextlib
import hashlib
import unittest.mock
from dataclasses import dataclass, field
from pathlib import Path

import torch

from models.loading import model_fingerprint
from schemas import FieldSpec, Lineage, TableSchema
from store import Store

C, D = 4, 32  # tiny model: z_dim 4, joint_attention_dim 32


@dataclass
class Spec:
    target: tuple[int, int]  # latent h, w (even)
    controls: list[tuple[int, int]] = field(default_factory=list)
    text_len: int = 8
    split: str = "train"
    mask: bool = False
    empty_mask: bool = False  # with `mask`: no token in the edited region (every weight the background's)


def key_of(i: int, tag: str = "") -> str:
    return hashlib.sha256(f"sample-{tag}-{i}".encode()).hexdigest()[:32]


def mixed_specs(n_train: int, n_val: int = 0, masks: bool = False) -> list[Spec]:
    """Mixed sizes, control counts 0..2 and text lengths (tiny: 4x4 .. 8x12 latents)."""
    sizes = [(8, 8), (8, 12), (12, 8), (4, 8), (8, 4), (6, 6), (4, 4), (6, 10)]
    out = []
    for i in range(n_train + n_val):
        controls = [sizes[(i + j + 1) % len(sizes)] for j in range(i % 3)]
        out.append(Spec(sizes[i % len(sizes)], controls, 5 + (i * 3) % 9, "train" if i < n_train else "val",
                        mask=masks and i % 2 == 0))
    return out


def _lineage(stage: str, model: str | None, fingerprint: str | None) -> Lineage:
    fp = fingerprint if fingerprint is not None else model_fingerprint(model)
    return Lineage(stage=stage, config_hash="test", model_fingerprint=fp, upstream={"images": 1}, code_version="test")


def make_train_store(
    root: Path, model: str, specs: list[Spec], seed: int = 0, schema_version: int = 2,
    fingerprint: str | None = None, tag: str = "", skip_text: set[int] = frozenset(), skip_vae: set[int] = frozenset(),
    poison: dict[int, float] | None = None, shard_size_mb: float = 256, attrs: dict | None = None,
) -> Store:
    """poison: sample index -> a value written (checksummed, so not "damaged") into its target latent.
    attrs: added to both tables' schema attrs (e.g. the feature lineage an encode stage records)."""
    st = Store(root)
    g = torch.Generator().manual_seed(seed)
    text_schema = TableSchema(
        name="text",
        fields=[FieldSpec("prompt_embeds", "bfloat16", 2), FieldSpec("empty_embeds", "bfloat16", 2),
                FieldSpec("split", "string", kind="column"), FieldSpec("length", "int64", kind="column")],
        lineage=_lineage("encode-text", model, fingerprint),
        schema_version=schema_version,
        attrs=dict(attrs or {}),
    )
    vae_schema = TableSchema(
        name="vae",
        fields=[FieldSpec("target", "bfloat16", 4), FieldSpec("control_{i}", "bfloat16", 4),
                FieldSpec("mask_weight", "float32", 1, optional=True), FieldSpec("split", "string", kind="column")],
        lineage=_lineage("encode-vae", model, fingerprint),
        schema_version=schema_version,
        attrs={"latents_mean": [0.0] * C, "latents_std": [1.0] * C, **(attrs or {})},
    )
    tw, vw = st.writer("text", text_schema, shard_size_mb=shard_size_mb), st.writer("vae", vae_schema, shard_size_mb=shard_size_mb)
    empty = torch.randn(3, D, generator=g).bfloat16()
    for i, s in enumerate(specs):
        key = key_of(i, tag)
        controls = [torch.randn(C, 1, h, w, generator=g) for h, w in s.controls]
        th, tw_ = s.target
        base = torch.randn(C, 1, th, tw_, generator=g) * 0.3
        if controls:  # learnable: the target follows the first control, resized
            base = base + torch.nn.functional.interpolate(controls[0][:, 0][None], size=(th, tw_))[0][:, None]
        target = (base + 0.5).bfloat16()
        if poison and i in poison:
            target[0, 0, 0, 0] = poison[i]
        shapes = [[1, th // 2, tw_ // 2]] + [[1, h // 2, w // 2] for h, w in s.controls]
        meta_common = {"split": s.split}
        if schema_version >= 2:
            meta_common["img_shapes"] = shapes
        else:  # v1: pixel sizes instead of img_shapes
            meta_common.update(height=th * 8, width=tw_ * 8)
            if s.controls:
                meta_common.update(control_height=s.controls[0][0] * 8, control_width=s.controls[0][1] * 8)
        if i not in skip_text:
            tw.add(key, tensors={"prompt_embeds": torch.randn(s.text_len, D, generator=g).bfloat16(),
                                 "empty_embeds": empty}, meta={**meta_common, "length": s.text_len})
        if i not in skip_vae:
            tensors = {"target": target, **{f"control_{j}": c.bfloat16() for j, c in enumerate(controls)}}
            if s.mask:
                m = torch.zeros(th // 2, tw_ // 2)
                m[: th // 4] = 0.0 if s.empty_mask else 1.0
                tensors["mask_weight"] = m.flatten()
            vw.add(key, tensors=tensors, meta={**meta_common, "num_controls": len(controls), "has_mask": s.mask})
    tw.commit()
    vw.commit()
    return st


def assert_close_lora(a: dict, b: dict, lr: float, steps: int):
    """Same LoRA up to float reassociation (other padding, other reduction order). Adam turns a gradient
    component near 0 into a move of up to ±lr whatever its size, so such rare components may differ by a
    visible fraction of lr: tolerance max |Δ| ≤ 1% of the largest possible move (lr × steps), and all but
    1% of the weights within 1e-7."""
    assert a.keys() == b.keys()
    diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    assert diff.max() <= 0.01 * lr * steps, diff.max()
    assert (diff > 1e-7).float().mean() <= 0.01


def trainer_vs_stock(model: str, store: Path, ours_model, lora_for_stock: Path):
    """(prediction of `ours_model` (a multires transformer with its adapter) on a stored sample with controls,
    the unmodified diffusers pipeline's prediction after `load_lora_weights(lora_for_stock)`, its base prediction),
    at σ 0.4 with the step-0 noise of seed 0."""
    from diffusers import QwenImageEditPipeline

    from models.multires import build_batch, multires_forward, pack_latents
    from models.randomness import draw_noise
    from stages.train.data import load

    tables = open_split(store, model)
    sample = next(s for s in (load(tables, k) for k in tables.keys) if s.controls)
    x_t = pack_latents(sample.target).float() * 0.6 + pack_latents(draw_noise(sample, 0, 0)) * 0.4
    sigma = torch.tensor([0.4])
    batch = build_batch([x_t], [list(sample.controls)], [sample.prompt_embeds], [sample.img_shapes])
    pipe = QwenImageEditPipeline.from_pretrained(model)
    tokens = torch.cat([x_t] + [pack_latents(c).float() for c in sample.controls])[None]

    def stock():
        return pipe.transformer(hidden_states=tokens, encoder_hidden_states=sample.prompt_embeds.float()[None],
                                timestep=sigma, img_shapes=[sample.img_shapes], return_dict=False)[0][0, : x_t.shape[0]]

    with torch.no_grad():
        ours = multires_forward(ours_model, batch.to("cpu", torch.float32), sigma)[0, : x_t.shape[0]]
        base = stock()
        pipe.load_lora_weights(lora_for_stock)
        theirs = stock()
    return ours, theirs, base


@contextlib.contextmanager
def offloaders_built():
    """The `BlockOffloader`s the trainings inside the block build, in a list filled as they are built (what a
    train.offload run streamed: its blocks, its onloads)."""
    from models.offload import BlockOffloader

    seen, original = [], BlockOffloader.__init__

    def spy(self, *a, **k):
        original(self, *a, **k)
        seen.append(self)

    with unittest.mock.patch.object(BlockOffloader, "__init__", spy):
        yield seen


def assert_same_training(a, b) -> None:
    """Two trainings' results (stages.train.recipe.run's) went through the same losses to the same LoRA, bit
    for bit."""
    from models.lora import read_lora

    la, lb = read_lora(a.lora_dir)[0], read_lora(b.lora_dir)[0]
    assert la.keys() == lb.keys()
    for k in la:
        assert torch.equal(la[k], lb[k]), k
    assert a.losses == b.losses


def open_split(store, model: str, split: str = "train", section: str = "train", **settings):
    """`text` + `vae` of one split as the product opens them (`features.open.open_configured`): with the reading
    settings of `section` (train: training and its validator; evaluate), their defaults or those given."""
    from features.open import open_configured
    from models.loading import model_files
    from schemas.config import EvaluateConfig, TrainConfig

    cfg = (TrainConfig if section == "train" else EvaluateConfig)(**settings)
    return open_configured(cfg, section, store, model, model_files(model), split)
