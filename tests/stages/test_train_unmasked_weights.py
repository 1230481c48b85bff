"""`train.loss.mask_weight` weighs the tokens of masked samples only: on tables without a masked sample (neither
split) a change to it trains the same LoRA, so the run stays current (before: trained again, the same weights);
with a masked sample it trains again. A run recorded with the weights as set (before they were named by the data)
stays current too."""

from __future__ import annotations

import pytest

from pipeline.config import load_config
from train_store import make_train_store, mixed_specs

TRAIN = {"train.device": "cpu", "train.batch_size": 2, "train.lora.rank": 4, "train.sigma.sampling": "uniform",
         "train.max_steps": 2, "train.checkpoint_every": 2}
WEIGHTS = {"train.loss.mask_weight.background": 0.5, "train.loss.mask_weight.foreground": 2.0}


def _trained(root, model, masks: bool, **sets):
    from stages.train.recipe import run

    make_train_store(root / "store", model, mixed_specs(3, 2, masks=masks))
    run(load_config(None, {**TRAIN, **sets}), root / "store", model, root / "run")
    return root


def _current(root, model, **sets) -> bool:
    from stages.train.recipe import up_to_date

    return up_to_date(load_config(None, {**TRAIN, **sets}), root / "store", model, root / "run")


# (a weight of 0 names training revision 4 in the record: trained again, as before)
@pytest.mark.parametrize("changed", [{"train.loss.mask_weight.background": 0.5}, WEIGHTS])
def test_mask_weights_on_tables_without_masks_keep_the_run(tiny_edit_model, tmp_path, changed):
    root = _trained(tmp_path, tiny_edit_model, masks=False)
    assert _current(root, tiny_edit_model)
    assert _current(root, tiny_edit_model, **changed)
    assert not _current(root, tiny_edit_model, **{**changed, "train.learning_rate": 2e-4})


def test_mask_weights_on_masked_tables_train_again(tiny_edit_model, tmp_path):
    root = _trained(tmp_path, tiny_edit_model, masks=True)
    assert _current(root, tiny_edit_model)
    assert not _current(root, tiny_edit_model, **WEIGHTS)


def test_a_run_recorded_with_the_weights_as_set_stays_current(tiny_edit_model, tmp_path, monkeypatch):
    from stages.train import settings

    real = settings.weighed
    monkeypatch.setattr(settings, "weighed", lambda cfg, masked: cfg)  # a record made before the data named them
    root = _trained(tmp_path, tiny_edit_model, masks=False, **WEIGHTS)
    monkeypatch.setattr(settings, "weighed", real)
    assert _current(root, tiny_edit_model, **WEIGHTS)


@pytest.mark.parametrize("before", ["weighed", "as set"])
def test_a_run_on_tables_without_masks_resumes_with_other_weights(tiny_edit_model, tmp_path, monkeypatch, before):
    """Other weights: the resume goes on (before: refused as another config); a checkpoint recorded with the weights
    as set (before the data named them) resumes with those weights (its hash names no others)."""
    from stages.train import settings
    from stages.train.recipe import run

    real = settings.weighed
    if before == "as set":
        monkeypatch.setattr(settings, "weighed", lambda cfg, masked: cfg)
    root = _trained(tmp_path, tiny_edit_model, masks=False, **WEIGHTS)
    monkeypatch.setattr(settings, "weighed", real)
    weights = WEIGHTS if before == "as set" else {"train.loss.mask_weight.background": 0.25}
    longer = load_config(None, {**TRAIN, "train.max_steps": 3, "train.checkpoint_every": 3, **weights})
    result = run(longer, root / "store", tiny_edit_model, root / "run", resume=True)
    assert result.steps == 3 and not result.up_to_date


def test_masks_added_refuse_the_resume_naming_them(tiny_edit_model, tmp_path):
    """Masks added to tables that had none, under weights other than 1 / 1: the resume is refused (its steps weighed
    no mask), and the refusal says why; before, it named a changed config fingerprint and no changed setting."""
    from stages.train.recipe import run
    from stages.train.state import ResumeMismatch

    root = _trained(tmp_path, tiny_edit_model, masks=False, **WEIGHTS)
    make_train_store(root / "store", tiny_edit_model, mixed_specs(3, 2, masks=True))
    longer = load_config(None, {**TRAIN, "train.max_steps": 3, "train.checkpoint_every": 3, **WEIGHTS})
    with pytest.raises(ResumeMismatch, match="the vae table now holds masked samples, which "
                                             r"train.loss.mask_weight \(foreground 2.0, background 0.5\) weighs"):
        run(longer, root / "store", tiny_edit_model, root / "run", resume=True)
