"""A rank killed without a word (SIGKILL: `kill -9`, the out-of-memory killer) under `pipeline launch`: every rank
stops with no traceback, and the launcher's last line names the killed rank, what probably killed it and the rerun
that continues. Before: the surviving rank died in gloo's "Connection reset by peer" traceback, and the launcher
said "rank 1 exit -9 (the ranks' own error is the line above)", where no rank had said anything."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest
import typer

from rank_hook import launch_with_hook
from train_store import make_train_store, mixed_specs

GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error "
              "[127.0.0.1]:48847: Connection reset by peer. This is typically caused by a remote worker hanging or "
              "bugs in the application.")


def test_a_launch_whose_rank_is_killed_ends_in_lines_that_name_it(tiny_edit_model, tmp_path) -> None:
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(8))
    # rank 1 kills itself at its third all-reduce (inside training: after the ranks' first agreements), as the
    # out-of-memory killer would: no Python unwinding, no line of its own
    p = launch_with_hook(tmp_path, (
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import signal, torch.distributed as dist\n"
        "    real, calls = dist.all_reduce, []\n"
        "    def all_reduce(*a, **k):\n"
        "        calls.append(1)\n"
        "        if len(calls) == 3:\n"
        "            os.kill(os.getpid(), signal.SIGKILL)\n"
        "        return real(*a, **k)\n"
        "    dist.all_reduce = all_reduce\n"),
        ["run", "train", "--store", str(store), "--model", tiny_edit_model, "--out", str(tmp_path / "run"),
         "--device", "cpu", "--max-steps", "4", "--batch-size", "2"], timeout=600)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr + p.stdout, p.stderr[-4000:]
    last = [line for line in p.stderr.splitlines() if line.startswith("error: ")][-1]
    assert last.startswith("error: pipeline.cli stopped: ") and "rank 1 killed by SIGKILL" in last, last
    assert "rank 1 printed nothing: a `kill -9`, or the kernel's out-of-memory killer" in last, last
    assert last.endswith("rerun with --resume to continue"), last


def test_a_rank_frozen_in_a_training_step_stops_every_rank_with_a_line_naming_it(tiny_edit_model, tmp_path) -> None:
    """Rank 1 freezes (SIGSTOP: a hung node, one that lost its network) in its second step's backward; rank 0 waits
    for it in DDP's gradient all-reduce, which only the process group's timeout ended before (gloo: 30 minutes,
    NCCL: 10, then a watchdog's abort naming no rank). Rank 0's watch thread sees its own steps stalled and rank 1
    silent for LOST_SECONDS (5 s here) and ends the launch with one line naming rank 1."""
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(8))
    p = launch_with_hook(tmp_path, (
        "import os\n"
        "from models.collective import timing\n"
        "timing.LOST_SECONDS, timing.LIVENESS_SECONDS = 5.0, 1.0\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import signal, torch\n"
        "    real, calls = torch.Tensor.backward, []\n"
        "    def backward(*a, **k):\n"
        "        calls.append(1)\n"
        "        if len(calls) == 2:\n"
        "            os.kill(os.getpid(), signal.SIGSTOP)\n"
        "        return real(*a, **k)\n"
        "    torch.Tensor.backward = backward\n"),
        ["run", "train", "--store", str(store), "--model", tiny_edit_model, "--out", str(tmp_path / "run"),
         "--device", "cpu", "--max-steps", "4", "--batch-size", "2"], timeout=600)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr + p.stdout, p.stderr[-4000:]
    assert ("error: rank(s) 1 of 2 gave no sign of life for 5 s while the others waited for them in a training "
            "step") in p.stderr, p.stderr[-3000:]
    # torchrun SIGKILLs the frozen rank once its grace period after the SIGTERM is over: no `kill -9` from outside
    last = [line for line in p.stderr.splitlines() if line.startswith("error: ")][-1]
    assert "rank 1 killed by SIGKILL from torchrun (it had not ended within torchrun's grace period" in last, last
    assert "out-of-memory" not in last and "Unable to shutdown process" not in p.stderr, p.stderr[-3000:]

def test_a_rank_that_lost_a_killed_peer_says_so_in_one_line(monkeypatch, capsys) -> None:
    """The surviving rank's side (whether gloo's error or torchrun's SIGTERM reaches it first is a race, so the
    launch above may not show it): gloo's connection error becomes one line, exit 1."""
    from pipeline.commands.common import user_errors

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(typer.Exit) as stopped, user_errors():
        raise RuntimeError(GLOO_RESET)
    assert stopped.value.exit_code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: rank 0 lost its connection to another rank (Connection "
                                                   "reset by peer): that rank's process ended without a word"), lines
    with pytest.raises(RuntimeError), user_errors():  # one process: no peer to lose, the error is this one's
        monkeypatch.setenv("WORLD_SIZE", "1")
        raise RuntimeError(GLOO_RESET)


