"""The warm parent of tests/warm_start.py (run as a script, not a test module): imports the heavy third-party
libraries once, then forks one child per request, each child running `python SCRIPT ARGS` as a cold start would.

Requests on stdin, one JSON object a line: {"id": I, "argv": [SCRIPT | -m MODULE | -c CODE, ARGS...], "env":
{...}, "cwd": DIR, "out": FILE, "err": FILE, "session": BOOL} ("session": the child starts a session of its own,
as subprocess.Popen's start_new_session). Answers on stdout, one a line: {"id": I, "pid": N} for each request,
and {"exited": I, "returncode": R} as its child ends (R as subprocess.Popen gives it: -signal for a child a signal
killed). Exits are told by request id, not pid: a pid is reused once its process is reaped (pid_max is 32768
here), and a test may ask after a child long gone.
Single-threaded on purpose (a fork copies only the thread that calls it): requests and exits are polled in one
loop. It exits when its stdin closes (the test process ended), leaving its running children to finish alone.

Its children's torchrun workers start warm too. A torchrun agent (`pipeline launch`, `torch.distributed.run`) that
is a child here starts each worker, `python -u SCRIPT | -m MODULE | -c CODE ...`, through SubprocessHandler._popen,
which is patched here (`_popen`): the agent asks this parent over a Unix socket (`SOCKET`, one connection per
worker) to fork the worker, passing the worker's stdout/stderr as file descriptors (SCM_RIGHTS) so the worker shares
their open file description as an inherited descriptor does. The answer is {"pid": N}, then {"returncode": R}; the
worker stays a zombie (waitid WNOWAIT) until the agent has read that and closed the connection, as a Popen child
stays one until polled: its pid is not reused while the agent may still signal it. A connection closed before
the worker's exit (the agent killed) kills the worker's process group: the tests' "node killed" (kill_node) finds
no worker under the agent's pid any more. A worker whose environment differs from this parent's in more than the
per-launch variables (`worker_per_launch`), or any other command, starts cold as before (`_cold_popen`).
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading

PRELOAD = (  # what every rank script imports through the project, ~9 s of CPU on the project's 2-core machine
    "torch", "torch.distributed", "diffusers.pipelines.qwenimage.pipeline_qwenimage",
    "diffusers.models.transformers.transformer_qwenimage", "peft", "safetensors.torch", "pyarrow.parquet",
    "webdataset", "PIL.Image", "typer", "pydantic", "tqdm",
    "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler",  # patched: _popen
)
# Variables that differ between launches and that no preloaded library reads at import: set in the child only
# (tests/warm_start.py keys its parents on the rest). PYTHONPATH: the child puts its own before the parent's
# sys.path (_run_as_main). WARM_COLD_WORKERS: a launch whose torchrun workers must start cold (`_popen`). COLUMNS:
# read when a bar or a console is drawn (tqdm, rich's Console), never at import. The S3 test server's variables
# (tests/s3_server.py's aws_env): read by botocore when a session or client is made and by the HTTP stack per
# request, never at import (the primed loader is keyed on AWS_DATA_PATH alone): an S3 test's child shares the
# default parent instead of starting one of its own (~9 s of CPU).
PER_LAUNCH = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_USE_AGENT_STORE", "PYTEST_CURRENT_TEST", "STORE_PAUSE_AT", "STORE_CRASH_AT", "PYTHONPATH",
              "WARM_COLD_WORKERS", "COLUMNS", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
              "AWS_ENDPOINT_URL", "AWS_MAX_ATTEMPTS", "NO_PROXY")
# ... and what torchrun's agent adds to a worker's (torch/distributed/elastic/agent/server/local_elastic_agent.py,
# multiprocessing/api.py), besides every TORCHELASTIC_* variable
WORKER_PER_LAUNCH = (*PER_LAUNCH, "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE",
                     "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def worker_per_launch(name: str) -> bool:
    return name in WORKER_PER_LAUNCH or name.startswith("TORCHELASTIC_")


SOCKET = ""  # the path workers are asked for on (main), in a private folder
BASE_ENV: dict[str, str] = {}  # this parent's environment less the per-launch variables: what a warm worker needs
_SOCKETS: list[socket.socket] = []  # this parent's listening socket and connections: closed in every child


def _exit_code(code) -> int:
    """What the interpreter makes of SystemExit(code) at exit."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _python_path(env: dict[str, str]) -> list[str]:
    return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


