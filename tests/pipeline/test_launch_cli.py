"""`pipeline launch`: torchrun around the CLI; when the ranks fail, the user sees their one line and the
launcher's one line (which ranks, which exit status), not torchrun's `ChildFailedError` traceback and box."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_failed_launch_ends_in_one_line_per_rank_and_one_for_the_launcher(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    missing = tmp_path / "no-model"
    p = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "launch", "--nproc-per-node", "2", "run", "train", "--store",
         str(tmp_path / "store"), "--model", str(missing), "--out", str(tmp_path / "run"), "--device", "cpu"],
        env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr + p.stdout and "ChildFailedError" not in p.stderr, p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    # the first rank to fail exits 1; torchrun may stop the other one before it got as far (SIGTERM)
    assert errors[-1].startswith("error: pipeline.cli stopped: rank ") and " exit 1" in errors[-1], errors
    assert 2 <= len(errors) <= 3 and all(e == errors[0] for e in errors[:-1]) and str(missing) in errors[0], errors


def test_launch_help_and_a_missing_command_say_what_goes_where() -> None:
    """torchrun's own usage calls the pipeline command `training_script` and, without it, only says that one is
    required: the launcher says the command comes after torchrun's options, with an example."""
    from typer.testing import CliRunner

    from pipeline.cli import app

    for args in (["launch"], ["launch", "--nproc-per-node", "2"]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2 and "then the pipeline command: `pipeline launch --nproc-per-node 2 run train" in r.output
    r = CliRunner().invoke(app, ["launch", "--help"])
    assert r.exit_code == 0 and r.output.startswith("pipeline launch [TORCHRUN OPTIONS] COMMAND ...") \
        and "--nproc-per-node" in r.output
