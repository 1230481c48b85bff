"""The train summary compares epoch means, not two single steps, and reads the same in every command."""

from __future__ import annotations

import pytest

from stages.train.summary import epoch_losses, loss_phrase, train_line


def test_epoch_means_not_single_steps():
    # a noisy run whose last step is above its first, while every epoch's mean falls
    losses = [1.40, 1.20, 1.30, 1.10, 1.00, 1.05, 0.90, 0.95, 1.45]
    epochs = [0, 0, 0, 1, 1, 1, 2, 2, 2]
    means = epoch_losses(losses, epochs)
    assert [(e.epoch, e.steps) for e in means] == [(0, 3), (1, 3), (2, 3)]
    assert [e.mean for e in means] == pytest.approx([1.30, 1.05, 1.10])
    assert loss_phrase(losses, epochs) == "train loss 1.3000 (epoch 0 mean, 3 steps) -> 1.1000 (epoch 2 mean, 3 steps)"


def test_resumed_mid_epoch_and_single_epoch():
    assert loss_phrase([2.0, 1.0], [4, 4]) == "train loss 1.5000 (mean of 2 steps in epoch 4)"
    assert loss_phrase([2.0], [4]) == "train loss 2.0000 (the one step of epoch 4)"
    assert loss_phrase([2.0, 1.0, 3.0], [0, 0, 1]) == \
        "train loss 1.5000 (epoch 0 mean, 2 steps) -> 3.0000 (epoch 1 mean, 1 step)"
    assert train_line(6, 8, [2.0, 1.0], [4, 4], "RUN/lora") == (
        "trained resumed at step 6 to step 8: train loss 1.5000 (mean of 2 steps in epoch 4); LoRA: RUN/lora")
    assert loss_phrase([], []) == "no steps trained"



def test_skipped_nonfinite_steps_are_left_out_of_the_means_and_counted():
    line = train_line(0, 4, [2.0, float("nan"), 1.0, float("inf")], [0, 0, 0, 0], "RUN/lora", skipped=2)
    assert "nan" not in line and "inf" not in line
    assert "train loss 1.5000 (mean of 2 steps in epoch 0)" in line and "2 non-finite step(s) skipped" in line
    assert train_line(0, 1, [1.0], [0], "RUN/lora", init_lora="A.safetensors").startswith(
        "trained from init_lora A.safetensors to step 1")
