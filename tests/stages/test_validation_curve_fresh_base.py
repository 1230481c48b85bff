"""A training's fresh start over RUN/losses.zarr that a killed earlier start recorded (`ValidationCurve.record`:
its steps dropped, then its own base written over the recorded one), killed as zarr had deleted the recorded
base's chunks and before the commit: the curve read as damaged, the next start set it aside saying so (a
`losses.<fingerprint>.zarr` left in the run folder) and its recorded base was unreadable. Now the base is
written in a new group swapped in whole (`store.loss_array.LossStore.write_base`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from store.loss_array import GROUP, recorded_steps
import warm_start

# run folder, then "kill" to be SIGKILLed right after zarr deleted the base's files
START = """
import os, signal, sys
from pathlib import Path
import numpy as np
from zarr.storage import LocalStore
from models.sample import TrainSample
from schemas.config import TrainConfig
from stages.train.val_curve import ValidationCurve

run, kill = Path(sys.argv[1]), sys.argv[2:] == ["kill"]
if kill:
    real_delete = LocalStore.delete_dir
    async def delete_dir(self, prefix):
        await real_delete(self, prefix)
        if prefix.endswith("base_loss"):
            os.kill(os.getpid(), signal.SIGKILL)
    LocalStore.delete_dir = delete_dir
cfg = TrainConfig(validate_noise_seeds=[0, 1], validate_timesteps=[0.25, 0.75])
samples = [TrainSample(k, None, [], None, None, [(1, 2, 2)]) for k in ("a", "b")]
curve = ValidationCurve(cfg, run, samples, {"val": "content"}, {"val": 1}, "model", start_step=0)
curve.record(0, np.full((2, 2, 2, 3), 4.0), np.full((2, 2, 2, 3), 7.0))  # a fresh start: base 7
"""


def _start(run: Path, *kill: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    # started warm (tests/warm_start.py): a process of its own without a cold start's ~9 s of imports each
    return warm_start.run([sys.executable, "-c", START, str(run), *kill], env=env, timeout=600)


def test_a_fresh_start_killed_while_it_writes_its_base_leaves_the_curve_readable(tmp_path):
    from models.sample import TrainSample
    from schemas.config import TrainConfig
    from stages.train.val_curve import ValidationCurve

    run = tmp_path / "run"
    run.mkdir()
    cfg = TrainConfig(validate_noise_seeds=[0, 1], validate_timesteps=[0.25, 0.75])
    samples = [TrainSample(k, None, [], None, None, [(1, 2, 2)]) for k in ("a", "b")]
    killed = ValidationCurve(cfg, run, samples, {"val": "content"}, {"val": 1}, "model", start_step=0)
    killed.record(0, np.full((2, 2, 2, 3), 3.0), np.full((2, 2, 2, 3), 2.0))  # an earlier start, killed later
    killed.record(5, np.full((2, 2, 2, 3), 2.5), None)

    p = _start(run, "kill")
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    # the curve as the fresh start committed it before its base: its steps dropped, the recorded base whole
    assert recorded_steps(run, killed.fingerprint) == {}
    np.testing.assert_array_equal(killed.recorded_base(), np.full((2, 2, 2, 3), 2.0))

    p = _start(run)  # the rerun
    assert p.returncode == 0, p.stderr[-2000:]
    assert sorted(q.name for q in run.iterdir()) == [GROUP]  # nothing set aside as damaged
    assert recorded_steps(run, killed.fingerprint) == {0: ""}
    np.testing.assert_array_equal(killed.recorded_base(), np.full((2, 2, 2, 3), 7.0))
