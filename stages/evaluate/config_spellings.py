"""A report's `config_fingerprint` and the other spellings of the same settings: a `max_loss_samples` cap that
reads every val sample, settings hashed before the attention backend was resolved."""

from __future__ import annotations

from schemas.config import EvaluateConfig


def config_fingerprint(cfg: EvaluateConfig, n: int | None) -> str:
    """A single-LoRA report's `config_fingerprint`: `cfg.fingerprint()` with `max_loss_samples` at or above the val
    split's `n` samples spelled null, as the loss array's settings spell it (`loss_fingerprint.samples_read`): it reads
    every sample, the same numbers. Hashed as set, 256 (the default) then null on a split 256 covered made the
    report out of date, and its rerun ran the LoRA's loss pass again. `n` None: as set (the split not opened)."""
    return _cap_spelled(cfg, None).fingerprint() if _reads_all(cfg.max_loss_samples, n) else cfg.fingerprint()


def _reads_all(cap, n: int | None) -> bool:
    return n is not None and (cap is None or (isinstance(cap, int) and not isinstance(cap, bool) and cap >= n))


def _cap_spelled(cfg: EvaluateConfig, cap) -> EvaluateConfig:
    return cfg.model_copy(update={"max_loss_samples": cap})


def cap_spellings(cfg: EvaluateConfig, n: int | None, recorded_cap) -> list[EvaluateConfig]:
    """`cfg` and the configs with another cap that reads the same val samples (every one of the split's `n`):
    null, and the cap `recorded_cap` a report's config records (256 then null: the same numbers, the same
    report); only `cfg` when its cap reads fewer."""
    if not _reads_all(cfg.max_loss_samples, n):
        return [cfg]
    return [cfg] + [_cap_spelled(cfg, c) for c in dict.fromkeys((None, recorded_cap))
                    if c != cfg.max_loss_samples and _reads_all(c, n)]


def same_config(recorded: str | None, cfg: EvaluateConfig, n: int | None, metrics: dict) -> bool:
    """Is a report's recorded `config_fingerprint` these settings (`cfg`, resolved) under another spelling: as set
    (`earlier_config_fingerprints`; the attention backend recorded unset, where the report's own run record says
    which it used), or with another cap that reads every one of the val split's `n` samples too (256, then null:
    `cap_spellings`)? One rule for a single-LoRA report and an --all-checkpoints one (that one compared only the
    spellings as set: 256 then null rewrote its report, the same figures)."""
    from stages.evaluate.backend import unset_backend
    from stages.evaluate.report_current import earlier_config_fingerprints

    if not isinstance(metrics, dict):
        return False
    unset_used = unset_backend(cfg.dtype, metrics)
    recorded_cap = ((metrics.get("run") or {}).get("config") or {}).get("max_loss_samples")
    spellings = cap_spellings(cfg, n, recorded_cap)
    return recorded in [c.fingerprint() for c in spellings] + \
        [h for c in spellings for h in earlier_config_fingerprints(c, unset_used)]
