"""A val sample whose stored latent is NaN (checksum valid, as a faulty encoder writes it): evaluate stops naming
it (exit 1, nothing written), or with `evaluate.on_nonfinite: skip` leaves it out of every mean and names it."""

from __future__ import annotations

import json
import math
import shutil

import pytest
from typer.testing import CliRunner

from models.loading import load_component
from models.lora import add_lora, save_lora
from pipeline.cli import app
from schemas.config import LoraConfig
from train_store import key_of, make_train_store, mixed_specs


@pytest.fixture(scope="module")
def poisoned(tiny_edit_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("nonfinite")
    make_train_store(root / "store", tiny_edit_model, mixed_specs(2, 3), poison={3: float("nan")})
    transformer = load_component(tiny_edit_model, "transformer")
    add_lora(transformer, LoraConfig(rank=4))
    save_lora(transformer, root / "lora")
    return root


def _evaluate(root, model, out, *sets):
    args = ["run", "evaluate", "--store", root / "store", "--model", model, "--lora", root / "lora", "--out", out,
            "--set", "evaluate.device=cpu", "--set", "evaluate.num_samples=0", "--set", "evaluate.noise_seeds=[0]",
            "--set", "evaluate.timesteps=[0.5]"]
    for s in sets:
        args += ["--set", s]
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.output
    return result


def test_nonfinite_val_loss_stops_naming_the_sample(poisoned, tiny_edit_model, tmp_path):
    r = _evaluate(poisoned, tiny_edit_model, tmp_path / "report")
    assert r.exit_code == 1, r.output
    assert key_of(3) in r.output and "evaluate.on_nonfinite=skip" in r.output and "base" in r.output
    assert not (tmp_path / "report" / "metrics.json").exists()


def test_skip_leaves_the_sample_out_of_every_mean(poisoned, tiny_edit_model, tmp_path):
    r = _evaluate(poisoned, tiny_edit_model, tmp_path / "report", "evaluate.on_nonfinite=skip")
    assert r.exit_code == 0, r.output
    assert "left out 1 val sample(s) with a non-finite loss" in r.output and "nan" not in r.output.lower()
    loss = json.loads((tmp_path / "report" / "metrics.json").read_text())["loss"]
    assert loss["nonfinite_samples"] == [key_of(3)] and loss["overall"]["n"] == 2
    assert math.isfinite(loss["overall"]["base"]) and math.isfinite(loss["overall"]["lora"])
    assert key_of(3) not in loss["per_sample"]
    # the same command again: up to date, its numbers said again (before: evaluated again from scratch)
    r = _evaluate(poisoned, tiny_edit_model, tmp_path / "report", "evaluate.on_nonfinite=skip")
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"report {tmp_path / 'report'} is up to date; held-out loss on 2 val samples"), r.output
    assert "left out 1 val sample(s) with a non-finite loss" in r.output


def test_a_report_interrupted_before_metrics_json_is_written_over(poisoned, tiny_edit_model, tmp_path):
    """A full disk (or a kill) while evaluate wrote its report leaves grid.png / index.html / a temp file but no
    metrics.json (written last): the rerun completes it; a folder holding anything else is still refused."""
    out = tmp_path / "report"
    out.mkdir()
    (out / "grid.png").write_bytes(b"half")
    (out / ".index.html.tmp-4242").write_bytes(b"<ht")
    r = _evaluate(poisoned, tiny_edit_model, out, "evaluate.on_nonfinite=skip")
    assert r.exit_code == 0, r.output
    assert (out / "metrics.json").is_file()
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    r = _evaluate(poisoned, tiny_edit_model, other, "evaluate.on_nonfinite=skip")
    assert r.exit_code == 2 and "not empty" in r.output and (other / "notes.txt").read_text() == "mine"


def test_a_full_disk_without_a_file_name_names_the_commands_output(tmp_path, capsys):
    import errno

    import typer

    from pipeline.commands.common import user_errors

    out = tmp_path / "run"
    with pytest.raises(typer.Exit), user_errors(out):
        raise OSError(errno.ENOSPC, "No space left on device")  # a write() reports no file name
    err = capsys.readouterr().err
    assert f"disk full while writing output in {out}" in err and " in . (" not in err


