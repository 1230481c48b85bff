"""bitsandbytes and prodigyopt are optional (pyproject extras `bnb`, `prodigy`): a setting that needs a missing one
stops with one line naming the extra to install, before any work (here: the package made unimportable)."""

from __future__ import annotations

import sys

import pytest
import torch

from pipeline.config import load_config
from schemas import UserError


@pytest.fixture
def without(monkeypatch):
    def hide(*modules: str) -> None:
        for m in modules:
            monkeypatch.setitem(sys.modules, m, None)  # `import m` raises ImportError

    return hide


@pytest.mark.parametrize("optimizer,package,extra", [("adamw8bit", "bitsandbytes", "bnb"),
                                                     ("prodigy", "prodigyopt", "prodigy")])
def test_an_optimizer_without_its_package_names_the_extra(without, optimizer, package, extra):
    from stages.train.optimizers import build_optimizer

    without(package)
    cfg = load_config(None, {"train.optimizer": optimizer}).train
    with pytest.raises(UserError, match=rf"train.optimizer '{optimizer}' needs the package '{package}'.*"
                                        rf"pip install 'qwen-edit-lora-pipeline\[{extra}\]'") as e:
        build_optimizer([torch.zeros(2, requires_grad=True)], cfg)
    assert "\n" not in str(e.value)


def test_nf4_without_bitsandbytes_names_the_extra(without, tiny_edit_model):
    from models.loading import load_component

    without("bitsandbytes", "bitsandbytes.functional", "bitsandbytes.nn")
    with pytest.raises(UserError, match=r"quantize_base 'nf4' needs the package 'bitsandbytes'.*"
                                        r"pip install 'qwen-edit-lora-pipeline\[bnb\]'"):
        load_component(tiny_edit_model, "transformer", quantize="nf4")


def test_the_extras_exist_in_pyproject():
    import tomllib
    from pathlib import Path

    from models.optional import EXTRA_OF, PROJECT

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    assert project["name"] == PROJECT
    extras = project["optional-dependencies"]
    for package, extra in EXTRA_OF.items():
        assert any(r.startswith(package) for r in extras[extra]), (package, extra)
        assert not any(r.startswith(package) for r in project["dependencies"]), f"{package} is a hard dependency"
    assert not any(r.startswith("rich") for r in project["dependencies"])  # never imported
