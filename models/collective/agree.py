"""Decisions every rank takes together through the process group: a step that can fail on one rank (a checkpoint
write on a full disk, a damaged input, a threshold) runs inside `together(...)`, and afterwards every rank knows
whether any rank failed; if one did, every rank raises the same one-line `UserError` (the lowest failing rank's
message), so all ranks exit within seconds with the same line instead of one rank dying and the others waiting at
the next barrier until the collective timeout (torchtune all-reduces its decisions the same way). Also the other
small exchanges of integers and texts (`all_max`, `all_sum`, `spread`, `gather_texts`, `differing_ranks`).

Only integers and UTF-8 bytes travel (two small collectives: an all-reduce of the failing rank, a broadcast of
its message); no pickled objects. With one process nothing is exchanged and the error passes through as it is."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

from models.collective.arrive import arrive_together
from models.collective.errors import RankFailed, _mark, _message, agreed
from models.collective.interrupt import _tell_interrupt
from models.collective.publish import _publish
from models.collective.watch import watch_failures
from schemas.errors import UserError

if TYPE_CHECKING:
    import torch


MESSAGE_BYTES = 2048  # the broadcast message's fixed size (a one-line error; longer ones are cut)


def _device() -> torch.device:
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(message: str | None, world: int) -> str | None:
    """Every rank's view of the step: None when every rank succeeded, else the lowest failing rank's message."""
    import torch
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


@contextmanager
def together(world: int, what: str = "", uneven: bool = False) -> Iterator[None]:
    """Run the block on every rank, then agree: an exception on any rank becomes the same `RankFailed` on every
    rank. A `UserError` keeps its message; any other exception is named by type (and re-raised with its
    traceback on the rank where it happened: a bug is still a bug). `what` names the step in that message.
    Also a barrier: no rank leaves before every rank has run the block.
    `uneven`: the ranks may come to the agreement far apart (each ends its own share of the work there, or one
    rank works alone in the block): they wait for each other through the launcher's store first
    (`arrive_together`), not inside the agreement's collective, whose timeout (NCCL's: 10 minutes) would end
    the ranks that came early. Only for a block with no collective inside: a rank failing before one would wait
    at the arrival for ranks that wait for it in that collective."""
    if world <= 1:
        yield
        return
    watch_failures(world)  # from the first agreement on, a rank that fails alone stops this one too
    error: BaseException | None = None
    try:
        yield
    except KeyboardInterrupt as e:  # on this rank alone: the others would wait for it at the agreement
        _tell_interrupt(e, world, what)
        raise
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        if agreed(e):  # a nested agreement already told every rank
            raise
        error = e
    if uneven:
        arrive_together(world, what)
    message = _agree(None if error is None else _message(error, what), world)
    if message is None:
        return
    if error is not None and not isinstance(error, UserError):
        raise _mark(error)
    raise RankFailed(message) from None


def all_max(world: int, values: list[int]) -> list[int]:
    """Each value's maximum over every rank (integers only, like everything here); one process: `values`."""
    return _all_reduce(world, values, "MAX")


def spread(world: int, values: list[int]) -> list[tuple[int, int]]:
    """Each value's (highest, lowest) over every rank, from one all-reduce of the values and their negations: a
    value is the same on every rank where the two are equal. One process: (value, value)."""
    out = all_max(world, [x for v in values for x in (v, -v)])
    return [(high, -neg_low) for high, neg_low in zip(out[0::2], out[1::2])]


def differing_ranks(world: int, digests: list[str]) -> list[list[int]]:
    """For each hex digest (a fingerprint, a sha256), the ranks whose digest is not rank 0's ([]: the same on every
    rank), the same lists on every rank, so a refusal can name the ranks: one all-gather of every rank's digests
    (`gather_texts`). One process: none differs."""
    if world <= 1:
        return [[] for _ in digests]
    text = " ".join(digests)
    if len(text) > MESSAGE_BYTES:  # a bug of the caller, not a configuration to refuse
        raise ValueError(f"{len(digests)} digests of {len(text)} characters in all: at most {MESSAGE_BYTES}")
    ranks = [t.split(" ") for t in gather_texts(world, text)]
    return [[r for r in range(1, world) if ranks[r][i:i + 1] != ranks[0][i:i + 1]] for i in range(len(digests))]


def ranks_differ(ranks: list[int]) -> str:
    """`differing_ranks`' ranks for a line: "rank 1 differs from rank 0", "ranks 1, 3 differ from rank 0"."""
    shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"rank {shown} differs from rank 0" if len(ranks) == 1 else f"ranks {shown} differ from rank 0"


def gather_texts(world: int, text: str, size: int | None = MESSAGE_BYTES) -> list[str]:
    """Every rank's `text` (UTF-8, cut at `size` bytes), in rank order, on every rank: one all-gather of fixed-size
    byte buffers, so every rank can take the same decision from the same data. `size` None: each text whole, the
    buffers as long as the longest (agreed by an all-reduce first: a text cut short, as JSON, read as none). One
    process: [text]."""
    if world <= 1:
        return [text]
    import torch
    import torch.distributed as dist

    dev = _device()
    data = text.encode("utf-8", "replace")
    if size is None:
        size = max(1, all_max(world, [len(data)])[0])
    data = data[:size]
    buf = torch.zeros(size, dtype=torch.uint8, device=dev)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    bufs = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf)
    return [bytes(b.cpu().numpy()).rstrip(b"\0").decode("utf-8", "replace") for b in bufs]


def all_sum(world: int, values: list[int]) -> list[int]:
    """Each value's sum over every rank (integers only); one process: `values`."""
    return _all_reduce(world, values, "SUM")


def _all_reduce(world: int, values: list[int], op: str) -> list[int]:
    if world <= 1:
        return list(values)
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return [int(v) for v in t.tolist()]


def share_failure(world: int, error: BaseException | None, what: str = "") -> None:
    """The failure path of a rank that left the steps it shares with the others (an error in its own part of
    the work): publish it through the launcher's store, so the other ranks stop at once with this message
    (their watch threads: `watch_failures`) instead of finishing their share first; without a store, take part in
    the one agreement the other ranks reach next (`together`). Nothing to do for one process, no error, or an agreed
    one."""
    if world <= 1 or error is None or agreed(error) or not isinstance(error, Exception):
        return
    message = _message(error, what)
    if _publish(message, world) is None:  # no store: the others learn it at their next agreement
        _agree(message, world)
    _mark(error)
