"""What a single-LoRA report depends on (`evaluate_inputs`, recorded in metrics.json `run.inputs`), whether OUT's
report is current for them (`report_up_to_date`), and the inputs the kept loss grids and images are keyed by
(`read_inputs`)."""

from __future__ import annotations

from pathlib import Path

from features.open import open_configured
from models.lora import lora_weight_file
from schemas import up_to_date as current
from schemas.config import EvaluateConfig
from stages.evaluate.config_spellings import config_fingerprint, same_config
from stages.evaluate.settings import resolved_config
from stages.evaluate.table_ids import read_table_ids, version_table_ids
from store.join import JoinedTables


def evaluate_inputs(cfg: EvaluateConfig, store: str | Path, model: str, lora: str | Path,
                    lora_sha256: str | None = None, tables: JoinedTables | None = None,
                    table_ids: dict | None = None) -> dict:
    """Everything a report depends on; equal inputs = the report is up to date (`pipeline run all` skips it).
    `lora_sha256`: the LoRA file's hash when the caller has it (`stage.run` hashes it once, with its CRC check).
    The tables are named by what evaluate reads from them (`read_table_ids`; `tables`: the val split's join when
    open, else opened here), or `table_ids` when the caller has them (without `tables`: the split is not opened,
    and `max_loss_samples` is hashed as set, `config_fingerprint`)."""
    from schemas.file_digest import file_sha256
    from models.loading import model_files, model_fingerprint
    from stages.evaluate.base_images import extra_prompt_bytes
    from stages.evaluate.loss_fingerprint import EVALUATION_REVISION

    if tables is None and table_ids is None:
        with open_configured(cfg, "evaluate", store, model, model_files(model), "val") as opened:
            return evaluate_inputs(cfg, store, model, lora, lora_sha256, opened)
    cfg = resolved_config(cfg, model)
    h = lora_sha256 or file_sha256(lora_weight_file(lora))  # chunked: a GB-sized LoRA is not read into memory
    inputs = {  # not the store's path: the tables' identities name the data (a moved store is the same report)
        "tables": table_ids if table_ids is not None else read_table_ids(cfg, store, model, tables),
        "model_fingerprint": model_fingerprint(model),
        "lora_sha256": h,
        "config_fingerprint": config_fingerprint(cfg, len(tables) if tables is not None else None),
        "evaluation_revision": EVALUATION_REVISION,
    }
    if cfg.extra_prompts:  # only then: a report without extra prompts keeps the inputs it recorded before
        inputs["extra_prompts_sha256"] = extra_prompt_bytes(cfg)
    return inputs


def report_up_to_date(cfg: EvaluateConfig, store: str | Path, model: str, lora: str | Path, out: str | Path,
                      lora_sha256: str | None = None, why: list[str] | None = None) -> bool:
    """Is OUT's report this run's (`schemas.up_to_date`)? `why`: filled, when it holds one that is not, with what
    differs (`report_current.differences`)."""
    return current_report(cfg, store, model, lora, out, lora_sha256, why) is not None


def current_report(cfg: EvaluateConfig, store: str | Path, model: str, lora: str | Path, out: str | Path,
                   lora_sha256: str | None = None, why: list[str] | None = None) -> dict | None:
    """OUT's metrics.json object when its report is this run's (`report_up_to_date`), read and checked once
    (`report.report_metrics`: a damaged one said, and None); else None."""
    from stages.evaluate.report import report_metrics, report_whole

    if not report_whole(out):
        return None
    metrics_of = report_metrics(out)
    try:
        recorded = metrics_of.get("run", {}).get("inputs")
    except AttributeError:  # None (none, damaged, unreadable) or other JSON than a report's
        return None
    if not isinstance(recorded, dict):
        return None
    return metrics_of if _same_inputs(cfg, store, model, lora, out, lora_sha256, why, metrics_of, recorded) else None


def _same_inputs(cfg: EvaluateConfig, store: str | Path, model: str, lora: str | Path, out: str | Path,
                 lora_sha256: str | None, why: list[str] | None, metrics_of: dict, recorded: dict) -> bool:
    """Are a report's `recorded` inputs (`metrics_of`, its metrics.json) this run's (`current_report`)?"""
    from stages.evaluate.report_current import damaged_current, differences, nonfinite_current
    from stages.evaluate.loss_fingerprint import damaged_read
    # recorded before the path left the inputs, or before the evaluation revision was recorded
    recorded = {"evaluation_revision": current.UNRECORDED_REVISION,
                **{k: v for k, v in recorded.items() if k != "store"}}
    # recorded before the tables were named by content: the store's version ids then, compared as they were; else
    # the present content ids (`read_table_ids`). The val split is opened either way: its size says which caps
    # read every sample (`cap_spellings`)
    versions = version_table_ids(store)
    table_ids = versions if recorded.get("tables") == versions else None
    from models.loading import model_files

    with open_configured(cfg, "evaluate", store, model, model_files(model), "val") as tables:  # its size: the cap
        tables.damaged.update(damaged_read(metrics_of))  # its read went as many rows further (`rows_read`)
        present = evaluate_inputs(cfg, store, model, lora, lora_sha256, tables, table_ids)
        n = len(tables)
    resolved = resolved_config(cfg, model)
    if same_config(recorded.get("config_fingerprint"), resolved, n, metrics_of):
        present["config_fingerprint"] = recorded["config_fingerprint"]
    if current.is_current(recorded, present) and damaged_current(metrics_of, cfg) \
            and nonfinite_current(metrics_of, cfg):
        return True
    if why is not None:
        why += differences(recorded, present, metrics_of, resolved, None)
    return False


def read_inputs(cfg: EvaluateConfig, store: str | Path, model: str, tables) -> dict:
    """`loss_fingerprint`'s settings with the text / vae tables the val samples were read from, named by content
    (`loss_fingerprint.read_fingerprint`): the store's current ones may have changed since (an encode beside evaluate),
    and a cache keyed by those would name numbers the new version never gave."""
    from stages.evaluate.loss_fingerprint import loss_fingerprint, read_fingerprint

    return read_fingerprint(loss_fingerprint(cfg, store, model)[1], tables)[1]
