"""Launched ranks decide their device together, before the process group exists (models/launch_devices.py, through
the launcher's store: `models.collective.gather_before_group`). Two real processes on the CPU share a real
TCPStore; each "sees" the GPUs its argument gives its rank (tests/models/device_ranks.py). Before: each rank decided
alone, so with train.device unset rank 0 (no GPU) chose the CPU (gloo) and rank 1 its GPU (NCCL): a launch that
hung until the collective timeout, or trained mixed; a device setting naming a GPU missing on one node stopped
that rank alone while the other went on to wait for it in the process group."""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from launch_ports import start_host_first
from own_collective import own_collective  # noqa: F401  (the fixture)
from warm_start import WarmProcess, outcomes

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TIMEOUT = 120  # a bound for a rank left waiting (the test then fails), generous under load; not a timing assert


def _env(rank: int, port: int, agent_store: bool, nodes: int = 2) -> dict[str, str]:
    """Rank `rank` of 2, on 2 nodes of one process each (as where one node's driver failed) or on 1 node."""
    local = rank if nodes == 1 else 0
    # the suite's PYTHONPATH after the repository: a `pip --target` stack (bench/gpu/rehearse, the GPU machine)
    # has its libraries only there (the warm parent of test_failure_lines lost diffusers without it)
    suite = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO)]
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": str(3 - nodes),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(REPO), *suite])}
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    env.pop("GROUP_RANK", None)
    if agent_store:  # as torchrun's workers: the store is the agent's (here: this test's), node 0's
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        env["GROUP_RANK"] = str(rank if nodes == 2 else 0)
    return env


def _wait(procs: list[WarmProcess]) -> list[tuple[int, str, str]]:
    return outcomes(procs, TIMEOUT)


def _two_ranks(gpus: str, *args: str, nodes: int = 2, agent_store: bool = True) -> list[tuple[int, str, str]]:
    """Ranks 0 and 1 of a torchrun-like launch whose store this test serves, or (not `agent_store`) of a plain
    env:// launch, where rank 0 serves it (started first: tests/launch_ports.py)."""
    def start(rank: int, port: int) -> WarmProcess:
        return WarmProcess([sys.executable, str(HERE / "device_ranks.py"), gpus, *args],
                           env=_env(rank, port, agent_store=agent_store, nodes=nodes))

    if not agent_store:
        return _wait(start_host_first(start, 2))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    return _wait([start(rank, store.port) for rank in (0, 1)])


def _results(outs: list[tuple[int, str, str]], name: str) -> list[str]:
    assert [rc for rc, _, _ in outs] == [0, 0], [err[-2000:] for _, _, err in outs]
    return [dict(line[len("RESULT "):].split(": ", 1) for line in out.splitlines()
                 if line.startswith("RESULT ")).get(name) for _, out, _ in outs]


def _same_line_everywhere(outs: list[tuple[int, str, str]]) -> str:
    (rc0, out0, err0), (rc1, out1, err1) = outs
    assert "Traceback" not in err0 + out0 + err1 + out1, (err0[-3000:], err1[-3000:])
    assert rc0 == rc1 == 1, (rc0, rc1, out0, out1, err0[-2000:], err1[-2000:])
    assert err0.strip().count("\n") == err1.strip().count("\n") == 0, (err0, err1)  # one line each
    assert err0 == err1 and err0.startswith("error: "), (err0, err1)
    return err0.strip()


@pytest.mark.parametrize("agent_store", [True, False])  # False: rank 0 serves the store, and waits for rank 1
def test_one_rank_seeing_no_gpu_stops_every_rank_with_one_line(agent_store: bool) -> None:
    line = _same_line_everywhere(_two_ranks("0,1", "unset", agent_store=agent_store))
    host = socket.gethostname()
    assert line == (f"error: train.device is unset and rank 0 on {host} (of 2) has no GPU of its own while the "
                    "other ranks do (NCCL and gloo ranks cannot train together): fix the GPU driver there "
                    "(nvidia-smi), or set train.device=cpu to train every rank on the CPU"), line


def test_a_node_with_fewer_gpus_than_its_processes_stops_every_rank() -> None:
    line = _same_line_everywhere(_two_ranks("2,1", "unset", nodes=1))  # local rank 1: cuda:1 is not there
    assert "rank 1 on " in line and "launch as many processes per node as it has GPUs" in line, line


