"""Decisions every rank takes together: a step that can fail on one rank (a checkpoint write on a full disk, a
damaged input, a threshold) is run inside `together(...)`, and afterwards every rank knows whether any rank
failed; if one did, every rank raises the same one-line `UserError` (the lowest failing rank's message), so all
ranks exit within seconds with the same line instead of one rank dying and the others waiting at the next
barrier until the collective timeout (torchtune all-reduces its decisions the same way).

Only integers and UTF-8 bytes travel (two small collectives: an all-reduce of the failing rank, a broadcast of
its message); no pickled objects. With one process nothing is exchanged and the error passes through as it is.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from schemas.errors import UserError

MESSAGE_BYTES = 2048  # the broadcast message's fixed size (a one-line error; longer ones are cut)


class RankFailed(UserError):
    """Another rank (or this one) failed a step all ranks take together; the message is that rank's error."""


def _device() -> torch.device:
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(message: str | None, world: int) -> str | None:
    """Every rank's view of the step: None when every rank succeeded, else the lowest failing rank's message."""
    import torch.distributed as dist

    rank, dev = dist.get_rank(), _device()
    first = torch.tensor([rank if message is not None else world], dtype=torch.int64, device=dev)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    src = int(first.item())
    if src == world:
        return None
    buf = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8, device=dev)
    if rank == src:
        data = message.encode("utf-8", "replace")[:MESSAGE_BYTES]
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    dist.broadcast(buf, src=src)
    return bytes(buf.cpu().numpy()).rstrip(b"\0").decode("utf-8", "replace")


def _message(error: BaseException, what: str) -> str:
    if isinstance(error, UserError):
        text = str(error)
    else:
        text = f"{what or 'a step'} failed: {type(error).__name__}: {error}"
    return " ".join(text.splitlines()) or type(error).__name__


def agreed(error: BaseException | None) -> bool:
    """Whether every rank already knows of this error (it came out of `together` or `share_failure`)."""
    return isinstance(error, RankFailed) or getattr(error, "agreed_by_all_ranks", False)


def _mark(error: BaseException) -> BaseException:
    try:
        error.agreed_by_all_ranks = True  # type: ignore[attr-defined]
    except AttributeError:  # an exception type with __slots__: it is then reported as any other
        pass
    return error


@contextmanager
def together(world: int, what: str = "") -> Iterator[None]:
    """Run the block on every rank, then agree: an exception on any rank becomes the same `RankFailed` on every
    rank. A `UserError` keeps its message; any other exception is named by type (and re-raised with its
    traceback on the rank where it happened: a bug is still a bug). `what` names the step in that message.
    Also a barrier: no rank leaves before every rank has run the block."""
    if world <= 1:
        yield
        return
    error: BaseException | None = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        if agreed(e):  # a nested agreement already told every rank
            raise
        error = e
    message = _agree(None if error is None else _message(error, what), world)
    if message is None:
        return
    if error is not None and not isinstance(error, UserError):
        raise _mark(error)
    raise RankFailed(message) from None


def share_failure(world: int, error: BaseException | None, what: str = "") -> None:
    """The failure path of a rank that left the steps it shares with the others (an error in its own part of
    the work): take part in the one agreement the other ranks reach next (`together`), so they stop with this
    message instead of waiting for this rank. Nothing to do for one process, no error, or an agreed one."""
    if world <= 1 or error is None or agreed(error) or not isinstance(error, Exception):
        return
    _agree(_message(error, what), world)
    _mark(error)


def any_over_ranks(mask, world: int):
    """A boolean numpy mask OR-ed over all ranks (e.g. the damaged rows each rank found in its share)."""
    if world <= 1:
        return mask
    import numpy as np
    import torch.distributed as dist

    t = torch.from_numpy(mask.astype(np.uint8)).to(_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().numpy().astype(bool)
