"""`pipeline run all`: every stage in order on a tiny model and synthetic data with masks; killed during
training (SIGKILL of the whole process group) and rerun, it resumes train from its last checkpoint and skips
the finished stages; a third run skips everything. The report's held-out loss is checked for consistency
(buckets, inside/outside the edit mask) and training lowers it."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import yaml
from typer.testing import CliRunner

from pipeline.cli import app
import warm_start

STAGES = ["resize-bucket", "encode-text", "encode-vae", "train", "evaluate"]


def _config(tmp: Path, model: str) -> Path:
    cfg = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "demo.yaml").read_text())
    cfg["paths"] = {"source": str(tmp / "data"), "store": str(tmp / "store"), "model": model,
                    "run": str(tmp / "run"), "report": str(tmp / "report")}
    # split by key: these demo sources were chosen for what the key hash puts in 'val' (the pictures rule's own
    # check: tests/pipeline/test_val_split_pictures.py)
    cfg["resize"].update(target_area=64 * 64, control_vae_area=64 * 64, val_fraction=0.3, split_by="key")
    cfg["train"].update(max_steps=24, checkpoint_every=2, keep_checkpoints=2, batch_size=2)
    cfg["evaluate"].update(num_samples=2, num_inference_steps=2, noise_seeds=[0], timesteps=[0.3, 0.7])
    # an extra prompt from files (goes through predict's stock-equivalent path, text encoder included)
    cfg["evaluate"]["extra_prompts"] = [{"prompt": "mirror the scene", "images": [str(tmp / "data/target/sample_0000.png")],
                                         "target": str(tmp / "data/target/sample_0001.png"), "height": 64, "width": 64}]
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _first_checkpoint(run: Path) -> bool:
    ckpts = run / "checkpoints"
    return ckpts.is_dir() and any((p / "resume.json").is_file() for p in ckpts.glob("step-*"))


def _run_cli(config: Path) -> str:
    result = CliRunner().invoke(app, ["run", "all", "--config", str(config)])
    assert result.exit_code == 0, result.output
    return result.output


def _run_all_killed_at_its_first_checkpoint(config: Path, run: Path) -> None:
    """`run all` in a process of its own, in a session of its own, started warm (tests/warm_start.py: its
    third-party imports done already; the project's modules it imports itself), SIGKILLed with its whole process
    group as soon as train has committed a checkpoint."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = warm_start.WarmProcess([sys.executable, "-m", "pipeline.cli", "run", "all", "--config", str(config)],
                                  env=env, start_new_session=True)
    deadline = time.monotonic() + 240
    while not _first_checkpoint(run) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    code = proc.wait(60)
    assert code == -signal.SIGKILL, f"run all ended (exit {code}) before the kill:\n{''.join(proc.output())[-3000:]}"


def _assert_held_out_losses_add_up(loss: dict, val_samples: int) -> None:
    """The report's held-out loss: buckets and samples sum to the overall figure, and per sample the loss inside
    and outside the edit mask combine to the whole: N·overall = M·inside + (N − M)·outside (per-sample
    normalisation)."""
    overall, per_sample = loss["overall"], loss["per_sample"]
    assert overall["lora"] < overall["base"]  # 24 steps on the train split lower the held-out loss
    assert sum(b["n"] for b in loss["per_bucket"].values()) == overall["n"] == val_samples
    for m in ("base", "lora"):
        assert math.isclose(overall[m], sum(v[m] for v in per_sample.values()) / len(per_sample), rel_tol=1e-9)
    mask = loss["mask"]
    assert mask["inside"]["n"] >= 1 and mask["per_sample"]
    for key, region in mask["per_sample"].items():
        n, m_ = region["tokens"], region["mask_tokens"]
        for m in ("base", "lora"):
            combined = m_ * region["inside"][m] + (n - m_) * region["outside"][m]
            assert math.isclose(n * per_sample[key][m], combined, rel_tol=1e-4), (key, m)


