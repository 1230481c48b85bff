"""How many processes the launcher started, and whether they must train on the CPU.

`accelerate launch --multi_gpu --num_processes N` on a machine without GPUs sets up no process group unless
the Accelerator is told `cpu=True` (accelerate picks gloo then): without that, each of the N processes trains
alone (world size 1) into the same run folder. So with `train.device` unset, a multi-process launch with no
GPU trains on the CPU over gloo, and `stages.train` refuses any launch whose process group does not match.
Whether there is a GPU is decided by all ranks together (`models.launch_devices.agreed_cpu`): a launch where
some ranks see one and others do not is refused on every rank alike, before the process group exists.
"""

from __future__ import annotations

import os


def launched_world_size() -> int:
    """Processes the launcher (accelerate launch / torchrun) started; 1 for a plain run."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def use_cpu(device: str | None) -> bool:
    """Whether accelerate is told to run on the CPU. With `train.device` unset and several ranks, a collective
    (every launched rank calls it): no rank sees a GPU -> yes; every rank sees its own -> no; else `UserError`."""
    if device is not None:
        return device == "cpu"
    world = launched_world_size()
    if world <= 1:
        return False  # accelerate's own choice: the GPU when there is one
    from models.launch_devices import agreed_cpu

    return agreed_cpu(world, "train.device")
