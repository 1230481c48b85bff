"""The launch helpers under a port collision, forced: another process binds the port found free before the
launched store host does (what the other test file's launch can do when two run at once, scripts/test.sh)."""

from __future__ import annotations

import os
import socket
import sys

import launch_ports
from launch_ports import Logged, free_port, run_retrying_port, start_host_first

# Two ranks of one gloo world meeting at MASTER_ADDR:MASTER_PORT (a plain env:// launch: rank 0 hosts the store).
RANK = "import torch.distributed as d; d.init_process_group('gloo'); d.barrier(); print('rank', d.get_rank(), 'done')"


def _rank(rank: int, port: int) -> Logged:
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": "1"}
    return Logged([sys.executable, "-c", RANK], env=env)


def _taken() -> socket.socket:
    """A port found free, then taken by another process's listener before the launch binds it."""
    s = socket.socket()
    s.bind(("127.0.0.1", free_port()))
    s.listen()
    return s


def test_a_port_taken_after_it_was_found_free_fails_the_store_host():
    with _taken() as other:
        host = _rank(0, other.getsockname()[1])
        _, err = host.communicate(timeout=300)
    assert host.returncode != 0 and launch_ports.address_in_use(err), err[-2000:]


def _first_free_port_taken(monkeypatch):
    """(a socket holding a port, that port): the next `free_port` answers it, as if taken after it was found free;
    the ones after are really free."""
    other = _taken()
    taken = other.getsockname()[1]
    ports = iter([taken])
    monkeypatch.setattr(launch_ports, "free_port", lambda: next(ports, None) or free_port())
    return other, taken


def test_the_launch_starts_again_on_another_port_and_the_second_rank_never_meets_the_taken_one(monkeypatch):
    other, taken = _first_free_port_taken(monkeypatch)
    started = []

    def start(rank: int, port: int) -> Logged:
        started.append((rank, port))
        return _rank(rank, port)

    with other:
        procs = start_host_first(start, 2)
        outs = [p.communicate(timeout=300) for p in procs]
    assert started[0] == (0, taken) and [r for r, p in started if p == taken] == [0]  # rank 1: never on it
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [o.strip() for o, _ in outs] == ["rank 0 done", "rank 1 done"]


def test_a_launcher_whose_agent_found_its_port_taken_runs_again_on_another(monkeypatch):
    other, taken = _first_free_port_taken(monkeypatch)
    tried = []

    def command(port: int) -> list[str]:
        tried.append(port)
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                "--master-port", str(port), "-m", "json.tool", "--help"]

    with other:
        proc = run_retrying_port(command, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert len(tried) == 2 and tried[0] == taken, tried
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_suite_keeps_its_caches_out_of_the_users_home(tmp_path_factory):
    """Every session's S3 buckets have the same names, and the remote stores' cache is keyed by URL: in the user's
    home, two runs at once (or the next run) shared cached stores of different servers."""
    from models.file_hashes import FileHashes
    from store.remote_cache import default_cache_dir

    session = tmp_path_factory.getbasetemp()
    assert default_cache_dir().is_relative_to(session) and FileHashes().path.is_relative_to(session)


def test_the_s3_test_server_on_a_taken_port_fails_at_once():
    """moto's ThreadedMotoServer binds in its own thread: on a taken port its start() waited forever."""
    import pytest

    from s3_server import start_server

    with _taken() as other, pytest.raises(OSError, match="is taken"):
        start_server(other.getsockname()[1])
