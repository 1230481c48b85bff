"""`evaluate --all-checkpoints` over several processes (`pipeline launch --nproc-per-node N run evaluate
--all-checkpoints ...`): hundreds of checkpoints of a large model are too slow for one GPU.

Every rank loads the transformer on its own device and computes the held-out losses of its share of the val
samples (sample i on rank i % world, as validation while training splits them); the per-row losses are summed
across ranks into the full grid, so every number is the one process's number (up to the float rounding of other
batches). Rank 0 holds the report folder, decides what is missing, appends and writes the report. Every step
that can fail on one rank is agreed on by all (`models.collective.together`), and a rank's own loss pass runs in
`fails_alone`, so a failing rank stops every rank with its line instead of leaving the others in a collective.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from models.collective import all_max, close_at_exit


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def share(self, n: int) -> list[int]:
        """The val samples this rank computes (all of them in one process)."""
        return [i for i in range(n) if i % self.world == self.rank]

    def any(self, flags: list[int]) -> list[int]:
        """Each flag's maximum over the ranks: what any rank saw (one process: the flags)."""
        return all_max(self.world, flags)

    def from_main(self, values: list[int]) -> list[int]:
        """Rank 0's non-negative integers on every rank (the others pass anything of the same length)."""
        return all_max(self.world, values if self.main else [0] * len(values))

    def from_owners(self, hashes: list[str | None]) -> list[str | None]:
        """sha256 hex digests, each computed by one rank (None on the others), on every rank: as 32-bit words
        each rank fills for its own and leaves 0 for the others', max-reduced. None where no rank had one."""
        words = 8  # 64 hex digits
        flat = [int(h[8 * w : 8 * w + 8], 16) if h else 0 for h in hashes for w in range(words)]
        owned = self.any([int(h is not None) for h in hashes])
        flat = self.any(flat)
        return [None if not have else "".join(f"{v:08x}" for v in flat[i * words : (i + 1) * words])
                for i, have in enumerate(owned)]

    def full_grid(self, part: np.ndarray, mine: list[int], n: int) -> np.ndarray:
        """This rank's [len(mine), ...] losses summed with the others' into the [n, ...] grid (every rank).
        NaN (a region a sample has not) survives the sum: NaN + 0 is NaN."""
        if self.world == 1:
            return part
        import torch.distributed as dist

        full = torch.zeros((n, *part.shape[1:]), dtype=torch.float64)
        full[mine] = torch.from_numpy(part)
        if dist.get_backend() == "nccl":  # NCCL reduces device tensors only
            full = full.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(full, op=dist.ReduceOp.SUM)
        return full.cpu().numpy()


def launched(cfg) -> Ranks:
    """This process's place under a launcher (torchrun / accelerate launch); a plain run is rank 0 of 1 and never
    touches torch.distributed (nor the config). `cfg.device` on the CPU: gloo, as train and encode do; a GPU
    missing on one rank stops every rank alike before the process group exists."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Ranks()
    from accelerate import PartialState

    from models.launch_devices import check_devices
    from models.precision import first_device

    check_devices(cfg.device, "evaluate.device", world)

    state = PartialState(cpu=str(first_device(cfg.device)).startswith("cpu"))
    close_at_exit()
    return Ranks(state.process_index, state.num_processes)
