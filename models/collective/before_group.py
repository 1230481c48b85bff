"""Decisions taken before any process group exists, through the launch's store: every rank's text on every rank
(`gather_before_group`: what the group is made of, its backend) and `together` before the group
(`together_before_group`). Its first exchange starts the watch thread. On rank 0 of a plain env:// launch this
process serves the store itself (`_before_group_store`)."""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from models.collective import state, timing
from models.collective.canary import forget_store_hosts
from models.collective.counting import _all_set, _count_and_wait
from models.collective.errors import RankFailed, _first_line, _mark, _message, agreed
from models.collective.store_client import StoreSilent, _call, _ends_store, _hosts_store, _launch_key, _store_client
from models.collective.watch import watch_failures
from schemas.errors import UserError


def gather_before_group(world: int, what: str, text: str, timeout: float | None = None,
                        ending: Callable[[list[str]], str | None] | None = None) -> list[str]:
    """Every rank's `text`, in rank order, on every rank, before any process group exists, so that all ranks can
    decide together what the group is made of (its backend): through the launcher's store, under keys of this
    launch attempt and of `what` (the decision, e.g. train.device; every rank calls it as often with the same
    `what`). A rank waits for the others at most `timeout` seconds (BEFORE_GROUP_SECONDS), then refuses naming
    those that never came.
    Without a launcher's store (a plain env:// launch: a platform set WORLD_SIZE, RANK, MASTER_*), rank 0 serves
    the store, and the process group later serves from it too. One process, or a launch that names no store
    (then no env:// group can form either): [text], this rank's alone. `ending(texts)`: the line the texts end
    the command with, if any, this process's line for a SIGTERM from here on (publish.py `ending_line`)."""
    if world <= 1 or not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        return [text]
    timeout = timing.BEFORE_GROUP_SECONDS if timeout is None else timeout
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        store = _before_group_store(timeout)
    except Exception as e:  # noqa: BLE001 - the store's own error (a timeout, a refused connection, a taken port)
        raise UserError(f"{what}: the ranks decide it together through the launch's store at {where}, but none "
                        f"could be reached ({_first_line(e)}): launch with `pipeline launch` (torchrun)") from None
    # from the first exchange on, a rank that fails alone before the group (between two of these, or before the
    # group forms) ends this one with its line, wherever it waits (here: else until `timeout`, 30 minutes)
    watch_failures(world)
    rank = int(os.environ.get("RANK", "0"))
    count = state.before["count"][what] = state.before["count"].get(what, 0) + 1
    key = f"{_launch_key('before-group')}/{what}/{count}"
    keys = [f"{key}/{r}" for r in range(world)]
    try:
        # each call bounded (`_call`): a store whose host stopped answering held this wait for ever, a Ctrl-C ignored
        _call(store, lambda c: c.set(keys[rank], text))
        _wait_keys(store, keys, timeout)
        texts = [_call(store, lambda c: c.get(k)).decode("utf-8", "replace") for k in keys]
    except Exception as e:  # noqa: BLE001 - timed out (DistStoreError), or the store went away: named below
        raise _exchange_failed(e, what, store, keys, timeout) from None
    if ending is not None and (line := ending(texts)) is not None:
        # under torchrun another worker of this node may end on it first: the agent then SIGTERMs this one in the
        # wait below, which ended it silently
        state.run["ending"] = line
    # every rank counts itself as having read the texts; a process whose exit may end the store waits for them
    # (`_ends_store`: when the decision is a refusal, the others read first): its host, or under an agent's store
    # a worker of the node whose agent serves it: the agent ends it once its worker exits, and a rank on another
    # node one poll behind met a reset connection instead of the texts (CI: "the launch's store ... went away
    # meanwhile" in place of the refusal). The others do not wait: a rank polling for a read mark while the store
    # ended printed torch's C++ warning and stack
    _count_and_wait(store, f"{key}/read", world, wait=state.before["hosted"] or _ends_store())
    return texts


def _exchange_failed(e: Exception, what: str, store, keys: list[str], timeout: float) -> UserError:
    """The one line for an exchange of `gather_before_group` that failed with `e`: the store silent, ranks that
    never reported within `timeout` (named), or the store gone meanwhile."""
    from models.agreement import few

    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    if isinstance(e, StoreSilent):
        return UserError(f"{what}: the ranks decide it together through the launch's store, but {e}: see that host "
                         "(rank 0's when no launcher serves the store) or the launcher's log")
    try:
        missing = [r for r, k in enumerate(keys) if not _call(store, lambda c: c.check([k]))]
    except Exception:  # noqa: BLE001 - the store is gone (its host ended): not the ranks' silence
        missing = []
    if missing:
        return UserError(f"{what}: the ranks decide it together before training, but rank(s) {few(missing)} of "
                         f"{len(keys)} did not report within {timeout:.0f} s: see their logs (a rank that failed "
                         "earlier, or launched with another command)")
    # e.g. rank 0 of a plain env:// launch, which serves the store, ended (killed, or failed) meanwhile
    return UserError(f"{what}: the ranks decide it together through the launch's store at {where}, which went away "
                     f"meanwhile ({_first_line(e)}): see rank 0's log (it serves the store when no launcher does) or "
                     "the launcher's")


