"""Ranks that come to an agreement far apart wait for each other through the launch's store (`arrive_together`), not
inside a collective whose timeout would end the early ones; a rank killed without a word is named after
LOST_SECONDS, and a long wait says whom it waits for."""

from __future__ import annotations

import os
import sys
import time
from typing import Callable

from models.collective import state, timing
from models.collective.errors import RankFailed, _first_line
from models.collective.publish import publish_failure
from models.collective.reconnect import _read
from models.collective.store_client import _call, _launch_key, _store_client, signs_of_life
from models.collective.watch import watch_failures
from schemas.errors import UserError


def arrive_together(world: int, what: str) -> None:
    """Wait until every rank has come here, through the launcher's store: however long the others still work
    (an encoder's share that ends an hour after another's, a commit rank 0 makes alone), where a collective would
    have ended this rank at its timeout (NCCL's: 10 minutes; the agreement that follows then finds every rank
    there). A rank that fails meanwhile stops this one through its watch thread, as anywhere; a rank killed
    without a word (its watch thread's signs of life, `HEARTBEAT_SECONDS`, stop) stops every waiting rank after
    LOST_SECONDS with one line naming it; one that never gave any (still starting) after BEFORE_GROUP_SECONDS.
    Without a store (a launch naming none): nothing (the collective waits). Every rank calls it as often, in the
    same order: the arrivals are numbered per process (`what`, which may name a rank's own path, only names the
    step in the line)."""
    if world <= 1 or not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        return
    watch_failures(world)
    try:
        client = _store_client()
    except Exception as e:  # noqa: BLE001 - never skipped alone: the others would wait here for this rank
        raise UserError(f"{what}: the ranks wait for each other through the launch's store at "
                        f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}, which this rank cannot reach "
                        f"({_first_line(e)}): see the launcher's log") from None
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    state.run["arrivals"] = state.run.get("arrivals", 0) + 1
    key = f"{_launch_key('arrived')}/{state.run['arrivals']}"
    _call(client, lambda c: c.set(f"{key}/{rank}", "1"))
    _call(client, lambda c: c.append(f"{key}/ranks", f"{rank},"))  # every arrival in one value (`_wait_notice`)
    # bounded, not tried again (`_read`): an add applied twice counts two
    first = _call(client, lambda c: c.add(key, 1)) == 1
    seen: dict[int, tuple[int, float]] = {}  # rank -> (its signs of life, when they last changed here)
    look, began = 0.0, time.monotonic()
    notice = began + timing.WAIT_NOTICE_SECONDS
    clients = [client]
    while _read(clients, lambda c: c.add(key, 0)) < world:
        if first and time.monotonic() >= notice:
            notice += timing.WAIT_NOTICE_SECONDS
            waited = time.monotonic() - began
            sys.stderr.write(_wait_notice(lambda op: _read(clients, op), key, world, waited, what) + "\n")
            sys.stderr.flush()
        if time.monotonic() >= look:
            look = time.monotonic() + timing.LIVENESS_SECONDS
            lost = _lost_ranks(lambda op: _read(clients, op), key, world, seen)
            if lost:
                from models.agreement import few

                line = (f"{what}: rank(s) {few(lost)} of {world} gave no sign of life for "
                        f"{timing.LOST_SECONDS:.0f} s while the others waited for them (killed: `kill -9`, the "
                        "out-of-memory killer - `dmesg` on its node says - or its node lost); what the ranks "
                        "committed is kept: rerun the same command to continue")
                raise RankFailed(publish_failure(line, world))
        time.sleep(timing.POLL_SECONDS)


def _wait_notice(call: Callable, key: str, world: int, waited: float, what: str) -> str:
    """The line a long wait prints (every WAIT_NOTICE_SECONDS), by the first rank arrived only (its `add` counted
    1: one line, not one per rank, known without asking the store): a rank alive but stuck (a hung network file
    system read) keeps counting signs of life, so the others wait on without an end; the line says who they wait
    for, so a user sees it and can stop the job. `call(op)`: one store call (`_read`): one `get` of every arrival
    (`{key}/ranks`, which each rank appends itself to), whoever is missing: asking each rank's own mark cost the
    store calls that grew with the ranks missing (512 ranks, 256 missing: 66,046 calls; bench/wait_notice.py)."""
    from models.agreement import few

    arrived = {int(r) for r in call(lambda c: c.get(f"{key}/ranks")).decode().split(",") if r}
    missing = [r for r in range(world) if r not in arrived]
    return (f"{what}: {world - len(missing)} of {world} ranks have waited {waited / 60:.0f} min for rank(s) "
            f"{few(missing)}, still alive (working, or stuck: its node's logs say which)")


def _lost_ranks(call: Callable, key: str, world: int, seen: dict[int, tuple[int, float]]) -> list[int]:
    """The ranks not arrived at `key` whose signs of life have not changed for LOST_SECONDS; a rank that never gave
    any (its watch thread not started yet, or unable to reach the store) only after BEFORE_GROUP_SECONDS: a rank
    still starting is no lost one, but no wait is for ever. `call(op)`: one store call (`_read`): two for every
    rank's signs of life (`signs_of_life`), and one more for each silent one: whether it arrived (not waited for)."""
    now, lost = time.monotonic(), []
    for r, beats in enumerate(signs_of_life(call, list(range(world)))):
        if r not in seen or seen[r][0] != beats:
            seen[r] = (beats, now)
        elif (now - seen[r][1] > (timing.LOST_SECONDS if beats else timing.BEFORE_GROUP_SECONDS)
              and not call(lambda c: c.check([f"{key}/{r}"]))):
            lost.append(r)
    return lost