# sys.path without its first entry and this process's PYTHONPATH: a child's is put before it (set in main)
BASE_PATH: list[str] = []


def _run_as_main(args: list[str]) -> None:
    """What `python ARGS` runs, for ARGS = SCRIPT ..., -m MODULE ... or -c CODE ...: sys.argv and sys.path[0] as
    the interpreter sets them."""
    import runpy
    import types

    sys.path[:] = ["", *_python_path(os.environ), *BASE_PATH]
    _sitecustomize()
    if args[0] == "-c":
        sys.argv, sys.path[0] = ["-c", *args[2:]], ""
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(args[1], "<string>", "exec"), main.__dict__)
    elif args[0] == "-m":
        sys.argv, sys.path[0] = ["-m", *args[2:]], os.getcwd()
        runpy._run_module_as_main(args[1], alter_argv=True)  # what `python -m` calls
    else:
        sys.argv, sys.path[0] = args, os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


def _sitecustomize() -> None:
    """What site.py does at a cold start, before the script's folder is on sys.path: import `sitecustomize`, here
    only one other than this parent's (a test's hook on the child's PYTHONPATH; this parent's ran already)."""
    from importlib.machinery import PathFinder

    spec = PathFinder.find_spec("sitecustomize", sys.path[1:])
    if spec is None or spec.origin == getattr(sys.modules.get("sitecustomize"), "__file__", None):
        return
    sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # noqa: F401
    except Exception as err:  # noqa: BLE001 - site.py's own words, and the start goes on
        sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{err.__class__.__name__}: {err}\n")


def _unbuffered() -> None:
    """`python -u`: stdout and stderr written through to their descriptors at every write, as torchrun asks."""
    import io

    for name in ("stdout", "stderr"):
        old = getattr(sys, name)
        new = io.TextIOWrapper(io.FileIO(old.fileno(), "w", closefd=False), encoding=old.encoding, errors=old.errors,
                               newline="\n", write_through=True)
        setattr(sys, name, new)
        setattr(sys, f"__{name}__", new)


def _child(request: dict, fds: list[int] | None = None) -> None:
    """In the forked child: become `python SCRIPT ARGS` with the request's environment, folder and output
    files (`fds`: stdout and stderr passed by an agent, else the request's paths); never returns into the parent's
    loop."""
    import atexit
    import random
    import tempfile
    import threading

    code = 1
    try:
        for sock in _SOCKETS:
            sock.close()  # this parent's alone: an agent sees EOF when this parent ends, not when its last child does
        if request.get("session"):
            os.setsid()
        # stdin is not the parent's request pipe, stdout not its answers: /dev/null and the test's files (an
        # agent's worker: the agent's descriptors as they are, never reopened: O_TRUNC would clobber its output)
        opened = [os.open(os.devnull, os.O_RDONLY)]
        if fds:
            opened += fds
        else:
            opened += [os.open(request[key], os.O_WRONLY | os.O_TRUNC) for key in ("out", "err")]
        for fd, source in enumerate(opened):
            os.dup2(source, fd)
        for source in set(opened) - {0, 1, 2}:
            os.close(source)
        if request.get("unbuffered"):
            _unbuffered()
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        tempfile.tempdir = None  # read TMPDIR again, as a new process does
        random.seed()
        args = list(request["argv"])
        code = 0
        try:
            _run_as_main(args)
        except SystemExit as e:
            code = _exit_code(e.code)
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        threading._shutdown()  # the interpreter's own exit: non-daemon threads are joined, then atexit runs
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream: nothing left to write
                pass
        os._exit(code)


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _say(answer: dict) -> None:
    try:
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):  # the test process is gone: its children finish alone
        pass


def _accept(listener: socket.socket, conns: dict) -> None:
    conn, _ = listener.accept()
    _SOCKETS.append(conn)
    conns[conn] = None  # no worker yet


