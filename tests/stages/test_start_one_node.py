"""What a launched command reads on its own node before its first agreement (its config file, its folders, its
model, its trackers) when one node of two fails to: every node stops with the same one line naming the rank.
Before: the failing rank stopped alone; a rank on the other node waited for it at the process group's start (a
hang, until the group's timeout), or met its store or connection gone and said a rank was killed without a word.
Each case fails on one node only (node 1's or node 0's own paths, or a hook), and is one 2-node launch."""

from __future__ import annotations

import os

import pytest

from pipeline.config import config_not_found
from rank_hook import REPO
from test_settings_one_node import _one_line_each
from test_train_multinode import nodes_ended

# rank 1 sees wandb installed (it is not here): only rank 0, which makes the trackers, lacks it
WANDB_ON_RANK_1 = """
import os
if os.environ.get('RANK') == '1':
    from accelerate.utils import imports
    imports.is_wandb_available = lambda: True
"""


def _other_files(folder) -> str:
    folder.mkdir()
    (folder / "notes.txt").write_text("someone's")
    return str(folder)


def _missing_model_line(path: str) -> str:
    from models.loading import model_variant
    from schemas.errors import UserError

    with pytest.raises(UserError) as refused:
        model_variant(path)
    return str(refused.value)


def _empty_store(tmp_path) -> str:
    """A store with no table: the start's own checks come after --store's (a folder without store.json is refused
    before them, on every node)."""
    from store import Store

    Store(tmp_path / "store")
    return str(tmp_path / "store")


def _case(name: str, tmp_path, model: str) -> tuple[list[str], tuple[list[str], list[str]], dict, str]:
    """(command, each node's own arguments, node 1's hook or {}, the line every node ends with)."""
    cpu = ["--device", "cpu"]
    if name == "train: node 1's --out holds other files":
        theirs = _other_files(tmp_path / "theirs")
        out = ["--store", _empty_store(tmp_path), "--model", model, *cpu]
        return (["run", "train"], ([*out, "--out", str(tmp_path / "run")], [*out, "--out", theirs]), {},
                f"rank 1: --out {theirs} holds other files (notes.txt) and no training run: train writes lora/, "
                "checkpoints/ and logs/ there; pass a new or empty folder, or the folder of an earlier run")
    if name == "train: node 0 lacks a tracker":
        hook = tmp_path / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(WANDB_ON_RANK_1)
        args = ["--store", _empty_store(tmp_path), "--model", model, "--out", str(tmp_path / "run"), "--new-run",
                "--set", "train.log_with=[wandb]", *cpu]
        return (["run", "train"], (args, args), {"PYTHONPATH": os.pathsep.join([str(hook), str(REPO)])},
                "train.log_with: wandb is not installed; `pip install wandb` or log with tensorboard")
    if name == "encode-text: node 0 lacks the config file":
        (tmp_path / "config.yaml").write_text("encode_text: {batch_size: 1}\n")
        args = ["--store", str(tmp_path / "store"), "--model", model, *cpu]
        return (["run", "encode-text"], ([*args, "--config", str(tmp_path / "absent.yaml")],
                                         [*args, "--config", str(tmp_path / "config.yaml")]), {},
                f"rank 0: {config_not_found(tmp_path / 'absent.yaml')}")
    if name == "encode-text: node 0 lacks the model":
        absent = str(tmp_path / "model")
        args = ["--store", _empty_store(tmp_path), *cpu]
        return (["run", "encode-text"], ([*args, "--model", absent], [*args, "--model", model]), {},
                f"rank 0: {_missing_model_line(absent)}")
    if name == "evaluate --all-checkpoints: node 1 lacks the run folder":
        (tmp_path / "run").mkdir()
        args = ["--store", _empty_store(tmp_path), "--model", model, "--out", str(tmp_path / "report"), *cpu]
        # paths.run: torchrun's own parser takes `--run` after the module for its --run-path
        return (["run", "evaluate", "--all-checkpoints"], ([*args, "--set", f"paths.run={tmp_path / 'run'}"],
                                                          [*args, "--set", f"paths.run={tmp_path / 'absent'}"]), {},
                f"rank 1: run folder {tmp_path / 'absent'} does not exist; pass the folder train wrote (--run or "
                "paths.run)")
    assert name == "resize-bucket: node 0's --store holds other files"
    theirs = _other_files(tmp_path / "theirs")
    args = ["--source", str(tmp_path / "source")]
    return (["run", "resize-bucket"], ([*args, "--store", theirs], [*args, "--store", str(tmp_path / "store")]), {},
            f"rank 0: --store {theirs} holds other files (notes.txt) and no store (no store.json): a new store's "
            "tables would go in among them; pass a new or empty folder, or the folder of an existing store")


