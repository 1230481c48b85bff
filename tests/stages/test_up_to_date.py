"""One up-to-date rule (`schemas.up_to_date`) decides reuse on every path: a table version (resize, the encoders,
through `Store.find_version`), a trained run, an evaluate report and a checkpoint report. On each path a changed
hashed setting recomputes, a changed throughput setting (the device, the batch size) reuses, and with the rule
forced to say "stale" nothing is called up to date (a path with its own comparison would still reuse)."""

from __future__ import annotations

import re

import pytest

from pipeline.config import load_config
from schemas import up_to_date
from schemas.config import EvaluateConfig
from train_store import make_train_store, mixed_specs

TRAIN = {"train.device": "cpu", "train.batch_size": 2, "train.lora.rank": 4, "train.sigma.sampling": "uniform",
         "train.max_steps": 2, "train.checkpoint_every": 2}
EVAL = dict(noise_seeds=[0], timesteps=[0.5], batch_size=4, num_samples=0, device="cpu")


def test_the_rule_names_what_changed():
    assert up_to_date.stale_inputs({"a": 1, "b": 2}, {"a": 1, "b": 3}) == ["b"]
    assert up_to_date.stale_inputs({"a": 1}, {"a": 1, "c": 0}) == ["c"]
    assert up_to_date.stale_inputs(None, {"a": 1}) == ["a"]
    assert up_to_date.is_current({"a": [1, 2]}, {"a": [1, 2]})


@pytest.fixture(scope="module")
def trained(tiny_edit_model, tmp_path_factory):
    from stages.train.recipe import run

    root = tmp_path_factory.mktemp("uptodate")
    make_train_store(root / "store", tiny_edit_model, mixed_specs(3, 2))
    run(load_config(None, TRAIN), root / "store", tiny_edit_model, root / "run")
    return root


def test_train_reuses_on_a_device_change_and_recomputes_on_a_hashed_one(trained, tiny_edit_model, monkeypatch):
    from stages.train.recipe import up_to_date as train_up_to_date

    def check(**sets):
        return train_up_to_date(load_config(None, {**TRAIN, **sets}), trained / "store", tiny_edit_model,
                                trained / "run")

    assert check()
    assert check(**{"train.device": "cpu:0", "train.log_every": 5})  # throughput: the same LoRA
    assert not check(**{"train.learning_rate": 2e-4})
    assert not check(**{"train.max_steps": 3})
    monkeypatch.setattr(up_to_date, "is_current", lambda recorded, present: False)
    assert not check()


def test_evaluate_report_reuses_on_a_device_change_and_recomputes_on_a_hashed_one(trained, tiny_edit_model,
                                                                                   tmp_path, monkeypatch):
    from stages.evaluate.report_inputs import report_up_to_date
    from stages.evaluate.stage import run

    store, lora, out = trained / "store", trained / "run" / "lora", tmp_path / "report"
    run(EvaluateConfig(**EVAL), store, tiny_edit_model, lora, out)
    assert report_up_to_date(EvaluateConfig(**EVAL), store, tiny_edit_model, lora, out)
    assert report_up_to_date(EvaluateConfig(**{**EVAL, "device": "cpu:0", "batch_size": 1}), store,
                             tiny_edit_model, lora, out)
    assert not report_up_to_date(EvaluateConfig(**{**EVAL, "timesteps": [0.3]}), store, tiny_edit_model, lora, out)
    monkeypatch.setattr(up_to_date, "is_current", lambda recorded, present: False)
    assert not report_up_to_date(EvaluateConfig(**EVAL), store, tiny_edit_model, lora, out)


