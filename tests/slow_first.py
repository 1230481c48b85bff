"""The suite's longest files first (tests/conftest.py takes these hooks): with `--dist loadfile` a long file left
for the end (tests/store/ and the root's files are collected last) keeps one worker busy while the other has
nothing left to do.

The workers collect in this order, but xdist's loadfile scheduler re-sorts the files by their number of tests
before handing them out (`--loadscope-reorder`, on by default: xdist/scheduler/loadscope.py, `schedule`), so the
order was lost under `-n 2 --dist loadfile` (scripts/test.sh): the controller is told to keep it."""

from __future__ import annotations

# The longest files (`--durations`, 2026-12-02: a minute or more each on the project's 2-core machine), longest
# first. 2026-12-03: the 2.1 rehearsal moved from test_rehearsal.py to test_tiny_model_21.py (one rehearsal each
# now); test_signals.py's processes start warm (about a third of its time), so it left the list.
SLOW_FILES_FIRST = ("tests/stages/test_remote_multinode.py", "tests/stages/test_evaluate_checkpoints_ranks.py",
                    "tests/stages/test_rank_stale_view.py", "tests/pipeline/test_rehearsal.py",
                    "tests/models/test_tiny_model_21.py", "tests/store/test_remote_maintenance.py",
                    "tests/pipeline/test_launch_cli.py", "tests/models/test_attention_layout.py",
                    "tests/store/test_remote_parts.py", "tests/store/test_remote_lazy.py",
                    "tests/stages/test_predict.py", "tests/store/test_remote_parts_runs.py",
                    "tests/test_gpu_proof_smoke.py", "tests/stages/test_qwen21_stages.py")


def pytest_configure(config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # xdist installed (its controller reads it; workers ignore it)
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items) -> None:
    first = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))  # stable: the rest keep their order