@pytest.mark.parametrize("case", [
    "train: node 1's --out holds other files",
    "train: node 0 lacks a tracker",
    "encode-text: node 0 lacks the config file",
    "encode-text: node 0 lacks the model",
    "evaluate --all-checkpoints: node 1 lacks the run folder",
    "resize-bucket: node 0's --store holds other files",
])
def test_a_launched_commands_start_failing_on_one_node_stops_every_node(case, tiny_edit_model, tmp_path):
    command, node_args, hook_env, line = _case(case, tmp_path, tiny_edit_model)
    _one_line_each(nodes_ended(command, (hook_env, hook_env), node_args), f"error: {line}")


# rank 1 meets a bug (no handler makes a line of it) between two agreements of train's start: after the config's,
# before the run folder's
BUG_ON_RANK_1 = """
import os
if os.environ.get('RANK') == '1':
    from stages.train import settings
    def validate_config(cfg):
        raise RuntimeError('a bug between two agreements (test)')
    settings.validate_config = validate_config
"""


def test_a_bug_on_one_node_between_two_agreements_stops_every_node_naming_its_rank(tiny_edit_model, tmp_path):
    """Rank 1 ends in its traceback before any process group exists; rank 0 (the other node) ends at once with
    one line naming rank 1 and its error. Before: nothing was published before the group, and torchrun's agent
    on node 0 watches its own worker only: rank 0 waited at its next agreement for the before-group bound (30
    minutes; here nodes_ended's bound fails the test), then said only that rank 1 did not report."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(BUG_ON_RANK_1)
    env = {"PYTHONPATH": os.pathsep.join([str(hook), str(REPO)])}
    args = ["--store", str(tmp_path / "store"), "--model", tiny_edit_model, "--out", str(tmp_path / "run"),
            "--device", "cpu"]
    (code0, err0), (code1, err1) = nodes_ended(["run", "train", *args], (env, env))
    ours0, ours1 = (err.split("torch/distributed/elastic/")[0] for err in (err0, err1))  # then torchrun's lines
    assert code0 == 1 and [s for s in ours0.splitlines() if s.startswith("error: ")] == [
        "error: rank 1 failed: RuntimeError: a bug between two agreements (test) (its traceback is in that rank's "
        "output)"], err0[-3000:]
    assert "Traceback" not in ours0 and "frame #" not in ours0, err0[-3000:]
    assert code1 == 1 and "RuntimeError: a bug between two agreements (test)" in ours1, err1[-3000:]  # its own
    assert not (tmp_path / "run").exists()


def test_run_all_reads_the_model_on_every_rank_before_its_first_stage(tmp_path):
    """`run all`'s start, agreed by every rank (one process here), reads the model each rank encodes, trains and
    evaluates on: a node without it is refused before resize-bucket. Before: resize-bucket ran, then encode-text
    stopped on that node alone (launched, while the other ranks were in a collective)."""
    import yaml
    from typer.testing import CliRunner

    from pipeline.cli import app

    absent = str(tmp_path / "model")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"paths": {"source": str(tmp_path / "src"), "store": str(tmp_path / "store"),
                                                "model": absent, "run": str(tmp_path / "run"),
                                                "report": str(tmp_path / "report")}}))
    r = CliRunner().invoke(app, ["run", "all", "--config", str(config)])
    assert r.exit_code == 1 and r.output == f"error: {_missing_model_line(absent)}\n", r.output
    assert not (tmp_path / "store").exists()
