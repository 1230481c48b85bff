"""`evaluate.max_loss_samples` at or above the val split's size reads every sample, as `null` does: the loss array
and the base losses are the same numbers, kept when the cap changes between such values (a 5-sample split: 256,
the default, then null); a cap below the split's size reads other samples and starts another array. Arrays
recorded with the cap as set (before) stay current."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import xarray as xr
import zarr

from schemas.config import EvaluateConfig
from stages.evaluate import checkpoints as ev
from store.loss_array import GROUP
from test_evaluate_checkpoints import CFG, _ckpts, run_and_store  # noqa: F401 (the module fixture)


def _aside(out):
    return sorted(p.name for p in out.iterdir() if p.name.startswith("losses.") and p.name != GROUP)


def _respell_as_set(out, cap: int) -> None:
    """The array and the report as a release that hashed max_loss_samples as set recorded them."""
    _respell(out, lambda settings: {**settings, "evaluate": {**settings["evaluate"], "max_loss_samples": cap}})


def _respell(out, change) -> None:
    """The array's and the report's settings as `change` makes them, fingerprinted again (as an older release
    recorded them)."""
    group = zarr.open_group(out / GROUP, mode="r+", use_consolidated=True)
    settings = change(dict(group.attrs["settings"]))
    fingerprint = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    group.attrs.update({"settings": settings, "fingerprint": fingerprint})
    zarr.consolidate_metadata(out / GROUP)
    metrics = json.loads((out / "metrics.json").read_text())
    metrics["checkpoints"]["fingerprint"] = fingerprint
    metrics["run"]["settings"] = settings
    metrics.pop("checksum", None)  # edited by hand: unsealed, as a report of an earlier release
    (out / "metrics.json").write_text(json.dumps(metrics))


def test_a_cap_at_or_above_the_val_split_keeps_the_losses(run_and_store, tiny_edit_model, tmp_path, capsys):
    root, out = run_and_store, tmp_path / "report"
    store, model = root / "store", tiny_edit_model
    first = ev.run(EvaluateConfig(**CFG), store, model, _ckpts(root), out)  # max_loss_samples 256: all 5 samples
    assert first.evaluated == 3 and first.metrics["loss"]["overall"]["n"] == 5
    losses = xr.open_zarr(out / GROUP).sortby("step").loss.values

    _respell_as_set(out, 256)  # recorded before: still this setting's report
    assert ev.run(EvaluateConfig(**CFG), store, model, _ckpts(root), out, skip_if_done=True).up_to_date
    capsys.readouterr()

    written = {f: (out / f).read_bytes() for f in ("metrics.json", "index.html")}
    every = ev.run(EvaluateConfig(**{**CFG, "max_loss_samples": None}), store, model, _ckpts(root), out,
                   skip_if_done=True)
    said = capsys.readouterr().out
    # the same samples read, the same figures: the report is current, nothing evaluated nor written again (its
    # config fingerprint named the cap as set: the report was written again, as the single-LoRA one no longer is)
    assert every.up_to_date, said
    assert {f: (out / f).read_bytes() for f in ("metrics.json", "index.html")} == written
    assert _aside(out) == []  # the array of these numbers (and its base losses) kept in place
    np.testing.assert_array_equal(xr.open_zarr(out / GROUP).sortby("step").loss.values, losses)
    assert every.best["step"] == first.best["step"] and every.metrics["loss"] == first.metrics["loss"]
    assert ev.run(EvaluateConfig(**{**CFG, "max_loss_samples": 5}), store, model, _ckpts(root), out).evaluated == 0

    # fewer than the split holds: other samples, another array (the one of all samples kept aside)
    fewer = ev.run(EvaluateConfig(**{**CFG, "max_loss_samples": 3}), store, model, _ckpts(root), out, skip_if_done=True)
    assert fewer.evaluated == 3 and xr.open_zarr(out / GROUP).sizes["sample"] == 3 and len(_aside(out)) == 1


def test_compare_takes_arrays_of_one_sample_list_whatever_their_cap(tmp_path):
    """An array recorded with the default cap as set (before `samples_read`) and one recorded now as null, over the
    same val samples, are one held-out set for `pipeline compare` (it refused them: 'max_loss_samples: 256 vs
    None'); other samples are still refused."""
    import pytest

    from schemas.errors import UserError
    from stages.evaluate.compare import check_same_held_out, read_curves
    from store.loss_array import Axes, LossStore

    def array(folder, cap, keys):
        settings = {"tables": {"text": "content:t", "vae": "content:v"}, "model_fingerprint": "m",
                    "evaluate": {"noise_seeds": [0], "timesteps": [0.5], "max_loss_samples": cap, "lora_scale": 1.0,
                                 "dtype": "float32", "attention_backend": "native", "quantize_base": "none",
                                 "on_damaged": "stop"}, "evaluation_revision": 1}
        losses = LossStore(folder, f"fingerprint {cap} {keys}", Axes(keys, ["16x16"] * len(keys), [0], [0.5]), settings)
        losses.write_base(np.ones(losses.axes.shape))
        losses.append(10, str(folder / "step-10"), "sha", np.full(losses.axes.shape, 0.5))
        return read_curves(folder, folder.name)

    before, now = array(tmp_path / "before", 256, ["a", "b"]), array(tmp_path / "now", None, ["a", "b"])
    check_same_held_out([before, now])
    with pytest.raises(UserError, match="val samples"):
        check_same_held_out([before, array(tmp_path / "fewer", 1, ["a"])])


def test_a_single_lora_report_is_kept_across_caps_that_read_every_sample(run_and_store, tiny_edit_model, tmp_path,
                                                                         monkeypatch):
    """Single-LoRA evaluate, as --all-checkpoints: 256 (the default) then null on a 5-sample split read the same
    samples, the same numbers; before, the report's config fingerprint named the cap as set, and the rerun ran the
    LoRA's loss pass again (its base losses reused). A cap below the split's size is another report."""
    from stages.evaluate import loss_section, stage

    root, out = run_and_store, tmp_path / "report"
    store, model, lora = root / "store", tiny_edit_model, dict(_ckpts(root))[10]
    first = stage.run(EvaluateConfig(**CFG), store, model, lora, out)
    passes, real = [], loss_section.loss_grid
    monkeypatch.setattr(loss_section, "loss_grid", lambda *a, **k: (passes.append(k.get("desc")), real(*a, **k))[1])
    for cap in (None, 5, 256):
        res = stage.run(EvaluateConfig(**{**CFG, "max_loss_samples": cap}), store, model, lora, out, skip_if_done=True)
        assert res.up_to_date and passes == [], (cap, passes)
    assert res.metrics["loss"] == first.metrics["loss"]
    # a report made under null is kept under 256 too
    stage.run(EvaluateConfig(**{**CFG, "max_loss_samples": None}), store, model, lora, tmp_path / "null")
    res = stage.run(EvaluateConfig(**CFG), store, model, lora, tmp_path / "null", skip_if_done=True)
    assert res.up_to_date
    # another report (another LoRA scale) under the other cap: its LoRA pass only, the base losses kept (their
    # key held the cap as set)
    passes.clear()
    scaled = stage.run(EvaluateConfig(**{**CFG, "max_loss_samples": None, "lora_scale": 0.5}), store, model, lora, out,
                       skip_if_done=True)
    assert not scaled.up_to_date and passes == ["held-out loss (lora)"], passes
    passes.clear()
    fewer = stage.run(EvaluateConfig(**{**CFG, "max_loss_samples": 3}), store, model, lora, out, skip_if_done=True)
    assert not fewer.up_to_date and "held-out loss (lora)" in passes and fewer.metrics["loss"]["overall"]["n"] == 3


def test_a_val_sample_after_those_scored_keeps_the_losses_and_a_scored_one_changed_does_not(
        run_and_store, tiny_edit_model, tmp_path, capsys):
    """The losses (the array, the base losses) are keyed by the val samples read: the first max_loss_samples of
    the split. Keyed by the whole split, a sample added or changed after those (never read) evaluated every
    checkpoint and the base again. Val samples 1..5 sort as keys 2, 1, 3, 5, 4; a sixth sorts third: with a cap of
    2 it is not read, nor is sample 4 (last). Sample 1 is read: changed, it is evaluated again."""
    from train_store import make_train_store, mixed_specs

    ckpts, model, out = _ckpts(run_and_store), tiny_edit_model, tmp_path / "report"
    cfg = EvaluateConfig(**{**CFG, "max_loss_samples": 2})

    def store(name: str, n_val: int = 5, **kw):  # encoded-like tables: named by content
        make_train_store(tmp_path / name, model, mixed_specs(1, n_val, masks=True),
                         attrs={"feature_lineage": "encoded-by-a-stage"}, **kw)
        return tmp_path / name

    first = ev.run(cfg, store("five"), model, ckpts, out)
    assert first.evaluated == 3 and first.metrics["loss"]["overall"]["n"] == 2
    grown = ev.run(cfg, store("six", 6), model, ckpts, out, skip_if_done=True)  # before: 3 evaluated again
    assert grown.up_to_date, capsys.readouterr().out
    # a report of its own on the six-sample split: one held-out set for `pipeline compare` (before: "store tables")
    from stages.evaluate.compare import check_same_held_out, read_curves

    ev.run(cfg, tmp_path / "six", model, ckpts, tmp_path / "report-six")
    check_same_held_out([read_curves(out, "five"), read_curves(tmp_path / "report-six", "six")])
    late = ev.run(cfg, store("late", poison={4: 3.0}), model, ckpts, out, skip_if_done=True)
    assert late.up_to_date and _aside(out) == []
    capsys.readouterr()
    scored = ev.run(cfg, store("scored", poison={1: 3.0}), model, ckpts, out, skip_if_done=True)
    assert not scored.up_to_date and scored.evaluated == 3
    said = capsys.readouterr().out
    assert "base held-out loss: unchanged inputs" not in said  # the base computed again too
    assert scored.metrics["loss"]["overall"]["base"] != first.metrics["loss"]["overall"]["base"]


def _respell_tables(out, tables: dict) -> None:
    """The array and the report as a release that keyed the tables by the whole val split recorded them."""
    _respell(out, lambda settings: {**settings, "tables": tables})


def test_losses_keyed_by_the_whole_val_split_before_stay_current_for_that_split_only(
        run_and_store, tiny_edit_model, tmp_path):
    """An array an earlier release keyed by the whole split's content ids is this split's (its first samples are
    the ones read), not another split's with the same samples read: that one evaluates again."""
    from features.open import open_configured
    from models.loading import model_files
    from train_store import make_train_store, mixed_specs

    ckpts, model, out = _ckpts(run_and_store), tiny_edit_model, tmp_path / "report"
    cfg = EvaluateConfig(**{**CFG, "max_loss_samples": 2})

    def whole_split(name: str, n_val: int) -> tuple:
        make_train_store(tmp_path / name, model, mixed_specs(1, n_val, masks=True),
                         attrs={"feature_lineage": "encoded-by-a-stage"})
        with open_configured(cfg, "evaluate", tmp_path / name, model, model_files(model), "val") as tables:
            return tmp_path / name, tables.content_names()

    (five, five_ids), (_, six_ids) = whole_split("five", 5), whole_split("six", 6)
    assert five_ids != six_ids
    ev.run(cfg, five, model, ckpts, out)
    _respell_tables(out, five_ids)
    assert ev.run(cfg, five, model, ckpts, out, skip_if_done=True).up_to_date
    _respell_tables(out, six_ids)  # recorded for the six-sample split: not taken for the five's
    again = ev.run(cfg, five, model, ckpts, out, skip_if_done=True)
    assert not again.up_to_date and again.evaluated == 3


def test_a_damaged_sample_skipped_among_those_scored_keeps_the_report_current(run_and_store, tiny_edit_model,
                                                                             tmp_path):
    """on_damaged=skip: a damaged val sample among the first max_loss_samples is left out and the next row read in
    its place, so the losses are keyed by one row more; the up-to-date check counts the report's damaged samples
    alike (else every rerun found the report not current and wrote it again)."""
    from store import Store
    from train_store import key_of, make_train_store, mixed_specs

    ckpts, model, out, root = _ckpts(run_and_store), tiny_edit_model, tmp_path / "report", tmp_path / "store"
    make_train_store(root, model, mixed_specs(1, 5, masks=True), attrs={"feature_lineage": "encoded-by-a-stage"},
                     shard_size_mb=1e-6)  # a shard a sample
    r = Store(root, create=False).reader("vae", on_damaged="skip")
    shard = r.dir / r.manifest.to_pylist()[r.keys().index(key_of(1))]["shard"]  # val sample 1 sorts second
    r.close()
    shard.write_bytes(shard.read_bytes()[:600])
    cfg = EvaluateConfig(**{**CFG, "max_loss_samples": 2, "on_damaged": "skip", "max_damaged_fraction": 0.5})
    first = ev.run(cfg, root, model, ckpts, out)
    assert first.evaluated == 3 and first.metrics["loss"]["overall"]["n"] == 2
    assert key_of(1) in first.metrics["run"]["damaged_samples"]
    assert ev.run(cfg, root, model, ckpts, out, skip_if_done=True).up_to_date
    from stages.evaluate import stage  # the single-LoRA report alike

    one = stage.run(cfg, root, model, ckpts[0][1], tmp_path / "one")
    assert not one.up_to_date and key_of(1) in one.damaged
    assert stage.run(cfg, root, model, ckpts[0][1], tmp_path / "one", skip_if_done=True).up_to_date
