"""A SIGTERM (a scheduler's preemption) while training: the step under way is finished and checkpointed, then the
process stops with the signal's status and one line; `--resume` continues from that step and trains the LoRA a
straight run trains. Before: the process stopped at once and lost every step since the last checkpoint
(`train.checkpoint_every`, 50 by default). The signal is sent while the trainer has stopped itself right after its
step-3 checkpoint (`STORE_PAUSE_AT`), so it lands at the same point whatever the machine's load: a signal that
came while a checkpoint was written stops at that checkpoint (before: one more step ran, and was checkpointed,
inside the scheduler's grace period)."""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil
import torch

from models.lora import read_lora
from pipeline.config import load_config
from stages.train import state as train_state
from stages.train.recipe import run
from train_store import make_train_store, mixed_specs
from warm_start import WarmProcess

def to_main_thread(pid: int, signum: int) -> None:
    """`signum` to process `pid`'s main thread (tgkill). Sent to a stopped process as a whole (kill), it is taken
    on SIGCONT by whichever of its threads runs first (gloo's, OpenMP's, the prefetch thread): under load the main
    thread could enter the post-checkpoint all-reduce before that thread ran the handler, and stop one step later.
    A running process's main thread is the one Linux gives such a signal (unless it blocks it), as here."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.tgkill(pid, pid, signum) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill({pid}, {signum})")


SETS = {"train.device": "cpu", "train.batch_size": 2, "train.learning_rate": 2e-3, "train.lora.rank": 4,
        "train.checkpoint_every": 3}


def test_sigterm_checkpoints_the_step_under_way_and_resume_loses_nothing(tiny_edit_model, tmp_path) -> None:
    store, out = tmp_path / "store", tmp_path / "run"
    make_train_store(store, tiny_edit_model, mixed_specs(8))
    sets = [a for k, v in SETS.items() for a in ("--set", f"{k}={v}")]
    proc = WarmProcess(  # a real process of its own, started warm (tests/warm_start.py): torch imported already
        [sys.executable, "-m", "pipeline.cli", "run", "train", "--store", str(store), "--model", tiny_edit_model,
         "--out", str(out), "--max-steps", "1000", *sets], env={**os.environ, "STORE_PAUSE_AT": "train_after_checkpoint"})
    try:
        deadline = time.monotonic() + 600  # a bound for a regression, not a timing assert
        while psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED:
            assert proc.poll() is None and time.monotonic() < deadline, "the trainer never reached its checkpoint"
            time.sleep(0.1)
        to_main_thread(proc.pid, signal.SIGTERM)  # pending until it continues, inside the step-3 checkpoint's writing
        proc.send_signal(signal.SIGCONT)
        output = "".join(proc.communicate(timeout=300))  # stdout, then stderr
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert f"stopped by SIGTERM after optimizer step 3: its checkpoint {out / 'checkpoints' / 'step-3'}" in output
    assert [s for s, _ in train_state.complete_checkpoints(out / "checkpoints")] == [3]  # no step 4 run

    cfg = load_config(None, {**SETS, "train.max_steps": 6})
    resumed = run(cfg, store, tiny_edit_model, out, resume=True)
    assert resumed.start_step == 3
    run(cfg, store, tiny_edit_model, tmp_path / "straight")
    a, b = read_lora(out / "lora")[0], read_lora(tmp_path / "straight" / "lora")[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_sigterm_on_one_rank_checkpoints_the_same_step_on_every_rank(tiny_edit_model, tmp_path) -> None:
    """Two gloo processes; only rank 1 is sent SIGTERM (a scheduler that signals ranks one by one, or one node
    first) while the step-3 checkpoint is written: both learn of it right after that checkpoint (every rank's RNG
    state in it) and stop with 143, without a step 4."""
    from two_ranks import start_two

    store, out = tmp_path / "store", tmp_path / "run"
    make_train_store(store, tiny_edit_model, mixed_specs(8))
    sets = [a for k, v in SETS.items() for a in ("--set", f"{k}={v}")]
    procs = start_two("rank_cli.py", "run", "train", "--store", str(store), "--model", tiny_edit_model, "--out",
                      str(out), "--max-steps", "1000", *sets, env={"STORE_PAUSE_AT": "train_after_checkpoint"})
    try:
        deadline = time.monotonic() + 600  # a bound for a regression, not a timing assert
        while not all(psutil.Process(p.pid).status() == psutil.STATUS_STOPPED for p in procs):
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, [p.output() for p in procs]
            time.sleep(0.1)
        to_main_thread(procs[1].pid, signal.SIGTERM)  # pending until it continues, inside the step-3 checkpoint
        for p in procs:
            p.send_signal(signal.SIGCONT)
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (stdout, stderr) in zip(procs, outs):
        assert p.returncode == 128 + signal.SIGTERM, (p.returncode, stderr[-3000:])
        assert "Traceback" not in stdout + stderr, stderr[-3000:]
    # rank 0 says the stop, agreed on rank 1's signal: not one of its own to name
    assert "stopped by a signal after optimizer step 3" in outs[0][0], outs[0]
    assert [s for s, _ in train_state.complete_checkpoints(out / "checkpoints")] == [3]
    step3 = out / "checkpoints" / "step-3"
    assert {p.name for p in step3.glob("rng-rank*")} == {"rng-rank00.safetensors", "rng-rank01.safetensors"}
    assert train_state.ResumeRecord.read(step3 / "resume.json").step == 3


def test_the_signal_is_held_once_and_a_failing_step_after_it_stops_as_the_signal_would(capsys) -> None:
    """In-process: the handler the block replaced gets the signal when the stop is acted on; two SIGTERMs at once
    (SLURM signals every process of the step, torchrun's agent passes its own on: the second one stopped the rank
    at once, losing the step the first one was held for) are held; one after the request went into a step's
    all-reduce, or an error in the step under way (a peer that torchrun stopped first closed its connections), stops at once with
    the signal's status instead of that error's traceback."""
    import pytest

    from stages.train.stop import StopOnSignal

    got: list[int] = []

    def previous(signum, frame):
        got.append(signum)

    before = signal.signal(signal.SIGTERM, previous)
    try:
        with StopOnSignal() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # SLURM's and torchrun's, at once: both held
            assert got == []
            assert stop.requested() == 1.0 and got == []  # into the step's all-reduce
            with pytest.raises(SystemExit) as second:  # asked again after that: at once
                os.kill(os.getpid(), signal.SIGTERM)
        assert second.value.code == 128 + signal.SIGTERM and got == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is previous  # put back

        with pytest.raises(SystemExit) as failed:
            with StopOnSignal():
                os.kill(os.getpid(), signal.SIGTERM)
                raise RuntimeError("Connection closed by peer")
        assert failed.value.code == 128 + signal.SIGTERM and got == [signal.SIGTERM] * 2
        from schemas.errors import UserError

        with pytest.raises(SystemExit) as full:  # a one-line error after the signal (a full disk at the stop's
            with StopOnSignal():  # checkpoint): the signal's status, and the line still shown
                os.kill(os.getpid(), signal.SIGTERM)
                raise UserError("cannot write checkpoint step-3 (no space left)")
        assert full.value.code == 128 + signal.SIGTERM
        assert "error: cannot write checkpoint step-3 (no space left)" in capsys.readouterr().err
        with pytest.raises(RuntimeError):  # no signal: the error is the error
            with StopOnSignal():
                raise RuntimeError("a real error")
    finally:
        signal.signal(signal.SIGTERM, before)


def _stopped_by_sigterm(call) -> bool:
    """Run `call` with pipeline/cli.py's SIGTERM handler installed (SystemExit(128 + signum)); True when it
    stopped with that status."""
    import pytest

    def cli_handler(signum, frame):
        raise SystemExit(128 + signum)

    before = signal.signal(signal.SIGTERM, cli_handler)
    try:
        with pytest.raises(SystemExit) as stopped:
            call()
    finally:
        signal.signal(signal.SIGTERM, before)
    return stopped.value.code == 128 + signal.SIGTERM


def test_a_sigterm_during_the_last_step_stops_after_the_final_lora(tiny_edit_model, tmp_path, monkeypatch) -> None:
    """A SIGTERM that came during the last step (here: while its checkpoint is written) was held and then
    dropped: the run finished and returned as if never signalled, and `run all` went on into evaluate until the
    scheduler's SIGKILL. Now the final LoRA is written, then the process stops as the signal asks."""
    from stages.train import recipe

    store, out = tmp_path / "store", tmp_path / "run"
    make_train_store(store, tiny_edit_model, mixed_specs(8))
    real = recipe.checkpoint

    def checkpoint_then_signalled(r) -> None:
        real(r)
        os.kill(os.getpid(), signal.SIGTERM)  # the last step's checkpoint (checkpoint_every 3 > max_steps 2)

    monkeypatch.setattr(recipe, "checkpoint", checkpoint_then_signalled)
    assert _stopped_by_sigterm(lambda: run(load_config(None, {**SETS, "train.max_steps": 2}), store,
                                           tiny_edit_model, out))
    assert read_lora(out / "lora")[0]  # the run is complete: a rerun finds it up to date
    assert [s for s, _ in train_state.complete_checkpoints(out / "checkpoints")] == [2]


