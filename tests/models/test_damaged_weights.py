"""A model weight file cut short (an interrupted download or copy) or missing from its shard index: every load
names the file and what to do (a UserError, one line in the CLI), not safetensors' header error deep in a
loader's traceback."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from models.loading import load_component
from schemas.errors import UserError


def _copy(model: str, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(model, out)
    return out


def _truncate(path) -> None:
    os.truncate(path, path.stat().st_size // 2)


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_a_transformer_file_cut_short_is_named(tiny_edit_model, tmp_path, quantize):
    model = _copy(tiny_edit_model, tmp_path)
    _truncate(model / "transformer" / "diffusion_pytorch_model.safetensors")
    with pytest.raises(UserError, match=r"model folder .* is damaged: transformer/diffusion_pytorch_model\.safetensors "
                                        r"is not a whole safetensors file .*restore it from the original download"):
        load_component(str(model), "transformer", dtype=torch.float32, device="cpu", quantize=quantize)


def test_a_text_encoder_file_cut_short_and_a_shard_missing_from_the_index_are_named(tiny_edit_model, tmp_path):
    model = _copy(tiny_edit_model, tmp_path)
    (weights,) = (model / "text_encoder").glob("*.safetensors")
    _truncate(weights)
    with pytest.raises(UserError, match=rf"is damaged: text_encoder/{weights.name} is not a whole safetensors file"):
        load_component(str(model), "text_encoder", dtype=torch.float32, device="cpu")

    # a sharded transformer whose index names a shard that is not there
    sub = model / "transformer"
    shard = "diffusion_pytorch_model-00001-of-00001.safetensors"
    (sub / "diffusion_pytorch_model.safetensors").rename(sub / shard)
    from safetensors import safe_open

    with safe_open(str(sub / shard), framework="pt") as f:
        keys = list(f.keys())
    (sub / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: (shard if i else "diffusion_pytorch_model-00002-of-00002.safetensors")
                                        for i, k in enumerate(keys)}}))
    with pytest.raises(UserError, match=r"transformer/diffusion_pytorch_model-00002-of-00002\.safetensors is missing"):
        load_component(str(model), "transformer", dtype=torch.float32, device="cpu")


def test_an_intact_model_loads_and_other_errors_are_not_renamed(tiny_edit_model, monkeypatch):
    """Only a damaged file is reported as one: any other loading error keeps its own type and text."""
    assert load_component(tiny_edit_model, "transformer", dtype=torch.float32, device="cpu") is not None
    from diffusers import QwenImageTransformer2DModel

    def fail(*a, **k):
        raise RuntimeError("something else")

    monkeypatch.setattr(QwenImageTransformer2DModel, "from_pretrained", fail)
    with pytest.raises(RuntimeError, match="something else"):
        load_component(tiny_edit_model, "transformer", dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("component", ["transformer", "vae", "text_encoder"])
def test_a_weight_file_gone_from_a_21_component_is_named(tiny_21_model, tmp_path, component):
    """A component whose only weight file is gone (a partial copy): the loaders' OSError traceback lists file
    names it looked for; the error names the folder and what to do instead."""
    model = _copy(tiny_21_model, tmp_path)
    for f in (model / component).glob("*.safetensors"):
        f.unlink()
    with pytest.raises(UserError, match=rf"model folder .* is damaged: {component}/ has no weight file "
                                        r"\(\*\.safetensors\).*restore it from the original download"):
        load_component(str(model), component, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("variant", ["21", "plus"])
def test_a_tokenizer_folder_without_its_vocabulary_is_refused(tiny_21_model, tiny_plus_model, tmp_path, variant):
    """Without tokenizer.json the processor loaded without error as a tokenizer of the special tokens alone:
    'make it red' became one token, every prompt word lost (2.1: a ValueError deep in the VLM for a prompt with
    references, a silently empty prompt without)."""
    model = _copy(tiny_21_model if variant == "21" else tiny_plus_model, tmp_path)
    fast = model / "processor" / "tokenizer.json"
    bpe = json.loads(fast.read_text())["model"]
    fast.unlink()
    with pytest.raises(UserError, match=r"model folder .* is incomplete: processor/ has no tokenizer\.json \(nor "
                                        r"both vocab\.json and merges\.txt\).*restore them from the original download"):
        load_component(str(model), "processor")
    # the same vocabulary as vocab.json + merges.txt (as Qwen-Image-Edit's tokenizer/ ships it) is whole: loaded
    (model / "processor" / "vocab.json").write_text(json.dumps(bpe["vocab"]))
    (model / "processor" / "merges.txt").write_text("#version: 0.2\n" + "".join(" ".join(m) + "\n" for m in bpe["merges"]))
    full = load_component(tiny_21_model if variant == "21" else tiny_plus_model, "processor").tokenizer
    tok = load_component(str(model), "processor").tokenizer
    assert tok("make it red")["input_ids"] == full("make it red")["input_ids"]


@pytest.mark.parametrize("into,component", [("21", "transformer"), ("21", "vae"), ("21", "text_encoder"),
                                            ("plus", "vae"), ("plus", "text_encoder")])
def test_a_component_folder_of_the_other_family_is_refused(tiny_21_model, tiny_plus_model, tmp_path, into, component):
    """An Edit-Plus component copied into a 2.1 folder (or back): diffusers failed with a shape traceback, and
    transformers loaded the other family's text encoder with every weight left at random init (a warning table),
    which then encoded a prompt without references to noise."""
    target, other = (tiny_21_model, tiny_plus_model) if into == "21" else (tiny_plus_model, tiny_21_model)
    model = _copy(target, tmp_path)
    shutil.rmtree(model / component)
    shutil.copytree(os.path.join(other, component), model / component)
    with pytest.raises(UserError, match=rf"model folder .* is mixed: {component}/config\.json names (class|model_type) "
                                        rf"\w+, but this model \(model_index\.json\) loads \w+ \((class|model_type) "
                                        rf"\w+\) there; restore the {component} folder"):
        load_component(str(model), component, dtype=torch.float32, device="cpu")
    assert load_component(target, component, dtype=torch.float32, device="cpu") is not None  # its own folder loads


def test_a_text_encoder_config_naming_another_head_of_its_own_model_loads(tiny_plus_model, tmp_path):
    """The family check reads a transformers config's model_type, not its architectures' class: a text encoder
    saved as the bare `Qwen2_5_VLModel` holds the same weights and loads (its class name was refused as mixed)."""
    model = _copy(tiny_plus_model, tmp_path)
    config = model / "text_encoder" / "config.json"
    record = json.loads(config.read_text())
    config.write_text(json.dumps({**record, "architectures": ["Qwen2_5_VLModel"]}))
    assert load_component(str(model), "text_encoder", dtype=torch.float32, device="cpu") is not None
