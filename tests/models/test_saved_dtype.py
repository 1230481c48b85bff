"""`pipeline lora merge` writes the base back in the dtype it is stored in (`models.lora.saved_dtype`): the dtype
holding most of the weights. It was the first tensor's, and safetensors writes the widest dtype first: one float32
tensor in a bf16 checkpoint (a norm or embedding kept in float32) made the merge write the whole model as float32."""

from __future__ import annotations

import shutil

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from models.lora import saved_dtype


def test_a_bf16_checkpoint_with_one_float32_tensor_is_saved_as_bf16(tiny_edit_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_edit_model, model)
    (weights,) = (model / "transformer").glob("*.safetensors")
    state = {k: v.to(torch.bfloat16) for k, v in load_file(weights).items()}
    first = sorted(state)[0]
    state[first] = state[first].float()  # one tensor kept in float32
    save_file(state, weights)
    with safe_open(weights, framework="pt") as st:
        assert st.get_slice(next(iter(st.keys()))).get_dtype() == "F32"  # what the first-tensor rule read
    assert saved_dtype(str(model)) == torch.bfloat16
    save_file({k: v.float() for k, v in state.items()}, weights)
    assert saved_dtype(str(model)) == torch.float32
