"""Settings a command reads from files at its start (evaluate's extra prompt images) when one node of a launch
cannot read them: only rank 0 makes images, so only its node's files matter, and the outcome is one decision of
every rank. Before: each rank read them; under `run all` on two nodes, rank 0 stopped alone before resize-bucket
while the other node's rank waited for it, saying nothing, until its collective timeout (a hang); and a node
without the files stopped `evaluate --all-checkpoints` whose rank 0 had them."""

from __future__ import annotations

import json
import os

import numpy as np
import yaml
from PIL import Image

from rank_hook import REPO, launch_with_hook
from test_evaluate_checkpoints import run_and_store  # noqa: F401 (the module fixture)
from test_train_multinode import nodes_ended

# the rank named by NO_EXTRA_RANK (replaced by the rank, quoted) reads extra.png as a node that lacks it would; the
# rank is in the hook's text, not a variable: an environment of per-launch variables alone starts the nodes warm
# (test_train_multinode.start_nodes)
LACKS_EXTRA = """
import os, pathlib
if os.environ.get('RANK') == NO_EXTRA_RANK:
    real = pathlib.Path.read_bytes
    def read_bytes(self):
        if self.name == 'extra.png':
            raise FileNotFoundError(2, 'No such file or directory', str(self))
        return real(self)
    pathlib.Path.read_bytes = read_bytes
"""


def _extra(tmp_path) -> dict:
    Image.fromarray(np.full((32, 32, 3), 90, np.uint8)).save(tmp_path / "extra.png")
    return {"prompt": "make it red", "images": [str(tmp_path / "extra.png")], "height": 32, "width": 32}


def _run_all_config(tmp_path, model: str, name: str = "config.yaml", **paths) -> str:
    from pipeline.demo_data import make_demo_data

    if not (tmp_path / "data").exists():
        make_demo_data(tmp_path / "data", n=6, fmt="folder", max_controls=1, seed=1)
    cfg = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    cfg["paths"] = {"source": str(tmp_path / "data"), "store": str(tmp_path / "store"), "model": model,
                    "run": str(tmp_path / "run"), "report": str(tmp_path / "report"), **paths}
    cfg["evaluate"].update(num_inference_steps=2, extra_prompts=[_extra(tmp_path)])
    (tmp_path / name).write_text(yaml.safe_dump(cfg))
    return str(tmp_path / name)


def _two_nodes(tmp_path, node_env=({}, {}), node_args=([], [])) -> list[tuple[int, str]]:
    """`run all` on two "nodes" (tests/stages/test_train_multinode.py): each node's (exit status, stderr)."""
    return nodes_ended(["run", "all"], node_env, node_args)


def _one_line_each(ended: list[tuple[int, str]], line: str) -> None:
    for node in (1, 0):  # node 1 first: before, it ended in another line (or none: it waited)
        code, err = ended[node]
        assert code == 1, err[-3000:]
        ours = err.split("torch/distributed/elastic/")[0]  # then torchrun's own lines (of its launcher process)
        # the message is this node's own part whole: what came before its error line is the finding
        assert [s for s in ours.splitlines() if s.startswith("error: ")] == [line], ours
        assert "Traceback" not in ours and "frame #" not in ours, ours


def test_run_all_stops_every_node_when_rank_0_cannot_read_an_extra_prompt(tiny_plus_model, tmp_path):
    """Before: rank 0 stopped alone; the other node's rank met the store gone and said, after a C++ stack, that
    a rank was killed without a word."""
    config = _run_all_config(tmp_path, tiny_plus_model)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(LACKS_EXTRA.replace("NO_EXTRA_RANK", "'0'"))
    env = {"PYTHONPATH": os.pathsep.join([str(hook), str(REPO)])}
    ended = _two_nodes(tmp_path, (env, env), (["--config", config], ["--config", config]))
    _one_line_each(ended, f"error: rank 0: cannot read evaluate.extra_prompts[0] image {tmp_path / 'extra.png'}: No "
                          "such file or directory; check the path")
    assert not (tmp_path / "store").exists()  # stopped before resize-bucket


def test_run_all_stops_every_node_when_one_nodes_folder_is_refused(tiny_plus_model, tmp_path):
    """Node 1 sees paths.report as a folder of other files (its own mount there). Before: its rank stopped alone
    and rank 0 ran resize-bucket, then waited for it in the encoder's first collective (a hang)."""
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("someone's")
    config = _run_all_config(tmp_path, tiny_plus_model)
    theirs = _run_all_config(tmp_path, tiny_plus_model, "node1.yaml", report=str(tmp_path / "theirs"))
    ended = _two_nodes(tmp_path, node_args=(["--config", config], ["--config", theirs]))
    _one_line_each(ended, f"error: rank 1: paths.report {tmp_path / 'theirs'} is not empty and holds no earlier "
                          "report (no metrics.json): pass a new or empty folder, or the folder of an earlier report")
    assert all("(exitcode: 2)" in err for _, err in ended)  # each worker's: a usage error (torchrun's own is 1)
    assert not (tmp_path / "store").exists()


