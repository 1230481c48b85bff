"""A process started warm (tests/warm_start.py) is what `python ARGS` started cold is, as far as a test can see:
the same stdout, stderr, exit status (an exception, sys.exit, a signal), argv, sys.path, folder, environment and
warning filters;
and none of this project's modules is loaded before its own code runs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import warm_start

SCRIPT = textwrap.dedent("""
    import json, os, signal, sys
    what = sys.argv[1]
    print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "env": os.environ.get("WARM_TEST_X"),
                      "project": sorted(m for m in sys.modules if m.split(".")[0] in ("models", "pipeline", "stages",
                                                                                     "store", "schemas"))}))
    print("to stderr", file=sys.stderr)
    import warnings
    print(json.dumps([f[0] + ":" + f[2].__name__ for f in warnings.filters]))  # the interpreter's defaults
    if what == "raise":
        raise ValueError("boom")
    if what == "exit":
        sys.exit(3)
    if what == "message":
        sys.exit("a message")
    if what == "kill":
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("what", ["ok", "raise", "exit", "message", "kill"])
@pytest.mark.parametrize("form", ["script", "-c", "-m"])
def test_a_warm_process_is_a_cold_one(tmp_path, what, form):
    (tmp_path / "warm_probe.py").write_text(SCRIPT)
    run_in = tmp_path / "cwd"
    run_in.mkdir()
    head = {"script": [str(tmp_path / "warm_probe.py")], "-c": ["-c", SCRIPT], "-m": ["-m", "warm_probe"]}[form]
    args = [sys.executable, *head, what, "two"]
    env = {**os.environ, "WARM_TEST_X": "x", "PYTHONPATH": str(tmp_path)}  # one warm parent serves every case
    cold = subprocess.run(args, env=env, cwd=run_in, capture_output=True, text=True, timeout=120)
    warm = warm_start.run(args, env=env, cwd=run_in, timeout=120)
    assert (warm.returncode, warm.stdout) == (cold.returncode, cold.stdout), (warm, cold)
    # a traceback names the same lines (the script's own; the interpreter's frames are runpy's in both)
    assert warm.stderr.splitlines()[-1:] == cold.stderr.splitlines()[-1:], (warm.stderr, cold.stderr)
    assert ("Traceback" in warm.stderr) == ("Traceback" in cold.stderr)
    assert '"project": []' in warm.stdout


def test_a_preloaded_library_comes_from_the_suites_pythonpath_as_in_a_cold_start(tmp_path, monkeypatch):
    """A stack whose libraries are installed with `pip --target` on PYTHONPATH (the GPU machine's; bench/gpu/rehearse)
    has them nowhere else: the warm parent imports them from there, as a cold start does. Before, the parent was
    started without PYTHONPATH and stopped with "No module named 'diffusers'" on that stack. Here the suite's
    PYTHONPATH holds a `typer` of its own (a preloaded library no other preloaded one imports)."""
    shadow = tmp_path / "site" / "typer"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("FROM_THE_SUITES_PYTHONPATH = True\n")
    suite_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(shadow.parent), *suite_path]))
    env = {**os.environ, "WARM_TEST_SHADOW": "typer"}  # its own parent: no other test's sees this typer
    args = [sys.executable, "-c", "import typer; print(getattr(typer, 'FROM_THE_SUITES_PYTHONPATH', False))"]
    cold = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    warm = warm_start.run(args, env=env, timeout=120)
    assert cold.stdout == "True\n", cold
    assert (warm.returncode, warm.stdout) == (0, "True\n"), warm


@pytest.mark.parametrize("new_session", [False, True])
def test_a_warm_process_starts_a_session_of_its_own_as_a_cold_one_does(new_session):
    """start_new_session (a launch test's "node": its torchrun agent and workers killed as one process group) makes
    the child the leader of a new session and process group, warm as cold; without it, it leads neither."""
    args = [sys.executable, "-c", "import os; print(os.getsid(0) == os.getpid(), os.getpgid(0) == os.getpid())"]
    cold = subprocess.run(args, capture_output=True, text=True, timeout=120, start_new_session=new_session)
    warm = warm_start.WarmProcess(args, start_new_session=new_session)
    stdout, _ = warm.communicate(timeout=120)
    assert cold.stdout == f"{new_session} {new_session}\n", cold
    assert (warm.returncode, stdout) == (0, cold.stdout)
