"""`stages.train.start.check_same_start`: which refusal ranks whose starts differ get. The training revision is a
function of the config (`settings.training_revision`), so two nodes' config copies that differ in grad_accum
differ in their revision too; the refusal must name the config, not tell the user to reinstall the pipeline."""

from __future__ import annotations

import pytest

from models import collective
from pipeline.config import load_config
from schemas.errors import UserError
from stages.train.settings import config_fingerprint, training_revision
from stages.train.start import check_same_start
from stages.train.state import ResumeRecord


def _record(tc) -> ResumeRecord:
    return ResumeRecord(step=0, epoch=0, batch_in_epoch=0, config_fingerprint=config_fingerprint(tc), tables={},
                        store="s", model_fingerprint="m", world_size=2, training_revision=training_revision(tc))


def _digests(record: ResumeRecord) -> str:  # what check_same_start gathers, as rank 1 sends it
    return " ".join([record.config_fingerprint, record.init_lora_sha256 or "0", f"{record.training_revision:x}"])


def test_node_configs_that_differ_in_grad_accum_are_refused_as_differing_settings(monkeypatch) -> None:
    mine = load_config(None, {"train.grad_accum": 1}).train
    theirs = load_config(None, {"train.grad_accum": 2}).train
    assert training_revision(mine) != training_revision(theirs)  # the case: the revision follows the config
    monkeypatch.setattr(collective.agree, "gather_texts",
                        lambda world, text, *a: [text, _digests(_record(theirs))])
    with pytest.raises(UserError, match="the ranks do not train with the same settings"):
        check_same_start(2, _record(mine))


def test_the_same_config_under_another_revision_is_another_install(monkeypatch) -> None:
    tc = load_config(None, {"train.grad_accum": 2}).train
    other = ResumeRecord(**{**_record(tc).__dict__, "training_revision": training_revision(tc) + 1})
    monkeypatch.setattr(collective.agree, "gather_texts", lambda world, text, *a: [text, _digests(other)])
    with pytest.raises(UserError, match="the ranks do not run the same training code"):
        check_same_start(2, _record(tc))
