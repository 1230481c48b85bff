"""The suite's longest files first (tests/conftest.py takes these hooks): with `--dist loadfile` a long file left
for the end (tests/store/ and the root's files are collected last) keeps one worker busy while the other has
nothing left to do.

The workers collect in this order, but xdist's loadfile scheduler re-sorts the files by their number of tests
before handing them out (`--loadscope-reorder`, on by default: xdist/scheduler/loadscope.py, `schedule`), so the
order was lost under `-n 2 --dist loadfile` (scripts/test.sh): the controller is told to keep it."""

from __future__ import annotations

# The files of a minute or more in a full run's junit report (2026-12-03: `-n 2 --dist loadfile` on the 2-core
# machine under other jobs' load, the suite's CPU time 5070 s), longest first.
SLOW_FILES_FIRST = ("tests/stages/test_remote_multinode.py", "tests/models/test_attention_layout.py",
                    "tests/stages/test_start_one_node.py", "tests/stages/test_settings_one_node.py",
                    "tests/test_gpu_proof_smoke.py", "tests/pipeline/test_rehearsal.py",
                    "tests/pipeline/test_launch_cli.py", "tests/models/test_tiny_model_21.py",
                    "tests/stages/test_evaluate_base_images.py", "tests/stages/test_remote_encode_damaged.py",
                    "tests/stages/test_evaluate_checkpoints_ranks.py", "tests/pipeline/test_run_all_launch.py",
                    "tests/store/test_remote_parts.py", "tests/pipeline/test_cli_startup.py",
                    "tests/store/test_remote_cache_walks.py", "tests/pipeline/test_run_all.py",
                    "tests/store/test_remote_maintenance.py", "tests/stages/test_encode_multinode.py",
                    "tests/store/test_remote_lazy.py", "tests/stages/test_encode_vae.py",
                    "tests/store/test_remote_parts_runs.py", "tests/stages/test_rank_stale_view.py",
                    "tests/stages/test_evaluate_extra_prompts.py", "tests/stages/test_train_throughput.py")


def pytest_configure(config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # xdist installed (its controller reads it; workers ignore it)
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items) -> None:
    first = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))  # stable: the rest keep their order