def test_the_launchers_line_tells_a_rank_that_failed_from_one_that_was_killed() -> None:
    from pipeline.commands.launch import failed_line

    def fail(code: int) -> SimpleNamespace:
        return SimpleNamespace(exitcode=code)

    said = failed_line({0: fail(1), 1: fail(143)}, "rerun the same command")
    assert said == "rank 0 exit 1, rank 1 exit 143 (the ranks' own error is the line above)", said
    # a SIGTERM sent to a rank alone (its stop line is the launcher's to say): no line above says why
    said = failed_line({0: fail(143), 1: fail(143)}, "rerun with --resume")
    assert said == ("rank 0 exit 143, rank 1 exit 143: stopped by SIGTERM sent to the ranks, not to the launcher "
                    "(`kill` of a rank's process, a scheduler signalling the processes); what they committed stays: "
                    "rerun with --resume to continue"), said
    said = failed_line({0: fail(-signal.SIGTERM), 1: fail(143)}, "rerun the same command")
    assert said.startswith("rank 0 killed by SIGTERM, rank 1 exit 143: stopped by SIGTERM sent to the ranks"), said
    said = failed_line({0: fail(-signal.SIGTERM), 1: fail(-signal.SIGSEGV)}, "rerun the same command")
    assert said.startswith("rank 0 killed by SIGTERM, rank 1 killed by SIGSEGV; rank 1 printed nothing of its own: "
                           "a crash in native code"), said
    assert said.endswith("What they committed stays: rerun the same command to continue"), said


def test_a_rank_torchrun_sigkilled_after_its_grace_period_is_not_blamed_on_a_kill_from_outside() -> None:
    """torchrun's agent SIGKILLs a rank still running when the grace period after its SIGTERM is over (a frozen
    rank): the line blamed "a `kill -9`, or the kernel's out-of-memory killer" for it. The agent's log line
    names the pid it SIGKILLed; a rank killed by SIGKILL from outside is still told as before."""
    import logging

    from pipeline.commands.launch import _drop_agent_lines_ours_says, failed_line

    agent = _drop_agent_lines_ours_says()
    # torchrun's own words (torch/distributed/elastic/multiprocessing/api.py, `_close`)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").warning(
        "Unable to shutdown process %s via %s, forcefully exiting via %s", 4242, signal.SIGTERM, signal.SIGKILL)
    assert 4242 in agent.forced
    failures = {0: SimpleNamespace(exitcode=1, pid=4241), 1: SimpleNamespace(exitcode=-signal.SIGKILL, pid=4242)}
    said = failed_line(failures, "rerun with --resume", agent.forced)
    assert said == ("rank 0 exit 1, rank 1 killed by SIGKILL from torchrun (it had not ended within torchrun's "
                    "grace period after its stop signal) (the ranks' own error is the line above)"), said
    said = failed_line(failures, "rerun with --resume", set())
    assert "rank 1 printed nothing: a `kill -9`, or the kernel's out-of-memory killer" in said, said


def test_a_peer_lost_inside_a_ranks_own_step_is_the_lost_peer_line(monkeypatch) -> None:
    """The same gloo error met inside `fails_alone` (the forward and backward, where DDP all-reduces): the lost
    peer's line, not 'rank 0: optimizer step 1 failed: RuntimeError: [gloo...]' blaming this rank."""
    from models import collective
    from models.collective import RankFailed, fails_alone

    monkeypatch.setattr(collective.state, "run", dict(collective.state.run))  # its watch state stays this test's
    monkeypatch.setenv("RANK", "0")
    for name in ("MASTER_ADDR", "MASTER_PORT"):  # no launch's store: the line is not published anywhere
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RankFailed) as failed, fails_alone(2, "optimizer step 1"):
        raise RuntimeError(GLOO_RESET)
    assert str(failed.value).startswith("rank 0 lost its connection to another rank (Connection reset by peer)"), \
        str(failed.value)
