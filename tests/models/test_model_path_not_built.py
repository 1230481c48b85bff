"""Local folder or hub id, decided as diffusers' from_pretrained does: a name that is a folder is loaded from it,
any other `owner/name` is a hub id. A config's local model path not built yet (configs/qwen-image-2.1.yaml names
demo-workdir/tiny-qwen-image-2.1) looks like a hub id too: the line names the folder that lacks it and how to
build it - as the one cause only when the hub says there is no such repo; when the hub could not be asked
(offline), a folder `./Qwen` says nothing about `Qwen/Qwen-Image-Edit-2509`, so the hub comes first."""

from __future__ import annotations

import pytest

from models.loading import ModelNotFoundError, resolve_model


@pytest.fixture(autouse=True)
def _fresh_resolve(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    resolve_model.cache_clear()
    yield
    resolve_model.cache_clear()


def test_offline_a_path_not_built_names_the_hub_and_the_folder_with_how_to_build_it(tmp_path):
    (tmp_path / "demo-workdir").mkdir()
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("demo-workdir/tiny-qwen-image-2.1")
    line = str(e.value)
    assert line.startswith("cannot load model 'demo-workdir/tiny-qwen-image-2.1' from the hub: it is not in the "
                           "Hugging Face cache and HF_HUB_OFFLINE is set"), line
    assert "if you meant a local folder: demo-workdir has no 'tiny-qwen-image-2.1'" in line
    assert "pipeline make-tiny-model demo-workdir/tiny-qwen-image-2.1" in line and "\n" not in line


def test_a_hub_id_whose_owner_is_a_folder_here_is_a_hub_id_as_for_diffusers(tmp_path):
    """`./Qwen` exists (a clone, a workdir): `Qwen/Qwen-Image-Edit-2509` was called a local model "not built"."""
    from diffusers import DiffusionPipeline

    (tmp_path / "Qwen").mkdir()
    with pytest.raises(OSError, match="not fully cached locally"):  # diffusers goes to the hub (its cache), too
        DiffusionPipeline.download("Qwen/Qwen-Image-Edit-2509")
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("Qwen/Qwen-Image-Edit-2509")
    assert str(e.value).startswith("cannot load model 'Qwen/Qwen-Image-Edit-2509' from the hub: it is not in the "
                                   "Hugging Face cache"), str(e.value)
    assert not str(e.value).startswith("no model folder")


def test_a_cached_hub_id_loads_from_the_cache_though_its_owner_is_a_folder_here(tmp_path, monkeypatch):
    import huggingface_hub.constants

    cache = tmp_path / "hf-cache"
    snapshot = cache / "models--Qwen--Qwen-Image-Edit-2509" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "model_index.json").write_text("{}")
    (cache / "models--Qwen--Qwen-Image-Edit-2509" / "refs").mkdir()
    (cache / "models--Qwen--Qwen-Image-Edit-2509" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    (tmp_path / "Qwen").mkdir()
    assert resolve_model("Qwen/Qwen-Image-Edit-2509") == snapshot


def test_the_folder_wins_when_it_exists(tmp_path, tiny_edit_model):
    (tmp_path / "Qwen").mkdir()
    (tmp_path / "Qwen" / "Qwen-Image-Edit-2509").symlink_to(tiny_edit_model)
    assert resolve_model("Qwen/Qwen-Image-Edit-2509") == (tmp_path / "Qwen" / "Qwen-Image-Edit-2509").resolve()


def test_when_the_hub_has_no_such_repo_the_path_not_built_is_the_one_cause(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError

    def no_such_repo(repo_id, **kwargs):  # what the hub answers online (a 401/404 response) for a name it lacks
        response = SimpleNamespace(headers={}, request=None)
        raise RepositoryNotFoundError(f"404 Client Error: Repository Not Found for url: .../{repo_id}", response=response)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_such_repo)
    (tmp_path / "demo-workdir").mkdir()
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("demo-workdir/tiny-qwen-image-2.1")
    line = str(e.value)
    assert line.startswith("no model folder demo-workdir/tiny-qwen-image-2.1 (demo-workdir has no "
                           "'tiny-qwen-image-2.1': build it (`pipeline make-tiny-model demo-workdir/tiny-qwen-image-2.1"), line
    assert "no hub id 'demo-workdir/tiny-qwen-image-2.1' either (RepositoryNotFoundError)" in line
