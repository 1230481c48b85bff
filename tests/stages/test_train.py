"""The train stage on the tiny model: what it loads, checkpoints, logs, the LoRA diffusers reads back, exact
resume (straight vs stop + resume, and a SIGKILL in the middle of a checkpoint write), gradient accumulation,
options (int8 base, checkpointing, bf16), the CLI, and that it learns."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from models.lora import load_lora
from models.multires import build_batch, multires_forward, pack_latents
from pipeline.config import load_config
from schemas import UserError
from stages.train import state as train_state
from stages.train.sampler import LengthAwareBatchSampler
from stages.train.recipe import run, setup_transformer
from stages.train.schedule import lr_factor
from models.flow import flow_loss
from models.randomness import draw_noise
from stages.train.data import load
from store import Store
from train_store import assert_close_lora, make_train_store, mixed_specs, open_split as open_train_tables
from warm_start import WarmProcess

REPO = Path(__file__).resolve().parents[2]

BASE = {
    "train.device": "cpu",
    "train.batch_size": 2,
    "train.learning_rate": 2e-3,
    "train.lora.rank": 4,
    "train.sigma.sampling": "uniform",
}


def cfg_of(**train):
    return load_config(None, {**BASE, **{f"train.{k}": v for k, v in train.items()}})


def lora_of(run_dir: Path, sub: str = "lora") -> dict[str, torch.Tensor]:
    from models.lora import read_lora

    return read_lora(run_dir / sub)[0]


def assert_same_lora(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, tiny_edit_model):
    root = tmp_path_factory.mktemp("train") / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(8, 4, masks=True))
    return root


# ---------------------------------------------------------------------------------------------- one full run


@pytest.fixture(scope="module")
def trained(store_dir, tiny_edit_model, tmp_path_factory):
    from models.loading import LOAD_LOG

    LOAD_LOG.clear()
    cfg = cfg_of(max_steps=4, batch_size=3, checkpoint_every=1, keep_checkpoints=2, warmup_steps=2,
                 lr_schedule="cosine", caption_dropout=0.3, **{"loss.mask_weight.foreground": 2.0})
    out = tmp_path_factory.mktemp("run") / "run"
    result = run(cfg, store_dir, tiny_edit_model, out)
    return cfg, out, result, list(LOAD_LOG)


def test_reads_store_and_loads_only_the_transformer(trained, tiny_edit_model):
    _, _, result, loads = trained
    assert loads == [(tiny_edit_model, "transformer")]  # never the text encoder or the VAE
    assert result.steps == 4 and len(result.losses) == 4 and all(torch.isfinite(torch.tensor(result.losses)))


def test_checkpoints_are_complete_and_only_the_last_k_kept(trained, store_dir):
    cfg, out, _, _ = trained
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-3", "step-4"]
    for step, ckpt in train_state.complete_checkpoints(root):
        names = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()}
        assert names == {"lora/pytorch_lora_weights.safetensors", "optimizer.safetensors", "optimizer.json",
                         "scheduler.json", "rng-rank00.safetensors", "resume.json"}
        rec = train_state.ResumeRecord.read(ckpt / "resume.json")
        st = Store(store_dir)
        assert rec.step == step and rec.world_size == 1
        assert rec.tables == {"text": st.version_id("text", 1), "vae": st.version_id("vae", 1)}
        assert rec.tables["text"].startswith("v1-")  # version number + manifest hash
    # 8 samples at batch 3 -> 3 batches per epoch: after 4 steps, epoch 1, batch 1.
    rec = train_state.ResumeRecord.read(root / "step-4" / "resume.json")
    assert (rec.epoch, rec.batch_in_epoch) == (1, 1)
    assert_same_lora(lora_of(root / "step-4"), lora_of(out))


def test_tensorboard_scalars_and_epoch_padding_efficiency(trained, store_dir, tiny_edit_model):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg, out, result, _ = trained
    ea = EventAccumulator(str(out / "logs"))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/padding_efficiency", "train/samples_per_s"):
        assert tag in tags and [e.step for e in ea.Scalars(tag)] == [1, 2, 3, 4], tag
    assert [round(e.value, 6) for e in ea.Scalars("train/loss")] == [round(v, 6) for v in result.losses]
    # train/lr at step k is the LR step k trained with (0-based schedule step k - 1): warm-up 2 of cosine 4 trains
    # at 0.5, 1, 1, 0.5 x lr (it logged the next step's LR: 1, 1, 0.5, 0, a full LR for the warm-up's first step)
    lrs = [e.value for e in ea.Scalars("train/lr")]
    assert lrs == pytest.approx([cfg.train.learning_rate * f for f in (0.5, 1.0, 1.0, 0.5)])
    assert lrs == pytest.approx([cfg.train.learning_rate * lr_factor(s, cfg.train) for s in range(4)])
    # Epoch 0 ends at step 3; its efficiency is valid / computed tokens of the sampler's batches.
    tables = open_train_tables(store_dir, tiny_edit_model)
    batches = [s[0] for s in LengthAwareBatchSampler(tables.lengths, 3, seed=0, window=cfg.train.sampler_window).global_steps(0)]
    valid = sum(tables.lengths[i] for b in batches for i in b)
    computed = sum(max(tables.lengths[i] for i in b) * len(b) for b in batches)
    assert result.epoch_padding == {0: pytest.approx(valid / computed)}
    (epoch_event,) = ea.Scalars("epoch/padding_efficiency")
    assert epoch_event.step == 3 and epoch_event.value == pytest.approx(valid / computed)


def test_train_loss_with_log_every_is_the_mean_since_the_last_log_point(store_dir, tiny_edit_model, tmp_path):
    """With train.log_every N, train/loss at a log point is the mean of the N step losses since the previous one
    (HF Trainer's), non-finite ones (a step with no intact sample: nan) left out. Before: the one step's loss,
    a sparse sample of a noisy curve. max_steps 5 off the cadence of 2: the last step is a point too, the mean of
    the steps since step 4 (it was left out, and the curve ended a step short)."""
    from array import array
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from stages.train.recipe import recent_mean_loss

    out = tmp_path / "run"
    result = run(cfg_of(max_steps=5, log_every=2, checkpoint_every=100), store_dir, tiny_edit_model, out)
    ea = EventAccumulator(str(out / "logs"))
    ea.Reload()
    logged = ea.Scalars("train/loss")
    losses = result.losses.tolist()
    assert [e.step for e in logged] == [2, 4, 5]
    assert [e.value for e in logged] == pytest.approx([sum(losses[0:2]) / 2, sum(losses[2:4]) / 2, losses[4]],
                                                      rel=1e-6)
    assert [e.step for e in ea.Scalars("train/lr")] == [2, 4, 5]  # the step's other figures with it
    assert losses[1] != pytest.approx(sum(losses[0:2]) / 2, rel=1e-6)  # the step's own loss would not pass
    nan = float("nan")
    assert recent_mean_loss(array("d", [9.0, 1.0, nan, 3.0]), 3) == 2.0  # the window's finite losses
    none_finite = recent_mean_loss(array("d", [1.0, nan]), 1)
    assert none_finite != none_finite  # nan


def test_diffusers_pipeline_with_the_lora_reproduces_the_trainer_prediction(trained, store_dir, tiny_edit_model):
    from diffusers import QwenImageEditPipeline

    cfg, out, _, _ = trained
    lora = lora_of(out)
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in lora.items())  # it trained

    tables = open_train_tables(store_dir, tiny_edit_model)
    sample = next(s for s in (load(tables, k) for k in tables.keys) if s.controls)
    x_t = pack_latents(sample.target).float() * 0.6 + pack_latents(draw_noise(sample, 0, 0)) * 0.4
    sigma = torch.tensor([0.4])

    trainer_model = setup_transformer(tiny_edit_model, cfg.train, torch.device("cpu")).eval()
    load_lora(trainer_model, out / "lora")
    batch = build_batch([x_t], [list(sample.controls)], [sample.prompt_embeds], [sample.img_shapes])
    with torch.no_grad():
        ours = multires_forward(trainer_model, batch.to("cpu", torch.float32), sigma)[0, : x_t.shape[0]]

    pipe = QwenImageEditPipeline.from_pretrained(tiny_edit_model)
    pipe.load_lora_weights(out / "lora")
    tokens = torch.cat([x_t] + [pack_latents(c).float() for c in sample.controls])[None]
    with torch.no_grad():
        theirs = pipe.transformer(hidden_states=tokens, encoder_hidden_states=sample.prompt_embeds.float()[None],
                                  timestep=sigma, img_shapes=[sample.img_shapes], return_dict=False)[0][0, : x_t.shape[0]]
        base = QwenImageEditPipeline.from_pretrained(tiny_edit_model).transformer(
            hidden_states=tokens, encoder_hidden_states=sample.prompt_embeds.float()[None],
            timestep=sigma, img_shapes=[sample.img_shapes], return_dict=False)[0][0, : x_t.shape[0]]
    assert not torch.equal(theirs, base)  # the LoRA matters for this prediction...
    assert torch.equal(ours, theirs)  # ...and diffusers reproduces the trainer bit for bit


# ---------------------------------------------------------------------------------------------- resume


@pytest.fixture(scope="module")
def straight(store_dir, tiny_edit_model, tmp_path_factory):
    """6 steps without interruption (checkpoints every 2): the reference for the resume tests."""
    out = tmp_path_factory.mktemp("straight") / "run"
    run(cfg_of(max_steps=6, checkpoint_every=2, warmup_steps=2), store_dir, tiny_edit_model, out)
    return out


def test_stop_and_resume_gives_identical_lora(straight, store_dir, tiny_edit_model, tmp_path):
    out = tmp_path / "run"
    run(cfg_of(max_steps=3, checkpoint_every=3, warmup_steps=2), store_dir, tiny_edit_model, out)
    with pytest.raises(UserError, match="already holds checkpoints"):
        run(cfg_of(max_steps=6, warmup_steps=2), store_dir, tiny_edit_model, out)
    result = run(cfg_of(max_steps=6, checkpoint_every=3, warmup_steps=2), store_dir, tiny_edit_model, out, resume=True)
    assert result.start_step == 3 and result.steps == 6
    assert_same_lora(lora_of(out), lora_of(straight))
    a, b = out / "checkpoints" / "step-6", straight / "checkpoints" / "step-6"
    from safetensors.torch import load_file

    opt_a, opt_b = load_file(a / "optimizer.safetensors"), load_file(b / "optimizer.safetensors")
    assert opt_a.keys() == opt_b.keys() and all(torch.equal(opt_a[k], opt_b[k]) for k in opt_a)
    assert (a / "scheduler.json").read_text() == (b / "scheduler.json").read_text()


def test_resume_with_changed_config_or_store_fails_loudly(store_dir, tiny_edit_model, tmp_path):
    out = tmp_path / "run"
    run(cfg_of(max_steps=1), store_dir, tiny_edit_model, out)
    with pytest.raises(UserError, match="train config fingerprint") as refused:
        run(cfg_of(max_steps=2, learning_rate=1e-2, **{"lora.rank": 2}), store_dir, tiny_edit_model, out, resume=True)
    # the refusal names the changed settings (vs the run folder's train_config.yaml), not only two fingerprints;
    # max_steps (constant schedule) may change on resume and is not listed
    changed = str(refused.value).split("changed since")[1]
    assert "train.learning_rate: " in changed and "-> 0.01" in changed and "train.lora.rank: " in changed
    assert "max_steps" not in changed
    other = tmp_path / "store"
    make_train_store(other, tiny_edit_model, mixed_specs(8, 4, masks=True), seed=1)
    # same version numbers (v1, v1), other contents: the manifest hash in the identity tells them apart
    with pytest.raises(UserError, match=r"store tables \{'text': 'v1-\w+', 'vae': 'v1-\w+'\} -> \{'text': 'v1-\w+'"):
        run(cfg_of(max_steps=2), other, tiny_edit_model, out, resume=True)
    make_train_store(other, tiny_edit_model, mixed_specs(8), tag="b")  # a newer text/vae version
    with pytest.raises(UserError, match=r"-> \{'text': 'v2-\w+', 'vae': 'v2-\w+'\}"):
        run(cfg_of(max_steps=2), other, tiny_edit_model, out, resume=True)
    with pytest.raises(UserError, match="already past train.max_steps"):  # a shorter run is not the longer one
        run(cfg_of(max_steps=1), store_dir, tiny_edit_model, tmp_path / "run2")
        run(cfg_of(max_steps=2), store_dir, tiny_edit_model, tmp_path / "run2", resume=True)
        run(cfg_of(max_steps=1), store_dir, tiny_edit_model, tmp_path / "run2", resume=True)



def test_the_order_of_lora_target_modules_is_no_setting(straight, store_dir, tiny_edit_model, tmp_path):
    """peft matches each layer against the set of names and the LoRA file records them sorted: the same layers in
    another order (or named twice) build the same adapter. A resume with them reordered continues the run (it was
    refused as other settings, and `run all` kept the run aside and trained afresh from step 0); a run recorded
    under its order as set is still this run's, and the default list keeps its fingerprint."""
    from schemas.lineage import hashed_settings, settings_hash
    from stages.train.settings import config_fingerprint, known_fingerprint

    order = {"lora.target_modules": ["to_out.0", "to_v", "to_k", "to_q", "to_k"]}
    out = tmp_path / "run"
    run(cfg_of(max_steps=3, checkpoint_every=3, warmup_steps=2, **order), store_dir, tiny_edit_model, out)
    with pytest.raises(UserError) as refused:  # without --resume: a run of these settings, not of others
        run(cfg_of(max_steps=6, checkpoint_every=3, warmup_steps=2), store_dir, tiny_edit_model, out)
    assert "pass --resume to continue it" in str(refused.value) and "target_modules" not in str(refused.value)
    result = run(cfg_of(max_steps=6, checkpoint_every=3, warmup_steps=2), store_dir, tiny_edit_model, out, resume=True)
    assert result.start_step == 3 and result.steps == 6
    assert_same_lora(lora_of(out), lora_of(straight))  # the default order's straight run
    default = cfg_of(max_steps=6).train
    assert config_fingerprint(default) == settings_hash(hashed_settings(default, as_set=True))
    mlp = cfg_of(**{"lora.target_modules": ["net.2", "to_q", "net.0.proj"]}).train
    as_set = settings_hash(hashed_settings(mlp, as_set=True))  # how a release before this one recorded it
    assert as_set != config_fingerprint(mlp) and known_fingerprint(as_set, mlp) == config_fingerprint(mlp)


def test_a_start_over_a_run_of_other_settings_names_them_and_both_ways_on(store_dir, tiny_edit_model, tmp_path):
    """A start without --resume into a folder whose run was trained with other settings. Before, it said only
    "pass --resume to continue it", and that --resume was then refused for the settings, named only there. Now
    the refusal lists what differs (a few lines: past five, counted) and says what --resume continues (the run
    under its own settings) beside --new-run; the run is left as it was."""
    out = tmp_path / "run"
    run(cfg_of(max_steps=1), store_dir, tiny_edit_model, out)
    lora = lora_of(out)
    with pytest.raises(UserError) as refused:
        run(cfg_of(max_steps=2, learning_rate=1e-2, **{"lora.rank": 2}), store_dir, tiny_edit_model, out)
    lines = str(refused.value).splitlines()
    assert lines[0] == f"{out} already holds checkpoints (step-1) trained with other settings " \
                       f"({out / 'train_config.yaml'} -> now):"
    assert lines[1:3] == ["  train.learning_rate: 0.002 -> 0.01", "  train.lora.rank: 4 -> 2"]  # not max_steps
    assert lines[3].startswith("--resume continues it only with the settings it was trained with") and \
        f"--new-run to keep it as {out}.previous/N-TIME and train afresh" in lines[3]
    changes = {"learning_rate": 1e-2, "lora.rank": 2, "lora.alpha": 3.0, "weight_decay": 0.5, "seed": 7,
               "caption_dropout": 0.2}  # six settings: four lines shown, one counting the other two
    with pytest.raises(UserError) as refused:
        run(cfg_of(max_steps=1, **changes), store_dir, tiny_edit_model, out)
    lines = str(refused.value).splitlines()
    assert len(lines) == 7 and lines[5] == "  ... and 2 more train.* setting(s)", lines
    assert_same_lora(lora_of(out), lora)  # nothing trained over


def test_a_finished_run_without_checkpoints_is_not_replaced(store_dir, tiny_edit_model, tmp_path):
    """RUN/lora of a finished run whose checkpoints were deleted (they hold the optimizer state: the usual thing
    to remove to save disk): a new train into RUN, with or without --resume, used to start at step 0 and replace
    that LoRA at the end. Now refused in one line; --new-run keeps it aside (what `run all` does)."""
    out = tmp_path / "run"
    run(cfg_of(max_steps=2, checkpoint_every=2), store_dir, tiny_edit_model, out)
    finished = lora_of(out)
    import shutil

    shutil.rmtree(out / "checkpoints")
    for resume in (False, True):
        with pytest.raises(UserError, match="holds a final LoRA but no checkpoints.*--new-run"):
            run(cfg_of(max_steps=3, learning_rate=0.05), store_dir, tiny_edit_model, out, resume=resume)
        assert_same_lora(lora_of(out), finished)
        assert not (out / "checkpoints").exists()
    result = run(cfg_of(max_steps=1), store_dir, tiny_edit_model, out, resume=True, new_run=True)
    assert result.kept_previous is not None and result.start_step == 0 and result.steps == 1
    assert_same_lora(lora_of(result.kept_previous), finished)


_KILLED_WRITER = """
import sys, time
from pathlib import Path
from pipeline.config import load_config
from stages.train import recipe as train, state as train_state

store, model, out, overrides = sys.argv[1], sys.argv[2], Path(sys.argv[3]), eval(sys.argv[4])
real = train_state.save_optimizer

def slow_save_optimizer(optimizer, folder):  # the checkpoint of step 4 hangs half-written
    real(optimizer, folder)
    if folder.name == ".step-4.tmp":
        (out / "writing-step-4").write_text("")
        time.sleep(120)

train_state.save_optimizer = slow_save_optimizer
train.run(load_config(None, overrides), store, model, out)
"""


def test_sigkill_during_checkpoint_write_then_resume(straight, store_dir, tiny_edit_model, tmp_path):
    out = tmp_path / "run"
    overrides = {**BASE, "train.max_steps": 6, "train.checkpoint_every": 2, "train.warmup_steps": 2}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    # a real process of its own, started warm (tests/warm_start.py): torch imported already
    proc = WarmProcess([sys.executable, "-c", _KILLED_WRITER, str(store_dir), tiny_edit_model, str(out),
                        repr(overrides)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not (out / "writing-step-4").exists():
            assert proc.poll() is None, proc.output()[1][-2000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    root = out / "checkpoints"
    assert (root / ".step-4.tmp" / "optimizer.safetensors").is_file()  # killed mid-write...
    assert not (root / "step-4").exists()  # ...never visible as a checkpoint
    assert train_state.latest_checkpoint(root) == root / "step-2"

    result = run(load_config(None, overrides), store_dir, tiny_edit_model, out, resume=True)
    assert result.start_step == 2 and not (root / ".step-4.tmp").exists()
    assert_same_lora(lora_of(out), lora_of(straight))


# ---------------------------------------------------------------------------------------------- options


def test_gradient_accumulation_equals_the_bigger_batch(tiny_edit_model, tmp_path):
    # 4 samples: batch 4 is one step per epoch; batch 2 x accum 2 puts the same 4 samples in each step.
    make_train_store(tmp_path / "s", tiny_edit_model, mixed_specs(4))
    run(cfg_of(max_steps=2, batch_size=4), tmp_path / "s", tiny_edit_model, tmp_path / "big")
    run(cfg_of(max_steps=2, batch_size=2, grad_accum=2), tmp_path / "s", tiny_edit_model, tmp_path / "accum")
    assert_close_lora(lora_of(tmp_path / "big"), lora_of(tmp_path / "accum"), lr=2e-3, steps=2)


def test_gradient_checkpointing_int8_base_and_bf16(store_dir, tiny_edit_model, tmp_path):
    run(cfg_of(max_steps=2), store_dir, tiny_edit_model, tmp_path / "plain")
    run(cfg_of(max_steps=2, gradient_checkpointing=True), store_dir, tiny_edit_model, tmp_path / "ckpt")
    assert_same_lora(lora_of(tmp_path / "plain"), lora_of(tmp_path / "ckpt"))  # recomputation is exact

    cfg = cfg_of(max_steps=2, quantize_base="int8_weight_only")  # the old name of int8
    model = setup_transformer(tiny_edit_model, cfg.train, torch.device("cpu"))
    assert "Int8" in type(model.transformer_blocks[0].attn.to_q.base_layer.weight).__name__
    result = run(cfg, store_dir, tiny_edit_model, tmp_path / "int8")
    assert all(torch.isfinite(torch.tensor(result.losses)))
    plain, int8 = lora_of(tmp_path / "plain"), lora_of(tmp_path / "int8")
    assert any(v.abs().sum() > 0 for k, v in int8.items() if "lora_B" in k)
    assert not all(torch.equal(plain[k], int8[k]) for k in plain)  # the quantised base changes the gradients

    result = run(cfg_of(max_steps=2, mixed_precision="bf16"), store_dir, tiny_edit_model, tmp_path / "bf16")
    assert all(torch.isfinite(torch.tensor(result.losses)))
    assert all(v.dtype == torch.float32 for v in lora_of(tmp_path / "bf16").values())  # LoRA trains in fp32


def test_lr_schedule():
    cfg = cfg_of(max_steps=10, warmup_steps=2, lr_schedule="cosine").train
    assert [lr_factor(s, cfg) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert lr_factor(6, cfg) == pytest.approx(0.5) and lr_factor(10, cfg) == pytest.approx(0.0)
    lin = cfg.model_copy(update={"lr_schedule": "linear"})
    assert lr_factor(6, lin) == pytest.approx(0.5)
    assert lr_factor(9, cfg.model_copy(update={"lr_schedule": "constant"})) == 1.0


# ---------------------------------------------------------------------------------------------- CLI


def test_cli_trains_and_reports_user_errors(store_dir, tiny_edit_model, tmp_path):
    from typer.testing import CliRunner

    from pipeline.cli import app

    runner = CliRunner()
    args = ["run", "train", "--store", str(store_dir), "--model", tiny_edit_model, "--out", str(tmp_path / "run"),
            "--max-steps", "2", "--batch-size", "2", "--device", "cpu"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "LoRA:" in res.output and (tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors").is_file()
    lora = tmp_path / "run" / "lora"
    written = (lora / "pytorch_lora_weights.safetensors").stat().st_mtime_ns
    # the same command again, with or without --resume: up to date, as `run all` says (before: the plain rerun
    # was refused, "already holds checkpoints; pass --resume to continue it", and --resume rewrote the LoRA)
    for again in (args, args + ["--resume"]):
        res = runner.invoke(app, again)
        assert res.exit_code == 0, res.output
        assert res.output.endswith(f"LoRA {lora} is up to date (2 steps on the current tables)\n"), res.output
    assert (lora / "pytorch_lora_weights.safetensors").stat().st_mtime_ns == written
    res = runner.invoke(app, [*args[:-5], "3", *args[-4:]])  # --max-steps 3: not the finished run's config
    assert res.exit_code == 1 and "already holds checkpoints (step-2); pass --resume" in res.output, res.output
    res = runner.invoke(app, ["run", "train", "--store", str(tmp_path / "nowhere"), "--model", tiny_edit_model,
                              "--out", str(tmp_path / "r2")])
    assert res.exit_code == 1 and "no store at" in res.output
    # --resume with nothing to resume (a typo in --out, an empty folder) stops instead of training from step 0
    (tmp_path / "empty").mkdir()
    for out, what in ((tmp_path / "rnu", "does not exist"), (tmp_path / "empty", "is empty")):
        res = runner.invoke(app, args[:7] + [str(out)] + args[8:] + ["--resume"])
        assert res.exit_code == 1 and f"nothing to resume, {out} {what}" in res.output, res.output
        assert not (out / "checkpoints").exists()


# ---------------------------------------------------------------------------------------------- learning


def test_held_out_flow_loss_drops_after_training(tiny_edit_model, tmp_path):
    make_train_store(tmp_path / "s", tiny_edit_model, mixed_specs(12, 4))
    cfg = cfg_of(max_steps=10, batch_size=4, learning_rate=2e-2, **{"lora.rank": 8})
    run(cfg, tmp_path / "s", tiny_edit_model, tmp_path / "run")

    val = open_train_tables(tmp_path / "s", tiny_edit_model, split="val")
    samples = [load(val, k) for k in val.keys]

    def held_out(model) -> float:
        losses = []
        with torch.no_grad():
            for seed in (0, 1):
                for sigma in (0.2, 0.5, 0.8):
                    noises = [draw_noise(s, seed, 0) for s in samples]
                    losses.append(flow_loss(model, samples, torch.full((len(samples),), sigma), noises).mean())
        return float(torch.stack(losses).mean())

    model = setup_transformer(tiny_edit_model, cfg.train, torch.device("cpu")).eval()
    before = held_out(model)  # the freshly initialised LoRA (B = 0) is the base model
    load_lora(model, tmp_path / "run" / "lora")
    after = held_out(model)
    assert after < 0.9 * before, (before, after)
