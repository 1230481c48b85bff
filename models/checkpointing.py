"""Gradient checkpointing of the transformer's blocks, all of them or all but the first few.

A checkpointed block keeps only its input for the backward and runs its forward again there (a third of a
step's work with a frozen base); a block left out keeps its activations (its family's per_token_block per token,
`ActivationUnits` in models/memory_plan.py) and is not run again. Both model families call
`transformer._gradient_checkpointing_func(block, *args)` for every block while checkpointing is on (the Edit
models' stock diffusers loop, 2.1's models/qwen21_multires.py), so one function installed through diffusers'
`enable_gradient_checkpointing` chooses per block. The blocks left out are the *leading* ones: `train.offload:
blocks` keeps the leading `offload_blocks_on_device` resident and needs every offloaded block checkpointed (an
un-checkpointed one would keep its device weight copy until the backward), so the two compose while
uncheckpointed <= that count.
"""

from __future__ import annotations

from torch.utils.checkpoint import checkpoint


def enable_checkpointing(transformer, uncheckpointed: int = 0) -> None:
    """Turn gradient checkpointing on for every block of `transformer.transformer_blocks` but the first
    `uncheckpointed` (0: all, as diffusers' default function does; the same call for a block it checkpoints)."""
    keep = set(transformer.transformer_blocks[:uncheckpointed])  # modules hash by identity

    def checkpoint_selected(block, *args):
        if block in keep:
            return block(*args)
        return checkpoint(block.__call__, *args, use_reentrant=False)

    transformer.enable_gradient_checkpointing(checkpoint_selected)
