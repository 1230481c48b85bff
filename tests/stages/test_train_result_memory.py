"""`TrainResult`'s per-step figures at scale: ~8 bytes a step each (a list of Python floats held ~32: ~162 MB
per rank at 1M steps), and every consumer still reads them: the summary line, JSON, slices and comparisons."""

from __future__ import annotations

import json
import math
import tracemalloc

from stages.train.result import TrainResult
from stages.train.prefetch import data_wait_line

STEPS = 100_000


def _record(result: TrainResult, steps: int) -> None:
    """What `stages.train.recipe.log` appends at each step."""
    for step in range(steps):
        result.losses.append(1.0 / (step + 1))
        result.step_epochs.append(step // 1000)
        result.step_times.append(0.25 + step * 1e-9)
        result.step_cpu_times.append(0.2 + step * 1e-9)
        result.step_data_times.append(0.01 + step * 1e-9)


def test_per_step_figures_cost_about_8_bytes_a_step_each(tmp_path):
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        result = TrainResult(tmp_path, tmp_path / "lora", start_step=0, steps=STEPS)
        _record(result, STEPS)
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    per_step = grown / STEPS
    assert per_step < 5 * 8 * 1.5, per_step  # five figures of 8 bytes, with the arrays' over-allocation

    # the consumers: the summary line, the JSON record, benchmarks' slices and sums, tests' comparisons
    assert "train loss" in str(result) and "epoch 99 mean, 1000 steps" in str(result)
    record = json.loads(json.dumps(result.to_json()))
    assert record["loss_first"] == 1.0 and math.isclose(record["loss_last"], 1.0 / STEPS)
    assert json.loads(json.dumps(result.losses[:3].tolist())) == [1.0, 0.5, 1.0 / 3]
    assert result.losses[:2] == result.losses[:2] and list(result.step_epochs[999:1001]) == [0, 1]
    assert math.isclose(sum(result.step_times[1:3]), 0.5 + 3e-9)
    waited = data_wait_line(result.step_cpu_times, result.step_times, 0)  # 80% of each step: the hint line
    assert waited is not None and waited == data_wait_line(list(result.step_cpu_times), list(result.step_times), 0)