def test_all_checkpoints_stop_on_bad_features_or_leave_them_out(poisoned, tiny_edit_model, tmp_path):
    """`--all-checkpoints` applies the same rule to the base's losses: NaN features stop naming the sample (before
    this, every mean became NaN and the run ended with 'no checkpoint has a finite held-out loss')."""
    from schemas.config import EvaluateConfig
    from schemas.errors import UserError
    from stages.evaluate import checkpoints as ev

    ckpt = tmp_path / "run" / "checkpoints" / "step-1"
    ckpt.mkdir(parents=True)
    shutil.copytree(poisoned / "lora", ckpt / "lora")
    (ckpt / "resume.json").write_text("{}")
    cfg = dict(noise_seeds=[0], timesteps=[0.5], num_samples=0, device="cpu")
    with pytest.raises(UserError, match=key_of(3)):
        ev.run(EvaluateConfig(**cfg), poisoned / "store", tiny_edit_model, [(1, ckpt / "lora")], tmp_path / "stop")
    res = ev.run(EvaluateConfig(**cfg, on_nonfinite="skip"), poisoned / "store", tiny_edit_model,
                 [(1, ckpt / "lora")], tmp_path / "skip")
    loss = res.metrics["loss"]
    assert loss["nonfinite_samples"] == [key_of(3)] and loss["overall"]["n"] == 2
    assert math.isfinite(loss["overall"]["base"]) and math.isfinite(loss["overall"]["lora"])
    assert res.best["step"] == 1 and math.isfinite(res.best["loss"])


def test_all_checkpoints_stops_on_bad_features_before_evaluating_any_checkpoint(poisoned, tiny_edit_model, tmp_path):
    """The base's losses say the stored features are bad (NaN with no LoRA at all): --all-checkpoints stops right
    after the base pass, naming the sample. Before, it evaluated every checkpoint first (hours on a big run) and
    then stopped with the same line, on every rerun too."""
    import xarray as xr

    from schemas.config import EvaluateConfig
    from schemas.errors import UserError
    from stages.evaluate import checkpoints as ev
    from store.loss_array import GROUP
    from test_evaluate_checkpoints import _write_lora

    transformer = load_component(tiny_edit_model, "transformer")
    add_lora(transformer, LoraConfig(rank=4))
    ckpts = []
    for step in (10, 20):
        _write_lora(transformer, tmp_path / "run" / f"step-{step}", 0.1)
        ckpts.append((step, tmp_path / "run" / f"step-{step}" / "lora"))
    cfg = EvaluateConfig(device="cpu", num_samples=0, noise_seeds=[0], timesteps=[0.5])
    for _ in range(2):  # the rerun (the base already recorded) stops as early
        with pytest.raises(UserError, match=key_of(3)) as e:
            ev.run(cfg, poisoned / "store", tiny_edit_model, ckpts, tmp_path / "report")
        assert "base" in str(e.value) and "\n" not in str(e.value)
        assert xr.open_zarr(tmp_path / "report" / GROUP).sizes["step"] == 0  # no checkpoint was evaluated


def test_single_lora_stops_on_bad_features_before_the_lora_pass(poisoned, tiny_edit_model, tmp_path, monkeypatch):
    """A NaN in the base's held-out losses means bad stored features, whatever the LoRA does: single-LoRA
    evaluate stops right after the base pass, as --all-checkpoints does. Before, it ran the LoRA pass too (as
    long as the base pass) and then stopped with the same line."""
    from schemas.config import EvaluateConfig
    from schemas.errors import UserError
    from stages.evaluate import loss_section, stage

    real, passes = loss_section.loss_grid, []

    def loss_grid(*a, **k):
        passes.append(k.get("desc"))
        return real(*a, **k)

    monkeypatch.setattr(loss_section, "loss_grid", loss_grid)
    cfg = EvaluateConfig(device="cpu", num_samples=0, noise_seeds=[0], timesteps=[0.5])
    with pytest.raises(UserError, match=key_of(3)) as e:
        stage.run(cfg, poisoned / "store", tiny_edit_model, poisoned / "lora", tmp_path / "report")
    assert "base" in str(e.value) and "\n" not in str(e.value)
    assert passes == ["held-out loss (base)"]