def _assert_a_base_loss_is_the_trainers_alone(store: Path, model: str, loss: dict) -> None:
    """The base loss of one sample, recomputed alone (batch of 1) with the trainer's flow_loss and the fixed
    noise, is the report's."""
    import torch

    from models.flow import flow_loss
    from models.loading import load_component
    from models.multires import install_multires
    from models.randomness import eval_noise
    from features.open import open_configured
    from models.loading import model_files
    from schemas.config import EvaluateConfig
    from stages.train.data import load

    per_sample = loss["per_sample"]
    key = sorted(per_sample)[0]
    sample = load(open_configured(EvaluateConfig(), "evaluate", store, model, model_files(model), "val"), key)
    transformer = load_component(model, "transformer")
    install_multires(transformer)
    with torch.no_grad():
        alone = [float(flow_loss(transformer, [sample], torch.tensor([t]), [eval_noise(sample, seed)])[0])
                 for seed in loss["noise_seeds"] for t in loss["timesteps"]]
    assert math.isclose(per_sample[key]["base"], sum(alone) / len(alone), rel_tol=1e-5)


def _assert_every_stage_up_to_date(config: Path) -> None:
    """A run with nothing left to do says so for every stage, in text and as JSON (one object per stage on
    stdout, nothing else there)."""
    out = _run_cli(config)
    assert out.count("skipped, up to date") == len(STAGES), out
    result = CliRunner().invoke(app, ["run", "all", "--config", str(config), "--json"])
    assert result.exit_code == 0, result.output
    records = json.loads(result.stdout)
    assert [r["stage"] for r in records] == STAGES and all(r["up_to_date"] and r["encoded"] == 0 for r in records)
    assert [r["table"] for r in records[:3]] == ["images", "text", "vae"]


def test_run_all_resumes_after_kill_and_skips_when_up_to_date(tiny_plus_model, tmp_path, monkeypatch):
    import models.edit
    from pipeline.demo_data import make_demo_data

    # the extra prompt's control at a 256² VAE view rather than the stock ~1024² (as tests/stages/test_predict.py):
    # its ~4k control tokens went through every denoising step of its base and LoRA images, and nothing checked
    # here depends on the view's size (the killed first run stops before evaluate; the reruns are in-process)
    monkeypatch.setattr(models.edit, "VAE_AREA", 256 * 256)
    make_demo_data(tmp_path / "data", n=12, fmt="folder", max_controls=2, seed=1, with_masks=True)
    config = _config(tmp_path, tiny_plus_model)

    # 1) a run killed as soon as train has committed a checkpoint: no LoRA, no report
    _run_all_killed_at_its_first_checkpoint(config, tmp_path / "run")
    assert not (tmp_path / "run" / "lora").exists() and not (tmp_path / "report").exists()

    # 2) rerun: finished stages are up to date, train resumes from its checkpoint, evaluate writes the report
    out = _run_cli(config)
    for stage in ("resize-bucket", "encode-text", "encode-vae"):
        section = out.split(f"== {stage}")[1].split("==")[0]
        assert "skipped, up to date" in section, out
    assert "trained resumed at step" in out and "to step 24" in out, out
    report = tmp_path / "report"
    assert {p.name for p in report.iterdir()} >= {"index.html", "grid.png", "metrics.json"}
    metrics = json.loads((report / "metrics.json").read_text())
    _assert_held_out_losses_add_up(metrics["loss"], metrics["run"]["val_samples"])
    _assert_a_base_loss_is_the_trainers_alone(tmp_path / "store", tiny_plus_model, metrics["loss"])
    titles = [s["title"] for s in metrics["generation"]["samples"]]
    assert len(titles) == 3 and titles[-1] == "extra 1", titles
    assert all(math.isfinite(s["psnr_lora"]) for s in metrics["generation"]["samples"])

    # 3) nothing left to do
    _assert_every_stage_up_to_date(config)


def test_shipped_configs_validate():
    """configs/*.yaml load with the typed config (unknown keys or wrong types would be rejected)."""
    from pipeline.config import load_config

    configs = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
    assert len(configs) >= 2
    for path in configs:
        cfg = load_config(path)
        assert all(getattr(cfg.paths, k) for k in ("source", "store", "model", "run", "report")), path


def _lora_bytes(run: Path) -> bytes:
    return (run / "lora" / "pytorch_lora_weights.safetensors").read_bytes()


def _add_samples(tmp_path: Path, stems: list[str]) -> None:
    """Copy the files of these demo samples from tmp_path/all into the source folder tmp_path/data."""
    import shutil

    for f in (tmp_path / "all").rglob("*"):
        if f.is_file() and f.name.split(".")[0] in stems:
            to = tmp_path / "data" / f.relative_to(tmp_path / "all")
            to.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, to)


