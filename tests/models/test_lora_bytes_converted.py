"""`read_lora(path, data=...)` parses the bytes it is handed for every format it reads: evaluate hashes a LoRA's
bytes, then loads those bytes (stages/evaluate/lora_bytes.py), so the weights evaluated are the ones recorded.
A ComfyUI / kohya file went through diffusers' converter from its path instead, a second read of the file that
loaded whatever was on disk then (another file's weights, had it been rewritten since the hash)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import QwenImagePipeline
from safetensors.torch import save_file

from models.lora import read_lora

MODULES = ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k", "transformer_blocks.1.img_mlp.net.2")


def _file(path: Path, seed: int, fmt: str) -> Path:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for n in MODULES:
        name = f"diffusion_model.{n}" if fmt == "comfyui" else "lora_unet_" + n.replace(".", "_")
        sd[f"{name}.lora_down.weight"] = torch.randn(4, 16, generator=g)
        sd[f"{name}.lora_up.weight"] = torch.randn(16, 4, generator=g)
        sd[f"{name}.alpha"] = torch.tensor(8.0)
    save_file(sd, path)
    return path


@pytest.mark.parametrize("fmt", ["comfyui", "kohya"])
def test_a_converted_lora_is_read_from_the_bytes_handed_in(tmp_path, fmt):
    on_disk = _file(tmp_path / "on_disk.safetensors", 0, fmt)
    hashed = _file(tmp_path / "hashed.safetensors", 1, fmt)
    # the reference: diffusers' own converter on the file whose bytes are handed in
    want = {k[len("transformer."):]: v for k, v in QwenImagePipeline.lora_state_dict(str(hashed)).items()}
    assert read_lora(hashed)[0].keys() == want.keys()
    for got in (read_lora(hashed)[0], read_lora(on_disk, data=hashed.read_bytes())[0]):
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
    other = read_lora(on_disk)[0]
    assert not any(torch.equal(other[k], want[k]) for k in want)  # the two files differ: the test can tell them apart