@pytest.mark.parametrize(("gpus", "cpu"), [("0,0", "True"), ("1,1", "False")])
def test_ranks_that_see_the_same_train_as_before(gpus: str, cpu: str) -> None:
    """No rank sees a GPU: every rank on the CPU (gloo); every rank sees its own: NCCL (accelerate's choice)."""
    assert _results(_two_ranks(gpus, "unset"), "cpu") == [cpu, cpu]


def test_a_device_setting_missing_on_one_rank_stops_every_rank() -> None:
    line = _same_line_everywhere(_two_ranks("1,0", "set", "cuda"))
    assert line.startswith("error: encode_vae.device: 'cuda:0' requested but this machine has 0 CUDA device(s)"), line
    assert line.endswith(f"(on rank 1 on {socket.gethostname()}, of 2)"), line
    assert _results(_two_ranks("1,1", "set", "cuda"), "checked") == ["yes", "yes"]


def test_device_auto_is_decided_by_all_ranks_together() -> None:
    """`auto` follows each node's GPUs: every rank on its own GPU, or every rank on the CPU; a node without CUDA
    among nodes with it is refused on every rank alike (not one rank joining over gloo while the others wait)."""
    line = _same_line_everywhere(_two_ranks("0,1", "set", "auto"))
    assert line.startswith(f"error: encode_vae.device is auto and rank 0 on {socket.gethostname()} (of 2) has no GPU"), line
    assert _results(_two_ranks("0,0", "set", "auto"), "checked") == ["yes", "yes"]
    assert _results(_two_ranks("1,1", "set", "auto"), "checked") == ["yes", "yes"]


def test_without_a_launchers_store_rank_0_serves_it_and_the_group_forms_there() -> None:
    """A plain env:// launch (a platform set WORLD_SIZE, RANK, MASTER_*; no torchrun agent): rank 0 serves the store
    for the decision, and the process group then forms on the same port (its multi-tenant server)."""
    outs = _two_ranks("0,0", "unset", "group", agent_store=False)
    assert _results(outs, "cpu") == ["True", "True"] and _results(outs, "sum") == ["3", "3"]


def test_a_rank_that_never_reports_is_named_within_the_bound(monkeypatch, own_collective) -> None:
    from schemas.errors import UserError

    collective = own_collective
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    for name, value in _env(0, store.port, agent_store=True).items():
        monkeypatch.setenv(name, value)
    # 3 s, not 1: the bound is also each store call's (its client's timeout, then `StoreSilent`); 1 s + 1 of grace
    # was once too short for a call on a loaded CI machine, which then said the store did not answer
    with pytest.raises(UserError, match=r"^train.device: the ranks decide it together before training, but "
                                        r"rank\(s\) 1 of 2 did not report within 3 s"):
        collective.gather_before_group(2, "train.device", "{}", timeout=3)


# Serves the launch's store until rank 1 has reported, then ends (as rank 0 of a plain env:// launch killed then).
_HOST = """
import sys
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
print(store.port, flush=True)
store.wait([sys.argv[1]])
"""


