"""Where this encode process runs: its rank among the launched processes and its device."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    barrier: Callable[[], None] = lambda: None


def current_ranks(device: str | list[str], what: str = "device") -> Ranks:
    """This process's place under `accelerate launch` (or torchrun); a plain run is rank 0 of 1.

    Accelerate is only initialised when a launcher set WORLD_SIZE > 1, so a single process never touches
    torch.distributed. On a CPU device the process group is gloo (DESIGN §7: `Accelerator(cpu=True)`). A GPU
    missing on one rank (`what` names the setting) stops every rank alike before the group exists.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Ranks()
    from accelerate import PartialState

    from models.collective import close_at_exit
    from models.launch_devices import check_devices
    from models.precision import first_device

    check_devices(device, what, world)

    state = PartialState(cpu=str(first_device(device)).startswith("cpu"))
    close_at_exit()
    return Ranks(state.process_index, state.num_processes, state.local_process_index, state.wait_for_everyone)


def rank_device(device: str | list[str], ranks: Ranks, what: str = "device") -> str:
    """`cuda` under a multi-process launch means this rank's own GPU; a list names one device per local rank."""
    from models.precision import device_for_rank

    return device_for_rank(device, ranks.local_rank, ranks.world_size, what)
