"""The `gpu` tier: what only CUDA can show. Every test here is marked `gpu` and skipped, with that reason, where
no CUDA device is. On the GPU machine (bench/gpu/README.md): `python3 -m pytest -m gpu tests/gpu`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench.gpu


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason="gpu tier: needs a CUDA device (torch.cuda.is_available() is False here)")
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


@pytest.fixture
def cuda() -> torch.device:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda")
