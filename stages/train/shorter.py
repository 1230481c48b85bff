"""A run continued to a lower `train.max_steps` than its checkpoints reached (`pipeline run all`, `run train --resume
--new-run`), where no step up to the new max_steps depends on it: a constant LR, with or without warm-up (diffusers'
`constant_with_warmup` never reads the number of training steps; σ, noise, data order and the EMA's decay are
functions of the step, not of max_steps). The run's steps up to the new max_steps are then the steps a straight run
to it takes, so its kept checkpoint at exactly that step is that run's result, and one below it is where that run
stands: the start continues from there instead of training from step 0.

The run folder is kept aside whole (`previous.keep`: nothing is lost, and raising max_steps back later takes it back,
`recipe.take_back_kept`), and the fresh RUN gets first the damaged-sample list the resume's checks read, then the
checkpoints up to the new max_steps as hard links (copies where the filesystem has none: a committed checkpoint is
never written again, only read and removed), each linked into `.step-N.tmp` and committed (`store.format.atomic_dir`),
so a kill leaves whole checkpoints only, each with the list (the rerun resumes from the newest there). The run's
curve (TensorBoard events, RUN/losses.zarr, sample grids) stays with the kept run: the fresh one logs from its resume
on.

Under a decaying schedule (`cosine`, `linear`) every step's LR depends on max_steps: the run is trained afresh, and
the line says why (`why_retrained`)."""

from __future__ import annotations

from pathlib import Path

from schemas.config import TrainConfig
from schemas.lineage import role_of
from stages.train import damaged_log, state as train_state
from store import format as fmt


def depends_on_max_steps(cfg: TrainConfig) -> bool:
    """Whether the trained weights at a step depend on max_steps (as the config declares it: max_steps is hashed
    into the run's fingerprint only then)."""
    return role_of(TrainConfig, "max_steps").enters("output", cfg)


def why_retrained(cfg: TrainConfig) -> str:
    """Why a changed max_steps is another run: said beside `train.max_steps: A -> B` where it is listed."""
    return (f"train.lr_schedule {cfg.lr_schedule} decays the learning rate over train.max_steps: every step past "
            "the warm-up trains at another rate")


def start_point(checkpoints: Path, max_steps: int) -> Path | None:
    """The newest committed checkpoint at or below `max_steps` (None: none is kept, `train.keep_checkpoints`)."""
    below = [p for step, p in train_state.complete_checkpoints(checkpoints) if step <= max_steps]
    return below[-1] if below else None


def seed(kept: Path, run_dir: Path, max_steps: int) -> None:
    """The kept run's damaged-sample list (as its steps up to `max_steps` left it), then its checkpoints up to `max_steps` (newest first: a kill leaves the
    one to resume from), into the fresh `run_dir`. The list first: a kill between the two leaves no checkpoint
    without the list a resume of it reads (resumed without it, the run's left-out samples were unlisted, and an
    up-to-date check under train.on_damaged stop served it). The caller holds the run folder's lock."""
    # a copy (durable): the fresh run appends to its own, a link to the kept one's; only what the steps up to
    # max_steps left out (a sample the kept run met later was left out of no step of this run)
    damaged_log.copy_up_to(kept, run_dir, max_steps)
    root = run_dir / "checkpoints"
    root.mkdir(exist_ok=True)
    for step, src in reversed(train_state.complete_checkpoints(kept / "checkpoints")):
        if step > max_steps:
            continue
        # the project's folder commit, fsynced (a copy's bytes too, where there are no hard links); a kill's
        # leftover `.step-N.tmp` is removed by the start (`remove_stale`)
        with fmt.atomic_dir(train_state.checkpoint_dir(root, step), train_state.temp_dir(root, step)) as tmp:
            fmt.link_or_copy(src, tmp)
