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


def same_file(a: Path, b: Path) -> None:
    x, y = load_file(a), load_file(b)
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), a.name


def test_a_resume_off_the_log_cadence_logs_the_straight_runs_loss_curve(store_dir, tiny_edit_model, tmp_path):
    """train.log_every 4 and a stop after step 3 (a checkpoint off the log cadence: a preemption's, or
    checkpoint_every 3): train/loss at step 4 is the mean of steps 1-4, as in the straight run. Before, the resumed
    start averaged only its own steps (step 4 alone), a point of the curve off by a step's noise."""
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
    assert a == b


@pytest.mark.parametrize("batching", [{}, {"max_tokens_per_batch": 80}], ids=["batch", "token-budget"])
def test_a_stop_inside_an_accumulation_cycle_resumes_every_state_and_the_curve(store_dir, tiny_edit_model, tmp_path,
                                                                              monkeypatch, batching):
    """Validation every 3 steps: the one due at the stop's step runs after the resume (from the restored state,
    its RNG forked) and logs what the straight run logged."""
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
    resumed = run(cfg_of(**sets), store_dir, tiny_edit_model, out, resume=True)
    assert resumed.start_step == 3
    s, r = tmp_path / "straight", out
    for name in ("lora/pytorch_lora_weights.safetensors", "optimizer.safetensors", "ema.safetensors"):
        same_file(s / "checkpoints" / "step-6" / name, r / "checkpoints" / "step-6" / name)
    for name in ("scheduler.json", "optimizer.json"):
        assert (s / "checkpoints" / "step-6" / name).read_text() == (r / "checkpoints" / "step-6" / name).read_text()
    same_file(s / "lora" / "pytorch_lora_weights.safetensors", r / "lora" / "pytorch_lora_weights.safetensors")
    same_file(s / "lora_ema" / "pytorch_lora_weights.safetensors", r / "lora_ema" / "pytorch_lora_weights.safetensors")
    assert list(resumed.losses) == list(straight.losses)[3:]  # bit for bit, step by step
    curves = scalars(s)
    assert [step for step, _ in curves["val/loss"]] == [3, 6] and "val/loss_ema" in curves
    assert curves == scalars(r)


def test_the_damaged_sample_limit_counts_the_steps_before_a_resume(tiny_edit_model, tmp_path):
    """train.on_damaged=skip with max_damaged_fraction 0.2 on 8 samples: the straight run stops at the second
    damaged sample (2 > 0.2 x 8), in step 3. A run stopped after step 2 (one damaged sample read) and resumed
    used to count from the resume (1 of 8: under the limit) and trained on past the step the straight run
    refused; the checkpoint now keeps the counts and the resumed run stops where the straight one did."""
    from damage import flip_bit, sample_byte
    from stages.train.data import open_inputs
    from stages.train.sampler import LengthAwareBatchSampler

    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(8))
    tables = open_inputs(store, tiny_edit_model)
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