def test_run_all_stops_every_node_when_one_node_lacks_the_optimizers_package(tiny_plus_model, tmp_path):
    """Node 1's install lacks prodigyopt (train.optimizer: prodigy). Before: resize-bucket and both encoders ran on
    both nodes, then train's optimizer build refused on node 1, after the model's load. Now every node stops with
    node 1's line before resize-bucket (`orchestrate._check_node`, agreed by every rank)."""
    config = _run_all_config(tmp_path, tiny_plus_model)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text("import os, sys\nif os.environ.get('RANK') == '1':\n"
                                           "    sys.modules['prodigyopt'] = None  # its import raises ImportError\n")
    env = {"PYTHONPATH": os.pathsep.join([str(hook), str(REPO)])}
    args = ["--config", config, "--set", "train.optimizer=prodigy"]
    ended = _two_nodes(tmp_path, (env, env), (args, args))
    _one_line_each(ended, "error: rank 1: train.optimizer 'prodigy' needs the package 'prodigyopt', which is not "
                          "installed (import of prodigyopt halted; None in sys.modules); pip install "
                          "'qwen-edit-lora-pipeline[prodigy]' (or pip install prodigyopt)")
    assert not (tmp_path / "store").exists()  # stopped before resize-bucket


def test_a_node_without_the_extra_prompt_files_does_not_stop_evaluate(run_and_store, tiny_edit_model,  # noqa: F811
                                                                       tmp_path):
    root = run_and_store
    extra = json.dumps([_extra(tmp_path)])
    # rank 0's controls at a 256² view rather than the stock ~1024² (as tests/stages/test_predict.py): its text
    # and VAE encoding took seconds of CPU; which rank makes the images does not depend on their size
    small_controls = "if os.environ.get('RANK') == '0':\n    import models.edit\n    models.edit.VAE_AREA = 256 * 256\n"
    hook = LACKS_EXTRA.replace("NO_EXTRA_RANK", "'1'") + small_controls
    p = launch_with_hook(tmp_path, hook, [
        "run", "evaluate", "--all-checkpoints", "--set", f"paths.run={root / 'run'}", "--store", str(root / "store"),
        "--model", tiny_edit_model, "--out", str(tmp_path / "report"), "--num-samples", "0", "--device", "cpu",
        "--set", "evaluate.noise_seeds=[0]", "--set", "evaluate.timesteps=[0.5]",
        "--set", "evaluate.num_inference_steps=2", "--set", f"evaluate.extra_prompts={extra}"], timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    samples = json.loads((tmp_path / "report" / "metrics.json").read_text())["generation"]["samples"]
    assert [s["caption"] for s in samples] == ["make it red"], samples  # rank 0 made its images


def test_nodes_whose_copies_of_the_config_differ_stop_before_training(tiny_edit_model, tmp_path):
    """Each node reads its own copy of the config at the same path; node 1's says train.checkpoint_every: 2, a
    setting outside train's fingerprint. Its device (a node's own) differs too, and is let through. Before: every
    read check passed and the ranks trained, rank 0 saving a checkpoint (its agreements) at step 1 where rank 1
    went on to step 2: the launch hung (this test's bound). Now every node stops at the start, exit 2, with one
    line naming the rank and the key."""
    from train_store import make_train_store, mixed_specs

    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(8))
    configs = []
    for node, (every, device) in enumerate([(1, "cpu"), (2, "[cpu]")]):
        (tmp_path / f"node{node}").mkdir()
        configs.append(tmp_path / f"node{node}" / "train.yaml")
        configs[node].write_text(f"train: {{checkpoint_every: {every}, device: {device}, lora: {{rank: 4}}}}\n")
    args = ["--store", str(store), "--model", tiny_edit_model, "--out", str(tmp_path / "run"), "--max-steps", "2",
            "--batch-size", "2"]
    ended = nodes_ended(["run", "train"], node_args=([*args, "--config", str(configs[0])],
                                                    [*args, "--config", str(configs[1])]))
    _one_line_each(ended, "error: the ranks do not run with the same settings: rank 1's train.checkpoint_every is "
                   "2, rank 0's 1 (each node reads --config and --set itself, and the nodes' copies of the config or "
                   "their flags differ); use one config and the same flags on every node")
    assert all("(exitcode: 2)" in err for _, err in ended)  # each worker's: a usage error (torchrun's own is 1)
    assert not (tmp_path / "run" / "checkpoints").exists()
