"""A run stopped at any step and resumed ends with the straight run's LoRA *and* its loss curve: the trained state
(adapter, optimizer, scheduler, EMA, RNG, data position) and what the trackers log, with the options that carry
state across steps on together (gradient accumulation running on into the next epoch, a warm-up + cosine
schedule, EMA, caption and LoRA dropout, prefetch, logit-normal σ, masked loss) and the stop landing inside an
accumulation cycle (a SIGTERM during step 3's second of three micro-batches)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.config import load_config
from stages.train.recipe import run
from tests.stages.test_train_preempted import _stopped_by_sigterm
from train_store import make_train_store, mixed_specs

BASE = {"train.device": "cpu", "train.batch_size": 2, "train.learning_rate": 5e-3, "train.lora.rank": 4}


def cfg_of(**train):
    return load_config(None, {**BASE, **{f"train.{k}": v for k, v in train.items()}})


@pytest.fixture(scope="module")
def store_dir(tiny_edit_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("curves") / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(7, 2, masks=True))  # 4 batches of 2 per epoch
    return root


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every train/* and val/* scalar the run's TensorBoard logs hold, as a reader sees them (a resume's purge
    of the steps after its checkpoint applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir / "logs"))
    ea.Reload()
    timing = {"train/samples_per_s", "train/data_wait_share", "train/peak_memory_gb"}  # of the machine, not the run
    return {t: [(e.step, e.value) for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]
            if t.split("/")[0] in ("train", "val", "epoch") and t not in timing}


def logged_steps(run_dir: Path, tag: str = "train/loss") -> list[int]:
    """The steps of `tag`'s events in the run's event files as written, every start's (no purge applied): a
    step logged twice shows twice here, where a reader keeps only the later one."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return [e.step for f in sorted((run_dir / "logs").glob("events.out.tfevents.*"))
            for e in EventFileLoader(str(f)).Load() if any(v.tag == tag for v in e.summary.value)]


def without_step(curves: dict[str, list[tuple[int, float]]], step: int) -> dict[str, list[tuple[int, float]]]:
    return {t: [p for p in points if p[0] != step] for t, points in curves.items()}


class Killed(Exception):
    """A kill right after a checkpoint is committed (nothing after it is written)."""


def same_file(a: Path, b: Path) -> None:
    x, y = load_file(a), load_file(b)
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), a.name


def test_a_resume_off_the_log_cadence_logs_the_straight_runs_loss_curve(store_dir, tiny_edit_model, tmp_path):
    """train.log_every 4 and a stop after step 3 (a checkpoint off the log cadence: a preemption's, or
    checkpoint_every 3): train/loss at step 4 is the mean of steps 1-4, as in the straight run. Before, the resumed
    start averaged only its own steps (step 4 alone), a point of the curve off by a step's noise. The first start
    (max_steps 3) logs its last step, the mean of steps 1-3; only multiples of 4 begin a window, so the points
    after the resume are the straight run's."""
    sets = {"log_every": 4, "warmup_steps": 2}
    straight = run(cfg_of(max_steps=8, checkpoint_every=3, **sets), store_dir, tiny_edit_model, tmp_path / "straight")
    out = tmp_path / "resumed"
    run(cfg_of(max_steps=3, checkpoint_every=3, **sets), store_dir, tiny_edit_model, out)
    run(cfg_of(max_steps=8, checkpoint_every=3, **sets), store_dir, tiny_edit_model, out, resume=True)
    same_file(tmp_path / "straight" / "lora" / "pytorch_lora_weights.safetensors",
              out / "lora" / "pytorch_lora_weights.safetensors")
    a, b = scalars(tmp_path / "straight"), scalars(out)
    losses = list(straight.losses)
    assert [s for s, _ in a["train/loss"]] == [4, 8]
    assert a["train/loss"][0][1] == pytest.approx(sum(losses[:4]) / 4, rel=1e-6)
    assert [s for s, _ in b["train/loss"]] == [3, 4, 8]
    assert b["train/loss"][0][1] == pytest.approx(sum(losses[:3]) / 3, rel=1e-6)
    assert without_step(b, 3) == a
    # train/padding_efficiency is of train/loss's window (steps 1-4, 5-8), here each an epoch of 4 steps: the
    # epoch's figure at the same step, not the log point's step alone (1.0 beside the epoch's 0.888 before)
    assert [s for s, _ in a["epoch/padding_efficiency"]] == [4, 8]
    assert a["train/padding_efficiency"] == a["epoch/padding_efficiency"]


