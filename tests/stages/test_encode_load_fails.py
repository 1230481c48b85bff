"""A model load that fails in an encoder (a damaged or missing component file, out of memory while loading)
closes its job: the `images` reader and its read lease were left open until garbage collection (the traceback the
caller holds keeps the job alive: a `store gc` meanwhile kept the version for a reader that was gone)."""

from __future__ import annotations

import pytest

import models.loading
from pipeline.config import load_config
from stages.encode import text as encode_text, vae as encode_vae
from test_qwen21_stages import F32, write_store21


def _lease_files(store) -> list[str]:
    leases = store / ".leases"
    return sorted(p.name for p in leases.iterdir()) if leases.exists() else []


def _failing_load(monkeypatch) -> None:
    def load_component(model, component, **kwargs):
        raise OSError(f"cannot load {component} of {model}: damaged file")

    monkeypatch.setattr(models.loading, "load_component", load_component)


@pytest.mark.parametrize("stage", [encode_text, encode_vae])
def test_a_failed_model_load_releases_the_images_lease(stage, tiny_plus_model, plus_store, monkeypatch):
    _failing_load(monkeypatch)
    with pytest.raises(OSError, match="damaged file") as raised:
        stage.run(load_config(None, F32), plus_store, tiny_plus_model)
    assert raised.traceback  # the job is still referenced from the traceback: only closing it released the lease
    assert _lease_files(plus_store) == []


def test_a_failed_21_text_encoder_load_releases_the_images_lease(tiny_21_model, tmp_path, monkeypatch):
    store = write_store21(tmp_path / "s", [("a red square", (64, 64, "RGB"), [])])
    _failing_load(monkeypatch)
    with pytest.raises(OSError, match="damaged file") as raised:
        encode_text.run(load_config(None, F32), store, tiny_21_model)
    assert raised.traceback
    assert _lease_files(store) == []
