"""`evaluate` stage: held-out loss and sample images, base model vs LoRA -> a report directory.

Read top to bottom: open the val split of `text` + `vae` (and `images` for the pictures) -> load the
transformer once, install the multi-resolution pieces, attach the LoRA -> held-out flow-matching loss with the
trainer's own `flow_loss` at fixed noise seeds x a fixed σ grid, LoRA off and on -> generate N val samples
(and the configured extra prompts) from the stored features, LoRA off and on, same seed -> PSNR/SSIM against
the targets -> metrics.json, grid.png, index.html (`stages.evaluate.report`).

The text encoder is not loaded for val samples: their prompt embeds are in the store, and the true-CFG
negative is the stored empty-prompt embedding of the same sample (the instruction left empty, the same
controls). Only `evaluate.extra_prompts` (images from files) load the text encoder, through `models.edit` (2.1:
the stock pipeline call of `models.qwen21_predict`, stages/evaluate/qwen21.py).

Here: the flow of one LoRA's report. Its parts: one evaluate per report folder (`report_lock`), the settings as
they run (`settings`), the report's inputs and whether it is current (`report_inputs`; its config spellings:
`config_spellings`, its tables' names: `table_ids`), the val samples read (`val_samples`), the transformer
(`transformer_load`) and the LoRA on it (`lora_attach`, `other_base`), the held-out loss (`loss_section`), the
sample images (`sample_images`; their stored pictures: `val_pictures`) and their summary (`generation_summary`),
and the result (`result`).
"""

from __future__ import annotations

import time
from pathlib import Path

from tqdm.auto import tqdm

from models.lora import lora_weight_file
from models.precision import auto_note
from schemas.config import EvaluateConfig
from stages.evaluate.ema_curve import unscored_final_ema
from stages.evaluate.generation_summary import generation_summary
from stages.evaluate.loss_section import held_out_loss
from stages.evaluate.lora_attach import attach_checked
from stages.evaluate.lora_bytes import checked_hashes, known_or_checked
from stages.evaluate.other_base import warn_other_base
from stages.evaluate.report import SampleRow, write_report
from stages.evaluate.report_folder import check_report_folder
from stages.evaluate.report_inputs import evaluate_inputs, read_inputs, current_report
from stages.evaluate.report_lock import one_evaluate_per_report
from stages.evaluate.result import EvaluateResult
from stages.evaluate.sample_images import pick_samples, sample_rows
from stages.evaluate.settings import agreed_config, for_model, say_unused_negative
from stages.evaluate.transformer_load import load_transformer
from stages.evaluate.val_samples import read_val_samples
from store import Store


