"""`evaluate --all-checkpoints` beside a training that is still writing the run: its checkpoints can be pruned
(train.keep_checkpoints) or rewritten while evaluate runs. Such a checkpoint is left out with a line naming it;
the others are evaluated, and no number is recorded under a hash of bytes other than the ones evaluated."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

from schemas.config import EvaluateConfig
from stages.evaluate import best_checkpoint, checkpoint_files, checkpoints as ev, loss_pass
from read_counter import count_lora_reads
from store.loss_array import GROUP
from test_evaluate_checkpoints import CFG, _ckpts, run_and_store  # noqa: F401 (the module fixture)

WEIGHTS = "pytorch_lora_weights.safetensors"


def _copy_run(run_and_store, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(run_and_store / "run", root / "run")
    return root


def _while_the_first_is_evaluated(monkeypatch, action):
    """Run `action` while the held-out loss of the first checkpoint evaluated (the newest, step 30) is computed
    (the base is first)."""
    real, calls = loss_pass.loss_grid, []

    def loss_grid(*a, **k):
        calls.append(k.get("desc", a[-1] if len(a) > 5 else ""))
        if len(calls) == 2:
            action()
        return real(*a, **k)

    monkeypatch.setattr(loss_pass, "loss_grid", loss_grid)


def test_a_checkpoint_pruned_while_evaluating_is_left_out_and_the_others_are_evaluated(
        run_and_store, tiny_edit_model, tmp_path, monkeypatch, capsys):
    root = _copy_run(run_and_store, tmp_path)
    _while_the_first_is_evaluated(monkeypatch, lambda: shutil.rmtree(root / "run" / "checkpoints" / "step-20"))
    res = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, _ckpts(root), tmp_path / "r")
    assert res.evaluated == 2
    assert res.metrics["checkpoints"]["steps"] == [10, 30]
    assert res.best["step"] == 30  # the zero LoRA (= the base) beats the far one; step 20 is gone
    err = "".join(capsys.readouterr())
    assert "checkpoint step 20 was deleted before it was evaluated" in err and "train.keep_checkpoints" in err
    assert res.pruned == [20] and "1 deleted meanwhile, skipped: the training keeps only its newest" in str(res)
    # appended newest first (the ones a training prunes last); sorted, the steps evaluated
    assert list(xr.open_zarr(tmp_path / "r" / GROUP).sortby("step").step.values) == [10, 30]


def test_a_checkpoint_pruned_while_hashing_is_left_out(run_and_store, tiny_edit_model, tmp_path, monkeypatch,
                                                       capsys):
    root = _copy_run(run_and_store, tmp_path)
    real = checkpoint_files.lora_digest

    def lora_digest(path, hashes):  # step 10 hashed: the training prunes step 20 meanwhile
        if "step-10" in str(path):
            shutil.rmtree(root / "run" / "checkpoints" / "step-20", ignore_errors=True)
        return real(path, hashes)

    monkeypatch.setattr(checkpoint_files, "lora_digest", lora_digest)
    res = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, _ckpts(root), tmp_path / "r")
    assert res.metrics["checkpoints"]["steps"] == [10, 30]
    assert "checkpoint step 20 was deleted before it was evaluated" in "".join(capsys.readouterr())


def test_a_checkpoint_rewritten_while_evaluating_is_not_recorded_under_its_old_hash(
        run_and_store, tiny_edit_model, tmp_path, monkeypatch, capsys):
    """Step 10 (a far LoRA when hashed) is rewritten with step 30's zero weights before it is loaded (a training
    restarted into the run folder). Before, its losses were those of the new bytes recorded under the old bytes'
    hash: the report showed step 10 as good as step 30, and a rerun found the array 'up to date' for the file."""
    root = _copy_run(run_and_store, tmp_path)
    ck = root / "run" / "checkpoints"
    _while_the_first_is_evaluated(monkeypatch, lambda: shutil.copyfile(ck / "step-30" / "lora" / WEIGHTS,
                                                                       ck / "step-10" / "lora" / WEIGHTS))
    out = tmp_path / "r"
    res = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, _ckpts(root), out)
    assert res.metrics["checkpoints"]["steps"] == [20, 30]
    assert "checkpoint step 10 was rewritten while evaluating" in "".join(capsys.readouterr())
    monkeypatch.undo()
    again = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, _ckpts(root), out)
    assert again.evaluated == 1 and again.metrics["checkpoints"]["steps"] == [10, 20, 30]
    per_step = again.metrics["checkpoints"]["per_step"]
    np.testing.assert_allclose(per_step[0]["overall"], per_step[2]["overall"], rtol=1e-6)  # its bytes now: step 30's


def test_a_truncated_unsealed_checkpoint_stops_naming_its_step_and_what_to_do(run_and_store, tiny_edit_model,
                                                                                tmp_path):
    """A checkpoint whose resume.json seals no checksums (written before them) and whose LoRA file is cut short:
    one line naming the step and how to evaluate the others, before anything is evaluated (before: the file's
    parse error with the advice for a final LoRA, 'pass the LoRA written by pipeline run train (RUN/lora)')."""
    import pytest

    from schemas.errors import UserError

    root = _copy_run(run_and_store, tmp_path)
    weights = root / "run" / "checkpoints" / "step-20" / "lora" / WEIGHTS
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(UserError) as e:
        ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, _ckpts(root), tmp_path / "r")
    msg = str(e.value)
    assert msg.startswith("checkpoint step 20: ") and str(weights) in msg and "\n" not in msg
    assert f"move {weights.parent.parent} out of the run's checkpoints/" in msg
    assert not (tmp_path / "r" / GROUP).exists()  # nothing evaluated


def test_a_checkpoint_of_another_lora_rank_is_evaluated_as_saved(run_and_store, tiny_edit_model, tmp_path):
    """A run folder holding checkpoints of two trainings with other LoRA ranks (8 at step 5, then 4): each
    checkpoint goes through an adapter built from its own saved config, so its held-out loss is what single-LoRA
    evaluate gives for it. Before, the rank-4 checkpoints were copied into the rank-8 adapter and refused ('shapes
    differ'), stopping the whole run. Generation switches ranks too: the best (step 5, rank 8) after the loop
    left the rank-4 adapter of step 30, then the last (step 30, rank 4)."""
    import torch

    from models.loading import load_component
    from models.lora import add_lora, save_lora
    from schemas.config import LoraConfig
    from stages.evaluate import stage

    root = _copy_run(run_and_store, tmp_path)
    t = load_component(tiny_edit_model, "transformer")
    with torch.random.fork_rng():
        torch.manual_seed(5)
        add_lora(t, LoraConfig(rank=8, alpha=8.0))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in t.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 20.0)
    folder = root / "run" / "checkpoints" / "step-5"
    save_lora(t, folder / "lora")
    (folder / "resume.json").write_text("{}")
    ckpts = [(5, folder / "lora"), *_ckpts(root)]

    res = ev.run(EvaluateConfig(**{**CFG, "num_samples": 1, "num_inference_steps": 2}), run_and_store / "store",
                 tiny_edit_model, ckpts, tmp_path / "r")
    c = res.metrics["checkpoints"]
    assert c["steps"] == [5, 10, 20, 30] and c["last"]["step"] == 30
    one = stage.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, folder / "lora", tmp_path / "one")
    np.testing.assert_allclose(c["per_step"][0]["overall"], one.metrics["loss"]["overall"]["lora"], rtol=1e-6)
    # with these seeds the rank-8 LoRA lowers this tiny random model's loss (a random direction can): the best
    assert res.best["step"] == 5 and c["per_step"][0]["overall"] < c["base"]["overall"]
    assert (tmp_path / "r" / "index.html").is_file()  # base, best (rank 8) and last (rank 4) generated


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_a_loha_or_lokr_checkpoint_of_another_alpha_is_scored_at_its_own_alpha(kind, tiny_edit_model, tmp_path):
    """Two trainings' LoHa / LoKr checkpoints in one run folder, the same weights saved under alpha 4 (step 10)
    and 16 (step 20). peft names their alpha `alpha`, not `lora_alpha`, so copying step 20 into the adapter built
    for step 10 went unchecked: step 20 was scored at alpha 4, i.e. as step 10 (its number equal to step 10's,
    not to its own)."""
    import torch

    from models.loading import load_component
    from models.lora import add_lora, save_lora
    from schemas.config import LoraConfig
    from train_store import make_train_store, mixed_specs

    make_train_store(tmp_path / "store", tiny_edit_model, mixed_specs(1, 3))
    ckpts = []
    for step, alpha in ((10, 4.0), (20, 16.0)):
        t = load_component(tiny_edit_model, "transformer")
        add_lora(t, LoraConfig(rank=4, alpha=alpha, kind=kind))
        g = torch.Generator().manual_seed(1)  # the same factors in both: only alpha differs
        with torch.no_grad():
            for name, p in t.named_parameters():
                if f"{kind}_" in name or "hada_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        folder = tmp_path / "run" / "checkpoints" / f"step-{step}"
        save_lora(t, folder / "lora")
        (folder / "resume.json").write_text("{}")
        ckpts.append((step, folder / "lora"))
    cfg = EvaluateConfig(**{**CFG, "noise_seeds": [0], "timesteps": [0.5]})
    both = ev.run(cfg, tmp_path / "store", tiny_edit_model, ckpts, tmp_path / "both")
    alone = ev.run(cfg, tmp_path / "store", tiny_edit_model, ckpts[1:], tmp_path / "alone")
    per_step = [p["overall"] for p in both.metrics["checkpoints"]["per_step"]]
    assert per_step[1] == alone.metrics["checkpoints"]["per_step"][0]["overall"]
    assert per_step[0] != per_step[1]  # the alpha does change the numbers


def test_the_best_checkpoint_rewritten_before_its_images_is_refused_not_pictured(
        run_and_store, tiny_edit_model, tmp_path, monkeypatch):
    """Step 20 (best: a zero LoRA) is rewritten with step 10's far weights after the losses were computed and
    before the base / best / last images are generated. Before, the 'best (step 20)' column silently showed the
    new weights under the old weights' numbers; now evaluate stops naming the step."""
    import pytest

    from schemas.errors import UserError

    root = _copy_run(run_and_store, tmp_path)
    ck = root / "run" / "checkpoints"
    real = best_checkpoint._summary

    def summary_then_rewrite(*a, **k):
        out = real(*a, **k)
        shutil.copyfile(ck / "step-10" / "lora" / WEIGHTS, ck / "step-20" / "lora" / WEIGHTS)
        return out

    monkeypatch.setattr(best_checkpoint, "_summary", summary_then_rewrite)
    cfg = EvaluateConfig(**{**CFG, "num_samples": 1, "num_inference_steps": 2})
    with pytest.raises(UserError, match="checkpoint step 20 was rewritten after its held-out loss") as e:
        ev.run(cfg, run_and_store / "store", tiny_edit_model, _ckpts(root), tmp_path / "r")
    assert "\n" not in str(e.value)
    assert list(xr.open_zarr(tmp_path / "r" / GROUP).sortby("step").step.values) == [10, 20, 30]  # kept


def test_the_best_checkpoint_rewritten_after_its_losses_is_not_named_without_pictures(
        run_and_store, tiny_edit_model, tmp_path, monkeypatch):
    """No pictures (num_samples 0, as checkpoint selection is often run): step 20 (the best, a zero LoRA) is
    rewritten with step 10's far weights while step 10 - the last evaluated, newest first - is computed. Before,
    the summary named RUN/checkpoints/step-20/lora the best under the old weights' numbers (only a pictured best
    was read again); now evaluate stops with the pictured path's line, the losses kept for the rerun."""
    from schemas.errors import UserError

    root = _copy_run(run_and_store, tmp_path)
    ck = root / "run" / "checkpoints"
    real, calls = loss_pass.loss_grid, []

    def loss_grid(*a, **k):  # base, step 30, step 20, step 10
        calls.append(1)
        if len(calls) == 4:
            shutil.copyfile(ck / "step-10" / "lora" / WEIGHTS, ck / "step-20" / "lora" / WEIGHTS)
        return real(*a, **k)

    monkeypatch.setattr(loss_pass, "loss_grid", loss_grid)
    with pytest.raises(UserError, match="checkpoint step 20 was rewritten after its held-out loss") as e:
        ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, _ckpts(root), tmp_path / "r")
    assert "\n" not in str(e.value) and not (tmp_path / "r" / "metrics.json").exists()
    assert list(xr.open_zarr(tmp_path / "r" / GROUP).sortby("step").step.values) == [10, 20, 30]  # kept


