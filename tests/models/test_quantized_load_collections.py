"""A quantised load of a many-shard checkpoint runs one full garbage collection, not one per shard."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from models.quantize import dequantize, is_quantized, load_quantized_transformer


def test_a_many_shard_load_collects_once_and_loads_what_one_file_does(tiny_edit_model, tmp_path, monkeypatch):
    """Before: a full `gc.collect()` after every shard (each walks the whole process's heap: 9 x ~0.9 s in int8
    rehearsals; bench/quantized_load_gc.py found no lower peak for it). The shards' model equals the one-file one."""
    from diffusers import QwenImageTransformer2DModel

    one_file = Path(tiny_edit_model) / "transformer"
    sharded = tmp_path / "transformer"
    QwenImageTransformer2DModel.from_pretrained(one_file).save_pretrained(sharded, max_shard_size="200KB")
    assert len(list(sharded.glob("*.safetensors"))) >= 4

    full, collect = [], gc.collect
    monkeypatch.setattr(gc, "collect", lambda generation=2: (full.append(generation) if generation == 2 else None)
                        or collect(generation))
    ours = load_quantized_transformer(sharded, torch.bfloat16, torch.device("cpu"), "int8")
    assert full == [2]
    monkeypatch.undo()

    ref = dict(load_quantized_transformer(one_file, torch.bfloat16, torch.device("cpu"), "int8").named_parameters())
    for name, p in ours.named_parameters():
        a, b = (dequantize(p), dequantize(ref[name])) if is_quantized(p) else (p, ref[name])
        assert torch.equal(a, b), name