def _small_run_config(tmp_path: Path, model: str) -> Path:
    """The demo config over tmp_path/data: 2 training steps of batch 4 (the whole train split), a 1-sample
    evaluate."""
    cfg = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "demo.yaml").read_text())
    cfg["paths"] = {"source": str(tmp_path / "data"), "store": str(tmp_path / "store"), "model": model,
                    "run": str(tmp_path / "run"), "report": str(tmp_path / "report")}
    cfg["resize"].update(target_area=64 * 64, control_vae_area=64 * 64, val_fraction=0.2, split_by="key")
    cfg["train"].update(max_steps=2, checkpoint_every=2, batch_size=4)  # 8 draws: the whole train split
    cfg["evaluate"].update(num_samples=1, num_inference_steps=2, noise_seeds=[0], timesteps=[0.5])
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return config


def _keeps_killed_before_and_after_their_rename(train: list[str]) -> None:
    """`run train ... --new-run` SIGKILLed before, then after, the rename that keeps the previous run."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    args = [sys.executable, "-m", "pipeline.cli", *train, "--new-run"]
    for point in ("keep_before_rename", "keep_after_rename"):
        killed = warm_start.run(args, env={**env, "STORE_CRASH_AT": point})
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]


def _run_all_json(config: Path) -> tuple[list[dict], str]:
    """`run all --json`, which must succeed: (its records, its stderr)."""
    result = CliRunner().invoke(app, ["run", "all", "--config", str(config), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), result.stderr


def _assert_kept_with_its_report(tmp_path: Path, kept: Path, messages: str, old_lora: bytes, old_metrics: str) -> None:
    """The previous run (its LoRA, checkpoints and report) kept in RUN.previous/1-*, where the one line (with its
    reason) says; evaluate says its report went with it."""
    run, report = tmp_path / "run", tmp_path / "report"
    assert kept.parent == tmp_path / "run.previous" and kept.name.startswith("1-")
    assert f"kept the previous run of {run}" in messages and str(kept) in messages, messages
    assert "store tables" in messages.split(str(kept))[1].splitlines()[0]  # says why, on the same line
    assert _lora_bytes(kept) == old_lora and (kept / "checkpoints" / "step-2" / "resume.json").is_file()
    assert (kept / "evaluate-report" / "metrics.json").read_text() == old_metrics  # its own report, kept with it
    # evaluate says why it evaluates afresh: the report it replaces went with the kept run
    assert f"the report in {report} was the previous run's, kept with that run in {kept / 'evaluate-report'}" in (
        " ".join(messages.split())), messages


def test_run_all_after_adding_a_sample_keeps_the_old_run_and_trains_afresh(tiny_plus_model, tmp_path):
    """Adding a photo and rerunning `run all`: only it is encoded, the old run (LoRA, checkpoints, its report) is
    kept where the one line says, a new LoRA is trained and evaluated. `run train --resume` alone refuses and
    names --new-run; a keep killed before or after its rename loses nothing."""
    from pipeline.demo_data import make_demo_data

    make_demo_data(tmp_path / "all", n=10, fmt="folder", max_controls=1, seed=2)
    stems = sorted(p.stem for p in (tmp_path / "all" / "target").glob("*.png"))
    _add_samples(tmp_path, stems[:7])
    run, report, store = tmp_path / "run", tmp_path / "report", tmp_path / "store"
    config = _small_run_config(tmp_path, tiny_plus_model)

    first, _ = _run_all_json(config)
    assert first[3]["kept_previous"] is None and first[3]["steps"] == 2
    old_lora, old_metrics = _lora_bytes(run), (report / "metrics.json").read_text()

    # two more photos (the split is drawn from each key's hash: one of them lands in train here): encoded alone;
    # the old run is kept, a new one trained and evaluated
    _add_samples(tmp_path, stems[7:9])
    records, messages = _run_all_json(config)
    by = {r["stage"]: r for r in records}
    assert [(by[s]["encoded"], by[s]["reused"]) for s in ("encode-text", "encode-vae")] == [(2, 7), (2, 7)]
    assert by["train"]["data"]["joined"] > first[3]["data"]["joined"]  # the train split grew
    kept = Path(by["train"]["kept_previous"])
    _assert_kept_with_its_report(tmp_path, kept, messages, old_lora, old_metrics)
    assert by["train"]["start_step"] == 0 and by["train"]["steps"] == 2 and not by["evaluate"]["up_to_date"]
    assert _lora_bytes(run) != old_lora
    metrics = json.loads((report / "metrics.json").read_text())
    assert metrics != json.loads(old_metrics)
    assert "ok:" in CliRunner().invoke(app, ["store", "verify", str(store)]).stdout
    # up to date now: nothing kept, nothing trained
    again, _ = _run_all_json(config)
    assert all(r["up_to_date"] for r in again) and again[3]["kept_previous"] is None

    # another photo, encoded; `run train --resume` on its own refuses and names the flag
    _add_samples(tmp_path, stems[9:10])
    for stage in ("resize-bucket", "encode-text", "encode-vae"):
        assert CliRunner().invoke(app, ["run", stage, "--config", str(config)]).exit_code == 0
    train = ["run", "train", "--config", str(config), "--resume"]
    refused = CliRunner().invoke(app, train)
    assert refused.exit_code == 1 and "--new-run" in refused.output and "store tables" in refused.output
    second_lora = _lora_bytes(run)

    # a keep killed before / after its rename: the run is in one piece, in RUN or in RUN.previous/2-*
    _keeps_killed_before_and_after_their_rename(train)
    assert not run.exists()
    kept2 = [p for p in (tmp_path / "run.previous").iterdir() if p.name.startswith("2-")]
    assert len(kept2) == 1 and _lora_bytes(kept2[0]) == second_lora and _lora_bytes(kept) == old_lora
    out = CliRunner().invoke(app, [*train[:-1], "--new-run", "--json"])  # RUN is gone: a fresh run, nothing kept
    assert out.exit_code == 0, out.output
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    assert rec["kept_previous"] is None and rec["steps"] == 2 and (run / "lora").is_dir()
    # evaluate over the fresh run says why the report there is evaluated again: it is of the run kept in 2-*
    out = CliRunner().invoke(app, ["run", "evaluate", "--all-checkpoints", "--config", str(config)])
    assert out.exit_code == 0, out.output
    assert f"is not this run's (it is the report of the run kept in {kept2[0]};" in " ".join(out.output.split()), (
        out.output)


def test_run_all_with_no_val_split_is_refused_before_any_stage(tmp_path):
    """resize.val_fraction: 0 leaves evaluate (the last stage) no val sample: before, `run all` resized, encoded
    and trained, then failed at evaluate ('the val split is empty ... add training samples'). Now a usage
    mistake naming the setting, before anything is read or written."""
    config = _config(tmp_path, str(tmp_path / "no-model"))
    cfg = yaml.safe_load(config.read_text())
    cfg["resize"]["val_fraction"] = 0.0
    config.write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(app, ["run", "all", "--config", str(config)])
    assert result.exit_code == 2, result.output
    assert "resize.val_fraction: 0" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "store").exists() and not (tmp_path / "run").exists()


def test_run_all_with_a_val_split_left_empty_stops_before_train(tiny_plus_model, tmp_path):
    """A source of 4 samples whose key hashes all lie above resize.val_fraction 0.2: the hash split puts none in
    'val'. Before, `run all` encoded and trained, then failed at evaluate ('the val split is empty'); now it
    stops right after resize-bucket with one line (0 of 4, why, what to do), before the encoders and train."""
    from pipeline.demo_data import make_demo_data

    make_demo_data(tmp_path / "data", n=4, fmt="folder", max_controls=1, seed=3)  # keys' hash fractions >= 0.27
    config = _config(tmp_path, tiny_plus_model)
    cfg = yaml.safe_load(config.read_text())
    cfg["resize"]["val_fraction"] = 0.2
    cfg["evaluate"]["extra_prompts"] = []
    config.write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(app, ["run", "all", "--config", str(config)])
    assert not (tmp_path / "run").exists() and not (tmp_path / "report").exists(), result.output[-2000:]
    assert result.exit_code == 1, result.output
    line = next(ln for ln in result.output.splitlines() if "stopped before training" in ln)
    assert "0 of 4 samples went to the 'val' split" in line and "resize.val_fraction 0.2" in line, line
    assert "raise resize.val_fraction or add samples" in line and "`pipeline run train`" in line, line
    assert "Traceback" not in result.output and "== encode-text" not in result.output, result.output
    from store import Store

    assert set(Store(tmp_path / "store").tables()) == {"images"}  # stopped before the encoders


def _run_all_stopped(tmp_path: Path, model: str, n: int, settings: dict[str, dict]) -> tuple[str, str]:
    """`run all` on `n` demo samples (seed 3, 0..2 controls, val_fraction 0.3) with `settings` merged into the
    config's sections; it must stop before training: (its stopping line, the whole output)."""
    from pipeline.demo_data import make_demo_data

    make_demo_data(tmp_path / "data", n=n, fmt="folder", max_controls=2, seed=3)
    config = _config(tmp_path, model)
    cfg = yaml.safe_load(config.read_text())
    cfg["evaluate"]["extra_prompts"] = []
    for section, values in settings.items():
        cfg[section].update(values)
    config.write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(app, ["run", "all", "--config", str(config)])
    assert not (tmp_path / "run").exists() and not (tmp_path / "report").exists(), result.output[-2000:]
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and "== train" not in result.output, result.output
    assert "keys only in one side dropped" not in result.output, result.output  # the check's join says nothing
    return next(ln for ln in result.output.splitlines() if "stopped before training" in ln), result.output