def _wait_keys(store, keys: list[str], timeout: float) -> None:
    """`store.wait(keys, timeout)`, polled: the store's own wait is one C++ call that no signal ends (a Ctrl-C while
    a rank waited for a rank still starting held it for the whole bound, 30 minutes); between polls the main thread
    runs Python, where a signal's handler runs."""
    if not _all_set(lambda k: _call(store, lambda c: c.check([k])), keys, time.monotonic() + timeout):
        raise TimeoutError(f"the keys were not all set within {timeout:.0f} s")


@contextmanager
def together_before_group(world: int, what: str) -> Iterator[None]:
    """`together` before any process group exists (a check that reads files, at a command's start): the block
    runs on every rank, then every rank's outcome goes to every rank through the launch's store
    (`gather_before_group`), and a failure on any rank becomes the same `RankFailed` on every rank: the lowest
    failing rank's message, named by its rank when some ranks did not fail (a node's own copy of a file). Without
    it, a rank that failed alone there exited while the others went on to wait for it in their first collective
    (on another node: until the collective timeout, saying nothing). One process, or a launch naming no store:
    errors pass through."""
    if world <= 1 or not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        yield
        return
    error: BaseException | None = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        if agreed(e):
            raise
        error = e
    texts = gather_before_group(world, what, "" if error is None else _message(error, what),
                                ending=lambda texts: _refusal(texts, world))
    line = _refusal(texts, world)
    if line is None:
        return
    if error is not None and not isinstance(error, UserError):
        raise _mark(error)
    raise RankFailed(line) from None


def _refusal(texts: list[str], world: int) -> str | None:
    """The line of `together_before_group`'s outcome, None where no rank failed: the lowest failing rank's text,
    named by its rank where some ranks did not fail."""
    failed = [r for r, text in enumerate(texts) if text]
    if not failed:
        return None
    first = texts[failed[0]]
    return first if len(failed) == world else f"rank {failed[0]}: {first}"


def _before_group_store(timeout: float):
    """This process's connection to the launch's store, made once: a client of the launcher's (torchrun's agent
    store), or, on rank 0 of a launch without one, the store itself, kept for the process life. It is made
    multi-tenant as torch's env:// rendezvous makes rank 0's: the process group then serves from this server
    instead of binding MASTER_PORT a second time."""
    if state.before["store"] is None:
        forget_store_hosts()  # a new store (a later run's in this process may have this address)
        # rank 0 of a plain env:// launch serves the store itself; under torchrun the agent does
        if _hosts_store():
            from datetime import timedelta

            import torch.distributed as dist

            host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            listener = _ipv4_listener(host, port)
            try:
                state.before["store"] = dist.TCPStore(host, port, is_master=True, multi_tenant=True,
                                                 wait_for_workers=False, timeout=timedelta(seconds=timeout), **listener)
            except BaseException:  # its listening socket is ours until a store holds it: the port freed
                if listener:
                    os.close(listener["master_listen_fd"])
                raise
            state.before["hosted"] = True
        else:  # waits for a store that is not up yet (rank 0 still starting) as long as for the other ranks
            state.before["store"] = _store_client(timeout)
    return state.before["store"]


def _ipv4_listener(host: str, port: int) -> dict:
    """`master_listen_fd` for the store this rank serves, where the launch names it by an IPv4 address: a socket
    listening on IPv4, bound as torch binds its own (every interface, the port reusable). torch's own listens on
    IPv6, dual-stack, and names each connection it accepts by a reverse DNS lookup (c10d socket.cpp formats every
    socket's peer with getnameinfo), on the store's one thread: a peer at 127.0.0.1 is then ::ffff:127.0.0.1,
    which /etc/hosts does not answer, so every connection asked the DNS server, and one query left unanswered
    held every rank's calls for the resolver's timeout, 5 s (bench/store_connect.py). Seen on IPv4, the peer is
    named from /etc/hosts where it is there (127.0.0.1 always). An IPv6 address or a host name: torch's own."""
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return {}
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("", port))
    except OSError:
        # taken: by a store this process still serves there (an earlier run's in the same process, kept by its
        # process group: torch's multi-tenant store serves it again), or by another process (torch's own bind
        # then says "address already in use", the words launchers match): torch's own listener, as before
        listener.close()
        return {}
    return {"master_listen_fd": listener.detach()}  # torch listens on it and closes it with the store
