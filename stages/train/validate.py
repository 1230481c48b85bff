"""Validation while training (`train.validate_every`, `train.sample_every`).

Held-out loss: evaluate's protocol on a fixed, capped subset of the val split (the first
`validate_max_samples` keys in sorted order) x `validate_noise_seeds` x `validate_timesteps`, with the trainer's
own flow loss (`models.held_out.loss_grid` over `models.flow`) and `models.randomness.eval_noise` (fixed per
(seed, key), the same at every validation) -> tracker `val/loss` (and `val/loss_ema` with an EMA). Samples: the first `sample_count` of those
val samples generated from their stored features (`models.generate`, seed `train.seed`, `sample_steps` Euler
steps, true CFG 4 against the stored empty prompt) -> `RUN/samples/step-N.png` (one row: each sample's output)
and TensorBoard `samples/grid`.

Resume-exact: validation runs in eval mode (no LoRA dropout), under `torch.no_grad` and a forked global RNG,
and never touches the data stream, so a run with validation trains the same LoRA as one without (tested).

The held-out loss runs on every rank: rank r computes the samples i with i % world == r (one forward per row,
`models.held_out.loss_grid`), the per-row losses are summed across ranks into the full grid, so every rank
holds the same numbers as one process computing them all (tested with two gloo processes). The main process
appends each validation's grid to RUN/losses.zarr (`store.loss_array`, the layout evaluate --all-checkpoints
writes; the base model's losses once, as its reference), readable with `xarray.open_zarr` while training runs.
Sample images stay on the main process.

The curve's setting names the val split's tables by content (`JoinedTables.content_names`, as evaluate's loss
arrays do): an `images` rerun that changed no sample gives new version numbers that a resume accepts (train's
`ResumeRecord.table_contents`), and the curve goes on in the same array instead of being set aside. The version
ids read are kept beside it, with how the losses were measured (precision, quantised base, attention backend:
`measured`), for `pipeline compare` (`LossStore.note`); a curve recorded under version ids (the
earlier spelling) is continued and re-recorded under content.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tqdm.auto import tqdm

from features.open import open_configured
from models.collective import fails_alone, main_alone
from models.generate import Conditioning, generate
from models.held_out import bucket_of, loss_grid
from models.sample import TrainSample
from schemas.config import TrainConfig
from schemas.errors import UserError
from schemas.img_shapes import PIXELS_PER_PATCH
from features.damaged import read_intact
from stages.train.data import load_at
from stages.train.guard import one_line_errors

SAMPLE_CFG = 4.0
# What to change when validation runs out of memory (named in the error every rank prints).
VALIDATION_OOM_ADVICE = ("lower train.sample_count or train.batch_size (held-out rows per forward), or validate "
                         "less often (train.sample_every / validate_every)")


@contextmanager
def untouched(transformer):
    """Eval mode, no grad, the global RNG states restored afterwards: training continues as if nothing ran."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    was_training = transformer.training
    transformer.eval()
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            yield
    finally:
        transformer.train(was_training)


class _Agreement:
    """The validator's ranks agreeing on damaged val samples (`features.damaged.read_intact`)."""

    def __init__(self, world: int) -> None:
        self.world = world

    def reading(self):
        from models.collective import together

        return together(self.world, "read the val samples")

    def any(self, flags: list[int]) -> list[int]:
        from models.collective import all_max

        return all_max(self.world, flags)