def test_a_sigterm_during_a_step_checkpoints_that_step_and_stops(tiny_edit_model, tmp_path, monkeypatch) -> None:
    """In-process: a signal that came during step 2's forward (checkpoint_every 3: none due) is carried by that
    step's loss all-reduce; the step is finished, checkpointed and the process stops with the signal's status."""
    from stages.train import recipe

    store, out = tmp_path / "store", tmp_path / "run"
    make_train_store(store, tiny_edit_model, mixed_specs(8))
    real, calls = recipe.backward_of, []

    def signalled_in_step_2(*a, **k):
        calls.append(1)
        if len(calls) == 2:  # batch 2 x grad_accum 1: one call per step
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    monkeypatch.setattr(recipe, "backward_of", signalled_in_step_2)
    assert _stopped_by_sigterm(lambda: run(load_config(None, {**SETS, "train.max_steps": 5}), store,
                                           tiny_edit_model, out))
    assert [s for s, _ in train_state.complete_checkpoints(out / "checkpoints")] == [2] and len(calls) == 2


def _signalled_at_call(monkeypatch, n: int) -> list[int]:
    """recipe.backward_of sends this process SIGTERM as its `n`-th call begins (one call per micro-batch here);
    the calls so far, counted."""
    from stages.train import recipe

    real, calls = recipe.backward_of, []

    def signalled(*a, **k):
        calls.append(1)
        if len(calls) == n:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    monkeypatch.setattr(recipe, "backward_of", signalled)
    return calls