def test_a_store_that_goes_away_while_a_rank_waits_is_one_line(monkeypatch, own_collective) -> None:
    """Before: the timeout branch asked the gone store which ranks had reported, and that call's own network error
    left the rank with a traceback instead of a line."""
    import subprocess

    from schemas.errors import UserError

    collective = own_collective

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    key = "pipeline/before-group/none/0/train.device/1/1"  # rank 1's key of the first train.device decision
    host = subprocess.Popen([sys.executable, "-c", _HOST, key], stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        for name, value in _env(1, port, agent_store=True).items():
            monkeypatch.setenv(name, value)
        with pytest.raises(UserError, match=r"^train.device: the ranks decide it together through the launch's "
                                            r"store at 127.0.0.1:\d+, which went away meanwhile"):
            collective.gather_before_group(2, "train.device", "{}", timeout=TIMEOUT)
    finally:
        host.kill()
        host.wait()


# Rank 0: two decisions before the process group, as a command's start takes them (the config, then the device).
_TWO_DECISIONS = """
from models.collective import gather_before_group
gather_before_group(2, "the config", "")
print("first decided", flush=True)
gather_before_group(2, "train.device", "{}")
print("second decided", flush=True)
"""


def test_a_rank_failing_between_two_decisions_stops_the_rank_waiting_for_it(monkeypatch, own_collective) -> None:
    """Rank 1 (this process) fails after the first decision, before the second, on an error no handler made a
    line of (the CLI then publishes it: pipeline/cli.py); rank 0, waiting for it at the second, ends at once with
    its line. Before: nothing was published before the process group existed (no rank watched yet), and rank 0
    waited out the before-group bound (models/collective/timing.py BEFORE_GROUP_SECONDS, 30 minutes: here the test's
    bound fails it) to say that rank 1 did not report."""
    collective = own_collective
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    rank0 = WarmProcess([sys.executable, "-c", _TWO_DECISIONS], env=_env(0, store.port, agent_store=True))
    for name, value in _env(1, store.port, agent_store=True).items():
        monkeypatch.setenv(name, value)
    collective.gather_before_group(2, "the config", "")
    error = RuntimeError("damaged install\n(second line)")
    line = collective.failure_line(error, collective.rank_error_line(error))
    assert line == ("rank 1 failed: RuntimeError: damaged install (second line) (its traceback is in that rank's "
                    "output)")
    [(code, out, err)] = _wait([rank0])
    assert (code, out, err.strip()) == (1, "first decided\n", f"error: {line}"), err[-3000:]


HOLD_SECONDS = 30  # the wait's bound here: far above what a passing run needs under load

# Rank 1 of 2 waiting for rank 0, which never comes; a Ctrl-C comes while it waits.
_INTERRUPTED_WAIT = f"""
import signal, sys
from signal_elsewhere import main_in_call, signal_elsewhere_once
from models.collective import gather_before_group

try:
    signal_elsewhere_once(lambda: main_in_call("gather_before_group", ("wait(", "sleep(")), signal.SIGINT)
    gather_before_group(2, "train.device", "{{}}", timeout={HOLD_SECONDS})
except KeyboardInterrupt as e:  # raised while the timeout was handled (its context), or while waiting
    print("interrupted", "after the wait timed out" if e.__context__ is not None else "while waiting")
    sys.exit(130)
"""


def test_ctrl_c_ends_a_rank_waiting_for_the_others_before_the_group(monkeypatch) -> None:
    """The store's `wait` is one C++ call that no signal ends, on whichever thread it lands (here another one,
    tests/signal_elsewhere.py; on the main thread too): a Ctrl-C while a rank waited for a rank still starting
    held it for the before-group bound (models/collective/timing.py BEFORE_GROUP_SECONDS, 30 minutes)."""
    from signal_elsewhere import run_script

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    for name, value in _env(1, store.port, agent_store=True).items():
        monkeypatch.setenv(name, value)
    proc = run_script(_INTERRUPTED_WAIT, timeout=HOLD_SECONDS + 120)
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert proc.stdout.strip() == "interrupted while waiting"


# Rank 1 of 2 connecting to rank 0's store, which never comes up (its port refuses); a Ctrl-C comes meanwhile, to
# another thread or to the main thread itself.
_INTERRUPTED_CONNECT = f"""
import signal, sys, threading
from signal_elsewhere import main_in_call, signal_elsewhere_once
from models.collective import gather_before_group

to_main = sys.argv[1] == "main"
def ready():
    if not main_in_call("gather_before_group", ("TCPStore(", "connect(", "sleep(")):
        return False
    if to_main:
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    return not to_main
try:
    signal_elsewhere_once(ready, signal.SIGINT)
    gather_before_group(2, "train.device", "{{}}", timeout={HOLD_SECONDS})
except KeyboardInterrupt as e:  # raised while the timeout was handled (its context), or between two tries (a refusal)
    late = e.__context__ is not None and not isinstance(e.__context__, ConnectionRefusedError)
    print("interrupted", "after the connection timed out" if late else "while connecting")
    sys.exit(130)
"""


@pytest.mark.parametrize("to", ["elsewhere", "main"])
def test_ctrl_c_ends_a_rank_connecting_to_a_store_not_up_yet(monkeypatch, to: str) -> None:
    """torch's client retries a refused connection inside one C++ call that no signal ends, on whichever thread it
    lands: a Ctrl-C (or a launcher's SIGTERM) while a rank waited for rank 0 to start held it for the before-group
    bound (models/collective/timing.py BEFORE_GROUP_SECONDS, 30 minutes)."""
    from signal_elsewhere import run_script

    with socket.socket() as held:  # bound, never listening: every connection to it is refused, no one takes it
        held.bind(("127.0.0.1", 0))
        for name, value in _env(1, held.getsockname()[1], agent_store=True).items():
            monkeypatch.setenv(name, value)
        proc = run_script(_INTERRUPTED_CONNECT.replace("sys.argv[1]", repr(to)), timeout=HOLD_SECONDS + 120)
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert proc.stdout.strip() == "interrupted while connecting"
