"""Run by each of two gloo processes (tests/stages/test_evaluate_checkpoints_ranks.py, not a test module itself):
`pipeline run evaluate --all-checkpoints` where what rank 0 decides alone from the files must stop both ranks.
Exit status and output are the test's.

    rank_evaluate_decisions.py gone STORE MODEL RUN OUT   after the loss passes, every rank's relisting of RUN
                                                         finds no checkpoint (all removed meanwhile, none newer
                                                         written): rank 0 finds none it recorded still on disk
    rank_evaluate_decisions.py report STORE MODEL RUN OUT  rank 0 cannot write the report (after every loss pass,
                                                         its images and report are its own work)
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    from pipeline.cli import main as cli

    what, store, model, run, out = sys.argv[1:6]
    if what == "gone":
        from stages.train import state as train_state

        real, calls = train_state.complete_checkpoints, []

        def listed(root):  # the start's listing as it is; every later one (the relisting) finds none left
            calls.append(root)
            return real(root) if len(calls) == 1 else []

        train_state.complete_checkpoints = listed
    elif what == "report" and os.environ["RANK"] == "0":
        from schemas.errors import UserError
        from stages.evaluate import checkpoint_report

        def cannot(out, *a, **k):
            raise UserError(f"cannot write the report into {out} (injected)")

        checkpoint_report.write_checkpoint_report = cannot
    sys.argv = ["pipeline", "run", "evaluate", "--all-checkpoints", "--set", f"paths.run={run}", "--store", store,
                "--model", model, "--out", out, "--num-samples", "0", "--device", "cpu",
                "--set", "evaluate.noise_seeds=[0]", "--set", "evaluate.timesteps=[0.5]"]
    cli()


if __name__ == "__main__":
    main()