ACCUMULATED = {**SETS, "train.grad_accum": 4, "train.lora.dropout": 0.1}  # dropout: the global RNG goes on too


def test_a_sigterm_mid_accumulation_stops_before_the_update_and_resumes_bit_for_bit(tiny_edit_model, tmp_path,
                                                                                   monkeypatch, capsys) -> None:
    """grad_accum 4, a SIGTERM during micro-batch 2 of step 2: the ranks agree at that micro-batch's end, the
    partial step is dropped (no micro-batch 3, no update) and step 1, the last completed one, is checkpointed with
    the state at step 2's start; the resume trains the straight run's LoRA bit for bit. Before, the step was
    finished first: a step of the real model (32-64 micro-batches of 1-2 s) outlasts SLURM's 30 s grace."""
    store, out = tmp_path / "store", tmp_path / "run"
    make_train_store(store, tiny_edit_model, mixed_specs(8))
    calls = _signalled_at_call(monkeypatch, 4 + 2)
    assert _stopped_by_sigterm(lambda: run(load_config(None, {**ACCUMULATED, "train.max_steps": 5}), store,
                                           tiny_edit_model, out))
    assert len(calls) == 6  # not one micro-batch more
    assert [s for s, _ in train_state.complete_checkpoints(out / "checkpoints")] == [1]
    said = capsys.readouterr()
    assert (f"stopped by SIGTERM during optimizer step 2 (its partial gradients dropped): the checkpoint of "
            f"optimizer step 1, {out / 'checkpoints' / 'step-1'}, is written") in said.out + said.err
    monkeypatch.undo()
    cfg = load_config(None, {**ACCUMULATED, "train.max_steps": 5})
    assert run(cfg, store, tiny_edit_model, out, resume=True).start_step == 1
    run(cfg, store, tiny_edit_model, tmp_path / "straight")
    a, b = read_lora(out / "lora")[0], read_lora(tmp_path / "straight" / "lora")[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_sigterm_mid_accumulation_after_a_due_checkpoint_writes_nothing_new(tiny_edit_model, tmp_path,
                                                                             monkeypatch) -> None:
    """The step before the dropped one was checkpointed already (checkpoint_every 3, a signal in step 4): that
    checkpoint is the resume point, written once; a signal in step 1 keeps nothing (no step completed)."""
    from stages.train import recipe

    store, out = tmp_path / "store", tmp_path / "run"
    make_train_store(store, tiny_edit_model, mixed_specs(8))
    real, written = recipe.checkpoint, []
    monkeypatch.setattr(recipe, "checkpoint", lambda r: (written.append(r.step), real(r)))
    calls = _signalled_at_call(monkeypatch, 3 * 4 + 2)
    assert _stopped_by_sigterm(lambda: run(load_config(None, {**ACCUMULATED, "train.max_steps": 5}), store,
                                           tiny_edit_model, out))
    assert len(calls) == 14 and written == [3]
    assert [s for s, _ in train_state.complete_checkpoints(out / "checkpoints")] == [3]

    first = _signalled_at_call(monkeypatch, 2)
    assert _stopped_by_sigterm(lambda: run(load_config(None, {**ACCUMULATED, "train.max_steps": 5}), store,
                                           tiny_edit_model, tmp_path / "first"))
    assert len(first) == 2 and written == [3] and not (tmp_path / "first" / "checkpoints" / "step-0").exists()
    monkeypatch.undo()  # the line's advice, --resume, starts that run again
    assert run(load_config(None, {**ACCUMULATED, "train.max_steps": 1}), store, tiny_edit_model, tmp_path / "first",
               resume=True).start_step == 0


def test_a_sigterm_mid_accumulation_on_one_rank_stops_every_rank_at_that_micro_batch(tiny_edit_model,
                                                                                     tmp_path) -> None:
    """Two gloo processes, grad_accum 4; only rank 1 is sent SIGTERM, during its micro-batch 2 of step 2: both
    ranks agree at that micro-batch's end, run no micro-batch more, write step 1's checkpoint together (every
    rank's RNG state in it) and stop with 143."""
    from two_ranks import launch_two, results

    store, out = tmp_path / "store", tmp_path / "run"
    make_train_store(store, tiny_edit_model, mixed_specs(8))
    sets = [a for k, v in ACCUMULATED.items() for a in ("--set", f"{k}={v}")]
    outs = launch_two("rank_stop_mid_step.py", "6", "run", "train", "--store", str(store), "--model",
                      tiny_edit_model, "--out", str(out), "--max-steps", "1000", *sets)
    for code, stdout, stderr in outs:
        assert code == 128 + signal.SIGTERM, (code, stderr[-3000:])
        assert "Traceback" not in stdout + stderr, stderr[-3000:]
        assert results(stdout)["micro-batches"] == "6", stdout[-2000:]
    assert "stopped by a signal during optimizer step 2" in outs[0][1], outs[0]  # rank 1's signal, not rank 0's
    assert [s for s, _ in train_state.complete_checkpoints(out / "checkpoints")] == [1]
    step1 = out / "checkpoints" / "step-1"
    assert {p.name for p in step1.glob("rng-rank*")} == {"rng-rank00.safetensors", "rng-rank01.safetensors"}


def test_a_second_sigterm_just_after_the_micro_batch_agreement_still_gets_the_checkpoint(tiny_edit_model, tmp_path,
                                                                                        monkeypatch) -> None:
    """SLURM's SIGTERM and the one torchrun's agent passes on come milliseconds apart; a micro-batch boundary
    (every 1-2 s, grad_accum times a step) can fall between them. The second one, arriving while the stop writes
    step 1's checkpoint, stopped the process at once: no checkpoint, every step since the last one lost. It is
    held: the stop it belongs to is already under way."""
    from stages.train import recipe

    store, out = tmp_path / "store", tmp_path / "run"
    make_train_store(store, tiny_edit_model, mixed_specs(8))
    real = recipe.checkpoint

    def second_signal_first(r):
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun's copy, just after the boundary agreed on the first
        real(r)

    monkeypatch.setattr(recipe, "checkpoint", second_signal_first)
    calls = _signalled_at_call(monkeypatch, 4 + 2)
    assert _stopped_by_sigterm(lambda: run(load_config(None, {**ACCUMULATED, "train.max_steps": 5}), store,
                                           tiny_edit_model, out))
    assert len(calls) == 6
    assert [s for s, _ in train_state.complete_checkpoints(out / "checkpoints")] == [1]


def test_an_epoch_ended_inside_a_dropped_step_is_said_once(tiny_edit_model, tmp_path, monkeypatch, capsys) -> None:
    """6 samples, batch 2, grad_accum 4: epoch 1 ends at micro-batch 2 of step 2, where a SIGTERM drops that step.
    The epoch's padding line was printed by the stopped start, then again by the resume that runs the step anew;
    it is said once, by the step that completes."""
    store, out = tmp_path / "store", tmp_path / "run"
    make_train_store(store, tiny_edit_model, mixed_specs(6))
    _signalled_at_call(monkeypatch, 4 + 2)
    cfg = load_config(None, {**ACCUMULATED, "train.max_steps": 3})
    assert _stopped_by_sigterm(lambda: run(cfg, store, tiny_edit_model, out))
    monkeypatch.undo()
    run(cfg, store, tiny_edit_model, out, resume=True)
    said = capsys.readouterr()
    lines = [line for line in (said.out + said.err).splitlines() if "padding efficiency" in line]
    assert [line.split(":")[0] for line in lines] == ["epoch 0", "epoch 1", "epoch 2", "epoch 3"], lines



def test_a_cpu_run_on_a_gpu_host_reads_no_cuda_rng(tmp_path, monkeypatch) -> None:
    """train.device=cpu where CUDA is available (its GPUs busy or failing: the reason to train on the CPU): the
    step start kept for a stop at a micro-batch boundary and the checkpoint's RNG file read and set only the CPU
    generator's state; reading the CUDA generators initializes CUDA (here: fails). On CUDA they are kept too."""
    from types import SimpleNamespace

    from safetensors.torch import load_file

    from stages.train.recipe import _StepStart

    def no_cuda(*a, **k):
        raise RuntimeError("CUDA touched by a run on the CPU")

    for name in ("get_rng_state_all", "set_rng_state_all"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    r = SimpleNamespace(device=torch.device("cpu"), position=(0, 0), epoch_tokens=[0, 0], ended_tokens=[0, 0],
                        optimizer=torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0))
    begun = _StepStart.of(r)
    torch.rand(3)
    begun.put_back(r)
    assert list(begun.rng) == ["cpu"] and torch.equal(torch.get_rng_state(), begun.rng["cpu"])
    train_state.save_rng(tmp_path, 0, cuda=False)
    assert list(load_file(tmp_path / "rng-rank00.safetensors")) == ["cpu"]
    train_state.load_rng(tmp_path, 0, cuda=False)

    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.zeros(16, dtype=torch.uint8)])
    assert list(train_state.rng_states(cuda=True)) == ["cpu", "cuda0"]