def _tables(store: Path) -> set[str]:
    from store import Store

    return set(Store(store).tables())


def test_run_all_whose_val_samples_encode_text_all_quarantines_stops_before_encode_vae(tiny_edit_model, tmp_path):
    """The edit model takes exactly one control: of these 5 samples the hash split (val_fraction 0.3) puts two in
    'val', one with 2 controls, one with none, and encode-text quarantines both. Before, `run all` trained and
    failed at evaluate (later: stopped after encode-vae, whose VAE pass is hours at 1M samples); now it stops right
    after encode-text, naming its reasons, with encode-vae not run."""
    line, output = _run_all_stopped(tmp_path, tiny_edit_model, 5, {})
    assert "2 of 5 samples went to the 'val' split" in line and "encode-text left out all 2" in line, line
    assert "(none is in the text table)" in line, line
    assert "encode-text: edit model needs exactly one control image 2" in line and "quarantine.parquet" in line, line
    assert line.endswith("or train without evaluating: `pipeline run encode-vae`, `pipeline run train`"), line
    assert "== encode-text" in output and "== encode-vae" not in output, output
    assert _tables(tmp_path / "store") == {"images", "text"}


def test_run_all_with_more_val_samples_dropped_than_evaluate_accepts_stops_before_encode_vae(tiny_edit_model,
                                                                                             tmp_path):
    """Of these 8 samples the hash split puts 3 in 'val': one the edit model accepts (1 control), two encode-text
    quarantines (2 controls, none): 67% dropped, above evaluate.max_dropped_fraction 0.05 (train's raised so train
    itself would run). Before, `run all` trained and evaluate refused the split at the end; now it stops after
    encode-text with evaluate's rule and wording (`features.open.dropped_beyond`), before encode-vae."""
    line, output = _run_all_stopped(tmp_path, tiny_edit_model, 8, {"train": {"max_dropped_fraction": 0.9}})
    assert "of the 'val' split that evaluate (its last stage) reads, 2 of 3 samples (66.7%) are not in the text " \
        "table, above evaluate.max_dropped_fraction = 0.05" in line, line
    assert "encode-text: edit model needs exactly one control image 2" in line, line
    assert "raise evaluate.max_dropped_fraction to use the rest, then rerun" in line, line
    assert "== encode-text" in output and "== encode-vae" not in output, output
    assert _tables(tmp_path / "store") == {"images", "text"}


def test_run_all_whose_val_samples_resize_all_quarantines_says_so(tiny_edit_model, tmp_path):
    """resize.min_controls = max_controls = 1: resize-bucket quarantines the two samples (2 controls, none) whose
    keys the hash split puts in 'val', so the split is empty. Before, the line blamed the hash split ('put none of
    the 2 there: raise resize.val_fraction'); now it names resize-bucket's quarantine and its reasons."""
    line, output = _run_all_stopped(tmp_path, tiny_edit_model, 5, {"resize": {"min_controls": 1, "max_controls": 1}})
    assert "0 of 2 samples are in the 'val' split" in line, line
    assert "put 2 there, and resize-bucket quarantined all 2 (control-count 2; rows in" in line, line
    assert "fix those inputs, add samples or raise resize.val_fraction" in line, line
    assert "== encode-text" not in output, output
    assert _tables(tmp_path / "store") == {"images"}
