"""`pipeline lora merge` writes the fused transformer itself (a progress bar in bytes: ~40 GB for the 20B model):
the folder holds what diffusers' own `save_pretrained` writes, sharded or not, and loads back unchanged."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from models.loading import load_component
from pipeline.commands.lora import save_transformer


def _tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("shard", ["10GB", 40_000])  # one file; several files and an index
def test_the_merged_transformer_is_what_diffusers_writes(tiny_edit_model, tmp_path, capsys, shard):
    transformer = load_component(tiny_edit_model, "transformer", dtype=torch.float32, device="cpu")
    save_transformer(transformer, tmp_path / "ours", max_shard_size=shard)
    transformer.save_pretrained(tmp_path / "diffusers", safe_serialization=True, max_shard_size=shard)

    ours, theirs = tmp_path / "ours", tmp_path / "diffusers"
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    assert json.loads((ours / "config.json").read_text()) == json.loads((theirs / "config.json").read_text())
    index = "diffusion_pytorch_model.safetensors.index.json"
    assert (ours / index).exists() == (shard != "10GB")
    if shard != "10GB":
        assert json.loads((ours / index).read_text()) == json.loads((theirs / index).read_text())
    a, b = _tensors(ours), _tensors(theirs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    loaded = type(transformer).from_pretrained(ours)
    assert all(torch.equal(v, transformer.state_dict()[k]) for k, v in loaded.state_dict().items())
    assert "write merged transformer: 100%" in capsys.readouterr().err.replace("\r", "\n")