# ---- evaluate beside a fast training (train.checkpoint_every=2, keep_checkpoints small): it prunes the oldest
# checkpoints and writes new ones while evaluate runs. Pruned ones are skipped with a line, never a failure.


def _cli(root, store, model, out, as_json: bool = True):
    """`pipeline run evaluate --all-checkpoints --run ROOT/run [--json]`, in this process (its hooks apply)."""
    from typer.testing import CliRunner

    from pipeline.cli import app

    args = ["run", "evaluate", "--all-checkpoints", "--run", str(root / "run"), "--store", str(store), "--model",
            model, "--out", str(out), "--num-samples", "0", *(["--json"] if as_json else []),
            *[x for k, v in {"evaluate.noise_seeds": "[0, 1]", "evaluate.timesteps": "[0.3, 0.7]"}.items()
              for x in ("--set", f"{k}={v}")]]
    res = CliRunner().invoke(app, args)
    return res, (json.loads(res.stdout.strip().splitlines()[-1]) if res.exit_code == 0 and as_json else None)


def _training_meanwhile(monkeypatch, at_call: int, new_steps: list[int], keep: int, ck):
    """At the `at_call`-th loss pass (1 = the base), once: the training writes checkpoints `new_steps` (copies of
    step 20, a zero LoRA, with its sealed resume.json) and prunes to its newest `keep`, as train does."""
    from stages.train.state import prune

    def training():
        for step in new_steps:
            shutil.copytree(ck / "step-20", ck / f"step-{step}")
        prune(ck, keep)

    real, calls = loss_pass.loss_grid, []

    def loss_grid(*a, **k):
        calls.append(1)
        if len(calls) == at_call:
            training()
        return real(*a, **k)

    monkeypatch.setattr(loss_pass, "loss_grid", loss_grid)