def test_checkpoint_report_keeps_its_array_on_a_device_or_batch_change(trained, tiny_edit_model, tmp_path,
                                                                       monkeypatch):
    """The loss array's fingerprint comes from the declared scheme: evaluate.batch_size and the device are
    throughput (they used to start a new array and recompute every checkpoint)."""
    from stages.evaluate import checkpoints as ev

    store, out = trained / "store", tmp_path / "report"
    ckpts = [(2, trained / "run" / "checkpoints" / "step-2" / "lora")]
    assert ev.run(EvaluateConfig(**EVAL), store, tiny_edit_model, ckpts, out).evaluated == 1
    again = ev.run(EvaluateConfig(**{**EVAL, "device": "cpu:0", "batch_size": 1}), store, tiny_edit_model, ckpts, out,
                   skip_if_done=True)
    assert again.up_to_date
    changed = ev.run(EvaluateConfig(**{**EVAL, "timesteps": [0.3]}), store, tiny_edit_model, ckpts, out,
                     skip_if_done=True)
    assert not changed.up_to_date and changed.evaluated == 1
    monkeypatch.setattr(up_to_date, "is_current", lambda recorded, present: False)
    assert not ev.run(EvaluateConfig(**{**EVAL, "timesteps": [0.3]}), store, tiny_edit_model, ckpts, out,
                      skip_if_done=True).up_to_date


def _recomputed(out: str) -> list[str]:
    return [line for line in out.splitlines() if "is not this run's" in line]


def test_evaluate_says_why_it_evaluates_again(trained, tiny_edit_model, tmp_path, capsys):
    """A report that is not this run's is computed again after one line naming what differs (as train says why it
    trains afresh); before, an `evaluate.noise_seeds` change recomputed every checkpoint without a reason."""
    from stages.evaluate import checkpoints as ev
    from stages.evaluate import stage

    store, out = trained / "store", tmp_path / "report"
    ckpts = [(2, trained / "run" / "checkpoints" / "step-2" / "lora")]
    ev.run(EvaluateConfig(**EVAL), store, tiny_edit_model, ckpts, out, skip_if_done=True)
    assert ev.run(EvaluateConfig(**{**EVAL, "batch_size": 1}), store, tiny_edit_model, ckpts, out,
                  skip_if_done=True).up_to_date
    assert _recomputed(capsys.readouterr().out) == []  # a new report, then one up to date: nothing to explain
    ev.run(EvaluateConfig(**{**EVAL, "noise_seeds": [0, 1]}), store, tiny_edit_model, ckpts, out, skip_if_done=True)
    (why,) = _recomputed(capsys.readouterr().out)
    assert why.startswith(f"evaluate: the report in {out} is not this run's (held-out loss inputs "), why
    assert "; evaluate config fingerprint " in why and why.count("evaluate.noise_seeds: [0] -> [0, 1]") == 1, why
    # a seed added: its (seed, σ) cells alone are computed (tests/stages/test_evaluate_grown_grid.py)
    assert "batch_size" not in why and re.search(r"\): computing 1 new \(seed, σ\) cell of 2 for the base and "
                                                 r"\d+ of \d+ checkpoints? \(the cells \S+ holds reused\)$", why), why
    # a setting of the pictures only: the line says the report is written again, not that anything is evaluated
    res = ev.run(EvaluateConfig(**{**EVAL, "noise_seeds": [0, 1], "num_samples": 1, "num_inference_steps": 2}),
                 store, tiny_edit_model, ckpts, out, skip_if_done=True)
    (why,) = _recomputed(capsys.readouterr().out)
    assert res.evaluated == 0 and "evaluate.num_samples: " in why, why
    assert why.endswith(f"): writing the report again (the losses of 1 checkpoint in {out / 'losses.zarr'} kept: "
                        "no checkpoint evaluated again)"), why

    single = tmp_path / "single"
    lora = trained / "run" / "lora"
    stage.run(EvaluateConfig(**EVAL), store, tiny_edit_model, lora, single, skip_if_done=True)
    stage.run(EvaluateConfig(**{**EVAL, "timesteps": [0.3]}), store, tiny_edit_model, lora, single, skip_if_done=True)
    (why,) = _recomputed(capsys.readouterr().out)
    assert why.startswith(f"evaluate: the report in {single} is not this run's (evaluate config fingerprint "), why
    assert why.endswith("; evaluate.timesteps: [0.5] -> [0.3]): evaluating again"), why


def test_table_versions_go_through_the_rule(trained, monkeypatch):
    """resize and the encoders reuse a table version only through `Store.find_version`, which asks the rule."""
    from store import Store
    from store.manifest_files import read_schema

    st = Store(trained / "store", create=False)
    version = st.tables()["text"]
    lineage = read_schema(st.version_dir("text", version)).lineage
    assert st.find_version("text", lineage) == version
    monkeypatch.setattr(up_to_date, "is_current", lambda recorded, present: False)
    assert st.find_version("text", lineage) is None


