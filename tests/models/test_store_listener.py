"""The store rank 0 of a plain env:// launch serves (models/collective/before_group.py `_before_group_store`) listens on
IPv4 where the launch names it by an IPv4 address. torch names each connection its store accepts by a reverse DNS
lookup, on the store's one thread; its own listener, IPv6 dual-stack, sees 127.0.0.1 as ::ffff:127.0.0.1, which
/etc/hosts does not answer: every connection asked the DNS server, and a query left unanswered held every rank's
connect and calls for the resolver's timeout, 5 s (CI; bench/store_connect.py has the figures)."""

from __future__ import annotations

import socket
from datetime import timedelta

import psutil
import pytest
import torch.distributed as dist

from launch_ports import free_port
from own_collective import own_collective  # noqa: F401  (the fixture)


def _listening_families(port: int) -> list[int]:
    return [c.family for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port]


@pytest.mark.parametrize(("address", "family"), [("127.0.0.1", socket.AF_INET), ("localhost", socket.AF_INET6)])
def test_rank_0s_store_listens_on_ipv4_for_an_ipv4_address(monkeypatch, own_collective, address, family) -> None:
    port = free_port()
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": address, "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    store = own_collective.before_group._before_group_store(30)
    # a host name (or an IPv6 address) keeps torch's own listener
    assert _listening_families(port) == [family]
    # it serves as before: another rank's client writes, the host reads; the process group's own store on the
    # same port is this server (multi-tenant), not a second bind
    client = dist.TCPStore(address, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))
    client.set("from-rank-1", "yes")
    group_store = dist.TCPStore(address, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                                timeout=timedelta(seconds=30))
    assert store.get("from-rank-1") == b"yes" and group_store.get("from-rank-1") == b"yes"


def test_a_store_hosted_again_in_the_same_process_is_served_by_the_one_still_there(monkeypatch,
                                                                                 own_collective) -> None:
    """A second run in one process (the CLI's tests, a notebook) hosts the store again on the port its first run's
    store still serves (kept by its process group): torch's multi-tenant store serves it. Before, the IPv4
    listener's own bind failed first ("[Errno 98] Address already in use"): every agreement of the second run was
    refused on rank 0 (CI: test_rank_failures, exit 2)."""
    port = free_port()
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    first = own_collective.before_group._before_group_store(30)
    first.set("first-run", "kept")
    # the next run's start: its own store object, the first one still alive
    monkeypatch.setattr(own_collective.state, "before", own_collective.state.fresh_before())
    again = own_collective.before_group._before_group_store(30)
    assert again.get("first-run") == b"kept" and _listening_families(port) == [socket.AF_INET]


def test_a_store_that_fails_to_start_leaves_the_port_free(monkeypatch, own_collective) -> None:
    """The IPv4 listener is this process's until torch's store holds it: a store that fails to start (any error of
    torch's constructor) closes it, so the port is free again. Before, the listening socket leaked with the port."""
    port = free_port()
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)

    def fails(*args, **kwargs):
        assert _listening_families(port) == []  # bound, not yet listening: torch listens on it
        raise RuntimeError("the store did not start")

    monkeypatch.setattr(dist, "TCPStore", fails)
    with pytest.raises(RuntimeError, match="did not start"):
        own_collective.before_group._before_group_store(30)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", port))  # no SO_REUSEADDR: a socket still bound there refuses this
