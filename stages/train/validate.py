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

The curve itself, its setting and how it was measured: `stages/train/val_curve.py`.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tqdm.auto import tqdm

from features.open import open_configured
from models.collective import fails_alone, main_alone
from models.generate import Conditioning, generate
from models.held_out import loss_grid
from models.sample import TrainSample
from schemas.config import TrainConfig
from schemas.errors import UserError
from schemas.img_shapes import PIXELS_PER_PATCH
from schemas.units import count_text
from features.damaged import read_intact
from stages.train.data import load_at
from stages.train.guard import one_line_errors
from stages.train.val_curve import ValidationCurve

SAMPLE_CFG = 4.0
# What to change when validation runs out of memory (named in the error every rank prints).
VALIDATION_OOM_ADVICE = ("lower train.sample_count or train.batch_size (held-out rows per forward), or validate "
                         "less often (train.sample_every / validate_every)")
SAMPLES_DIR = "samples"


def grid_path(run_dir: Path, step: int) -> Path:
    return run_dir / SAMPLES_DIR / f"step-{step:06d}.png"


def forget_grids(run_dir: Path) -> None:
    """A fresh start's grids begin anew: those of a start killed before its first checkpoint were made by another
    run, and a resume of this one at their step would take one for its own (`Validator._grid_recorded`)."""
    folder = run_dir / SAMPLES_DIR
    if folder.is_dir():
        for p in folder.iterdir():  # grids and the temp files of a write the kill cut short
            if p.name.startswith(("step-", ".step-")) and p.is_file():
                p.unlink(missing_ok=True)


def check_val_budget(cfg: TrainConfig, samples: list[TrainSample]) -> None:
    """Under a token budget, the val samples validation runs (all of them for the held-out loss, the first
    `sample_count` for sample grids alone) refused as training samples are (`refuse_over_budget`): one longer
    than the budget runs alone over it, an out-of-memory at the first validation, after hours of training."""
    if cfg.max_tokens_per_batch is None:
        return
    from stages.train.budget import refuse_over_budget

    run = samples if cfg.validate_every is not None else samples[: cfg.sample_count]
    refuse_over_budget([s.sequence_tokens for s in run], cfg.max_tokens_per_batch, "val", [s.key for s in run],
                       " at the first validation", ", or turn validation off (unset train.validate_every and "
                       "train.sample_every)")


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


def _curve_tables(tables, cfg: TrainConfig, run_dir: Path) -> tuple[dict, dict | None]:
    """(the val split's tables as the curve's setting names them: by the content of the rows validation reads, the
    first validate_max_samples and the damaged ones left out, as evaluate names its loss arrays; the whole split's
    names where a curve is recorded already, the spelling it was recorded under before, else None). Named by the
    whole split, a val sample added or changed past those rows (an `images` rerun) set the curve aside on resume
    and `pipeline compare` refused two curves of the same samples."""
    from features.damaged import rows_read
    from store.loss_array import recorded_setting

    scored = rows_read(tables, cfg.validate_max_samples)
    whole = tables.content_names() if scored is not None and recorded_setting(run_dir) is not None else None
    return tables.content_names(scored), whole


