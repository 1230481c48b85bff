"""Shared fixtures: tiny offline models (built once per session through the real save/from_pretrained path)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_edit_model(tmp_path_factory) -> str:
    from models.tiny import make_tiny_model

    out = tmp_path_factory.mktemp("models") / "tiny-edit"
    make_tiny_model(out, variant="edit", seed=0)
    return str(out)


@pytest.fixture(scope="session")
def tiny_plus_model(tmp_path_factory) -> str:
    from models.tiny import make_tiny_model

    out = tmp_path_factory.mktemp("models") / "tiny-edit-plus"
    make_tiny_model(out, variant="edit-plus", seed=0)
    return str(out)
