"""Optional packages (pyproject extras): imported when a setting needs them, else a one-line UserError naming the
extra that installs them."""

from __future__ import annotations

import importlib
from types import ModuleType

from schemas.errors import UserError

PROJECT = "qwen-edit-lora-pipeline"  # the distribution name in pyproject.toml
#: pip package -> the extra that installs it
EXTRA_OF = {"bitsandbytes": "bnb", "prodigyopt": "prodigy"}


def require(module: str, what: str) -> ModuleType:
    """`module` imported, or a UserError: `what` (the setting) needs it, and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        package = module.split(".")[0]
        how = (f"pip install '{PROJECT}[{EXTRA_OF[package]}]' (or pip install {package})" if package in EXTRA_OF
               else f"pip install {package}")
        raise UserError(f"{what} needs the package {package!r}, which is not installed ({e}); {how}") from None
