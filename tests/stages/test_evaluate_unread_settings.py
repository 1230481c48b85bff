"""evaluate settings that change no number keep every evaluate record: on_damaged (a damaged sample skipped changes
the samples read, which the loss array's sample axis and the base caches' keys record on their own), on_nonfinite
(a report made under "stop" has no non-finite sample) and a negative prompt no extra prompt reads. Before: each
changed the report's (and base images') keys, on_damaged and the negative prompt the loss array's too, so `run all`
re-ran held-out loss passes (the base's and every checkpoint's: hours at scale) and regenerated the base images for
the same numbers. Records made with them as set stay current."""

from __future__ import annotations

import json

import pytest

from test_same_content_tables import EVAL, _copy, _steps, trained  # noqa: F401 (the module fixture)


def _evaluate(store, run, single, every, model, monkeypatch, skip_if_done: bool, **settings):
    """Both reports (single-LoRA, --all-checkpoints) with EVAL and `settings`: (their results, the loss passes,
    the kept image sets written: base images, the single LoRA's and the best checkpoint's)."""
    from models import held_out
    from schemas.config import EvaluateConfig
    from stages.evaluate import base_images
    from stages.evaluate import checkpoints as ev
    from stages.evaluate import loss_pass, loss_section, stage

    passes, generated = [], []
    grid, write = held_out.loss_grid, base_images.write
    with monkeypatch.context() as m:
        counted = lambda *a, **k: passes.append(1) or grid(*a, **k)  # noqa: E731
        for module in (held_out, loss_section, loss_pass):
            m.setattr(module, "loss_grid", counted)
        m.setattr(base_images, "write", lambda *a, **k: generated.append(1) or write(*a, **k))
        cfg = EvaluateConfig(**{**EVAL, **settings})
        one = stage.run(cfg, store, model, run / "lora", single, skip_if_done=skip_if_done)
        all_ = ev.run(cfg, store, model, _steps(run), every, skip_if_done=skip_if_done)
    return one, all_, len(passes), len(generated)


def _reports(trained, model, tmp_path, monkeypatch, **settings):
    store, run = _copy(trained, tmp_path)
    single, every = tmp_path / "report", tmp_path / "checkpoints"
    *_, passes, generated = _evaluate(store, run, single, every, model, monkeypatch, False, **settings)
    # base + LoRA; base + 2 checkpoints. Image sets: a base set each, the single LoRA's, the best checkpoint's (its
    # last is the best: kept under its bytes in REPORT/lora-images since e1a3f96, so a rerun generates none)
    assert (passes, generated) == (2 + 3, 4)
    return store, run, single, every


@pytest.mark.parametrize("changed", [{"on_damaged": "skip"}, {"negative_prompt": "blurry"}, {"on_nonfinite": "skip"}],
                         ids=["on_damaged", "negative_prompt", "on_nonfinite"])
def test_a_setting_that_changes_no_number_recomputes_nothing(trained, tiny_plus_model, tmp_path, monkeypatch,
                                                             changed):
    store, run, single, every = _reports(trained, tiny_plus_model, tmp_path, monkeypatch)
    one, all_, passes, generated = _evaluate(store, run, single, every, tiny_plus_model, monkeypatch, True,
                                             **changed)
    assert one.up_to_date and all_.up_to_date and passes == generated == 0  # `run all`: before, 5 passes
    # forced: the loss array and both base caches are still this evaluation's
    one, all_, passes, generated = _evaluate(store, run, single, every, tiny_plus_model, monkeypatch, False,
                                             **changed)
    assert all_.evaluated == 0 and passes == 0 and generated == 0  # the single LoRA's grids kept too
    assert not list(every.glob("losses.*.zarr"))  # nothing set aside


def _release_before(monkeypatch) -> None:
    """on_damaged and negative_prompt hashed as set, as the release before hashed them."""
    from schemas.config import EvaluateConfig
    from schemas.lineage import IDENTITY, Role

    for name, role in (("on_damaged", IDENTITY), ("negative_prompt", Role("features"))):
        field = EvaluateConfig.model_fields[name]
        monkeypatch.setattr(field, "metadata", [role if isinstance(m, Role) else m for m in field.metadata])