def test_every_checkpoint_evaluated_pruned_meanwhile_evaluates_the_newer_ones(run_and_store, tiny_edit_model,
                                                                               tmp_path, monkeypatch):
    """The training prunes every checkpoint evaluate listed (10, 20, 30) while the last is evaluated, and writes
    steps 40 and 50. Before, evaluate ended rc 1 ('no checkpoint recorded ... is still on disk') after its work;
    now it lists the run again, evaluates the newer ones (newest first) and names the best still on disk."""
    root = _copy_run(run_and_store, tmp_path)
    ck = root / "run" / "checkpoints"
    _training_meanwhile(monkeypatch, 4, [40, 50], 2, ck)  # base, 30, 20, then 10's pass: 10..30 pruned
    res, record = _cli(root, run_and_store / "store", tiny_edit_model, tmp_path / "r")
    assert res.exit_code == 0, res.output
    assert record["checkpoints"] == [10, 20, 30, 40, 50] and record["checkpoints_evaluated"] == 5
    assert record["best_step"] in (40, 50) and Path(record["best_checkpoint"]).is_dir()
    assert record["checkpoints_pruned"] == [] and record["checkpoints_newer"] == []
    assert "every checkpoint evaluated was deleted meanwhile, as the training keeps only its newest checkpoints " \
           "(train.keep_checkpoints): evaluating the 2" in res.output


