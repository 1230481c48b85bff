"""RUN/losses.zarr, the validation curve of one run (main process): the setting it is recorded under, how its
losses were measured, and the appends.

The setting names the val split's tables by the content of the rows validation reads (`JoinedTables.content_names`
of the first `validate_max_samples` and the damaged ones left out: `features.damaged.rows_read`, as evaluate's loss
arrays are named): an `images` rerun that changed none of those samples gives new version numbers that a resume
accepts (train's `ResumeRecord.table_contents`), and the curve goes on in the same array instead of being set
aside, comparable with the curves of runs read from either. The version
ids read are kept beside it, with how the losses were measured (precision, quantised base, attention backend:
`measured`), for `pipeline compare` (`LossStore.note`); a curve recorded under an earlier spelling (tables by
version ids or by the whole split's content; batch_size hashed under a token budget) is continued and re-recorded
under today's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from models.held_out import bucket_of
from models.sample import TrainSample
from schemas.config import TrainConfig, held_out_axes
from schemas.lineage import settings_digest


class ValidationCurve:
    def __init__(self, cfg: TrainConfig, run_dir: Path, samples: list[TrainSample], tables: list[str] | dict,
                 versions, model_fingerprint: str, start_step: int = 0, attention_backend: str | None = None,
                 whole_split: dict | None = None) -> None:
        """`tables`: the val split's tables as the setting names them (by content; the other ranks, which never
        read the setting, pass the version ids), `versions`: the version ids read. `start_step`: the step this
        start resumes at (0: a fresh start, whose curve begins anew: what a killed earlier start in this folder
        recorded before its first checkpoint, base included, was measured for another run). `attention_backend`: the
        one the run resolved (`settings.run_backend`; None: as configured). `whole_split`: the tables named by the
        whole split's content, as a curve was recorded before it was named by the rows read (None: the same)."""
        self.cfg, self.run_dir, self.samples, self.versions = cfg, run_dir, samples, versions
        self.whole_split = whole_split
        self.start_step = start_step
        from store.loss_array import Axes

        seeds, sigmas = cfg.validate_axes  # sorted, as evaluate's: their order is no setting
        self.axes = Axes([s.key for s in samples], [bucket_of(s) for s in samples], seeds, sigmas)
        validate = {"keys": [s.key for s in samples], "noise_seeds": seeds, "timesteps": sigmas,
                    "batch_size": cfg.batch_size}
        if cfg.max_tokens_per_batch is not None:  # rows per forward only, and a resume may change it there
            validate = _without_batch_size(validate)
        self.settings = {"tables": tables, "model_fingerprint": model_fingerprint, "validate": validate}
        self.fingerprint = _fingerprint(self.settings)
        self.measured = measured(cfg, attention_backend)
        self._losses = None  # opened at the first append

    def _respelled(self, settings: dict) -> dict:
        """A recorded setting spelled as today's where it was an earlier spelling of it: the tables named by the
        version ids read now (before the curve named them by content) or by the whole split's content (before it
        named the rows validation reads), under a token budget without
        batch_size (hashed before, whatever value it recorded: validation's rows per forward only), and the noise
        seeds and σ sorted (hashed in the configured order before; the group's axes are read by value,
        `store.loss_array._placement`)."""
        out = dict(settings)
        if out.get("tables") == self.versions or self.whole_split is not None and out.get("tables") == self.whole_split:
            out["tables"] = self.settings["tables"]
        validate = out.get("validate")
        if isinstance(validate, dict) and all(isinstance(validate.get(k), list) for k in ("noise_seeds", "timesteps")):
            seeds, sigmas = held_out_axes(validate["noise_seeds"], validate["timesteps"])
            validate = out["validate"] = {**validate, "noise_seeds": seeds, "timesteps": sigmas}
        if self.cfg.max_tokens_per_batch is not None and isinstance(validate, dict):
            out["validate"] = _without_batch_size(validate)
        return out

    def recorded_fingerprint(self) -> str:
        """The fingerprint the curve of this setting is recorded under: today's, or that of a curve recorded
        under an earlier spelling of it (`_respelled`), which the first append re-records under today's (`record`),
        so neither a later `images` rerun that changes no sample nor a batch_size change sets it aside."""
        from store.loss_array import recorded_setting

        recorded = recorded_setting(self.run_dir)
        if recorded is not None and recorded[0] != self.fingerprint and \
                _fingerprint(self._respelled(recorded[1])) == self.fingerprint:
            return recorded[0]
        return self.fingerprint

    def has_step(self, step: int) -> bool:
        from store.loss_array import recorded_steps

        return step in (recorded_steps(self.run_dir, self.recorded_fingerprint()) or {})

    def recorded_base(self) -> np.ndarray | None:
        """The base model's grid the curve this run appends to holds (None: none, or another setting's)."""
        from store.loss_array import recorded_base

        return recorded_base(self.run_dir, self.recorded_fingerprint(), self.axes)

    def record(self, step: int, grid: np.ndarray, base: np.ndarray | None) -> None:
        """Append one validation's grid. The first append of this process drops steps >= `step` that a killed run
        recorded after its last checkpoint, so the curve never doubles back, and writes `base` (the base model's
        grid) where the curve holds none or this is a fresh start."""
        from store.loss_array import LossStore

        if self._losses is None:
            recorded = self.recorded_fingerprint()
            self._losses = LossStore(self.run_dir, recorded, self.axes, self.settings, self.versions, self.measured)
            if recorded != self.fingerprint:  # an earlier spelling: appended to, not set aside, and re-recorded
                self._losses.refingerprint(self.fingerprint, self.settings, self.versions)  # note_versions: no-op
            if self._losses.kept_aside is not None:  # e.g. the val samples changed under an accepted resume
                from tqdm.auto import tqdm

                tqdm.write(f"validation curve: {self._losses.aside_reason}: the earlier curve is kept in "
                           f"{self._losses.kept_aside}, a new one begins")
            # for `pipeline compare`: against arrays named by version ids, and against runs measured otherwise
            self._losses.note(table_versions=self.versions, measured=self.measured)
            # what a killed start recorded after the checkpoint this one resumes from (all of it on a fresh start:
            # validate_every enters no hash, so its rows may lie before this start's first validation step)
            self._losses.drop_from(self.start_step + 1 if self.start_step else 0)
            if self.start_step == 0 or not self._losses.has_base():
                self._losses.write_base(base)
        self._losses.append(step, f"training step {step}", "", grid)


def _fingerprint(settings: dict) -> str:
    return settings_digest(settings, default=str)


def measured(cfg: TrainConfig, attention_backend: str | None = None) -> dict:
    """How the validation losses are computed besides the setting they are recorded under (`RUN/losses.zarr`'s
    `measured`, not hashed: the train config fixes it for the run): the resolved precision of the frozen base (and
    the step's autocast, which validation runs outside of: `compare._validation_precision` reads it so), its
    quantisation, the attention backend (as resolved: `attention_backend`, else as configured).
    `pipeline compare` refuses two curves measured otherwise, as it refuses evaluate arrays of another
    `evaluate.dtype` etc.: on the same val samples a bf16 or quantised base gives other numbers (tiny model, bf16
    autocast vs float32: up to 1e-3 on a step's mean loss)."""
    return {"dtype": cfg.dtype, "mixed_precision": cfg.mixed_precision, "quantize_base": cfg.quantize_base,
            "attention_backend": attention_backend or cfg.attention_backend}


def _without_batch_size(validate: dict) -> dict:
    return {k: v for k, v in validate.items() if k != "batch_size"}
