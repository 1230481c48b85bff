"""Gradient accumulation holds one micro-batch's inputs at a time: a step used to read and prepare all grad_accum
micro-batches (packed latents, prompt embeddings, targets: on the device) before its first forward, only to count
the step's samples for the loss scale; after an elastic shrink each of them held W0 / W planned batches, so the
inputs on the device grew with grad_accum x W0 / W past what the run was sized for. The count now comes from the
plan, and each micro-batch is dropped after its backward: the same numbers (tests/stages/test_resume_curves.py,
test_elastic_accumulation.py pin them), a fraction of the memory."""

from __future__ import annotations

import weakref

import pytest

from pipeline.config import load_config
from stages.train import recipe
from stages.train.prefetch import MicroBatches
from train_store import make_train_store, mixed_specs


@pytest.mark.parametrize("budget", [None, 80])
def test_one_micro_batch_of_a_step_is_alive_at_each_backward(tiny_edit_model, tmp_path, monkeypatch, budget):
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(9))
    prepared: list[weakref.ref] = []  # every micro-batch handed to the step, by one of its input tensors
    alive_at_backward: list[int] = []
    real_next, real_backward = MicroBatches.next, recipe.backward_of

    def next_(self):
        m = real_next(self)
        prepared.append(weakref.ref(m.flows[0].sigmas))
        return m

    def backward_of(*args, **kwargs):
        alive_at_backward.append(sum(ref() is not None for ref in prepared))
        return real_backward(*args, **kwargs)

    monkeypatch.setattr(MicroBatches, "next", next_)
    monkeypatch.setattr(recipe, "backward_of", backward_of)
    sets = {"train.device": "cpu", "train.max_steps": 3, "train.grad_accum": 4, "train.batch_size": 1,
            "train.checkpoint_every": 3, "train.max_tokens_per_batch": budget}
    result = recipe.run(load_config(None, sets), store, tiny_edit_model, tmp_path / "run")
    assert result.steps == 3 and len(prepared) == 12
    # before: 4 at every backward (all four prepared before the first forward and kept to the step's end)
    assert alive_at_backward == [1] * 12, alive_at_backward


def test_the_planned_samples_are_those_the_stream_hands_out():
    """The loss scale counted from the plan is the count of the micro-batches read after it, on the run's own world
    size and re-split over others (elastic.py), across epoch ends."""
    import numpy as np

    from stages.train.budget import make_sampler
    from stages.train.data import DataStream
    from stages.train.elastic import on_world

    lengths = np.random.default_rng(0).integers(10, 60, 101)
    for budget in (None, 150):
        sampler = make_sampler(lengths, 3, budget, 0, 4, 4)
        for world in (4, 2, 3, 8):
            for position in ((0, 0), (0, 5), (1, 2)):
                for micro_steps in (1, 3, 40):
                    stream = DataStream(on_world(sampler, world), *position)
                    planned = stream.planned_samples(position, micro_steps)
                    handed = sum(len(b) for _ in range(micro_steps) for b in stream.next()[1])
                    assert planned == handed, (budget, world, position, micro_steps)