@pytest.mark.parametrize("as_json", [True, False])
def test_a_checkpoint_pruned_before_its_turn_is_skipped_and_newer_ones_are_named(as_json, run_and_store,
                                                                                 tiny_edit_model, tmp_path,
                                                                                 monkeypatch):
    """While the newest (step 30) is evaluated, the training writes step 40 and prunes step 10: step 10 is skipped
    with a line and counted, the others kept, and step 40 named for a rerun (before: evaluated oldest first, and
    the newer checkpoint went unsaid)."""
    root = _copy_run(run_and_store, tmp_path)
    ck = root / "run" / "checkpoints"
    _training_meanwhile(monkeypatch, 2, [40], 3, ck)
    res, record = _cli(root, run_and_store / "store", tiny_edit_model, tmp_path / "r", as_json)
    assert res.exit_code == 0, res.output
    assert "checkpoint step 10 was deleted before it was evaluated" in res.output
    metrics = json.loads((tmp_path / "r" / "metrics.json").read_text())["checkpoints"]
    assert metrics["steps"] == [20, 30] and metrics["best"]["step"] == 20
    if as_json:
        assert record["checkpoints_pruned"] == [10] and record["checkpoints_newer"] == [40]
    else:
        assert "(0 already in" in res.output
        assert "; 1 deleted meanwhile, skipped: the training keeps only its newest checkpoints " \
               "(train.keep_checkpoints))" in res.output
        assert "; 1 newer checkpoint was written meanwhile (step 40): rerun to include it" in res.output


