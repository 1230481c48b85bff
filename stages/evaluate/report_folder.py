"""What a report folder may hold before evaluate writes into it: its check, asked by the CLI right after parsing
(`pipeline run evaluate --out`, `run all`'s paths.report) and by the stage at its start. No torch here: a
refused folder is told before the model stack is imported."""

from __future__ import annotations

from pathlib import Path

from schemas.errors import UserError
from schemas.out_folder import refuse_a_file_on_the_path

REPORT_LOCK = ".evaluate.lock"  # in a report folder: held by the evaluate writing it


def _only_report_files(out: Path) -> bool:
    """Does `out` hold nothing but what the report writers write (an interrupted report: a full disk or a kill
    before metrics.json, written last; --all-checkpoints' loss arrays, kept or new)? Then the rerun may write over
    it; anything else is someone's folder."""
    from store.format import is_litter

    from stages.evaluate.base_images import (FOLDER as BASE_IMAGES, LAST_FOLDER as LAST_IMAGES,
                                             LORA_FOLDER as LORA_IMAGES)

    from stages.evaluate.base_losses import FILE as BASE_LOSSES
    from stages.evaluate.ema_curve import BEST_LORA, FOLDER as EMA_LOSSES
    from stages.evaluate.lora_losses import FOLDER as LORA_LOSSES

    return all(p.name in ("grid.png", "index.html", REPORT_LOCK, BASE_IMAGES, LORA_IMAGES, LAST_IMAGES, BASE_LOSSES,
                         LORA_LOSSES, EMA_LOSSES, BEST_LORA)
               or (p.name.startswith(("losses", ".losses")) and ".zarr" in p.name)
               or p.name.startswith(f".{BEST_LORA}")  # its atomic_dir's temp / swapped folder
               or (p.is_file() and is_litter(p.name))
               for p in out.iterdir())


def check_report_folder(out: Path, what: str = "--out") -> None:
    """A report goes into a new or empty folder, over an earlier report (metrics.json, written last) or over what
    an interrupted one left (`_only_report_files`); anything else is someone's folder, and a file there or on its
    path no folder. Evaluate's check at its start (of one LoRA or of every checkpoint), and `pipeline run all`'s
    of paths.report before its first stage (not after resize-bucket, the encoders and the training)."""
    refuse_a_file_on_the_path(out, f"{what} ")
    if out.is_dir() and not (out / "metrics.json").is_file() and not _only_report_files(out):
        raise UserError(f"{what} {out} is not empty and holds no earlier report (no metrics.json): pass a new or "
                        "empty folder, or the folder of an earlier report")
