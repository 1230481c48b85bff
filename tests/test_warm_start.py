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


# A torchrun worker: what it saw, then what the test asks of rank 1. Nothing flushed by hand: under torchrun's
# `python -u` every line is written as printed, even before os._exit.
WORKER = textwrap.dedent(r"""
    import json, os, signal, sys, time
    warm = "torch" in sys.modules  # a cold interpreter has imported nothing yet
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE")}
    # one write each (print writes the line's end apart: two ranks' lines could interleave)
    sys.stdout.write(json.dumps({"rank": os.environ["RANK"], "warm": warm, "argv": sys.argv[1:], "env": env,
                                 "cwd": os.getcwd()}) + "\n")
    sys.stderr.write(f"stderr of rank {os.environ['RANK']}\n")
    what = sys.argv[1]
    if what == "sleep":
        open(os.path.join(sys.argv[2], os.environ["RANK"]), "w").write(str(os.getpid()))
        time.sleep(600)
    if what in ("exit", "kill"):
        # Rank 0 is still running when rank 1 fails, so torchrun stops it (SIGTERM) and reports both, cold and warm
        # alike. Before, rank 0 exited on its own and raced rank 1's failure: whichever torchrun saw first decided
        # whether rank 0 was in the report (a loaded run reported it for the warm agent only).
        said = "said-" + os.environ["TORCHELASTIC_RUN_ID"]  # one per launch: the cold and warm runs share the folder
        if os.environ["RANK"] == "0":
            open(said, "w").close()
            time.sleep(600)
        deadline = time.monotonic() + 300
        while not os.path.exists(said) and time.monotonic() < deadline:  # rank 0's lines are written
            time.sleep(0.01)
        if what == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
""")
# The agent: a line of its own before torchrun starts (the workers' output follows it in the same files)
AGENT = ("import os, sys\nprint('agent before', flush=True)\nos.environ.update(dict(a.split('=') for a in sys.argv[1:2] if a))\n"
         "from torch.distributed.run import main\nmain(sys.argv[2:])\n")


def _agent(tmp_path, what: str, cold: bool, agent_env: str = "", *more: str) -> warm_start.WarmProcess:
    (tmp_path / "worker.py").write_text(WORKER)
    env = {**os.environ, **({"WARM_COLD_WORKERS": "1"} if cold else {})}
    env.pop("WORLD_SIZE", None)
    args = [sys.executable, "-c", AGENT, agent_env, "--standalone", "--nproc-per-node", "2", "--monitor-interval",
            "0.1", str(tmp_path / "worker.py"), what, *more]
    return warm_start.WarmProcess(args, env=env, cwd=tmp_path, start_new_session=True)


def _seen(stdout: str) -> dict[str, dict]:
    import json

    return {s["rank"]: s for s in (json.loads(line) for line in stdout.splitlines() if line.startswith("{"))}


def _failures(stderr: str) -> list[str]:
    """torchrun's summary of the failed ranks: rank and exit code (the pid differs between runs)."""
    import re

    return sorted(re.sub(r"\(pid: \d+\)", "", line).strip() for line in stderr.splitlines()
                  if re.match(r"\s*(rank|exitcode)\s*:", line))


@pytest.mark.parametrize("what", ["ok", "exit", "kill"])
def test_a_warm_agents_workers_start_warm_and_end_as_cold_ones_do(tmp_path, what):
    """A torchrun agent started warm has its workers forked by the warm parent (torch imported already) where it
    would start cold ones: the same exit status (an exit code, a signal) as torchrun sees it, argv, folder and
    environment as torchrun set them, output into the agent's own stdout and stderr after the agent's own line."""
    runs = {}
    for cold in (True, False):
        agent = _agent(tmp_path, what, cold)
        out, err = agent.communicate(timeout=300)
        runs[cold] = agent.returncode, out, err
    (cold_code, cold_out, cold_err), (warm_code, warm_out, warm_err) = runs[True], runs[False]
    assert warm_code == cold_code == (0 if what == "ok" else 1), (runs, what)
    cold_seen, warm_seen = _seen(cold_out), _seen(warm_out)
    assert sorted(warm_seen) == sorted(cold_seen) == ["0", "1"], (warm_out, cold_out)
    for rank in ("0", "1"):
        assert (cold_seen[rank].pop("warm"), warm_seen[rank].pop("warm")) == (False, True)
        assert cold_seen[rank]["env"].pop("WARM_COLD_WORKERS") == "1"  # the cold run's own
        assert warm_seen[rank] == cold_seen[rank], rank
    assert "GROUP_RANK" in warm_seen["1"]["env"] and warm_seen["1"]["env"]["LOCAL_RANK"] == "1"
    assert warm_out.startswith("agent before\n") and cold_out.startswith("agent before\n")
    assert all(f"stderr of rank {r}" in warm_err for r in "01"), warm_err
    rank1 = {"ok": [], "exit": ["exitcode  : 3"], "kill": ["exitcode  : -9   (SIGKILL)"]}[what]
    rank0 = [] if what == "ok" else ["exitcode  : -15   (SIGTERM)", "rank      : 0 (local_rank: 0)"]
    expected = sorted(rank0 + rank1 + (["rank      : 1 (local_rank: 1)"] if rank1 else []))
    assert _failures(warm_err) == _failures(cold_err) == expected, (warm_err, cold_err)


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_a_warm_agents_workers_end_with_it_as_cold_ones_do(tmp_path, how):
    """SIGTERM to the agent: torchrun stops its workers by killpg(worker, SIGTERM), warm ones too. SIGKILL to the
    agent's process group and to its child processes (tests/stages/test_train_multinode.py's kill_node): no worker
    is left, though a warm worker is the warm parent's child, not the agent's."""
    import signal
    import time

    import psutil

    for cold in (True, False):
        pids = tmp_path / f"pids-{cold}"
        pids.mkdir()
        agent = _agent(tmp_path, "sleep", cold, "", str(pids))
        deadline = time.monotonic() + 300  # a bound for a launch that never gets going
        while len(list(pids.iterdir())) < 2:
            assert agent.poll() is None and time.monotonic() < deadline, agent.output()
            time.sleep(0.05)
        time.sleep(0.2)  # the pid files are written before the sleep begins
        workers = [int(p.read_text()) for p in pids.iterdir()]
        assert all((psutil.Process(w).ppid() == agent.pid) == cold for w in workers)
        if how == "sigterm":
            agent.send_signal(signal.SIGTERM)
            assert agent.wait(timeout=120) != 0
        else:
            children = psutil.Process(agent.pid).children(recursive=True)
            os.killpg(agent.pid, signal.SIGKILL)
            for child in children:
                child.kill()
            agent.wait(timeout=120)
        deadline = time.monotonic() + 60
        while not all(_gone(w) for w in workers):
            assert time.monotonic() < deadline, f"a {'cold' if cold else 'warm'} worker outlived its agent"
            time.sleep(0.05)


def test_a_worker_whose_environment_is_not_the_warm_parents_starts_cold(tmp_path):
    """A variable the agent set that the warm parent's libraries may have read at import: the worker starts cold
    (and runs as before)."""
    agent = _agent(tmp_path, "ok", False, "WARM_TEST_AGENT_SET=1")
    out, err = agent.communicate(timeout=300)
    seen = _seen(out)
    assert agent.returncode == 0, err[-3000:]
    assert [seen[r]["warm"] for r in ("0", "1")] == [False, False]
    assert seen["0"]["env"]["WARM_TEST_AGENT_SET"] == "1"
