"""A config's local model path that was not built yet (configs/qwen-image-2.1.yaml names
demo-workdir/tiny-qwen-image-2.1) looks like a hub id (owner/name): the line said only that the hub could not be
reached. When the "owner" is a folder here, it says which folder lacks the model and how to build it."""

from __future__ import annotations

import pytest

from models.loading import ModelNotFoundError, resolve_model


def test_a_local_path_not_built_yet_is_named_with_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo-workdir").mkdir()
    resolve_model.cache_clear()
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("demo-workdir/tiny-qwen-image-2.1")
    line = str(e.value)
    assert "no model folder demo-workdir/tiny-qwen-image-2.1 (demo-workdir has no 'tiny-qwen-image-2.1')" in line
    assert "pipeline make-tiny-model demo-workdir/tiny-qwen-image-2.1" in line and "\n" not in line
    resolve_model.cache_clear()