def _serve(conn: socket.socket, conns: dict, workers: dict) -> None:
    """An agent's request (a worker to fork), or its end of the connection closed."""
    try:
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
    except OSError:
        message, fds = b"", []
    if message and conns[conn] is None and len(fds) == 2:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(json.loads(message), fds)
        for fd in fds:
            os.close(fd)
        conns[conn], workers[pid] = pid, conn
        _tell(conn, {"pid": pid})
        return
    for fd in fds:
        os.close(fd)
    pid = conns.pop(conn)
    _SOCKETS.remove(conn)
    conn.close()
    if pid is None:
        return
    if workers[pid] is conn:  # the agent ended before its worker (not yet told its exit): SIGKILLed, "node killed"
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # not yet in a session of its own
            os.kill(pid, signal.SIGKILL)
    workers[pid] = None  # reaped below


def _tell(conn: socket.socket, answer: dict) -> None:
    try:
        conn.send(json.dumps(answer).encode())
    except OSError:  # the agent is gone: its EOF comes next
        pass


def _watch_workers(workers: dict) -> None:
    """An agent's worker that ended is told to the agent, and stays a zombie until the agent closed the connection
    (Popen's poll reaps it then; until then its pid is not reused under the agent's signals)."""
    for pid, conn in list(workers.items()):
        if conn is None:
            if os.waitpid(pid, os.WNOHANG)[0]:
                del workers[pid]
        elif conn is not False:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is not None:
                code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
                _tell(conn, {"returncode": code})
                workers[pid] = False  # told; reaped once the agent closes