class Validator:
    def __init__(self, cfg: TrainConfig, store, model: str, run_dir: Path, world: int = 1, main: bool = True,
                 start_step: int = 0):
        """Every rank reads the same val samples (each computes its share of the grid): opened and read by all
        ranks together, from the same versions (models/same_versions.py), or every rank stops with one line.
        `main`: the process that reads and writes RUN/losses.zarr, the only one that hashes the val split's
        content for its setting (a pass over the manifests' checksum columns)."""
        self.cfg, self.model, self.run_dir = cfg, model, run_dir
        from models.collective import together
        from models.loading import model_fingerprint
        from models.same_versions import check_same_versions

        with together(world, "open the val split"):  # as training reads
            tables = open_configured(cfg, "train", store, model, model_fingerprint(model), "val")
        try:
            check_same_versions(world, tables.versions(), tables.store_root, "train (validation)")
            if not len(tables):  # the same versions on every rank: all alike
                raise UserError(f"train.validate_every / sample_every is set but store {store} has no val "
                                "samples; set resize.val_fraction > 0 or turn validation off")
            # the first validate_max_samples (sorted keys); on_damaged=skip: damaged ones (on any rank) left out,
            # the next read; a limit reached stops every rank alike (the same counts on all)
            with together(world, "read the val samples"):
                self.samples: list[TrainSample] = read_intact(tables, cfg.validate_max_samples,
                                                              lambda i: load_at(tables, i), "read val samples",
                                                              _Agreement(world) if world > 1 else None)
        except BaseException:
            tables.close()
            raise
        keys = [s.key for s in self.samples]
        self.damaged = dict(tables.damaged)  # named by the recipe (main process)
        self._vae = self._scheduler = None
        self._base: np.ndarray | None = None  # the base model's grid: recorded in the curve, or computed
        self._base_known = False  # decided at this process's first validation, by all ranks together
        # the step this start resumes at (0: a fresh start, whose curve begins anew: what a killed earlier start in
        # this folder recorded before its first checkpoint, base included, was measured for another run)
        self.start_step = start_step
        self._losses = None  # RUN/losses.zarr, opened by the main process at its first validation
        self.versions = tables.versions()  # the version ids read
        try:  # the other ranks never read the setting (`_unrecorded` and `record` are the main process's)
            named = tables.content_names() if main else self.versions
        finally:
            tables.close()  # the samples are in memory now
        validate = {"keys": keys, "noise_seeds": list(cfg.validate_noise_seeds),
                    "timesteps": list(cfg.validate_timesteps), "batch_size": cfg.batch_size}
        if cfg.max_tokens_per_batch is not None:  # rows per forward only, and a resume may change it there
            validate = _without_batch_size(validate)
        self.settings = {"tables": named, "model_fingerprint": model_fingerprint(model), "validate": validate}
        self.fingerprint = _fingerprint(self.settings)
        self.measured = measured(cfg)

    def _respelled(self, settings: dict) -> dict:
        """A recorded setting spelled as today's where it was an earlier spelling of it: the tables named by the
        version ids read now (before the curve named them by content), and under a token budget without
        batch_size (hashed before, whatever value it recorded: validation's rows per forward only)."""
        out = dict(settings)
        if out.get("tables") == self.versions:
            out["tables"] = self.settings["tables"]
        validate = out.get("validate")
        if self.cfg.max_tokens_per_batch is not None and isinstance(validate, dict):
            out["validate"] = _without_batch_size(validate)
        return out

    def _curve_fingerprint(self) -> str:
        """The fingerprint RUN/losses.zarr of this setting is recorded under: today's, or that of a curve recorded
        under an earlier spelling of it (`_respelled`: the tables by version ids; under a token budget, batch_size
        still hashed), which the first append re-records under today's (`record`), so neither a later `images`
        rerun that changes no sample nor a batch_size change sets it aside."""
        from store.loss_array import recorded_setting

        recorded = recorded_setting(self.run_dir)
        if recorded is not None and recorded[0] != self.fingerprint and \
                _fingerprint(self._respelled(recorded[1])) == self.fingerprint:
            return recorded[0]
        return self.fingerprint

    def grid(self, transformer, rank: int = 0, world: int = 1, accelerator=None) -> np.ndarray:
        """[sample, seed, σ, region] losses of every val sample: this rank's share computed here, summed across
        ranks (`accelerator.reduce`), so all ranks return the same full grid. Collective when world > 1."""
        mine = [i for i in range(len(self.samples)) if i % world == rank]
        part = loss_grid(transformer, [self.samples[i] for i in mine], list(self.cfg.validate_noise_seeds),
                         [float(t) for t in self.cfg.validate_timesteps], self.cfg.batch_size, "validation")
        full = torch.zeros(len(self.samples), *part.shape[1:], dtype=torch.float64)
        full[mine] = torch.from_numpy(part)  # other ranks' rows stay 0 here; the sum fills them in
        if world > 1:
            full = accelerator.reduce(full.to(accelerator.device), reduction="sum").cpu()
        return full.numpy()

    def loss(self, transformer, rank: int = 0, world: int = 1, accelerator=None) -> float:
        """Mean over samples x seeds x σ of the per-sample flow loss (rows in batches of train.batch_size)."""
        return mean_loss(self.grid(transformer, rank, world, accelerator))

    def samples_grid(self, transformer) -> Image.Image:
        from models.loading import load_component

        if self._vae is None:
            self._vae = load_component(self.model, "vae", dtype=torch.float32, device=transformer.device)
            self._scheduler = dict(load_component(self.model, "scheduler").config)
        images = []
        for s in tqdm(self.samples[: self.cfg.sample_count], desc="samples", leave=False):
            _, h, w = s.img_shapes[0]
            if s.slot_mask is not None:  # Qwen-Image-2.1 (models/qwen21_generate.py), RGB for the grid
                images.append(self._sample_21(transformer, s, h, w))
                continue
            dev, dt = transformer.device, transformer.dtype
            cond = Conditioning(prompt_embeds=s.prompt_embeds.to(dev, dt)[None],
                                control_latents=[c.to(dev, dt)[None] for c in s.controls],
                                negative_embeds=s.empty_embeds.to(dev, dt)[None])
            images.append(generate(transformer, self._vae, self._scheduler, cond, h * PIXELS_PER_PATCH,
                                   w * PIXELS_PER_PATCH, self.cfg.sample_steps, SAMPLE_CFG, self.cfg.seed))
        grid = Image.new("RGB", (sum(im.width for im in images), max(im.height for im in images)))
        x = 0
        for im in images:
            grid.paste(im, (x, 0))
            x += im.width
        return grid

    def _sample_21(self, transformer, s: TrainSample, h: int, w: int) -> Image.Image:
        from diffusers import FlowMatchEulerDiscreteScheduler

        from features.pictures import rgb_over_white
        from models.qwen21_generate import generate_21, pipeline_sample_sigmas
        from models.qwen21_predict import TRUE_CFG_21

        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self._scheduler)
        # 2.1 decodes RGBA: over white, as its targets are (convert("RGB") shows transparent pixels' stored colour)
        return rgb_over_white(generate_21(
            transformer, self._vae, scheduler, s.prompt_embeds, s.slot_mask, list(s.controls), h * 16, w * 16,
            self.cfg.sample_steps, self.cfg.seed, TRUE_CFG_21,  # 2.1: no guidance
            (s.empty_embeds, s.empty_slot_mask), sample_sigmas=pipeline_sample_sigmas(self.model)))

    def _grid_recorded(self, step: int) -> bool:
        return (self.run_dir / "samples" / f"step-{step:06d}.png").is_file()

    def _loss_recorded(self, step: int) -> bool:
        from store.loss_array import recorded_steps

        return step in (recorded_steps(self.run_dir, self._curve_fingerprint()) or {})

    def _base_needed(self, r) -> bool:
        """Whether the base grid is to be computed: not when the curve this run appends to holds it already (a
        resumed process recomputed it, a whole loss pass over the val samples, and threw it away: the curve keeps
        the one it has). Rank 0 reads the run folder (keeping what it read for `record`), every rank follows it
        (the loss pass is collective)."""
        from models.collective import all_max

        from store.loss_array import recorded_base

        if self.start_step == 0:  # a fresh start: its own base (the same on every rank)
            return True
        if r.main:
            shape = (len(self.samples), len(self.cfg.validate_noise_seeds), len(self.cfg.validate_timesteps))
            self._base = recorded_base(self.run_dir, self._curve_fingerprint(), shape)
        return bool(all_max(r.world, [int(r.main and self._base is None)])[0])

    def _unrecorded(self, r, do_loss: bool, do_samples: bool) -> tuple[bool, bool]:
        """At the resumed step: only the parts of the validation due there that left no record in the run folder
        (its losses.zarr row, its sample grid; e.g. the grid failed after the step's checkpoint). One that completed
        is not repeated, and recorded losses were logged too: run again, the resumed writer (it purges only later
        steps) held a second `val/loss` point at that step. Rank 0 reads the run folder, every rank follows it
        (the loss pass is collective)."""
        from models.collective import all_max

        flags = [int(do_loss and not self._loss_recorded(r.step)),
                 int(do_samples and not self._grid_recorded(r.step))] if r.main else [0, 0]
        loss, samples = all_max(r.world, flags)
        return bool(loss), bool(samples)

    def __call__(self, r) -> None:
        """At the configured steps: the held-out loss on every rank (logged and appended to RUN/losses.zarr by
        the main process), the sample grid on the main process."""
        cfg, step = self.cfg, r.step
        do_loss = cfg.validate_every is not None and step % cfg.validate_every == 0
        do_samples = cfg.sample_every is not None and step % cfg.sample_every == 0
        if (do_loss or do_samples) and step == getattr(getattr(r, "result", None), "start_step", None):
            do_loss, do_samples = self._unrecorded(r, do_loss, do_samples)
        if not (do_loss or do_samples):
            return
        # fails_alone: the sample grid and the writes are the main process's alone, and the other ranks go on to
        # the next step's all-reduce; a failure on any rank (out of memory, a full disk) stops every rank with
        # its one line instead of a traceback here and a wait there (models/collective.py)
        with fails_alone(r.world, f"the validation of step {step}", VALIDATION_OOM_ADVICE), untouched(r.transformer):
            if do_loss:
                collective = dict(rank=r.rank, world=r.world, accelerator=r.accelerator)
                if not self._base_known:  # the reference line, the model without its LoRA: once per run
                    if self._base_needed(r):
                        r.transformer.disable_lora()
                        try:
                            self._base = self.grid(r.transformer, **collective)
                        finally:
                            r.transformer.enable_lora()
                    self._base_known = True
                grid = self.grid(r.transformer, **collective)
                loss = mean_loss(grid)
                ema = None
                if r.ema is not None:
                    with r.ema.swapped_in():
                        ema = self.loss(r.transformer, **collective)
                if r.main:
                    with one_line_errors("the validation losses", self.run_dir / "losses.zarr"):
                        self.record(step, grid)
                    r.writer.add_scalar("val/loss", loss, step)
                    r.bar.write(f"step {step}: val loss {loss:.4f} ({len(self.samples)} samples)")
                    if ema is not None:
                        r.writer.add_scalar("val/loss_ema", ema, step)
            if do_samples:
                # the main process generates while the others wait for it through the launcher's store, not in
                # the next step's gradient all-reduce: minutes of generation (a 20B model, many steps, true CFG)
                # passed NCCL's 10-minute collective timeout there and killed the run
                main_alone(r.world, f"the validation of step {step}", lambda: self._write_samples(r, step),
                           VALIDATION_OOM_ADVICE)

    def _write_samples(self, r, step: int) -> None:
        import io

        from store.format import atomic_write_bytes

        grid = self.samples_grid(r.transformer)
        out = self.run_dir / "samples"
        with one_line_errors("the sample grid", out):
            out.mkdir(parents=True, exist_ok=True)
            png = io.BytesIO()
            grid.save(png, format="PNG")
            # whole or absent: a resume takes the file's presence for "this step's grid is done" (`_grid_recorded`)
            atomic_write_bytes(out / f"step-{step:06d}.png", png.getvalue())
        r.writer.add_image("samples/grid", np.asarray(grid), step, dataformats="HWC")

    def record(self, step: int, grid: np.ndarray) -> None:
        """Append this validation to RUN/losses.zarr (main process). The first append of this process drops
        steps >= `step` that a killed run recorded after its last checkpoint, so the curve never doubles back."""
        from store.loss_array import Axes, LossStore

        if self._losses is None:
            recorded = self._curve_fingerprint()
            axes = Axes([s.key for s in self.samples], [bucket_of(s) for s in self.samples],
                        list(self.cfg.validate_noise_seeds), [float(t) for t in self.cfg.validate_timesteps])
            self._losses = LossStore(self.run_dir, recorded, axes, self.settings, self.versions, self.measured)
            if recorded != self.fingerprint:  # an earlier spelling: appended to, not set aside, and re-recorded
                self._losses.refingerprint(self.fingerprint, self.settings, self.versions)  # note_versions: no-op
            if self._losses.kept_aside is not None:  # e.g. the val samples changed under an accepted resume
                from tqdm.auto import tqdm

                tqdm.write(f"validation settings or val samples changed: the earlier validation curve is kept in "
                           f"{self._losses.kept_aside}, a new one begins")
            # for `pipeline compare`: against arrays named by version ids, and against runs measured otherwise
            self._losses.note(table_versions=self.versions, measured=self.measured)
            # what a killed start recorded after the checkpoint this one resumes from (all of it on a fresh start:
            # validate_every enters no hash, so its rows may lie before this start's first validation step)
            self._losses.drop_from(self.start_step + 1 if self.start_step else 0)
            if self.start_step == 0 or not self._losses.has_base():
                self._losses.write_base(self._base)
        self._losses.append(step, f"training step {step}", "", grid)


def _fingerprint(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def measured(cfg: TrainConfig) -> dict:
    """How the validation losses are computed besides the setting they are recorded under (`RUN/losses.zarr`'s
    `measured`, not hashed: the train config fixes it for the run): the resolved precision of the frozen base and
    its autocast, its quantisation, the attention backend. `pipeline compare` refuses two curves measured
    otherwise, as it refuses evaluate arrays of another `evaluate.dtype` etc.: on the same val samples a bf16 or
    quantised base gives other numbers (tiny model, bf16 autocast vs float32: up to 1e-3 on a step's
    mean loss)."""
    return {"dtype": cfg.dtype, "mixed_precision": cfg.mixed_precision, "quantize_base": cfg.quantize_base,
            "attention_backend": cfg.attention_backend}


def _without_batch_size(validate: dict) -> dict:
    return {k: v for k, v in validate.items() if k != "batch_size"}


def mean_loss(grid: np.ndarray) -> float:
    """Mean of the region-"all" losses in row order (sample, seed, σ): the sum the one-process loop made."""
    values = grid[..., 0].reshape(-1).tolist()
    return sum(values) / len(values)
