"""`pipeline launch`: torchrun around the CLI; when the ranks fail, the user sees their one line and the
launcher's one line (which ranks, which exit status), not torchrun's `ChildFailedError` traceback and box."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import warm_start  # launcher and ranks started warm
from rank_hook import launch_with_hook

from store import Store

REPO = Path(__file__).resolve().parents[2]


def test_a_failed_launch_ends_in_one_line_per_rank_and_one_for_the_launcher(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    missing = tmp_path / "no-model"
    Store(tmp_path / "store")  # empty: a folder without store.json is refused before the model's path
    p = warm_start.run(
        # --standalone: a free port (torchrun's default 29500 may be another test's on a shared machine)
        [sys.executable, "-m", "pipeline.cli", "launch", "--standalone", "--nproc-per-node", "2", "run", "train",
         "--store", str(tmp_path / "store"), "--model", str(missing), "--out", str(tmp_path / "run"), "--device", "cpu"],
        env=env, timeout=300)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr + p.stdout and "ChildFailedError" not in p.stderr, p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    # the first rank to fail exits 1; torchrun may stop the other one before it got as far (SIGTERM)
    assert errors[-1].startswith("error: pipeline.cli stopped: rank ") and " exit 1" in errors[-1], errors
    assert 2 <= len(errors) <= 3 and all(e == errors[0] for e in errors[:-1]) and str(missing) in errors[0], errors
    # torchrun's agent logged the same between them ("E... failed (exitcode: 1) local_rank: 0 ...", "W... Sending
    # process N closing signal SIGTERM"): the launcher's "the ranks' own error is the line above" pointed at it
    assert p.stderr.splitlines()[-2] == errors[0], p.stderr[-3000:]


def test_a_launch_where_one_rank_sees_a_gpu_and_the_other_none_is_refused_by_both(tmp_path, tiny_edit_model) -> None:
    """train.device unset, rank 1 "sees" two GPUs (a sitecustomize patches torch.cuda there), rank 0 none: as where
    one node's GPU driver failed. The ranks decide the device together before any process group exists
    (models/launch_devices.py) and refuse in one line naming rank 0, before opening the store or loading the model
    (its folder is checked first, on every rank together). Before: rank 0 set
    up gloo on the CPU and rank 1 NCCL, which failed there with a traceback (on real nodes: a launch hung until
    the collective timeout, or trained mixed)."""
    # Told to the device decisions only (this project's and accelerate's): libraries that probe the GPU further
    # at import (torchao) would fail on a CPU machine told there is one.
    Store(tmp_path / "store")  # empty: a folder without store.json is refused first
    p = launch_with_hook(tmp_path, (
        "import os, sys\n"
        "if os.environ.get('RANK') == '1':  # a launched rank 1 only (the launcher's own process has no RANK)\n"
        "    import torch\n"
        "    def _asked_by_a_device_decision():\n"
        "        name = sys._getframe(2).f_code.co_filename\n"
        # this project's own files (not its .venv, which may lie inside the checkout) and accelerate's
        f"        return (name.startswith({str(REPO)!r}) and '/site-packages/' not in name) or '/accelerate/' in name\n"
        "    real_available, real_count = torch.cuda.is_available, torch.cuda.device_count\n"
        "    torch.cuda.is_available = lambda: _asked_by_a_device_decision() or real_available()\n"
        "    torch.cuda.device_count = lambda: 2 if _asked_by_a_device_decision() else real_count()\n"),
        ["run", "train", "--store", str(tmp_path / "store"), "--model", tiny_edit_model, "--out",
         str(tmp_path / "run")], timeout=300)  # a bound for a hang: the old code's failure mode
    assert p.returncode == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr + p.stdout and "ChildFailedError" not in p.stderr, p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    # the first rank to refuse exits 1; torchrun may stop the other one before it printed its line (SIGTERM)
    assert errors[-1].startswith("error: pipeline.cli stopped: rank ") and " exit 1" in errors[-1], errors
    assert 2 <= len(errors) <= 3 and all(e == errors[0] for e in errors[:-1]), errors
    assert errors[0].startswith("error: train.device is unset and rank 0 on ") and "train.device=cpu" in errors[0]
    assert not (tmp_path / "run").exists()


def test_launch_help_and_a_missing_command_say_what_goes_where() -> None:
    """torchrun's own usage calls the pipeline command `training_script` and, without it, only says that one is
    required: the launcher says the command comes after torchrun's options, with an example."""
    from typer.testing import CliRunner

    from pipeline.cli import app

    for args in (["launch"], ["launch", "--nproc-per-node", "2"]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2 and "then the pipeline command: `pipeline launch --nproc-per-node 2 run train" in r.output
    # torchrun's usage line (`usage: pipeline [-h] ... training_script ...`) came after a one-line preface; now
    # the launcher's own: what it launches, the options that matter here, examples, wherever --help stands
    for args in (["launch", "--help"], ["launch", "--nproc-per-node", "2", "-h"]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0 and r.output.startswith("usage: pipeline launch [TORCHRUN OPTIONS] COMMAND [ARGS]...")
        assert "--nproc-per-node" in r.output and "--master-addr" in r.output, r.output
        assert "training_script" not in r.output and "--no-python" not in r.output and "--run-path" not in r.output
        assert "  pipeline launch --nproc-per-node 2 run train --store S --model M --out RUN\n" in r.output
    r = CliRunner().invoke(app, ["launch", "--nproc-per-node", "2"])
    assert "required: COMMAND, ARGS" in r.output and "training_script" not in r.output, r.output


def test_a_launch_stopped_by_sigterm_ends_in_one_line(tiny_edit_model, tmp_path) -> None:
    """A scheduler's SIGTERM (preemption) to `pipeline launch`: torchrun's agent stops every rank and raised its
    `SignalException`, a traceback from the launcher (exit 1). Now one line and 128 + SIGTERM; the ranks'
    committed checkpoints resume. Sent once the first checkpoint is committed (the ranks are running), to a
    training of 10^5 steps (still running then)."""
    import signal
    import time

    sys.path.insert(0, str(REPO / "tests" / "stages"))
    from train_store import make_train_store, mixed_specs

    store, run = tmp_path / "store", tmp_path / "run"
    make_train_store(store, tiny_edit_model, mixed_specs(8))
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    # output into files, not a pipe nobody reads while waiting (a full pipe blocks the ranks)
    p = warm_start.WarmProcess(
        # --standalone: a free port (torchrun's default 29500 may be another test's on a shared machine)
        [sys.executable, "-m", "pipeline.cli", "launch", "--standalone", "--nproc-per-node", "2", "run", "train",
         "--store", str(store), "--model", tiny_edit_model, "--out", str(run), "--device", "cpu", "--max-steps", "100000",
         "--batch-size", "2", "--set", "train.lora.rank=4", "--set", "train.checkpoint_every=1"], env=env)
    try:
        deadline = time.monotonic() + 400  # a bound for a launch that never gets going, not a timing assertion
        while not (run / "checkpoints" / "step-1").is_dir() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert p.poll() is None and (run / "checkpoints" / "step-1").is_dir(), p.output()[1][-3000:]
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=240)
    finally:
        p.kill()
    err = p.output()[1]
    assert p.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "SignalException" not in err and "error: pipeline.cli stopped by SIGTERM" in err, err[-3000:]


def test_the_command_after_torchruns_options_keeps_every_option_of_its_own(monkeypatch) -> None:
    """`pipeline launch ... run evaluate --all-checkpoints --run RUN` was refused by torchrun's parser
    ("ambiguous option: --run could match --run-path, --run_path"): it read the command's options as its own.
    Now torchrun parses only what comes before the command; a command word taken as an option's value
    (`--rdzv-id run`) is not the command."""
    import torch.distributed.run as torchrun
    from typer.testing import CliRunner

    from pipeline.cli import app

    seen = []
    monkeypatch.setattr(torchrun, "run", seen.append)
    for words, torch_opts, command in (
        (["--nproc-per-node", "2", "run", "evaluate", "--all-checkpoints", "--run", "R", "--store", "S"],
         {"nproc_per_node": "2"}, ["run", "evaluate", "--all-checkpoints", "--run", "R", "--store", "S"]),
        (["--rdzv-id", "run", "--nnodes", "1", "run", "train", "--out", "O"],
         {"rdzv_id": "run", "nnodes": "1"}, ["run", "train", "--out", "O"]),
        (["--standalone", "store", "inspect", "--json", "S"], {"standalone": True}, ["store", "inspect", "--json", "S"]),
    ):
        seen.clear()
        r = CliRunner().invoke(app, ["launch", *words])
        assert r.exit_code == 0, r.output
        [args] = seen
        assert args.training_script == "pipeline.cli" and args.module and args.training_script_args == command
        assert all(getattr(args, k) == v for k, v in torch_opts.items()), vars(args)


def test_a_stopped_launch_names_the_rerun_its_command_takes(monkeypatch) -> None:
    """The stop line said 'rerun with --resume' for every command: `pipeline run all --resume` and
    `run encode-text --resume` are refused as unknown options (they continue on a plain rerun)."""
    import signal

    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from typer.testing import CliRunner

    from pipeline.cli import app

    def stopped(args) -> None:
        raise SignalException("stopped", signal.SIGTERM)

    monkeypatch.setattr(torchrun, "run", stopped)
    for command, rerun in ((["run", "all", "--config", "c.yaml"], "rerun the same command"),
                           (["run", "encode-text", "--store", "S", "--model", "M"], "rerun the same command"),
                           (["run", "train", "--store", "S", "--model", "M", "--out", "R"], "rerun with --resume")):
        r = CliRunner().invoke(app, ["launch", "--nproc-per-node", "2", *command])
        assert r.exit_code == 128 + signal.SIGTERM, r.output
        assert f"(what they committed stays: {rerun} to continue from the last checkpoint)" in r.output, r.output


def test_torchrun_options_it_refuses_end_in_one_line_naming_them() -> None:
    """torchrun checks some of its options only when it launches, by raising: `--nproc-per-node abc` (or `gpu` on
    a machine without CUDA), `--nnodes x`, `--rdzv-conf bad` ended in its traceback, and `--nproc-per-node 0` in a
    bare AssertionError. Now one line naming the option, exit 2, before any rank starts."""
    from typer.testing import CliRunner

    from pipeline.cli import app

    for option, named in ((["--nproc-per-node", "abc"], "Unsupported nproc_per_node value: abc"),
                          (["--nproc-per-node", "0"], "--nproc-per-node 0: at least 1 process per node"),
                          (["--nnodes", "x"], "--nnodes x: a number of nodes or MIN:MAX"),
                          (["--rdzv-conf", "bad"], "The rendezvous configuration option 'bad' must have a value")):
        r = CliRunner().invoke(app, ["launch", *option, "run", "train", "--out", "R"])
        assert r.exit_code == 2, (option, r.output, r.exception)
        assert r.output.startswith(f"error: pipeline launch: torchrun refused the launch: {named}"), r.output
        assert r.output.endswith("; check its options (`pipeline launch --help`)\n"), r.output
