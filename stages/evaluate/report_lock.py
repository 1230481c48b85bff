"""One evaluate per report folder, in one process: the folder's flock held while evaluate writes it, a launch of
several ranks refused, and the folder removed again when the run stopped before writing anything."""

from __future__ import annotations

from pathlib import Path

from schemas.errors import UserError
from stages.evaluate.report_folder import REPORT_LOCK


def single_process() -> None:
    """evaluate runs in one process. Under torchrun / accelerate launch every rank would evaluate everything into
    one report folder: the first took its lock, the others stopped naming it, and the launcher then ended the
    first too. Every rank sees the same launcher environment, so every rank refuses alike with this line."""
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise UserError(f"evaluate of one LoRA runs in one process, but it was launched as {world} (WORLD_SIZE="
                        f"{world}, torchrun / accelerate launch): run `pipeline run evaluate` directly, on the "
                        "device evaluate.device names (only --all-checkpoints shares its work between ranks)")


def one_evaluate_per_report(run):
    """Runs `run(cfg, store, model, what, out, ...)` holding `out`'s lock: two evaluates writing one report folder
    (its loss array, index.html, metrics.json) would interleave their files; the second stops at once, naming the
    first's pid. A flock: the kernel drops it with a killed process."""
    import functools

    from store.format import flock

    @functools.wraps(run)
    def locked(cfg, store, model, what, out, *args, **kwargs):
        single_process()
        out = Path(out)
        made = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        try:
            with flock(out / REPORT_LOCK, blocking=False, holder=f"the report folder {out}"):
                return run(cfg, store, model, what, out, *args, **kwargs)
        except BaseException:
            if made:
                _remove_if_only_the_lock(out)
            raise

    return locked


def _remove_if_only_the_lock(out: Path) -> None:
    """The report folder this evaluate made, when it stopped before writing anything (a store without its `text`
    table, a Ctrl-C while loading): removed, as train leaves no --out behind then; a folder holding only
    `.evaluate.lock` was left for every such mistake."""
    try:
        if [p.name for p in out.iterdir()] == [REPORT_LOCK]:
            (out / REPORT_LOCK).unlink()
            out.rmdir()
    except OSError:  # another evaluate's, or something written meanwhile: left as it is
        pass
