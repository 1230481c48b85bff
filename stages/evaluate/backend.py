"""Which attention backend a report recorded with `evaluate.attention_backend` unset used.

Settings are hashed with the backend resolved (`stages.evaluate.settings.agreed_config`): unset on a CPU and `native`
spelled out are one report. Reports and loss arrays written before hashed the name as set: `native`, `packed`, ...
are the backend they name, but an unset one (null) is whatever the default was on that device. Such a record is
this run's only where the evidence says its default was the backend resolved now (`unset_backend`); else its
numbers are computed again (never taken for another backend's).
"""

from __future__ import annotations

HALF = ("bfloat16", "float16")  # the only dtypes the default took packed in (models/attention.py `choose`)


def unset_backend(dtype: str | None, metrics: dict | None = None, settings: dict | None = None) -> str | None:
    """The backend an unset `evaluate.attention_backend` resolved to in a record of resolved dtype `dtype`: native
    outside bf16/fp16 (on any device); else the report's own record (`metrics`, its metrics.json: `run.attention`,
    or a CPU device in `run.config`) when that report is of the record (`settings`: the loss array's settings,
    which a report of it holds in `run.settings`; None: `metrics` is the record itself); else None (unknown)."""
    if isinstance(dtype, str) and dtype not in HALF:
        return "native"
    run = (metrics or {}).get("run") if isinstance(metrics, dict) else None
    if not isinstance(run, dict) or (settings is not None and run.get("settings") != settings):
        return None
    attention = run.get("attention")
    if isinstance(attention, dict) and isinstance(attention.get("backend"), str):
        return attention["backend"]
    config = run.get("config")
    device = config.get("device") if isinstance(config, dict) else None
    if isinstance(device, str) and device and not device.startswith("cuda"):
        return "native"  # the default off CUDA (a list of devices: unknown)
    return None


def as_resolved(evaluate: dict, metrics: dict | None, settings: dict | None) -> dict:
    """An array's recorded evaluate loss settings with an unset backend read as the one it used (`unset_backend`;
    `metrics`: the metrics.json of the report folder holding the array, None where there is none), left unset
    where that is unknown."""
    if not isinstance(evaluate, dict) or "attention_backend" not in evaluate or evaluate["attention_backend"]:
        return evaluate
    used = unset_backend(evaluate.get("dtype"), metrics, settings)
    return {**evaluate, "attention_backend": used} if used else evaluate
