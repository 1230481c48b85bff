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
"""

from __future__ import annotations

import gc
import json
import os
import select
import sys

PRELOAD = (  # what every rank script imports through the project, ~9 s of CPU on the project's 2-core machine
    "torch", "torch.distributed", "diffusers.pipelines.qwenimage.pipeline_qwenimage",
    "diffusers.models.transformers.transformer_qwenimage", "peft", "safetensors.torch", "pyarrow.parquet",
    "webdataset", "PIL.Image", "typer", "pydantic", "tqdm",
)


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


def _child(request: dict) -> None:
    """In the forked child: become `python SCRIPT ARGS` with the request's environment, folder and output
    files; never returns into the parent's loop."""
    import atexit
    import random
    import tempfile
    import threading

    code = 1
    try:
        if request.get("session"):
            os.setsid()
        # stdin is not the parent's request pipe, stdout not its answers: /dev/null and the test's files
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["out"], os.O_WRONLY | os.O_TRUNC),
                                (2, request["err"], os.O_WRONLY | os.O_TRUNC)):
            opened = os.open(path, flags)
            os.dup2(opened, fd)
            os.close(opened)
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


def main() -> None:
    import importlib
    import warnings

    own = {q for p in _python_path(os.environ) for q in (p, os.path.abspath(p))}
    BASE_PATH[:] = [p for p in sys.path[1:] if p not in own]
    with warnings.catch_warnings():  # the libraries' import noise is this process's; a child keeps the defaults
        warnings.simplefilter("ignore")
        for name in PRELOAD:
            importlib.import_module(name)
    # The preloaded heap (~550k objects) out of every collection: a child's exit collects once
    # (pipeline/exit_gc.py) over its own objects only, ~0.35 s of CPU less each, and no GC header of the parent's
    # pages is written (copied) by a child's collections. What gc.freeze() is documented for, before a fork.
    gc.freeze()
    _say({"ready": os.getpid()})
    pending, children, open_in = b"", {}, True  # children: pid -> request id
    while open_in or children:
        readable, _, _ = select.select([0] if open_in else [], [], [], 0.05)
        if readable:
            chunk = os.read(0, 65536)
            open_in = bool(chunk)
            pending += chunk
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
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _say({"exited": children.pop(pid), "returncode": _returncode(status)})


if __name__ == "__main__":
    main()