def test_a_rewritten_init_lora_is_another_run(trained, tiny_edit_model, tmp_path):
    """train.init_lora entered the fingerprint as its path only: weights rewritten at that path kept the run up to
    date and let --resume continue it. Now its bytes are recorded: the same bytes stay current (put back too),
    other ones are stale and a resume is refused naming the init LoRA."""
    import shutil

    from schemas.errors import UserError
    from stages.train.recipe import run, up_to_date as train_up_to_date

    init, out = tmp_path / "init.safetensors", tmp_path / "run"
    first = (trained / "run" / "lora" / "pytorch_lora_weights.safetensors").read_bytes()
    init.write_bytes(first)
    cfg = load_config(None, {**TRAIN, "train.init_lora": str(init)})
    run(cfg, trained / "store", tiny_edit_model, out)
    assert train_up_to_date(cfg, trained / "store", tiny_edit_model, out)

    shutil.copyfile(out / "lora" / "pytorch_lora_weights.safetensors", init)  # other weights, same path and format
    assert init.read_bytes() != first
    assert not train_up_to_date(cfg, trained / "store", tiny_edit_model, out)
    with pytest.raises(UserError, match=r"train\.init_lora") as refused:
        run(cfg, trained / "store", tiny_edit_model, out, resume=True)
    assert "--new-run" in str(refused.value)

    init.write_bytes(first)
    assert train_up_to_date(cfg, trained / "store", tiny_edit_model, out)

    # a checkpoint written before the bytes were recorded (no init_lora_sha256) is taken as made from the file there
    import os

    from store.checksum import seal, unseal

    record = out / "checkpoints" / "step-2" / "resume.json"
    stamp = record.stat()
    old = {k: v for k, v in unseal(record.read_bytes()).items() if k != "init_lora_sha256"}
    record.write_bytes(seal(old))
    os.utime(record, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # still older than the final LoRA
    shutil.copyfile(out / "lora" / "pytorch_lora_weights.safetensors", init)
    assert train_up_to_date(cfg, trained / "store", tiny_edit_model, out)


def test_the_same_init_lora_at_another_path_is_the_same_run(trained, tiny_edit_model, tmp_path):
    """train.init_lora's path entered the run fingerprint: the same weight file moved (another mount, a tidied
    folder) made the finished run stale (`run all` trained it again from step 0) and refused a resume. Its bytes
    are recorded (init_lora_sha256), so only they count."""
    import shutil

    from stages.train.recipe import run, up_to_date as train_up_to_date

    init, out = tmp_path / "a" / "init.safetensors", tmp_path / "run"
    init.parent.mkdir()
    shutil.copyfile(trained / "run" / "lora" / "pytorch_lora_weights.safetensors", init)
    run(load_config(None, {**TRAIN, "train.init_lora": str(init)}), trained / "store", tiny_edit_model, out)
    moved = tmp_path / "b" / "init.safetensors"
    moved.parent.mkdir()
    init.rename(moved)
    cfg = load_config(None, {**TRAIN, "train.init_lora": str(moved)})
    assert train_up_to_date(cfg, trained / "store", tiny_edit_model, out)
    longer = load_config(None, {**TRAIN, "train.init_lora": str(moved), "train.max_steps": 3})
    resumed = run(longer, trained / "store", tiny_edit_model, out, resume=True)  # not refused
    assert (resumed.start_step, resumed.steps) == (2, 3)


def _extra_prompt(tmp_path, seed: int):
    """An extra prompt whose control image (a small random picture) is written at the same path for any seed."""
    import numpy as np
    from PIL import Image

    img = tmp_path / "probe" / "cat.png"
    img.parent.mkdir(exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(img)
    return {"prompt": "make it red", "images": [str(img)], "height": 32, "width": 32}


def test_evaluate_report_is_stale_when_an_extra_prompt_image_is_replaced(trained, tiny_edit_model, tmp_path,
                                                                         monkeypatch):
    """Before: the report recorded the extra prompts' paths only, so a picture replaced at probe/cat.png kept a
    report of the old one up to date."""
    import models.edit
    from stages.evaluate.report_inputs import report_up_to_date

    # the controls' view at 256² rather than the stock ~1024² (as tests/stages/test_predict.py): the text and VAE
    from stages.evaluate.stage import run
    # encoding of each extra prompt's control took seconds of CPU; nothing asserted here depends on its size
    monkeypatch.setattr(models.edit, "VAE_AREA", 256 * 256)
    store, lora, out = trained / "store", trained / "run" / "lora", tmp_path / "report"
    cfg = EvaluateConfig(**EVAL, num_inference_steps=2, extra_prompts=[_extra_prompt(tmp_path, 0)])
    run(cfg, store, tiny_edit_model, lora, out)
    assert report_up_to_date(cfg, store, tiny_edit_model, lora, out)
    _extra_prompt(tmp_path, 1)
    assert not report_up_to_date(cfg, store, tiny_edit_model, lora, out)


def test_checkpoint_report_is_stale_when_an_extra_prompt_image_is_replaced(trained, tiny_edit_model, tmp_path,
                                                                           monkeypatch):
    """--all-checkpoints: the pictures are made again, the held-out losses are kept (extra prompts change none)."""
    import models.edit
    from stages.evaluate import checkpoints as ev

    # the controls' view at 256² rather than the stock ~1024² (as tests/stages/test_predict.py): the text and VAE
    # encoding of each extra prompt's control took seconds of CPU; nothing asserted here depends on its size
    monkeypatch.setattr(models.edit, "VAE_AREA", 256 * 256)
    store, out = trained / "store", tmp_path / "report"
    ckpts = [(2, trained / "run" / "checkpoints" / "step-2" / "lora")]
    cfg = EvaluateConfig(**EVAL, num_inference_steps=2, extra_prompts=[_extra_prompt(tmp_path, 0)])
    assert ev.run(cfg, store, tiny_edit_model, ckpts, out).evaluated == 1
    assert ev.run(cfg, store, tiny_edit_model, ckpts, out, skip_if_done=True).up_to_date
    _extra_prompt(tmp_path, 1)
    again = ev.run(cfg, store, tiny_edit_model, ckpts, out, skip_if_done=True)
    assert not again.up_to_date and again.evaluated == 0  # the same loss array: no checkpoint evaluated again
    assert ev.run(cfg, store, tiny_edit_model, ckpts, out, skip_if_done=True).up_to_date


def _rewrite_record(run, **change):
    """The last checkpoint's resume record as another release wrote it (`None`: the field left out), sealed again
    with its old mtime (still older than the final LoRA)."""
    import os

    from store.checksum import seal, unseal

    record = run / "checkpoints" / "step-2" / "resume.json"
    stamp = record.stat()
    d = unseal(record.read_bytes())
    for k, v in change.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    record.write_bytes(seal(d))
    os.utime(record, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))


def test_a_run_trained_under_another_training_revision_is_trained_again(trained, tiny_edit_model, tmp_path):
    """The up-to-date check compared the config, tables, model and init LoRA, not the code: a release that fixed
    the training math (TRAINING_REVISION bumped) left `run all` calling the old LoRA current. Now the revision is
    recorded: another one is not up to date, a record from before it was recorded counts as revision 1, a resume
    is refused naming the revision (the rule of a changed config), and `run all` (--new-run) keeps the old run
    and trains afresh."""
    import shutil

    from schemas.errors import UserError
    from stages.train.recipe import run, up_to_date as train_up_to_date
    from stages.train.settings import training_revision

    cfg, store, out = load_config(None, TRAIN), trained / "store", tmp_path / "run"
    TRAINING_REVISION = training_revision(cfg.train)  # this config's
    shutil.copytree(trained / "run", out)  # mtimes kept
    assert train_up_to_date(cfg, store, tiny_edit_model, out)

    _rewrite_record(out, training_revision=None)  # written before the revision was recorded: revision 1's
    assert train_up_to_date(cfg, store, tiny_edit_model, out) == (TRAINING_REVISION == up_to_date.UNRECORDED_REVISION)

    other = TRAINING_REVISION + 1
    _rewrite_record(out, training_revision=other)
    assert not train_up_to_date(cfg, store, tiny_edit_model, out)

    shutil.rmtree(out / "lora")  # killed before its final save: a resume would continue step-2
    with pytest.raises(UserError, match=f"training revision {other} -> {TRAINING_REVISION}") as refused:
        run(cfg, store, tiny_edit_model, out, resume=True)
    assert "release that started it" in str(refused.value) and "--new-run" in str(refused.value)
    assert (out / "checkpoints" / "step-2").is_dir()  # nothing touched

    again = run(cfg, store, tiny_edit_model, out, resume=True, skip_if_done=True, new_run=True)  # as `run all`
    assert not again.up_to_date and again.start_step == 0 and again.kept_previous is not None
    assert train_up_to_date(cfg, store, tiny_edit_model, out)


def test_an_evaluate_report_of_another_evaluation_revision_is_recomputed(trained, tiny_edit_model, tmp_path,
                                                                         monkeypatch):
    """A single-LoRA report records the evaluation revision in its inputs: another one recomputes it (its base
    losses too); a report recorded before the revision was counts as revision 1."""
    import json

    from stages.evaluate import loss_fingerprint
    from stages.evaluate.report_inputs import report_up_to_date
    from stages.evaluate.stage import run

    store, lora, out = trained / "store", trained / "run" / "lora", tmp_path / "report"
    cfg = EvaluateConfig(**EVAL)
    run(cfg, store, tiny_edit_model, lora, out)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["run"]["inputs"]["evaluation_revision"] == loss_fingerprint.EVALUATION_REVISION
    del metrics["run"]["inputs"]["evaluation_revision"]  # as written before the revision was recorded
    metrics.pop("checksum", None)  # edited by hand: unsealed, as a report of an earlier release
    (out / "metrics.json").write_text(json.dumps(metrics))
    assert report_up_to_date(cfg, store, tiny_edit_model, lora, out) == (
        loss_fingerprint.EVALUATION_REVISION == up_to_date.UNRECORDED_REVISION)  # revision 1's

    monkeypatch.setattr(loss_fingerprint, "EVALUATION_REVISION", loss_fingerprint.EVALUATION_REVISION + 1)
    assert not report_up_to_date(cfg, store, tiny_edit_model, lora, out)
    base_losses = (out / "base-losses.safetensors").read_bytes()
    again = run(cfg, store, tiny_edit_model, lora, out, skip_if_done=True)
    assert not again.up_to_date
    assert again.metrics["run"]["inputs"]["evaluation_revision"] == loss_fingerprint.EVALUATION_REVISION
    assert (out / "base-losses.safetensors").read_bytes() != base_losses  # recomputed under the new key
    assert report_up_to_date(cfg, store, tiny_edit_model, lora, out)


def test_a_checkpoint_report_of_another_evaluation_revision_evaluates_every_checkpoint_again(
        trained, tiny_edit_model, tmp_path, monkeypatch):
    """--all-checkpoints reuses each checkpoint's losses by its bytes: the evaluation revision is in the loss
    array's setting, so another revision keeps the old array aside and evaluates every checkpoint again. An
    array recorded before the revision was (no revision in its setting) is revision 1's: kept, nothing evaluated."""
    import zarr

    from stages.evaluate import checkpoints as ev, loss_fingerprint
    from store.loss_array import GROUP

    store, out = trained / "store", tmp_path / "report"
    ckpts = [(2, trained / "run" / "checkpoints" / "step-2" / "lora")]
    cfg = EvaluateConfig(**EVAL)
    first = ev.run(cfg, store, tiny_edit_model, ckpts, out)
    assert first.evaluated == 1

    # the array and report as written before the revision was recorded
    from tests.stages.test_evaluate_checkpoints import respell_report

    group = zarr.open_group(out / GROUP, mode="r", use_consolidated=True)
    respell_report(out, {k: v for k, v in group.attrs["settings"].items() if k != "evaluation_revision"})
    assert ev.run(cfg, store, tiny_edit_model, ckpts, out, skip_if_done=True).up_to_date
    assert ev.run(cfg, store, tiny_edit_model, ckpts, out).evaluated == 0  # forced: the losses are kept
    assert not list(out.glob("losses.*.zarr"))

    monkeypatch.setattr(loss_fingerprint, "EVALUATION_REVISION", loss_fingerprint.EVALUATION_REVISION + 1)
    again = ev.run(cfg, store, tiny_edit_model, ckpts, out, skip_if_done=True)
    assert not again.up_to_date and again.evaluated == 1
    assert list(out.glob("losses.*.zarr"))  # the earlier revision's losses kept aside
    assert ev.run(cfg, store, tiny_edit_model, ckpts, out, skip_if_done=True).up_to_date


def test_a_revision_retrains_only_the_configs_whose_weights_it_changes() -> None:
    """Revision 2 changed the draws of a sample held twice in one step (grad_accum > 1) and the ranks' LoRA dropout
    masks (lora.dropout > 0): runs of those configs are trained again, every other finished run stays current
    (a global bump retrained every run under `run all`). Revision 3 warmed the EMA up (RUN/lora_ema of runs with
    ema_decay set). Revision 4 left a sample of zero weight in every token out of its step's mean (runs whose
    train.loss.mask_weight has a 0)."""
    from schemas.config import TrainConfig
    from stages.train.settings import TRAINING_REVISION, training_revision

    assert TRAINING_REVISION == 4
    assert training_revision(TrainConfig(loss={"mask_weight": {"background": 0.0}})) == 4
    assert training_revision(TrainConfig(loss={"mask_weight": {"foreground": 0.0}}, ema_decay=0.999)) == 4
    assert training_revision(TrainConfig(loss={"mask_weight": {"background": 0.5}})) == 1
    assert training_revision(TrainConfig()) == up_to_date.UNRECORDED_REVISION == 1
    assert training_revision(TrainConfig(grad_accum=2)) == 2
    assert training_revision(TrainConfig(lora={"dropout": 0.1})) == 2
    assert training_revision(TrainConfig(caption_dropout=0.5, control_dropout=0.5)) == 1
    assert training_revision(TrainConfig(ema_decay=0.999)) == 3
    assert training_revision(TrainConfig(ema_decay=0.999, grad_accum=2)) == 3


def test_an_up_to_date_check_reads_the_report_once_and_says_a_damaged_one_in_one_process(
        trained, tiny_edit_model, tmp_path, monkeypatch, capsys):
    """An up-to-date check read and verified metrics.json three times (the inputs it records, the damaged samples
    it left out, then the report returned), where once is enough; and a damaged one was said only where the RANK
    variable read "0": a one-process evaluate under a platform that sets RANK for the job (WORLD_SIZE unset: rank
    0 of 1, `Ranks`) wrote the report again without saying why."""
    from stages.evaluate import checkpoints as ev
    from stages.evaluate import report, stage

    store, cfg = trained / "store", EvaluateConfig(**EVAL)
    reads: list = []
    real = report._load_metrics
    monkeypatch.setattr(report, "_load_metrics", lambda path: reads.append(path) or real(path))
    ckpts = [(2, trained / "run" / "checkpoints" / "step-2" / "lora")]
    paths = {"lora": (tmp_path / "lora-report", lambda out: stage.run(cfg, store, tiny_edit_model,
                                                                       trained / "run" / "lora", out, skip_if_done=True)),
             "checkpoints": (tmp_path / "ckpt-report", lambda out: ev.run(cfg, store, tiny_edit_model, ckpts, out,
                                                                         skip_if_done=True))}
    for name, (out, evaluate) in paths.items():
        evaluate(out)
        reads.clear()
        assert evaluate(out).up_to_date and reads == [out / "metrics.json"], (name, reads)
        data = (out / "metrics.json").read_bytes()
        at = re.search(rb'"val_samples": (\d)', data).start(1)  # a flipped digit: still JSON, not the sealed bytes
        (out / "metrics.json").write_bytes(data[:at] + str((int(data[at:at + 1]) + 1) % 10).encode() + data[at + 1:])
        monkeypatch.setenv("RANK", "1")
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        capsys.readouterr()
        reads.clear()
        assert not evaluate(out).up_to_date
        said = [line for line in capsys.readouterr().out.splitlines() if "is damaged" in line]
        assert len(said) == 1 and str(out / "metrics.json") in said[0], (name, said)
        assert reads.count(out / "metrics.json") == 1, (name, reads)
        monkeypatch.delenv("RANK")
