"""How many processes the launcher started, and whether they must train on the CPU.

`accelerate launch --multi_gpu --num_processes N` on a machine without GPUs sets up no process group unless
the Accelerator is told `cpu=True` (accelerate picks gloo then): without that, each of the N processes trains
alone (world size 1) into the same run folder. So with `train.device` unset, a multi-process launch with no
GPU trains on the CPU over gloo, and `stages.train` refuses any launch whose process group does not match.
"""

from __future__ import annotations

import os


def launched_world_size() -> int:
    """Processes the launcher (accelerate launch / torchrun) started; 1 for a plain run."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def use_cpu(device: str | None) -> bool:
    if device is not None:
        return device == "cpu"
    if launched_world_size() <= 1:
        return False  # accelerate's own choice: the GPU when there is one
    import torch

    return not torch.cuda.is_available()
