"""Reading the configuration: one YAML file with a section per stage, then `--set section.key=value` and CLI
flag overrides, validated into `schemas.config.PipelineConfig` (the section types live there, as pure data).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from schemas.config import PipelineConfig


class ConfigError(ValueError):
    """A config file or override that does not validate; the message names every offending key."""


def _format_errors(err: ValidationError, origin: str) -> str:
    lines = [f"invalid config ({origin}):"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"  unknown key '{key}'")
        else:
            lines.append(f"  '{key}': {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def _set_dotted(d: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ConfigError(f"cannot set '{dotted}': '{p}' is not a section")
    d[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """Read YAML (or nothing), apply dotted-key overrides (`{"train.batch_size": 8}`), validate.

    Overrides whose value is None are ignored, so CLI options can pass their defaults straight through.
    """
    data: dict[str, Any] = {}
    origin = "defaults"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {p} is not UTF-8 text (byte {e.start}): pass a YAML file") from None
        except OSError as e:
            raise ConfigError(f"config file {p} cannot be read: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections, got {type(loaded).__name__}")
        data = loaded
        origin = str(p)
    for k, v in (overrides or {}).items():
        if v is not None:
            _set_dotted(data, k, v)
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, origin)) from None
