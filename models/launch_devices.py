"""The device of every launched rank, decided by all ranks before the process group exists.

Under a launcher (WORLD_SIZE > 1) the process group's backend follows the device: NCCL between GPUs, gloo between
CPUs, chosen by each rank as it joins. Each rank used to decide alone: a node whose GPU driver failed (no CUDA
there, CUDA on the others) joined over gloo while the others set up NCCL, and the launch hung until a collective
timed out, or trained mixed; a device setting naming a GPU missing on one node stopped that rank alone while the
others waited for it. Now every rank publishes what it sees (its GPU count, its host and, for a device setting,
whether that device is there) through the launcher's store (`models.collective.gather_before_group`), and every
rank takes the same decision from the same data, or refuses with the same line. What the ranks agree on once the
group exists (the precision, the attention backend) is models/agreement.py's.
"""

from __future__ import annotations

import json
import os
import socket
from typing import TYPE_CHECKING, Callable

from schemas.errors import UserError

if TYPE_CHECKING:
    from models.precision import DeviceSpec


def agreed_cpu(world: int, what: str, how: str = "is unset") -> bool:
    """With the device setting `what` unset: whether the `world` launched ranks run on the CPU (gloo). Every rank
    sees a GPU of its own (cuda:LOCAL_RANK): no (NCCL, as accelerate chooses); no rank sees any GPU: yes; some do
    and some do not: the same `UserError` on every rank, naming the ranks without one and their hosts. A
    collective: every launched rank calls it."""
    ranks = _gather(world, what, _view(), lambda ranks: _mixed(ranks, world, what, how))
    if (line := _mixed(ranks, world, what, how)) is not None:
        from models.collective import RankFailed  # taken by every rank from the same data: nothing to publish

        raise RankFailed(line)
    return all(r["gpus"] == 0 for r in ranks)


def _mixed(ranks: list[dict], world: int, what: str, how: str) -> str | None:
    """`agreed_cpu`'s refusal where some ranks see a GPU of their own and some do not, else None."""
    without = [r for r in ranks if r["gpus"] <= r["local_rank"]]
    if not without or all(r["gpus"] == 0 for r in ranks):
        return None
    fewer = any(r["gpus"] for r in without)  # a node with fewer GPUs than processes
    one = len(without) == 1
    return (f"{what} {how} and {_named(without)} (of {world}) {'has' if one else 'have'} no GPU of "
            f"{'its' if one else 'their'} own while the other ranks do (NCCL and gloo ranks cannot train "
            "together): fix the GPU driver there (nvidia-smi)"
            + (" or launch as many processes per node as it has GPUs" if fewer else "")
            + f", or set {what}=cpu to train every rank on the CPU")


def check_devices(spec: DeviceSpec, what: str, world: int) -> None:
    """The device setting `what` (`spec`: one device, or one per local rank; cuda = cuda:LOCAL_RANK) checked for
    this rank (`auto`: CUDA where every rank has a GPU, the CPU where none has, else refused by all ranks alike): a
    device that is not there raises `UserError`. With several ranks and a GPU in the setting, every
    rank checks and all refuse together, with the lowest failing rank's line naming the failing ranks and their
    hosts, instead of that rank stopping alone while the others set up the process group and wait for it. A
    setting of CPUs only is checked by each rank alone (nothing there differs per node)."""
    from models.loading import check_device
    from models.precision import device_for_rank, holds_auto, resolve_auto

    if world > 1 and holds_auto(spec):
        # decided on each node by its own GPUs: all ranks decide together, as for train.device unset, so that
        # a node without CUDA does not join over gloo while the others wait for NCCL
        agreed_cpu(world, what, "is auto")
    spec = resolve_auto(spec)

    def own() -> None:
        check_device(device_for_rank(spec, what=what), what)

    names = [spec] if isinstance(spec, str) else list(spec)
    if world <= 1 or not any(str(d).startswith("cuda") for d in names):  # decided from the setting: alike on all
        own()
        return
    try:
        own()
        error = None
    except UserError as e:
        error = " ".join(str(e).splitlines())
    ranks = _gather(world, what, {**_view(), "error": error}, lambda ranks: _missing(ranks, world))
    if (line := _missing(ranks, world)) is not None:
        from models.collective import RankFailed  # taken by every rank from the same data: nothing to publish

        raise RankFailed(line)


def _missing(ranks: list[dict], world: int) -> str | None:
    """`check_devices`' refusal where a rank's device is not there: the lowest such rank's error, else None."""
    failed = [r for r in ranks if r["error"]]
    return f"{failed[0]['error']} (on {_named(failed)}, of {world})" if failed else None


def _view() -> dict:
    import torch

    return {"rank": int(os.environ.get("RANK", "0")), "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0, "host": socket.gethostname()}


def _gather(world: int, what: str, view: dict, refusal: Callable[[list[dict]], str | None]) -> list[dict]:
    """Every rank's `view`, in rank order. `refusal(ranks)`: the line they end the command with, if any, recorded
    before the exchange's last wait (`gather_before_group`'s `ending`): a SIGTERM there ends the rank with it."""
    from models.collective import gather_before_group

    def parsed(texts: list[str]) -> list[dict]:
        return [json.loads(text) for text in texts]

    return parsed(gather_before_group(world, what, json.dumps(view), ending=lambda texts: refusal(parsed(texts))))


def _named(ranks: list[dict]) -> str:
    """"rank 1 on node-b", "ranks 1, 3 on node-b, node-c": the first 8, then how many more."""
    from models.agreement import few

    hosts = ", ".join(dict.fromkeys(r["host"] for r in ranks[:8]))
    return f"rank{'s' if len(ranks) > 1 else ''} {few(r['rank'] for r in ranks)} on {hosts}"
