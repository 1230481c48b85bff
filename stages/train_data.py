"""The trainer's inputs: the `text` + `vae` tables (validated), per-sample loading, per-sample randomness, and
`flow_loss` — the one flow-matching loss that train and evaluate both call.

Randomness is drawn per sample from (seed, step, sample key), never from a global RNG, so a sample gets the
same σ, noise and caption-dropout decision whichever rank or batch it lands in: 1 and N processes (and any
resume point) see the same numbers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

import torch
from torch import Tensor

from models.flow import add_noise, flow_target, mask_token_weights, per_sample_loss, sample_sigmas
from models.multires import build_batch, multires_forward, pack_latents, target_outputs
from pipeline.config import SigmaConfig
from schemas.errors import UserError
from store import Store, TableReader

TABLES = {"text": "encode-text", "vae": "encode-vae"}  # table -> the stage (command) that writes it


@dataclass
class TrainSample:
    """One joined sample, tensors as stored (bf16, on the CPU, possibly zero-copy views of the shards)."""

    key: str
    target: Tensor  # [C, 1, h, w] normalised latent
    controls: list[Tensor]  # each [C, 1, h_i, w_i]
    prompt_embeds: Tensor  # [L, D] valid tokens only
    empty_embeds: Tensor  # [L0, D] the empty prompt (caption dropout)
    img_shapes: list[tuple[int, int, int]]  # patch units, target first, then each control
    mask_weight: Tensor | None = None  # [N_target] float32 edit mask at the token grid, optional

    @property
    def target_tokens(self) -> int:
        return prod(self.img_shapes[0])


@dataclass
class TrainTables:
    """The joined, validated train inputs of one store."""

    store_root: Path
    text: TableReader
    vae: TableReader
    keys: list[str]  # the split's keys, sorted
    lengths: list[int]  # per key: image tokens (target + controls) + text tokens = its sequence length
    damaged: dict[str, str] = field(default_factory=dict)  # on_damaged=skip: key -> problem, left out of `keys`

    def versions(self) -> dict[str, str]:
        """Identities of the tables trained on (version + manifest hash; see `Store.version_id`)."""
        st = Store(self.store_root, create=False)
        return {t: st.version_id(t, r.version) for t, r in (("text", self.text), ("vae", self.vae))}

    def __len__(self) -> int:
        return len(self.keys)

    def sample(self, key: str) -> TrainSample:
        return load_sample(self.text, self.vae, key)


# ---------------------------------------------------------------------------------------------- opening


def _open_table(st: Store, table: str, on_damaged: str = "stop") -> TableReader:
    if table not in st.tables():
        raise UserError(
            f"store {st.root} has no '{table}' table (tables: {sorted(st.tables()) or 'none'}); "
            f"run `pipeline run {TABLES[table]} --store {st.root}` first"
        )
    return st.reader(table, on_damaged=on_damaged)


def _split_keys(r: TableReader, split: str) -> list[str]:
    if "split" not in r.manifest.column_names:
        raise UserError(f"table '{r.table}' v{r.version} ({r.dir}) has no split column; rebuild it with the current code")
    splits = r.manifest.column("split").to_pylist()
    return sorted(k for k, s in zip(r.keys(), splits) if s == split)


def _name_keys(keys: set[str], limit: int = 5) -> str:
    shown = sorted(keys)[:limit]
    return ", ".join(shown) + (f" … ({len(keys)} in all)" if len(keys) > limit else "")


def open_train_tables(
    store: str | Path, model: str, split: str = "train", on_damaged: str = "stop", max_damaged_fraction: float = 0.0,
) -> TrainTables:
    """Open `text` + `vae`, check they were built with `model` and hold the same keys; UserError otherwise.

    on_damaged="stop": a damaged sample raises when it is first read (a missing / short shard on open).
    "skip": every sample of the split is checked now; damaged ones are left out and returned in `damaged`
    (more than `max_damaged_fraction` of them: UserError).
    """
    from models.loading import model_fingerprint

    st = Store(store, create=False)
    text, vae = _open_table(st, "text", on_damaged), _open_table(st, "vae", on_damaged)

    want = model_fingerprint(model)
    for r in (text, vae):
        found = r.schema.lineage.model_fingerprint
        if found != want:
            raise UserError(
                f"table '{r.table}' v{r.version} in {st.root} was built with a different model (fingerprint "
                f"{found or 'none'}) than --model {model} ({want}); use the model that encoded the store, "
                f"or re-run `pipeline run {TABLES[r.table]} --model {model}`"
            )

    text_keys, vae_keys = _split_keys(text, split), _split_keys(vae, split)
    if set(text_keys) != set(vae_keys):
        only_text, only_vae = set(text_keys) - set(vae_keys), set(vae_keys) - set(text_keys)
        parts = []
        if only_text:
            parts.append(f"only in 'text' v{text.version}: {_name_keys(only_text)}")
        if only_vae:
            parts.append(f"only in 'vae' v{vae.version}: {_name_keys(only_vae)}")
        raise UserError(
            f"the '{split}' splits of the text and vae tables in {st.root} hold different keys ({'; '.join(parts)}); "
            "re-run the encode stages so both are built from the same `images` table version"
        )
    if not text_keys:
        raise UserError(
            f"the '{split}' split is empty in store {st.root} (text v{text.version}, vae v{vae.version}); "
            "add training samples (resize-bucket puts val_fraction of them in 'val', the rest in 'train')"
        )
    damaged: dict[str, str] = {}
    if on_damaged == "skip":
        damaged = find_damaged(text, vae, text_keys)
        if len(damaged) > max_damaged_fraction * len(text_keys):
            raise UserError(
                f"{len(damaged)} of {len(text_keys)} '{split}' samples in {st.root} are damaged, more than "
                f"max_damaged_fraction {max_damaged_fraction} (e.g. {next(iter(damaged.values()))}); "
                f"run `pipeline store repair {st.root}`"
            )
        text_keys = [k for k in text_keys if k not in damaged]
        if not text_keys:
            raise UserError(f"every '{split}' sample in {st.root} is damaged; run `pipeline store repair {st.root}`")
    lengths = sequence_lengths(text, vae, text_keys)
    return TrainTables(st.root, text, vae, text_keys, lengths, damaged)


def find_damaged(text: TableReader, vae: TableReader, keys: list[str]) -> dict[str, str]:
    """key -> first problem found, over both tables (reads and checks every sample's bytes once)."""
    from tqdm import tqdm

    out: dict[str, str] = {}
    for k in tqdm(keys, desc="check samples", unit="sample", leave=False):
        problem = text.damaged(k) or vae.damaged(k)
        if problem is not None:
            out[k] = problem
    return out


def sequence_lengths(text: TableReader, vae: TableReader, keys: list[str]) -> list[int]:
    """Token count of each sample's joint sequence, from the manifests only (no tensor is read)."""
    if "length" in text.manifest.column_names:
        text_len = dict(zip(text.keys(), text.manifest.column("length").to_pylist()))
    else:  # the manifest records every tensor's shape too
        rows = text.manifest.column("tensors").to_pylist()
        text_len = {k: next(t["shape"][0] for t in r if t["name"] == "prompt_embeds") for k, r in zip(text.keys(), rows)}
    return [sum(prod(s) for s in vae.img_shapes(k)) + int(text_len[k]) for k in keys]


def load_sample(text: TableReader, vae: TableReader, key: str) -> TrainSample:
    """One sample from both tables; shapes are checked against img_shapes (v1 tables: derived ones)."""
    t, v = text.tensors(key), vae.tensors(key)
    shapes = [tuple(int(x) for x in s) for s in vae.img_shapes(key)]
    n_controls = sum(1 for name in v if name.startswith("control_"))
    controls = [v[f"control_{i}"] for i in range(n_controls)]
    latents = [v["target"], *controls]
    if len(shapes) != len(latents) or any(
        lat.ndim != 4 or (lat.shape[2] // 2, lat.shape[3] // 2) != (s[1], s[2]) for lat, s in zip(latents, shapes)
    ):
        raise UserError(
            f"sample {key} in 'vae' v{vae.version} ({vae.dir}): latent shapes {[tuple(x.shape) for x in latents]} "
            f"do not match img_shapes {shapes}; run `pipeline store verify` on the store"
        )
    mask = v.get("mask_weight")
    return TrainSample(
        key=key,
        target=v["target"],
        controls=controls,
        prompt_embeds=t["prompt_embeds"],
        empty_embeds=t["empty_embeds"],
        img_shapes=shapes,
        mask_weight=mask.float() if mask is not None else None,
    )


# ---------------------------------------------------------------------------------------------- randomness


def sample_generator(seed: int, step: int, key: str, purpose: str) -> torch.Generator:
    """A CPU generator seeded from (seed, step, sample key, purpose) alone."""
    digest = hashlib.sha256(f"{seed}:{step}:{key}:{purpose}".encode()).digest()
    return torch.Generator("cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def draw_noise(sample: TrainSample, seed: int, step: int) -> Tensor:
    """float32 ε shaped like the sample's target latent ([C, 1, h, w]), on the CPU (same on every device)."""
    g = sample_generator(seed, step, sample.key, "noise")
    return torch.randn(tuple(sample.target.shape), generator=g, dtype=torch.float32)


def draw_sigma(sample: TrainSample, seed: int, step: int, cfg: SigmaConfig) -> Tensor:
    """[] float32 σ from the configured distribution (dynamic shift uses the sample's own target length)."""
    g = sample_generator(seed, step, sample.key, "sigma")
    return sample_sigmas(1, cfg, g, [sample.target_tokens])[0]


def draw_caption_dropout(sample: TrainSample, seed: int, step: int, p: float) -> bool:
    if p <= 0:
        return False
    g = sample_generator(seed, step, sample.key, "caption-dropout")
    return bool(torch.rand((), generator=g) < p)


# ---------------------------------------------------------------------------------------------- the loss


def flow_loss(
    transformer,
    samples: list[TrainSample],
    sigmas: Tensor,
    noises: list[Tensor],
    use_empty: list[bool] | None = None,
    mask_weight: tuple[float, float] = (1.0, 1.0),
) -> Tensor:
    """Per-sample flow-matching losses [B] (float32) of `transformer` on a mixed-resolution batch.

    The one loss of the project: train and evaluate both call it.
    - samples: `TrainSample`s (any sizes, any control counts); their tensors may live on the CPU in bf16.
    - sigmas: [B] noise levels σ in [0, 1]; the transformer gets σ as its timestep (diffusers: t/1000).
    - noises: per sample ε shaped like its target latent [C, 1, h, w] (see `draw_noise` for fixed seeds).
    - use_empty: per sample, True = condition on the stored empty-prompt embeds (caption dropout).
    - mask_weight: (foreground, background) token weights from the sample's stored edit mask; samples
      without a mask, or (1, 1), give the plain loss.
    x_t = (1-σ)·x0 + σ·ε, target ε − x0, loss on the target tokens only, averaged per sample over its own
    valid tokens (padding and control tokens never count). Inputs go in the transformer's dtype and device;
    the flow arithmetic and the loss are float32. Gradients flow to whatever in `transformer` requires them.
    """
    device, dtype = transformer.device, transformer.dtype
    if not (len(samples) == len(noises) == sigmas.shape[0]):
        raise ValueError(f"flow_loss: {len(samples)} samples, {len(noises)} noises, {sigmas.shape[0]} sigmas")
    sigmas = sigmas.to(device=device, dtype=torch.float32)
    x0 = [pack_latents(s.target).to(device=device, dtype=torch.float32) for s in samples]
    eps = [pack_latents(n).to(device=device, dtype=torch.float32) for n in noises]
    x_t = [add_noise(x, e, s) for x, e, s in zip(x0, eps, sigmas)]
    prompts = [
        (s.empty_embeds if use_empty is not None and use_empty[i] else s.prompt_embeds).to(device)
        for i, s in enumerate(samples)
    ]
    batch = build_batch(
        [x.to(dtype) for x in x_t],
        [[c.to(device) for c in s.controls] for s in samples],
        prompts,
        [s.img_shapes for s in samples],
    )
    out = multires_forward(transformer, batch, sigmas.to(dtype))
    preds = target_outputs(out, batch)
    targets = [flow_target(x, e) for x, e in zip(x0, eps)]
    weights = None
    if tuple(mask_weight) != (1.0, 1.0):
        weights = [
            mask_token_weights(s.mask_weight, *mask_weight) if s.mask_weight is not None else None for s in samples
        ]
    return per_sample_loss(preds, targets, weights)


def padded_tokens(samples: list[TrainSample]) -> tuple[int, int]:
    """(valid, computed) joint-sequence tokens of a batch of these samples, each padded to the longest."""
    img = [sum(prod(s) for s in x.img_shapes) for x in samples]
    txt = [x.prompt_embeds.shape[0] for x in samples]
    return sum(img) + sum(txt), len(samples) * (max(img) + max(txt))
