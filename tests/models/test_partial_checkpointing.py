"""Gradient checkpointing of all blocks but the first `train.uncheckpointed_blocks` (models/checkpointing.py),
through the trainer's own setup (stages/train/build.py `setup_transformer`) on the tiny Edit and 2.1 models
(float32, CPU): the loss and every LoRA gradient are bit for bit those of full checkpointing and of none (a
recompute on the CPU runs the same kernels on the same inputs), also with the kept block resident under
`train.offload: blocks`; and the blocks run again in the backward are exactly the checkpointed ones."""

from __future__ import annotations

import pytest
import torch

from models.lora import lora_parameters
from pipeline.config import load_config

FAMILIES = ["tiny_edit_model", "tiny_21_model"]
# (train overrides): none, all, all but the first block, all but the first with block 0 resident under offload
SETTINGS = {
    "none": {"train.gradient_checkpointing": False},
    "all": {"train.gradient_checkpointing": True},
    "all-but-1": {"train.gradient_checkpointing": True, "train.uncheckpointed_blocks": 1},
    "all-but-1-offload": {"train.offload": "blocks", "train.offload_blocks_on_device": 1,
                          "train.uncheckpointed_blocks": 1},
}


def _model(path: str, overrides: dict):
    from stages.train.build import setup_transformer

    cfg = load_config(None, {"train.dtype": "float32", "train.lora.rank": 4, **overrides}).train
    model = setup_transformer(path, cfg, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # lora_B starts at zero (no gradient reaches lora_A): give every adapter weight a size
        for p in lora_parameters(model):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _edit_loss(model):
    g = torch.Generator().manual_seed(1)
    cfg, h, w, text = model.config, 4, 6, 7
    out = model(hidden_states=torch.randn(1, h * w, cfg.in_channels, generator=g), timestep=torch.tensor([0.5]),
                encoder_hidden_states=torch.randn(1, text, cfg.joint_attention_dim, generator=g),
                encoder_hidden_states_mask=torch.ones(1, text), img_shapes=[[(1, h, w)]], return_dict=False)[0]
    return out.square().mean()


def _qwen21_loss(model):
    from models.qwen21_multires import Qwen21Sample, build_batch, per_sample_loss, qwen21_forward

    g = torch.Generator().manual_seed(1)
    c, d = model.config.in_channels, model.config.context_in_dim

    def sample(ref_hw, target_hw, text):  # one reference of ref_hw latent tokens: h * w / 4 slots in the prompt
        slots = ref_hw[0] * ref_hw[1] // 4
        mask = torch.tensor([False] * text + [True] * slots + [False] * 2)
        return Qwen21Sample(prompt_embeds=torch.randn(len(mask), d, generator=g), slot_mask=mask,
                            references=[torch.randn(c, 1, *ref_hw, generator=g)],
                            target=torch.randn(target_hw[0] * target_hw[1], c, generator=g), target_hw=target_hw)

    batch = build_batch([sample((2, 4), (4, 2), 3), sample((4, 4), (2, 6), 5)])
    out = qwen21_forward(model, batch, torch.tensor([0.3, 0.7]))
    return per_sample_loss(out, torch.zeros_like(batch.image), batch).sum()


def _step(path: str, overrides: dict):
    """(loss, LoRA gradients, the block indices run in the backward, in order) of one step."""
    from models.qwen21_flow import is_qwen21

    model = _model(path, overrides)
    phase, backward_calls = ["forward"], []
    for i, block in enumerate(model.transformer_blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: backward_calls.append(i) if phase[0] == "backward" else None)
    loss = (_qwen21_loss if is_qwen21(model) else _edit_loss)(model)
    phase[0] = "backward"
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in lora_parameters(model)], backward_calls


@pytest.mark.parametrize("family", FAMILIES)
def test_partial_checkpointing_gives_the_gradients_of_all_and_none(family, request):
    path = request.getfixturevalue(family)
    results = {name: _step(path, overrides) for name, overrides in SETTINGS.items()}
    loss, grads, _ = results["none"]
    assert len(grads) > 0 and all(g.abs().max() > 0 for g in grads)
    for name, (other_loss, other_grads, _) in results.items():
        assert torch.equal(other_loss, loss), name
        assert all(torch.equal(a, b) for a, b in zip(other_grads, grads, strict=True)), name


@pytest.mark.parametrize("family", FAMILIES)
def test_the_backward_recomputes_exactly_the_checkpointed_blocks(family, request):
    """The tiny models have 2 blocks: checkpointing all recomputes both (last first), all but one only block 1;
    a selection ignored (every block checkpointed) or reversed (the trailing block kept) fails here."""
    path = request.getfixturevalue(family)
    assert len(_model(path, {}).transformer_blocks) == 2
    recomputed = {name: _step(path, overrides)[2] for name, overrides in SETTINGS.items()}
    assert recomputed == {"none": [], "all": [1, 0], "all-but-1": [1], "all-but-1-offload": [1]}
