"""Fixture for store tests: an empty store in a temp folder (sample builders live in store_samples.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from store import Store


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store")
