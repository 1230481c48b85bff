"""Run by each of two processes (tests/models/test_launch_devices.py, not a test module itself): this rank sees as
many GPUs as GPUS lists for its rank ("0,1": rank 0 none, rank 1 one; torch.cuda patched, the CPU runs both), as
on a cluster where one node's GPU driver failed, and decides its device as a launched stage does. Prints
`RESULT cpu: True|False`; a refusal as the CLI prints it (`error: LINE`, exit 1).

    device_ranks.py GPUS unset          train with train.device unset (`stages.train.launch.use_cpu`)
    device_ranks.py GPUS unset group    ... then the gloo process group on MASTER_PORT, one all-reduce (RESULT sum: 3)
    device_ranks.py GPUS set SPEC       a device setting checked on every rank (`models.launch_devices.check_devices`)
"""

from __future__ import annotations

import os
import sys

import torch

GPUS = int(sys.argv[1].split(",")[int(os.environ["RANK"])])
torch.cuda.is_available = lambda: GPUS > 0
torch.cuda.device_count = lambda: GPUS


def main() -> None:
    from schemas.errors import UserError

    case, *rest = sys.argv[2:]
    try:
        if case == "unset":
            from stages.train.launch import use_cpu

            print(f"RESULT cpu: {use_cpu(None)}", flush=True)
        else:
            from models.launch_devices import check_devices

            check_devices(rest[0], "encode_vae.device", int(os.environ["WORLD_SIZE"]))
            print("RESULT checked: yes", flush=True)
    except UserError as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(1)
    if rest == ["group"]:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        total = torch.tensor([dist.get_rank() + 1])
        dist.all_reduce(total)
        print(f"RESULT sum: {int(total.item())}", flush=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