class Validator:
    def __init__(self, cfg: TrainConfig, store, model: str, run_dir: Path, world: int = 1, main: bool = True,
                 start_step: int = 0, attention_backend: str | None = None):
        """Every rank reads the same val samples (each computes its share of the grid): opened and read by all
        ranks together, from the same versions (models/same_versions.py), or every rank stops with one line.
        `main`: the process that reads and writes RUN/losses.zarr, the only one that hashes the val split's
        content for its setting (a pass over the manifests' checksum columns)."""
        self.cfg, self.model, self.run_dir = cfg, model, run_dir
        from models.collective import together
        from models.loading import model_files
        from models.same_versions import check_same_versions
        from schemas.model_files import fingerprint_of

        with together(world, "open the val split"):  # as training reads
            files = model_files(model)  # one walk: the tables' check and the curve's record; a rank's failure agreed
            tables = open_configured(cfg, "train", store, model, files, "val")
        try:
            check_same_versions(world, tables.versions(), tables.store_root, "train (validation)")
            if not len(tables):  # the same versions on every rank: all alike
                raise UserError(f"train.validate_every / sample_every is set but store {store} has no val "
                                "samples; set resize.val_fraction > 0 or turn validation off")
            # the first validate_max_samples (sorted keys); on_damaged=skip: damaged ones (on any rank) left out,
            # the next read; a limit reached, or none intact, stops every rank alike (the same counts on all)
            with together(world, "read the val samples"):
                self.samples: list[TrainSample] = read_intact(tables, cfg.validate_max_samples,
                                                              lambda i: load_at(tables, i), "read val samples",
                                                              _Agreement(world) if world > 1 else None,
                                                              ", or turn validation off")
            check_val_budget(cfg, self.samples)  # the same samples on every rank: all refuse alike
        except BaseException:
            tables.close()
            raise
        self.damaged = dict(tables.damaged)  # named by the recipe (main process)
        self._vae = self._scheduler = None
        self._base: np.ndarray | None = None  # the base model's grid: recorded in the curve, or computed
        self._base_known = False  # decided at this process's first validation, by all ranks together
        self.start_step = start_step
        try:  # the other ranks never read the setting (`_unrecorded` and `record` are the main process's)
            named, whole = _curve_tables(tables, cfg, run_dir) if main else (tables.versions(), None)
            self.curve = ValidationCurve(cfg, run_dir, self.samples, named, tables.versions(),
                                         fingerprint_of(files), start_step, attention_backend, whole)
        finally:
            tables.close()  # the samples are in memory now

    def grid(self, transformer, rank: int = 0, world: int = 1, accelerator=None) -> np.ndarray:
        """[sample, seed, σ, region] losses of every val sample: this rank's share computed here, summed across
        ranks (`accelerator.reduce`), so all ranks return the same full grid. Collective when world > 1."""
        mine = [i for i in range(len(self.samples)) if i % world == rank]
        # in the curve's order (sorted, as evaluate's); under a token budget no forward holds more than a training
        # micro-batch's tokens (`pipeline plan` plans that, not batch_size x the longest val samples)
        part = loss_grid(transformer, [self.samples[i] for i in mine], *self.cfg.validate_axes, self.cfg.batch_size,
                         "validation", max_tokens=self.cfg.max_tokens_per_batch)
        full = torch.zeros(len(self.samples), *part.shape[1:], dtype=torch.float64)
        full[mine] = torch.from_numpy(part)  # other ranks' rows stay 0 here; the sum fills them in
        if world > 1:
            full = accelerator.reduce(full.to(accelerator.device), reduction="sum").cpu()
        return full.numpy()

    def loss(self, transformer, rank: int = 0, world: int = 1, accelerator=None) -> float:
        """Mean over samples x seeds x σ of the per-sample flow loss (train.batch_size val samples a forward, within
        train.max_tokens_per_batch when set, at one (seed, σ) cell each: `loss_grid`)."""
        return mean_loss(self.grid(transformer, rank, world, accelerator))

    def samples_grid(self, transformer) -> Image.Image:
        from models.loading import load_component

        if self._vae is None:
            self._vae = load_component(self.model, "vae", dtype=torch.float32, device=transformer.device)
            self._scheduler = dict(load_component(self.model, "scheduler").config)
        images = []
        for s in tqdm(self.samples[: self.cfg.sample_count], desc="samples", unit="image", leave=False):
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
        return grid_path(self.run_dir, step).is_file()

    def _base_needed(self, r) -> bool:
        """Whether the base grid is to be computed: not when the curve this run appends to holds it already (a
        resumed process recomputed it, a whole loss pass over the val samples, and threw it away: the curve keeps
        the one it has). Rank 0 reads the run folder (keeping what it read for `record`), every rank follows it
        (the loss pass is collective)."""
        from models.collective import all_max

        if self.start_step == 0:  # a fresh start: its own base (the same on every rank)
            return True
        if r.main:
            self._base = self.curve.recorded_base()
        return bool(all_max(r.world, [int(r.main and self._base is None)])[0])

    def _unrecorded(self, r, do_loss: bool, do_samples: bool) -> tuple[bool, bool]:
        """At the resumed step: only the parts of the validation due there that left no record in the run folder
        (its losses.zarr row, its sample grid; e.g. the grid failed after the step's checkpoint). One that completed
        is not repeated, and recorded losses were logged too: run again, the resumed writer (it purges only later
        steps) held a second `val/loss` point at that step. Rank 0 reads the run folder, every rank follows it
        (the loss pass is collective)."""
        from models.collective import all_max

        flags = [int(do_loss and not self.curve.has_step(r.step)),
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
        # its one line instead of a traceback here and a wait there (models/collective/)
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
                    r.bar.write(f"step {step}: val loss {loss:.4f} ({count_text(len(self.samples), 'sample')})")
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
        path = grid_path(self.run_dir, step)
        # the image first, flushed (`Trackers.add_image`), then the PNG: a resume takes the PNG for "this step's
        # grid is done" (`_grid_recorded`); a kill between the two makes the grid again (a second image at the step)
        r.writer.add_image("samples/grid", np.asarray(grid), step, dataformats="HWC")
        with one_line_errors("the sample grid", path.parent):
            path.parent.mkdir(parents=True, exist_ok=True)
            png = io.BytesIO()
            grid.save(png, format="PNG")
            atomic_write_bytes(path, png.getvalue())  # whole or absent

    def record(self, step: int, grid: np.ndarray) -> None:
        """Append this validation to RUN/losses.zarr (main process; `ValidationCurve.record`)."""
        self.curve.record(step, grid, self._base)


def mean_loss(grid: np.ndarray) -> float:
    """Mean of the region-"all" losses in row order (sample, seed, σ): the sum the one-process loop made."""
    values = grid[..., 0].reshape(-1).tolist()
    return sum(values) / len(values)