@one_evaluate_per_report
def run(cfg: EvaluateConfig, store: str | Path, model: str, lora: str | Path, out: str | Path,
        skip_if_done: bool = False) -> EvaluateResult:
    """Evaluate base vs LoRA on the store's val split and write the report into `out`. `skip_if_done`: reuse a
    report of the same inputs (`pipeline run all`)."""
    out = Path(out)
    started = time.perf_counter()
    cfg = for_model(cfg, model)
    say_unused_negative(cfg, model)
    # the file train sealed, checked and hashed in one read (none when unchanged since such a read: the up-to-date
    # check read it whole on every run): a flipped bit is refused, not evaluated; the bytes loaded are compared
    with checked_hashes() as remembered:
        lora_sha256 = known_or_checked(lora_weight_file(lora), remembered)
    if (line := unscored_final_ema(lora)) is not None:  # said whether the report is current or not
        tqdm.write(line)
    recorded = _recorded_report(cfg, store, model, lora, out, lora_sha256, skip_if_done)
    if recorded is not None:
        return recorded
    check_report_folder(out)
    device_note = auto_note(cfg.device)
    cfg, precision = agreed_config(cfg, model)
    tqdm.write(precision.describe("evaluate", cfg.device, device_note
                                  + (f", quantize_base {cfg.quantize_base}" if cfg.quantize_base != "none" else "")))
    warn_other_base([lora], model)
    from stages.evaluate import trained_val
    from stages.evaluate.val_share import complete

    tables, share = read_val_samples(cfg, store, model)
    # closed on every path (readers, read lease): a process that goes on (`run all`) holds nothing of them, and a
    # lease left held after a failure kept `store gc` from removing the version
    with tables:
        inputs = evaluate_inputs(cfg, store, model, lora, lora_sha256, tables)  # of the tables read
        samples, damaged = share.samples, dict(tables.damaged)
        trained = trained_val.check(Store(store, create=False), lora, [s.key for s in samples],
                                    trained_val.val_images_version(tables))  # said before the long passes

        transformer = load_transformer(cfg, model)
        attach_checked(transformer, lora, cfg.lora_scale, lora_sha256)
        loss = _held_out(cfg, store, model, lora, out, tables, share, transformer, lora_sha256)

        rows: list[SampleRow] = []
        if cfg.num_samples > 0 or cfg.extra_prompts:  # the pictured samples read in full
            rows = sample_rows(cfg, store, model, transformer, tables,
                               complete(tables, share, pick_samples(samples, cfg.num_samples)), damaged, out,
                               lora_sha256)

        metrics = {
            "loss": loss,
            "generation": generation_summary(rows, cfg, model),
            "run": {**_run_record(cfg, store, model, lora, tables, len(samples), damaged, inputs),
                    "trained_val": trained},
        }
    return EvaluateResult(metrics, write_report(out, metrics, rows), seconds=time.perf_counter() - started,
                          damaged=damaged)


def _recorded_report(cfg: EvaluateConfig, store: str | Path, model: str, lora: str | Path, out: Path,
                     lora_sha256: str, skip_if_done: bool) -> EvaluateResult | None:
    """With `skip_if_done`, OUT's report when it is current for these inputs (its line said again); else None,
    having said why a report there is not current (`report_current.say_recomputed`)."""
    from stages.evaluate.report_current import say_recomputed

    why: list[str] = []
    if skip_if_done and (metrics := current_report(cfg, store, model, lora, out, lora_sha256, why)) is not None:
        from stages.evaluate.trained_val import say_recorded

        say_recorded(metrics)  # the figures are the same, and so is what makes them not held out
        return EvaluateResult(metrics, out / "index.html", up_to_date=True)
    say_recomputed(out, why)
    return None


def _held_out(cfg: EvaluateConfig, store: str | Path, model: str, lora: str | Path, out: Path, tables, share,
              transformer, lora_sha256: str) -> dict:
    """The held-out loss section, base vs LoRA: the grids kept in OUT/lora-losses (`lora_losses`) and
    OUT/base-losses.safetensors (`base_losses`) reused, only what they lack computed."""
    from stages.evaluate.base_images import losses_key, machine
    from stages.evaluate.lora_losses import FOLDER, settings_of
    from stages.evaluate.val_share import reader

    samples = share.samples
    features = read_inputs(cfg, store, model, tables)
    settings = settings_of(features, lora_sha256, machine(cfg))
    return held_out_loss(transformer, samples, cfg, (out, losses_key(cfg, features, [s.key for s in samples])),
                         load=reader(tables, share), recorded=(out / FOLDER, settings, lora_weight_file(lora)))


def _run_record(cfg: EvaluateConfig, store: str | Path, model: str, lora: str | Path, tables, val_samples: int,
                damaged: dict, inputs: dict) -> dict:
    """metrics.json `run`: what was evaluated (`inputs`: what `skip_if_done` compares)."""
    return {
        "store": str(Path(store).resolve()),
        "tables": tables.versions(),
        "model": str(model),
        "lora": str(Path(lora).resolve()),
        "lora_scale": cfg.lora_scale,
        "val_samples": val_samples,
        "val_split": tables.report,
        "damaged_samples": damaged,
        "config": cfg.model_dump(mode="json"),
        "inputs": inputs,
    }
