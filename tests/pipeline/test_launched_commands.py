"""Every CLI command started on several ranks (`pipeline launch`, torchrun, accelerate: WORLD_SIZE > 1) does
what `pipeline.launched` says: splits its work, runs on rank 0 alone while the others wait, reads and prints on
rank 0 alone while the others exit quietly, or is refused on every rank with one line. `pipeline launch ... run resize-bucket` ran a whole resize on every rank into the same
store (one rank then stopped on the other's write lock, or rendered everything a second time)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_resize_bucket_under_a_launcher_runs_on_rank_0_while_rank_1_waits(tmp_path):
    from pipeline.demo_data import make_demo_data
    from store import Store

    make_demo_data(tmp_path / "data", n=8, fmt="folder", max_controls=2, seed=1)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    log = tmp_path / "launch.log"
    with open(log, "w") as out:  # a file, not a pipe nobody reads while waiting (a full pipe blocks the ranks)
        # --standalone: a free port (torchrun's default 29500 may be another test's on a shared machine)
        code = subprocess.run(
            [sys.executable, "-m", "pipeline.cli", "launch", "--standalone", "--nproc-per-node", "2", "run",
             "resize-bucket", "--source", str(tmp_path / "data"), "--store", str(tmp_path / "store"),
             "--target-area", "4096", "--control-vae-area", "4096", "--workers", "0"],
            env=env, stdout=out, stderr=subprocess.STDOUT, timeout=600).returncode
    text = log.read_text()
    assert code == 0, text[-4000:]  # both ranks exited 0 (torchrun ends 1 when any rank does not)
    assert Store(tmp_path / "store").versions("images") == [1], text[-4000:]
    # rendered once, by one rank: one summary, and no rank that found the table already written or locked
    assert text.count("images v1: 8 samples written") == 1, text[-4000:]
    assert "is up to date" not in text and "is being written by pid" not in text, text[-4000:]
    assert "rank 1: resize-bucket ran on rank 0 alone; this rank waited for it" in text, text[-4000:]


# refused on every rank before any work: the arguments each needs to get past its parser
REFUSED = {
    "store verify": ["store", "verify", "{tmp}/store"],
    "store gc": ["store", "gc", "{tmp}/store"],
    "store repair": ["store", "repair", "{tmp}/store"],
    "store push": ["store", "push", "{tmp}/store", "s3://bucket/store"],
    "store pull": ["store", "pull", "s3://bucket/store", "{tmp}/store"],
    "migrate v1-to-v2": ["migrate", "v1-to-v2", "{tmp}/store"],
    "predict": ["predict", "--model", "{tmp}/model", "--image", "{tmp}/a.png", "--prompt", "p", "--out", "{tmp}/o.png"],
    "lora merge": ["lora", "merge", "--model", "{tmp}/model", "--lora", "{tmp}/lora", "--out", "{tmp}/merged"],
    "lora export": ["lora", "export", "{tmp}/lora", "--out", "{tmp}/lora.safetensors"],
    "make-tiny-model": ["make-tiny-model", "{tmp}/model"],
    "make-demo-data": ["make-demo-data", "{tmp}/data"],
    "compare": ["compare", "{tmp}/a", "{tmp}/b", "--out", "{tmp}/compare"],
    "demo": ["demo", "--workdir", "{tmp}/demo"],
}


def _command_paths(group, prefix: str = "") -> set[str]:
    found = set()
    for name, cmd in group.commands.items():  # typer's groups (its own click) hold `commands`
        path = f"{prefix}{name}"
        found |= _command_paths(cmd, f"{path} ") if hasattr(cmd, "commands") else {path}
    return found


def test_every_command_has_its_behaviour_under_a_launcher_decided():
    import typer

    from pipeline.cli import app
    from pipeline.launched import ONE_PROCESS, UNDER_A_LAUNCHER

    assert _command_paths(typer.main.get_command(app)) == set(UNDER_A_LAUNCHER)
    assert {c for c, b in UNDER_A_LAUNCHER.items() if b == ONE_PROCESS} == set(REFUSED)  # each tested below


def test_launch_and_the_commands_refusal_read_one_table(monkeypatch):
    """`pipeline launch` and a command's own refusal (`one_process`) both read UNDER_A_LAUNCHER: a command moved
    out of ONE_PROCESS is started by `pipeline launch`, and its left-over refusal is an error in any process."""
    import typer

    import pipeline.launched as launched
    from pipeline.cli import app

    root = typer.main.get_command(app)
    assert launched.refused_launch(["predict"], root) is not None
    launched.one_process("predict")  # one process: goes on
    monkeypatch.setitem(launched.UNDER_A_LAUNCHER, "predict", launched.SHARES)
    assert launched.refused_launch(["predict"], root) is None
    with pytest.raises(AssertionError, match="UNDER_A_LAUNCHER"):
        launched.one_process("predict")


@pytest.mark.parametrize("command", sorted(REFUSED) + ["launch"])
def test_pipeline_launch_refuses_a_command_that_runs_in_one_process_in_one_line(command, tmp_path, monkeypatch):
    """`pipeline launch ... store gc S` started every rank, each refused with the same line, then the launcher
    said they failed: N + 1 lines and exit 1 for a usage mistake. Now one line before any rank starts, exit 2."""
    import torch.distributed.run
    from typer.testing import CliRunner

    from pipeline.cli import app

    monkeypatch.setattr(torch.distributed.run, "run", lambda args: pytest.fail("torchrun started the ranks"))
    monkeypatch.chdir(tmp_path)
    words = REFUSED.get(command, ["launch", "--nproc-per-node", "2", "run", "train"])
    r = CliRunner().invoke(app, ["launch", "--nproc-per-node", "2", *[a.format(tmp=tmp_path) for a in words]])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and lines == [f"error: `pipeline {command}` runs in one process (it shares no work "
                                          "between ranks): run it without `pipeline launch`"], r.output
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())


@pytest.mark.parametrize("command", sorted(REFUSED))
def test_a_command_that_runs_in_one_process_is_refused_on_every_rank(command, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from pipeline.cli import app

    monkeypatch.chdir(tmp_path)  # anything written to a default path would show up here
    for rank in ("0", "1"):  # every rank refuses alike: none waits for another
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", rank)
        r = CliRunner().invoke(app, [a.format(tmp=tmp_path) for a in REFUSED[command]])
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert r.exit_code == 1 and len(lines) == 1, r.output
        assert lines[0].startswith(f"error: `pipeline {command}` runs in one process") and "launched as 2" in lines[0]
        assert "without the launcher" in lines[0], lines[0]
        assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())  # before any work: nothing written


def test_evaluate_of_one_lora_is_refused_on_every_rank_before_a_store_url_is_pulled(tmp_path, monkeypatch):
    """`run evaluate` of one LoRA was refused by its stage, after the command had pulled the store URL's tables
    into the cache on every rank (a whole `vae` table per rank). Now the command refuses first."""
    from typer.testing import CliRunner

    import store.remote_cache
    from pipeline.cli import app

    pulled = []
    monkeypatch.setattr(store.remote_cache, "local_store", lambda *a, **k: pulled.append(a) or str(tmp_path / "x"))
    monkeypatch.chdir(tmp_path)
    for rank in ("0", "1"):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", rank)
        r = CliRunner().invoke(app, ["run", "evaluate", "--store", "s3://bucket/store", "--cache-dir",
                                     str(tmp_path / "cache"), "--model", str(tmp_path / "model"), "--lora",
                                     str(tmp_path / "lora"), "--out", str(tmp_path / "report")])
        assert pulled == [], pulled  # refused before the store URL's tables were pulled into the cache
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert r.exit_code == 1 and len(lines) == 1, r.output
        assert lines[0].startswith("error: `pipeline run evaluate` runs in one process") and "launched as 2" in lines[0]
        assert "only --all-checkpoints" in lines[0], lines[0]
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())  # nothing written: no cache, no report folder


def test_store_inspect_of_a_url_under_a_launcher_is_fetched_and_printed_by_rank_0_alone(tmp_path, monkeypatch):
    """Before, every rank fetched the store URL's metadata (its manifests: tens of MB each at a million samples)
    and printed the same report."""
    from typer.testing import CliRunner

    import store.remote_view
    from pipeline.cli import app
    from store import Store
    from store.remote_push import push

    url = f"file://{tmp_path / 'remote'}"
    push(Store(tmp_path / "store").root, url)
    fetched, real = [], store.remote_view.metadata_copy
    monkeypatch.setattr(store.remote_view, "metadata_copy", lambda u, *a, **k: fetched.append(u) or real(u, *a, **k))
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        r = CliRunner().invoke(app, ["store", "inspect", url])
        assert r.exit_code == 0, r.output
        if rank == "1":
            assert r.output == "" and fetched == [], r.output  # quiet, and nothing fetched
    assert fetched == [url] and f"store {url}" in r.stdout, r.output
