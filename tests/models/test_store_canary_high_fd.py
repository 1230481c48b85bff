"""`store_host_gone` on a canary connection whose file descriptor is past select()'s FD_SETSIZE (1024): a rank that
holds many files open (a store's shards, data loader pipes, NCCL's sockets) got one there, and `select.select`
raised "filedescriptor out of range in select()" (a ValueError, not the OSError it catches): a traceback from the
main thread's long wait (`_read`) or the watch thread, which then stopped watching. The canary is placed on a high
descriptor by the test itself (no race, no timing); the store is a plain listening socket of the test's own."""

from __future__ import annotations

import os
import resource
import socket

import pytest

from own_collective import own_collective  # noqa: F401  (the fixture)

HIGH_FD = 1500  # past FD_SETSIZE (1024)


def test_a_canary_past_fd_setsize_answers_alive_then_gone(monkeypatch, own_collective):
    collective = own_collective
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= HIGH_FD:
        pytest.skip(f"the hard limit on open files ({hard}) does not reach fd {HIGH_FD}")
    if soft != resource.RLIM_INFINITY and soft <= HIGH_FD:
        resource.setrlimit(resource.RLIMIT_NOFILE, (HIGH_FD + 1, hard))
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    try:
        plain = socket.create_connection(("127.0.0.1", port))
        high = os.dup2(plain.fileno(), HIGH_FD)
        plain.close()
        canary = socket.socket(fileno=high)
        accepted, _ = listener.accept()
        collective.state.run["canaries"] = {("127.0.0.1", str(port)): canary}
        assert not collective.store_host_gone()  # the store listens and sent nothing: alive
        accepted.close()
        listener.close()  # the store's process ended: its connections closed, its port refuses
        assert collective.store_host_gone()
    finally:
        listener.close()
        if soft != resource.RLIM_INFINITY and soft <= HIGH_FD:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