def test_records_made_with_on_damaged_as_set_stay_current(trained, tiny_plus_model, tmp_path, monkeypatch):
    """Reports and a loss array the release before recorded with on_damaged=skip (and an unread negative prompt)
    in their settings: current, and the array's numbers reused when forced. The base caches are made again: their
    keys hold the source digest, which that release had another of (here faked under today's source, so only the
    settings' spelling tells them apart; no fallback reads them)."""
    from schemas.config import EvaluateConfig

    as_set = {"on_damaged": "skip", "negative_prompt": "blurry"}
    with monkeypatch.context() as before:
        _release_before(before)
        assert EvaluateConfig(**{**EVAL, **as_set}).fingerprint() != EvaluateConfig(**EVAL).fingerprint()
        store, run, single, every = _reports(trained, tiny_plus_model, tmp_path, monkeypatch, **as_set)
    assert EvaluateConfig(**{**EVAL, **as_set}).fingerprint() == EvaluateConfig(**EVAL).fingerprint()

    one, all_, passes, generated = _evaluate(store, run, single, every, tiny_plus_model, monkeypatch, True, **as_set)
    assert one.up_to_date and all_.up_to_date and passes == generated == 0
    one, all_, passes, generated = _evaluate(store, run, single, every, tiny_plus_model, monkeypatch, False, **as_set)
    assert all_.evaluated == 0 and not list(every.glob("losses.*.zarr"))  # the array kept
    # the single LoRA's base and LoRA passes; every kept image set (two bases, the single LoRA's, the best's)
    assert (passes, generated) == (2, 4)


@pytest.mark.parametrize("setting, section, left_out", [("on_damaged", "run", "damaged_samples"),
                                                        ("on_nonfinite", "loss", "nonfinite_samples")])
def test_a_report_that_left_samples_out_is_current_under_skip_only(trained, tiny_plus_model, tmp_path, monkeypatch,
                                                                   setting, section, left_out):
    """on_damaged / on_nonfinite enter no key: a report that skipped a damaged sample (or one with a non-finite
    loss) must not pass, once "stop" is set, for a report of every sample (as before, when the changed setting
    recomputed it)."""
    skip = {setting: "skip"}
    store, run, single, every = _reports(trained, tiny_plus_model, tmp_path, monkeypatch, **skip)
    for report in (single, every):  # as a run that met one left it
        metrics = json.loads((report / "metrics.json").read_text())
        metrics[section][left_out] = {"some-key": "left out"} if section == "run" else ["some-key"]
        metrics.pop("checksum", None)  # edited by hand: unsealed, as a report of an earlier release
        (report / "metrics.json").write_text(json.dumps(metrics))
    one, all_, passes, _ = _evaluate(store, run, single, every, tiny_plus_model, monkeypatch, True, **skip)
    assert one.up_to_date and all_.up_to_date and passes == 0
    one, all_, passes, _ = _evaluate(store, run, single, every, tiny_plus_model, monkeypatch, True)  # stop
    assert not one.up_to_date and not all_.up_to_date
    assert all_.evaluated == 0 and passes == 0  # the numbers are of the samples read now: the arrays are kept


def test_compare_takes_an_array_recorded_with_on_damaged_as_set(trained, tiny_plus_model, tmp_path, monkeypatch):
    """`pipeline compare` of an array the release before recorded with on_damaged=skip and one recorded now (the
    same val samples): one held-out set. Which samples were read is compared on its own (`val samples`)."""
    from schemas.config import EvaluateConfig
    from stages.evaluate import checkpoints as ev
    from stages.evaluate.compare import check_same_held_out, read_curves

    store, run = _copy(trained, tmp_path)
    cfg = EvaluateConfig(**{**EVAL, "num_samples": 0, "on_damaged": "skip"})
    with monkeypatch.context() as before:
        _release_before(before)
        ev.run(cfg, store, tiny_plus_model, _steps(run), tmp_path / "old")
    ev.run(cfg, store, tiny_plus_model, _steps(run), tmp_path / "new")
    old, new = read_curves(tmp_path / "old", "old"), read_curves(tmp_path / "new", "new")
    assert old.held_out["evaluate settings"] == new.held_out["evaluate settings"]
    check_same_held_out([old, new])
