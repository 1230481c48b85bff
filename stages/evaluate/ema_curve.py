"""--all-checkpoints of a run trained with `train.ema_decay`: each checkpoint's EMA (`step-N/ema.safetensors`,
`models.ema_file`) scored beside its raw LoRA, so the report says which is better and the best pick weighs both.

The EMA rows are a loss group of their own, `REPORT/ema-losses/losses.zarr` (`store.loss_array`, opened, planned,
appended, set aside and taken back exactly as REPORT/losses.zarr: `loss_pass.open_losses`, `append_missing`),
under the raw array's settings plus `"weights": "ema"`, one row per step named by the EMA file's sha256. Its base is
the raw array's (the same val samples, noise and σ: the two curves are paired sample for sample). Its own folder:
the raw curve reads REPORT/losses.zarr only; `pipeline compare` reads both (`compare._ema_curve`).

The EMA file is no LoRA by itself: a best EMA checkpoint is written as one into `REPORT/best-ema-lora/` (its
step's adapter holding the EMA's values, `models.lora.save_lora`), the path the report, `--json` and `run all` name.
`evaluate.score_ema: false` scores the raw LoRAs only."""

from __future__ import annotations

import shutil
from pathlib import Path

from tqdm.auto import tqdm

from schemas.units import count_text

FOLDER = "ema-losses"
BEST_LORA = "best-ema-lora"  # the best checkpoint's EMA as a LoRA, when the EMA is the best


def ema_checkpoints(cfg, checkpoints: list[tuple[int, Path]], ranks) -> tuple[list[tuple[int, Path]], dict[int, str]]:
    """(step, EMA file) of the checkpoints that hold one, with each file's sha256, checked against the checkpoint's
    sealed record and hashed as the LoRAs are (`checkpoint_files.check_and_hash`: a flipped bit refused naming it); none
    without an EMA or with evaluate.score_ema off. A collective: every rank calls it."""
    from models.ema_file import ema_of
    from stages.evaluate.checkpoint_files import agreed_checkpoints, check_and_hash

    if not cfg.score_ema:
        return [], {}
    listed = agreed_checkpoints([(step, ema_of(path)) for step, path in checkpoints if ema_of(path).is_file()], ranks)
    if not listed:
        return [], {}
    return check_and_hash(listed, ranks)


def ema_settings(settings: dict, earlier: list[dict] = ()) -> tuple[str, dict, list[dict]]:
    """(fingerprint, settings, earlier spellings) of the EMA group: the raw array's, plus the weights scored."""
    from stages.evaluate.loss_groups import group_hash

    mine = {**settings, "weights": "ema"}
    return group_hash(mine), mine, [{**e, "weights": "ema"} for e in earlier]


def todo_line(out: Path, settings: dict, ema_shas: dict[int, str]) -> str:
    """What the line saying why a report is computed again adds for the EMA: the EMA rows REPORT/ema-losses lacks."""
    from store.loss_array import recorded_steps

    if not ema_shas:
        return ""
    recorded = recorded_steps(out / FOLDER, ema_settings(settings)[0]) or {}
    todo = sum(1 for step, sha in ema_shas.items() if recorded.get(step) != sha)
    return f"; scoring the EMA of {todo} of {count_text(len(ema_shas), 'checkpoint')}" if todo else ""


def write_best_lora(out: Path, transformer, best: dict, scale: float, data: bytes | None, sha: str | None) -> None:
    """When the best is a checkpoint's EMA (`best["weights"]`), it written as a LoRA into OUT/best-ema-lora (its
    step's adapter holding the EMA's values; its sealed checksum record beside it, as RUN/lora's), and `best`'s
    path set to it (`ema_checkpoint`: the EMA file, `lora_sha256`: the LoRA's bytes); else an earlier one removed,
    so no folder names a best that is not. Before metrics.json: a report names only a LoRA that is there. `data`:
    the EMA file's bytes read for its pictures (None: read here, and refused unless they are `sha`'s, the bytes
    its losses are of)."""
    from models.ema_file import ema_state
    from models.lora import lora_base_fingerprint, save_lora
    from models.lora_files import lora_weight_file
    from stages.evaluate.checkpoint_load import rewritten, use_checkpoint
    from stages.evaluate.lora_bytes import digest, read_for_load
    from store.checksum import write_folder_record
    from store.format import atomic_dir

    folder = out / BEST_LORA
    if best.get("weights") != "ema":
        shutil.rmtree(folder, ignore_errors=True)
        return
    ema = best["path"]
    raw = Path(ema).parent / "lora"
    if data is None:
        data, now = read_for_load(ema)
        if sha is not None and now != sha:
            raise rewritten(best["step"], Path(ema))
    use_checkpoint(transformer, Path(ema), scale, "lora" in (getattr(transformer, "peft_config", None) or {}), data)
    # the EMA file's float32 values, not the adapter's (evaluate's dtype: bf16 on a GPU, one more rounding)
    values = ema_state(transformer, "lora", data, Path(ema))
    with atomic_dir(folder) as tmp:
        save_lora(transformer, tmp, base_fingerprint=lora_base_fingerprint(raw), adapter_name="lora", values=values)
        write_folder_record(tmp)
    best.update(path=str(folder.resolve()), ema_checkpoint=ema, lora_sha256=digest(lora_weight_file(folder)).sha256)
    tqdm.write(f"the best checkpoint is step {best['step']}'s EMA: written as a LoRA to {folder}")


def best_lora_input(best: dict) -> tuple[str | None, str | None] | None:
    """(recorded, present) sha256 of the best EMA's LoRA a report names (None when the report's best is a raw
    checkpoint): a report whose LoRA was removed or changed since is not current."""
    from models.lora_files import lora_weight_file
    from schemas.errors import UserError
    from stages.evaluate.lora_bytes import remembered_sha256

    if best.get("weights") != "ema":
        return None
    try:
        now = remembered_sha256(lora_weight_file(best["path"]))
    except (UserError, OSError, KeyError, TypeError):
        now = None
    return best.get("lora_sha256"), now


def unscored_final_ema(lora: str | Path) -> str | None:
    """The line saying RUN/lora_ema is not scored when evaluate scores RUN/lora alone (a run without checkpoints:
    `run all`, `evaluate --run`), else None. Scoring it beside RUN/lora would take the checkpoints' mechanism (a
    best picked between two LoRAs, their losses paired) into the one-LoRA report; the run's EMA is one command
    away, and a run with checkpoints has its EMA scored at each of them."""
    from models.ema_file import LORA_EMA

    lora = Path(lora)
    ema = lora.parent / LORA_EMA
    if lora.name != "lora" or not ema.is_dir():
        return None
    return (f"evaluate: {ema} (the run's EMA, train.ema_decay) is not scored: evaluate scores {lora} alone; score "
            f"it with `pipeline run evaluate --lora {ema} --out ANOTHER_REPORT` (`--all-checkpoints` scores each "
            "checkpoint's EMA beside its LoRA)")


def label(point: dict, scored: bool = True) -> str:
    """Which weights a point (best, next best) is, where the EMA was `scored`: ' (EMA)' or ' (LoRA)'; else ''."""
    return (" (EMA)" if point.get("weights") == "ema" else " (LoRA)") if scored else ""