def test_a_resume_with_another_log_every_logs_the_straight_runs_first_window(store_dir, tiny_edit_model, tmp_path):
    """A start with log_every 3 checkpointed at step 6 (a log point: it kept no step losses), resumed with log_every
    4: train/loss at step 8 is the mean of steps 5-8, as a straight log_every 4 run logs it. Before, the checkpoint
    kept only the steps since its own last log point, and the first point after the resume averaged steps 7-8."""
    straight = run(cfg_of(max_steps=8, checkpoint_every=6, log_every=4), store_dir, tiny_edit_model,
                   tmp_path / "straight")
    out = tmp_path / "resumed"
    run(cfg_of(max_steps=6, checkpoint_every=6, log_every=3), store_dir, tiny_edit_model, out)
    run(cfg_of(max_steps=8, checkpoint_every=6, log_every=4), store_dir, tiny_edit_model, out, resume=True)
    losses = list(straight.losses)
    resumed = dict(scalars(out)["train/loss"])
    assert sorted(resumed) == [3, 6, 8]
    assert resumed[8] == pytest.approx(sum(losses[4:8]) / 4, rel=1e-6)
    assert resumed[8] == pytest.approx(dict(scalars(tmp_path / "straight")["train/loss"])[8], rel=1e-6)


def test_the_last_step_off_the_log_cadence_is_logged_straight_and_resumed(store_dir, tiny_edit_model, tmp_path,
                                                                          monkeypatch):
    """max_steps 8 (the second epoch's end) and train.log_every 3: the curve ends with a point at step 8, the
    mean of steps 7-8, and a run killed after its checkpoint at step 4 and resumed logs the same points, each
    once. Before, the last point was 6: the run's last two steps were on no curve."""
    from stages.train import recipe

    sets = {"max_steps": 8, "log_every": 3, "checkpoint_every": 4, "warmup_steps": 2}
    straight = run(cfg_of(**sets), store_dir, tiny_edit_model, tmp_path / "straight")
    out, real = tmp_path / "resumed", recipe.checkpoint

    def killed_after_step_4(r):
        real(r)
        if r.step == 4:
            raise Killed

    with monkeypatch.context() as m:
        m.setattr(recipe, "checkpoint", killed_after_step_4)
        with pytest.raises(Killed):
            run(cfg_of(**sets), store_dir, tiny_edit_model, out)
    resumed = run(cfg_of(**sets), store_dir, tiny_edit_model, out, resume=True)
    assert resumed.start_step == 4
    losses = list(straight.losses)
    a, b = scalars(tmp_path / "straight"), scalars(out)
    assert [s for s, _ in a["train/loss"]] == [3, 6, 8]
    assert [v for _, v in a["train/loss"]] == pytest.approx(
        [sum(losses[:3]) / 3, sum(losses[3:6]) / 3, sum(losses[6:]) / 2], rel=1e-6)
    assert a == b  # bit for bit: the window of step 6 began before the resume (the checkpoint kept step 4's loss)
    assert logged_steps(out) == [3, 6, 8]


