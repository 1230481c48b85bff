"""Which folders train may write a run into (`pipeline run train --out`, `run all`'s paths.run)."""

from __future__ import annotations

from pathlib import Path

from schemas.errors import UserError


# What a run folder holds from its start on (the lock is its first file): a folder with none of them is not one.
RUN_MARKERS = (".train.lock", "train_config.yaml", "checkpoints", "lora", "logs")


def refuse_a_folder_of_other_files(out: Path, what: str = "--out") -> None:
    """--out naming a non-empty folder that is no run (a dataset, a report, a home directory): train wrote its
    lora/, checkpoints/ and logs/ in among those files (and --new-run would move them all to OUT.previous/)."""
    if not out.is_dir() or any((out / name).exists() for name in RUN_MARKERS):
        return
    others = sorted(f.name for f in out.iterdir())
    if others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise UserError(f"{what} {out} holds other files ({shown}) and no training run: train writes lora/, "
                        "checkpoints/ and logs/ there; pass a new or empty folder, or the folder of an earlier run")
