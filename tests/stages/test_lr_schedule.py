"""The LR schedules are diffusers' (`diffusers.optimization.get_scheduler`), step for step, for every configured
name; only the warm-up is read one step ahead (the first step trains at 1/warmup_steps of the LR, not at 0)."""

from __future__ import annotations

import pytest
import torch
from diffusers.optimization import get_scheduler

from pipeline.config import load_config
from stages.train.schedule import LIBRARY_SCHEDULES, lr_factor, make_optimizer


def _library_lrs(name: str, warmup: int, total: int) -> list[float]:
    """The LR of each step of an unmodified diffusers scheduler (base LR 1), as a training loop sees it."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total)
    lrs = []
    for _ in range(total + 1):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup,total", [(0, 10), (3, 10), (2, 7), (5, 5)])
def test_every_schedule_is_the_library_s(schedule, warmup, total):
    cfg = load_config(None, {"train.lr_schedule": schedule, "train.warmup_steps": warmup,
                             "train.max_steps": total}).train
    library = _library_lrs(LIBRARY_SCHEDULES[schedule], warmup, total)
    ours = [lr_factor(s, cfg) for s in range(total)]
    expected = [library[s + 1] if s < warmup else library[s] for s in range(total)]
    assert ours == pytest.approx(expected, abs=1e-12)
    assert ours[0] > 0  # never a step at LR 0
    # the scheduler training uses steps the same way (LR of each optimizer step, base LR 2e-4)
    params = [torch.zeros(2, requires_grad=True)]
    cfg = cfg.model_copy(update={"optimizer": "adamw", "learning_rate": 2e-4})
    opt, sched = make_optimizer(params, cfg)
    seen = []
    for _ in range(total):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([2e-4 * f for f in expected], rel=1e-9)