@pytest.mark.parametrize("when", ["in-a-step", "in-its-checkpoint"])
def test_a_stop_logs_its_last_step_once_and_the_resume_the_straight_runs_points(store_dir, tiny_edit_model,
                                                                                tmp_path, monkeypatch, when):
    """train.log_every 4: a SIGTERM in step 2 (its checkpoint the stop's) or during step 3's scheduled checkpoint
    (checkpoint_every 3: the stop right after it) ends that start's curve with a point at the stop's step, the mean
    of the steps since step 0, as a finished run's last step; the resumed start logs the straight run's points 4
    and 6 bit for bit (a stop's point begins no window) and not the stop's step again. Before, the stopped start
    logged nothing: a run stopped and not resumed had no curve at all."""
    from stages.train import recipe

    sets = {"max_steps": 6, "log_every": 4, "checkpoint_every": 3}
    straight = run(cfg_of(**sets), store_dir, tiny_edit_model, tmp_path / "straight")
    out, stop = tmp_path / "stopped", 2 if when == "in-a-step" else 3
    real_backward, real_checkpoint, calls = recipe.backward_of, recipe.checkpoint, []

    def signalled_in_step_2(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_backward(*a, **k)

    def signalled_in_checkpoint_3(r):
        if r.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        real_checkpoint(r)

    with monkeypatch.context() as m:
        if when == "in-a-step":
            m.setattr(recipe, "backward_of", signalled_in_step_2)
        else:
            m.setattr(recipe, "checkpoint", signalled_in_checkpoint_3)
        assert _stopped_by_sigterm(lambda: run(cfg_of(**sets), store_dir, tiny_edit_model, out))
    stopped = scalars(out)
    assert [s for s, _ in stopped["train/loss"]] == [stop]
    assert stopped["train/loss"][0][1] == pytest.approx(sum(list(straight.losses)[:stop]) / stop, rel=1e-6)
    resumed = run(cfg_of(**sets), store_dir, tiny_edit_model, out, resume=True)
    assert resumed.start_step == stop
    b = scalars(out)
    assert b["train/loss"][0] == stopped["train/loss"][0]
    assert without_step(b, stop) == scalars(tmp_path / "straight")
    assert logged_steps(out) == [stop, 4, 6]


@pytest.mark.parametrize("batching", [{}, {"max_tokens_per_batch": 80}], ids=["batch", "token-budget"])
def test_a_stop_inside_an_accumulation_cycle_resumes_every_state_and_the_curve(store_dir, tiny_edit_model, tmp_path,
                                                                              monkeypatch, batching):
    """A SIGTERM during step 3's second micro-batch (of 3) is agreed at that micro-batch's end: the partial step is
    dropped (no third micro-batch, no update) and step 2 is checkpointed with the state at step 3's start (data
    position, RNG: LoRA dropout, token counts), so the resume trains every state and logs the curve of the straight
    run. Before, the step was finished first (a step of 32-64 micro-batches outlasts a scheduler's 30 s grace).
    Validation every 3 steps: the one due at step 3 runs in the resumed start and logs what the straight run logged."""
    from stages.train import recipe

    sets = dict(max_steps=6, checkpoint_every=4, keep_checkpoints=10, grad_accum=3, warmup_steps=2,
                lr_schedule="cosine", ema_decay=0.5, caption_dropout=0.3, prefetch=2, validate_every=3,
                validate_max_samples=2, **batching, **{
                    "lora.dropout": 0.1, "sigma.sampling": "logit_normal", "loss.mask_weight.foreground": 2.0})
    straight = run(cfg_of(**sets), store_dir, tiny_edit_model, tmp_path / "straight")
    out = tmp_path / "resumed"
    real, calls = recipe.backward_of, []

    def signalled_in_step_3(*a, **k):
        calls.append(1)
        if len(calls) == 8:  # grad_accum 3: step 3's second micro-batch
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    with monkeypatch.context() as m:
        m.setattr(recipe, "backward_of", signalled_in_step_3)
        assert _stopped_by_sigterm(lambda: run(cfg_of(**sets), store_dir, tiny_edit_model, out))
    assert len(calls) == 8  # not one micro-batch more
    from stages.train import state as train_state

    assert [s for s, _ in train_state.complete_checkpoints(out / "checkpoints")] == [2]
    resumed = run(cfg_of(**sets), store_dir, tiny_edit_model, out, resume=True)
    assert resumed.start_step == 2
    s, r = tmp_path / "straight", out
    for name in ("lora/pytorch_lora_weights.safetensors", "optimizer.safetensors", "ema.safetensors"):
        same_file(s / "checkpoints" / "step-6" / name, r / "checkpoints" / "step-6" / name)
    for name in ("scheduler.json", "optimizer.json"):
        assert (s / "checkpoints" / "step-6" / name).read_text() == (r / "checkpoints" / "step-6" / name).read_text()
    same_file(s / "lora" / "pytorch_lora_weights.safetensors", r / "lora" / "pytorch_lora_weights.safetensors")
    same_file(s / "lora_ema" / "pytorch_lora_weights.safetensors", r / "lora_ema" / "pytorch_lora_weights.safetensors")
    assert list(resumed.losses) == list(straight.losses)[2:]  # bit for bit, step by step
    curves = scalars(s)
    assert [step for step, _ in curves["val/loss"]] == [3, 6] and "val/loss_ema" in curves
    assert curves == scalars(r)
    assert logged_steps(r) == [1, 2, 3, 4, 5, 6]  # the stop's step on the cadence (log_every 1): logged once


def test_the_damaged_sample_limit_counts_the_steps_before_a_resume(tiny_edit_model, tmp_path):
    """train.on_damaged=skip with max_damaged_fraction 0.2 on 8 samples: the straight run stops at the second
    damaged sample (2 > 0.2 x 8), in step 3. A run stopped after step 2 (one damaged sample read) and resumed
    used to count from the resume (1 of 8: under the limit) and trained on past the step the straight run
    refused; the checkpoint now keeps the counts and the resumed run stops where the straight one did."""
    from damage import flip_bit, sample_byte
    from train_store import open_split
    from stages.train.sampler import LengthAwareBatchSampler

    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(8))
    tables = open_split(store, tiny_edit_model)
    plan = LengthAwareBatchSampler(tables.lengths, 2, seed=0, window=64).global_steps(0)
    keys = [tables.keys[plan[k][0][0]] for k in (0, 2)]  # a sample of step 1 and one of step 3
    tables.close()
    for key in keys:
        flip_bit(*sample_byte(store, "vae", key), 4)
    sets = {"on_damaged": "skip", "max_damaged_fraction": 0.2}
    with pytest.raises(Exception, match="2 of the .* are damaged .*more than train.max_damaged_fraction = 0.2"):
        run(cfg_of(max_steps=4, **sets), store, tiny_edit_model, tmp_path / "straight")
    out = tmp_path / "resumed"
    run(cfg_of(max_steps=2, **sets), store, tiny_edit_model, out)
    with pytest.raises(Exception, match="2 of the .* are damaged .*more than train.max_damaged_fraction = 0.2"):
        run(cfg_of(max_steps=4, **sets), store, tiny_edit_model, out, resume=True)
    from stages.train import state as train_state

    assert [s for s, _ in train_state.complete_checkpoints(out / "checkpoints")] == [2]  # nothing trained past it


