"""Ports for the processes the tests launch, safe with two test files running at once (scripts/test.sh).

A port found free (bind to 0, close) stays free only until someone binds it: the other test file's launch (its
store, its gloo listeners, its clients' ephemeral ports) can take it before our child binds it. The child that
hosts the store then fails with "address already in use" (torch's own words, which torch's elastic launcher matches
the same way in torch/distributed/elastic/utils/distributed.py), and, worse, a rank started alongside it connects
to whatever holds the port: another test's store. So `start_host_first` starts the process that binds the port
first, starts the others only once it listens there (seen by psutil: no timing), and on "address already in use"
starts again on another port. Every process's output goes to an unnamed temporary file, never a pipe: a rank
blocked on a full pipe would hold the other at a barrier until the test's timeout.
"""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
from typing import Callable

ATTEMPTS = 5
HOST_WAIT_SECONDS = 300  # a bound on a loaded 2-core machine (torch's import alone takes seconds there)


def free_port() -> int:
    """A port nothing listens on right now (the kernel's pick); see the module's note for what that promises."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def address_in_use(output: str) -> bool:
    return "address already in use" in output.lower()


class OutputFiles:
    """A process whose stdout and stderr go to two temporary files (`_files`), never pipes: `communicate` waits
    (the class's `wait`) and returns both (text)."""

    _files: tuple

    def communicate(self, input=None, timeout=None) -> tuple[str, str]:  # noqa: A002 - Popen's own signature
        assert input is None
        self.wait(timeout)
        return self.output()

    def output(self) -> tuple[str, str]:
        """What the process wrote so far."""
        texts = []
        for f in self._files:
            f.seek(0)
            texts.append(f.read())
        return texts[0], texts[1]


class Logged(OutputFiles, subprocess.Popen):
    def __init__(self, args, **kwargs):
        self._files = (tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+"))
        super().__init__(args, stdout=self._files[0], stderr=self._files[1], text=True, **kwargs)


def listens_on(pid: int, port: int) -> bool:
    """Whether process `pid` or one of its children listens on TCP `port`."""
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return False
    for p in procs:
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in p.net_connections(kind="tcp")):
                return True
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return False


def _host_listens(host: Logged, port: int) -> bool:
    """Wait until `host` listens on `port` (True) or has exited (False)."""
    deadline = time.monotonic() + HOST_WAIT_SECONDS
    while time.monotonic() < deadline:
        if listens_on(host.pid, port):
            return True
        if host.poll() is not None:
            return False
        time.sleep(0.05)
    host.kill()
    raise AssertionError(f"the launch's first process never listened on port {port}: {host.output()[1][-2000:]}")


def start_host_first(start: Callable[[int, int], Logged], count: int) -> list[Logged]:
    """`start(i, port)` for i = 0 .. count-1, all given one port that process 0 binds (the store's host): the
    others start once it listens there; if it failed because the port was taken meanwhile, all start again on
    another port. (A host that stops for another reason is the test's to see: the others start as before.)"""
    for _ in range(ATTEMPTS):
        port = free_port()
        host = start(0, port)
        if not _host_listens(host, port) and address_in_use("".join(host.output())):
            continue
        return [host, *(start(i, port) for i in range(1, count))]
    raise AssertionError(f"{ATTEMPTS} ports in a row were taken before the launch's first process bound them")


def run_retrying_port(command: Callable[[int], list[str]], **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(command(port), capture_output=True, text=True, **kwargs)` for a launcher that binds the port
    in one process of its own (a one-machine `accelerate launch`: its agent hosts the store, its workers start
    after), again on another port when that bind found the port taken."""
    for _ in range(ATTEMPTS):
        proc = subprocess.run(command(free_port()), capture_output=True, text=True, **kwargs)
        if proc.returncode == 0 or not address_in_use(proc.stdout + proc.stderr):
            return proc
    return proc