def _s3_models():
    """store/s3_models.py, run from its file and kept out of sys.modules: a child imports the project itself (its
    code may have changed since this parent started), and finds botocore's loader shared already."""
    import importlib.util

    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "store" / "s3_models.py"
    spec = importlib.util.spec_from_file_location("_warm_s3_models", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _preload() -> None:
    """The libraries imported once (their import noise this process's: a child keeps the default warnings), the
    paths and environment a child or a warm worker is judged against, and torchrun's _popen patched."""
    import importlib
    import warnings

    own = {q for p in _python_path(os.environ) for q in (p, os.path.abspath(p))}
    BASE_PATH[:] = [p for p in sys.path[1:] if p not in own]
    BASE_ENV.update({k: v for k, v in os.environ.items() if not worker_per_launch(k)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in PRELOAD:
            importlib.import_module(name)
        try:  # S3's model parsed here once, not per remote open of every child (store/s3_models.py)
            _s3_models().prime()
        except ImportError:  # no S3 support installed: nothing to share
            pass
    from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler

    _cold[0] = SubprocessHandler._popen
    SubprocessHandler._popen = _popen  # in this parent's children, which is where an agent runs


def _listen(folder: str) -> socket.socket:
    """The socket agents ask for workers on (SOCKET, in `folder`)."""
    global SOCKET
    SOCKET = os.path.join(folder, "s")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(SOCKET)
    listener.listen(64)
    _SOCKETS.append(listener)
    return listener


def _fork_requests(pending: bytes, children: dict) -> bytes:
    """A child forked for each whole request line of `pending` (recorded in `children`: pid -> request id);
    returns the unfinished rest."""
    while b"\n" in pending:
        line, pending = pending.split(b"\n", 1)
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        children[pid] = request["id"]
        _say({"id": request["id"], "pid": pid})
    return pending


def _reap_children(children: dict) -> None:
    """Each child that ended told by its request id. By pid: waitpid(-1) would reap an agent's worker before it is
    told."""
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            _say({"exited": children.pop(pid), "returncode": _returncode(status)})


def _serve_until_done(listener: socket.socket) -> None:
    """Requests on stdin and agents' connections polled in one loop, until stdin closed and every child, worker
    and connection is done."""
    # children: pid -> request id (stdin's); workers: pid -> the agent's connection, False once told its exit,
    # None once the agent closed it; conns: connection -> its worker's pid (None before the request)
    pending, children, workers, conns, open_in = b"", {}, {}, {}, True
    while open_in or children or workers or conns:
        readable, _, _ = select.select(([0] if open_in else []) + [listener, *conns], [], [], 0.05)
        readable = set(readable)
        if 0 in readable:
            chunk = os.read(0, 65536)
            open_in = bool(chunk)
            pending = _fork_requests(pending + chunk, children)
        if listener in readable:
            _accept(listener, conns)
        for conn in [c for c in readable if isinstance(c, socket.socket) and c is not listener]:
            _serve(conn, conns, workers)
        _reap_children(children)
        _watch_workers(workers)


def main() -> None:
    import tempfile

    _preload()
    folder = tempfile.mkdtemp(prefix="warm-", dir="/tmp")  # 0700; short: a socket path has at most 107 bytes
    listener = _listen(folder)
    # The preloaded heap (~550k objects) out of every collection: a child's exit collects once
    # (pipeline/exit_gc.py) over its own objects only, ~0.35 s of CPU less each, and no GC header of the parent's
    # pages is written (copied) by a child's collections. What gc.freeze() is documented for, before a fork.
    gc.freeze()
    _say({"ready": os.getpid()})
    try:
        _serve_until_done(listener)
    finally:
        listener.close()
        os.unlink(SOCKET)
        os.rmdir(folder)


# --- in an agent (a child of this parent): its workers asked of this parent --------------------------------------

_cold: list = [None]  # SubprocessHandler's own _popen


def _worker_request(args: tuple, env: dict[str, str]) -> dict | None:
    """The request for a worker this parent can fork (`python -u SCRIPT | -m M | -c C ...` in this parent's
    environment, less per-launch variables), or None: a cold start."""
    args = [str(a) for a in args]
    if (len(args) < 3 or args[1] != "-u" or env.get("WARM_COLD_WORKERS")
            or os.path.realpath(args[0]) != os.path.realpath(sys.executable)):
        return None
    if args[2].startswith("-") and not (args[2] in ("-c", "-m") and len(args) > 3):
        return None
    if {k: v for k, v in env.items() if not worker_per_launch(k)} != BASE_ENV:
        return None
    return {"argv": args[2:], "env": dict(env), "cwd": os.getcwd(), "session": True, "unbuffered": True}


def _popen(self, args: tuple, env: dict[str, str]):
    """SubprocessHandler._popen: the worker forked by this parent, or torch's own cold Popen."""
    request = _worker_request(args, env)
    if request is None or not SOCKET:
        return _cold[0](self, args, env)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(SOCKET)
        fds = [f.fileno() if f else fd for f, fd in ((self._stdout, 1), (self._stderr, 2))]  # None: inherited
        socket.send_fds(sock, [json.dumps(request).encode()], fds)
        answer = sock.recv(65536)
    except OSError:
        answer = b""
    if not answer:  # this parent is gone
        sock.close()
        return _cold[0](self, args, env)
    return WarmWorker(list(args), sock, json.loads(answer)["pid"])


class WarmWorker:
    """The part of subprocess.Popen torchrun's agent uses (pid, poll, wait, returncode, send_signal), for a worker
    this parent forked; its exit status comes on the connection."""

    def __init__(self, args: list[str], sock: socket.socket, pid: int) -> None:
        self.args, self.pid, self.returncode = args, pid, None
        self._sock: socket.socket | None = sock
        self._lock = threading.Lock()

    def _take(self, timeout: float | None) -> None:
        if self._sock is None:
            return
        ready, _, _ = select.select([self._sock], [], [], timeout)
        if not ready:
            return
        answer = self._sock.recv(65536)
        # no answer: the warm parent ended (killed with the test process); the worker's status is lost with it
        self.returncode = json.loads(answer)["returncode"] if answer else -signal.SIGKILL
        self._sock.close()  # the parent reaps the worker now, as Popen.poll does
        self._sock = None

    def poll(self) -> int | None:
        if self.returncode is None and self._lock.acquire(blocking=False):
            try:
                self._take(0)
            finally:
                self._lock.release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._lock:
            if self.returncode is None:
                self._take(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    main()