def test_a_resumes_event_file_sorts_after_the_killed_starts_in_the_same_second(tmp_path):
    """Event files are read in name order (`events.out.tfevents.SECONDS.HOST.PID.N`): a resume started in the same
    second as the killed start's file sorted by pid and counter (as text: 10 < 9), was read first, and the purge
    hid its points (CI: test_the_last_step_off_the_log_cadence_is_logged_straight_and_resumed, once)."""
    import socket
    import time

    from stages.train.trackers import Trackers

    logs = tmp_path / "logs"
    logs.mkdir()
    # the killed start's file, one second ahead of now (as one written within this second, whatever the clock does
    # meanwhile), under a pid and counter that sort after any this process gets
    earlier = logs / f"events.out.tfevents.{int(time.time()) + 1:010d}.{socket.gethostname()}.999999999.99"
    earlier.write_bytes(b"")
    trackers = Trackers(["tensorboard"], tmp_path, {}, purge_step=5)
    trackers.close()
    files = sorted(f.name for f in logs.glob("events.out.tfevents.*"))
    assert files[0] == earlier.name and len(files) == 2


def test_epochs_ending_in_one_step_are_one_epoch_point(tiny_edit_model, tmp_path):
    """3 samples at batch 2 (epochs of 2 micro-batches) with grad_accum 3: epoch 0 ends in step 1, epochs 1 and 2
    both in step 2. epoch/padding_efficiency is a point per step an epoch ended in, of the tokens of the epochs
    ended there; before, step 2 held two points (0.962 and 0.785), and a reader could not tell which epoch's."""
    from stages.train.budget import make_sampler
    from train_store import open_split
    from stages.train.sampler import padding_efficiency

    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(3))
    cfg = cfg_of(max_steps=2, grad_accum=3)
    result = run(cfg, store, tiny_edit_model, tmp_path / "run")
    assert logged_steps(tmp_path / "run", "epoch/padding_efficiency") == [1, 2]
    tables = open_split(store, tiny_edit_model)
    try:
        tc = cfg.train
        sampler = make_sampler(tables.lengths, tc.batch_size, None, tc.seed, tc.sampler_window, 1)
        plans = [[b for step in sampler.global_steps(e) for b in step] for e in range(3)]
        lengths = tables.lengths
    finally:
        tables.close()
    assert sorted(result.epoch_padding) == [0, 1, 2]
    want = [padding_efficiency(plans[0], lengths)[0], padding_efficiency(plans[1] + plans[2], lengths)[0]]
    assert [v for _, v in scalars(tmp_path / "run")["epoch/padding_efficiency"]] == pytest.approx(want, rel=1e-6)
