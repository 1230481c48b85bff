"""Test processes started warm: `python SCRIPT | -m MODULE | -c CODE ARGS` forked from a parent that has imported
the heavy third-party libraries already (tests/warm_parent.py), instead of a cold interpreter each.

Why: a rank script's imports (torch, diffusers, transformers, peft) take ~9 s of CPU on the project's 2-core
machine, and the suite starts ~80 rank processes: about a third of its CPU time went to importing the same
modules again. A fork is still a new process with its own pid, environment, argv, folder, output files and exit
status (its children's gloo world is as real as before); the project's own modules are never imported by the
parent, so each child imports them itself, after whatever its script patches first, as a cold start does.

One parent per environment (less the per-launch variables in `PER_LAUNCH`, read at run time): a library reads
some variables once at import (OMP_NUM_THREADS, HF_HUB_OFFLINE, ...), so a child whose environment differs in
anything else gets a parent started with it. The parents end with the test process (their stdin closes).
A torchrun agent started here starts its workers warm too, from its own parent (tests/warm_parent.py says how);
WARM_COLD_WORKERS=1 in its environment starts them cold.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from launch_ports import OutputFiles
from warm_parent import PER_LAUNCH  # noqa: F401 - the variables a child sets itself (its note says which)

HERE = Path(__file__).resolve().parent
READY_SECONDS = 300  # a bound for the parent's imports on a loaded 2-core machine


def _parent_env(base: dict[str, str]) -> dict[str, str]:
    """A parent's environment: `base` and this test process's PYTHONPATH. The libraries it preloads are found
    where the suite's are: a stack that installs them with `pip --target` on PYTHONPATH (the GPU machine's, and
    bench/gpu/rehearse) has no other copy; a child's own PYTHONPATH still comes first (tests/warm_parent.py)."""
    suite_path = os.environ.get("PYTHONPATH")
    return {**base, "PYTHONPATH": suite_path} if suite_path else dict(base)


class _Parent:
    def __init__(self, env: dict[str, str]) -> None:
        self._err = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, str(HERE / "warm_parent.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._err, env=_parent_env(env), text=True,
                                     bufsize=1)
        self._changed = threading.Condition()
        self._ids = itertools.count()
        self.pids: dict[int, int] = {}  # request id -> pid
        self.exits: dict[int, int] = {}  # request id -> return code (ids, not pids: a pid is reused once reaped)
        self._ready = threading.Event()
        threading.Thread(target=self._read, name="warm-parent-answers", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            answer = json.loads(line)
            with self._changed:
                if "ready" in answer:
                    self._ready.set()
                elif "pid" in answer:
                    self.pids[answer["id"]] = answer["pid"]
                else:
                    self.exits[answer["exited"]] = answer["returncode"]
                self._changed.notify_all()
        with self._changed:
            self._ready.set()
            self._changed.notify_all()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(self, argv: list[str], env: dict[str, str], cwd: str, out: str, err: str,
             session: bool = False) -> tuple[int, int]:
        """(request id, pid) of a new child (`session`: in a session of its own)."""
        if not self._ready.wait(READY_SECONDS) or not self.alive():
            self._err.seek(0)
            raise AssertionError(f"the warm parent did not start: {self._err.read()[-3000:]}")
        with self._changed:
            rid = next(self._ids)
            self.proc.stdin.write(json.dumps({"id": rid, "argv": argv, "env": env, "cwd": cwd, "out": out,
                                              "err": err, "session": session}) + "\n")
            self.proc.stdin.flush()
            if not self._changed.wait_for(lambda: rid in self.pids or not self.alive(), READY_SECONDS):
                raise AssertionError("the warm parent did not answer a fork request")
            if rid not in self.pids:
                raise AssertionError("the warm parent ended")
            return rid, self.pids[rid]

    def wait_exit(self, rid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: rid in self.exits or not self.alive(), timeout)
            return self.exits.get(rid)


_parents: dict[tuple, _Parent] = {}


def _parent_for(env: dict[str, str]) -> _Parent:
    base = {k: v for k, v in env.items() if k not in PER_LAUNCH}
    key = tuple(sorted(base.items()))
    parent = _parents.get(key)
    if parent is None or not parent.alive():
        parent = _parents[key] = _Parent(base)
    return parent


@atexit.register
def _close() -> None:
    for parent in _parents.values():
        parent.proc.stdin.close()  # it exits once its children have


class WarmProcess(OutputFiles):
    """`python SCRIPT ARGS` forked by a warm parent; the part of subprocess.Popen the launch tests use (pid, poll,
    wait, returncode, send_signal, kill, start_new_session) and, as tests/launch_ports.py's Logged, communicate
    and output."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None,
                 start_new_session: bool = False) -> None:
        assert Path(args[0]).resolve() == Path(sys.executable).resolve(), args
        assert args[1] in ("-c", "-m") or (args[1].endswith(".py") and not args[1].startswith("-")), args
        self.args = args
        self._files = tuple(tempfile.NamedTemporaryFile("w+", suffix=suffix) for suffix in (".out", ".err"))
        env = dict(os.environ if env is None else env)
        self._parent = _parent_for(env)
        self._id, self.pid = self._parent.fork(args[1:], env, str(cwd or os.getcwd()), self._files[0].name,
                                               self._files[1].name, start_new_session)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._parent.exits.get(self._id)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            code = self._parent.wait_exit(self._id, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = code
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # ended meanwhile (not yet reaped is still a process: no error)
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def run(args: list[str], env: dict[str, str] | None = None, timeout: float | None = None,
        cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """`subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)` for `python
    SCRIPT | -m MODULE | -c CODE ...`, started warm."""
    proc = WarmProcess(args, env, cwd)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)


def outcomes(procs: list, timeout: float | None = None) -> list[tuple[int, str, str]]:
    """(returncode, stdout, stderr) of each process in order, waiting at most `timeout` for each; every one is
    killed afterwards (a rank left waiting in a collective fails the caller's test with the timeout, not a hang)."""
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            outs.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            p.kill()
    return outs