def test_a_checkpoint_pruned_while_its_bytes_are_loaded_is_evaluated_from_them_not_refused(
        run_and_store, tiny_edit_model, tmp_path, monkeypatch, capsys):
    """The training prunes step 30 right after evaluate read its bytes (mid-load): the bytes read whole are the
    ones hashed, so step 30 is evaluated from them (kept on the curve, no longer on disk: not the best), not
    refused as damaged nor thrown away. Before, loading looked the file up again and left step 30 out."""
    from stages.evaluate import lora_bytes

    root = _copy_run(run_and_store, tmp_path)
    ck = root / "run" / "checkpoints"
    real = lora_bytes.read_for_load

    def read_then_pruned(path):
        out = real(path)
        if "step-30" in str(path) and (ck / "step-30").exists():  # as train prunes: rename away, then remove
            os.rename(ck / "step-30", ck / ".step-30.deleting")
            shutil.rmtree(ck / ".step-30.deleting")
        return out

    monkeypatch.setattr(lora_bytes, "read_for_load", read_then_pruned)
    res = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, _ckpts(root), tmp_path / "r")
    c = res.metrics["checkpoints"]
    assert c["steps"] == [10, 20, 30] and c["on_disk"] == [True, True, False] and res.best["step"] == 20
    assert res.pruned == [] and res.evaluated == 3
    err = "".join(capsys.readouterr())
    assert "damaged" not in err and "changed after it was written" not in err


def test_base_losses_computed_after_a_checkpoint_was_loaded_are_the_base_models(run_and_store, tiny_edit_model,
                                                                               tmp_path):
    """The training restarts beside evaluate: the checkpoints evaluated are all pruned and a newer one of another
    training is written, so the array goes aside and the base losses are needed again, after a checkpoint's LoRA
    was loaded (here the kept base-losses file holds another key, as one of another release does). They were
    computed with that LoRA on, recorded as the base and written to the base-losses file for later runs."""
    root = _copy_run(run_and_store, tmp_path)
    ck, out, store = root / "run" / "checkpoints", tmp_path / "r", run_and_store / "store"
    for step in (10, 20):
        (ck / f"step-{step}" / "resume.json").write_text(json.dumps({"config_fingerprint": "first training"}))
    cfg = EvaluateConfig(**CFG)
    ev.run(cfg, store, tiny_edit_model, _ckpts(root)[:2], out)
    base = xr.open_zarr(out / GROUP).base_loss.values
    (out / "base-losses.safetensors").unlink()
    shutil.rmtree(ck / "step-30")
    shutil.copytree(ck / "step-10", ck / "step-30")  # the far LoRA: the one loaded when the base is needed again

    def relist():  # after step 30 was evaluated: 10..30 gone, step 40 (a zero LoRA) of another training
        if (ck / "step-10").exists():
            for step in (10, 20, 30):
                shutil.rmtree(ck / f"step-{step}")
            shutil.copytree(run_and_store / "run" / "checkpoints" / "step-20", ck / "step-40")
            (ck / "step-40" / "resume.json").write_text(json.dumps({"config_fingerprint": "second training"}))
        return [(40, ck / "step-40" / "lora")]

    res = ev.run(cfg, store, tiny_edit_model, _ckpts(root), out, relist=relist)
    assert res.metrics["checkpoints"]["steps"] == [40] and res.best["step"] == 40
    np.testing.assert_allclose(xr.open_zarr(out / GROUP).base_loss.values, base, rtol=1e-6)
    from safetensors import safe_open

    with safe_open(str(out / "base-losses.safetensors"), framework="numpy") as f:  # kept for later runs
        np.testing.assert_allclose(f.get_tensor("base"), base, rtol=1e-6)
    c = res.metrics["checkpoints"]
    assert c["per_step"][0]["overall"] == pytest.approx(c["base"]["overall"], rel=1e-6)  # a zero LoRA: the base


def test_an_up_to_date_rerun_reads_no_checkpoint_and_a_rewritten_one_is_still_caught(
        run_and_store, tiny_edit_model, tmp_path, monkeypatch, capsys):
    """The up-to-date check hashed every checkpoint whole on every run (100 checkpoints of 0.5 GB: 50 GB read to
    say "up to date", on every rank): their sha256 is remembered by `models.file_hashes` now. A checkpoint
    rewritten with the same size and its mtime put back is read again (its new ctime gives it away) and evaluated
    again under its new bytes, as before."""
    root = _copy_run(run_and_store, tmp_path)
    ck, out = root / "run" / "checkpoints", tmp_path / "r"
    ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, _ckpts(root), out)
    read = count_lora_reads(monkeypatch)
    again = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, _ckpts(root), out,
                   skip_if_done=True)
    assert again.up_to_date and sum(read.values()) == 0  # before: every checkpoint's bytes
    # step 10 rewritten in place with step 30's bytes (a zero LoRA: the same size), its mtime restored
    step10, step30 = ck / "step-10" / "lora" / WEIGHTS, ck / "step-30" / "lora" / WEIGHTS
    st = step10.stat()
    assert step30.stat().st_size == st.st_size
    fd = os.open(step10, os.O_WRONLY)  # in place: the same inode and size
    os.write(fd, step30.read_bytes())
    os.close(fd)
    os.utime(step10, ns=(st.st_atime_ns, st.st_mtime_ns))
    capsys.readouterr()
    rerun = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, _ckpts(root), out,
                   skip_if_done=True)
    assert not rerun.up_to_date and rerun.evaluated == 3 and read[str(step10.resolve())] >= st.st_size
    assert "checkpoint step 10 holds other weights than the losses recorded" in capsys.readouterr().out


def test_a_checkpoint_that_cannot_be_read_at_its_load_names_the_read_error_not_a_move(tmp_path):
    """A checkpoint still there whose read fails at its load (a disk error, a permission) was told to be moved out
    of the run, as one of another base model is; its check said "cannot read" already: one line for both now."""
    from schemas.errors import UserError

    path = tmp_path / "checkpoints" / "step-20" / "lora"
    read = checkpoint_files.unloadable(20, path, PermissionError(13, "Permission denied"))
    assert str(read).startswith(f"checkpoint step 20: cannot read {path} (") and "move" not in str(read)
    refused = checkpoint_files.unloadable(20, path, UserError("saved [4, 8], model [4, 16]"))
    assert f"or move {path.parent} out of the run's checkpoints/" in str(refused)
