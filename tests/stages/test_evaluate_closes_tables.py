"""Single-LoRA evaluate closes the val tables it read on every path: a failure after they were opened released
neither the readers nor the read lease, and `pipeline run all` goes on in the same process (a lease held keeps
`store gc` from removing that version)."""

from __future__ import annotations

import pytest

from schemas.config import EvaluateConfig
from schemas.errors import UserError
from stages.evaluate import stage
from store.lease import LEASES_DIR
from test_evaluate_checkpoints import CFG, _ckpts, run_and_store  # noqa: F401 (the module fixture)


def test_a_failing_evaluate_releases_its_read_lease(run_and_store, tiny_edit_model, tmp_path, monkeypatch):
    root = run_and_store
    leases = root / "store" / LEASES_DIR

    def fails(*a, **k):  # after the tables are read and leased, as a model that cannot load
        assert list(leases.glob("*.json")), "the val tables are read under a lease"
        raise UserError("the transformer cannot load (injected)")

    monkeypatch.setattr(stage, "load_transformer", fails)
    with pytest.raises(UserError, match="injected") as failed:
        stage.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, dict(_ckpts(root))[10], tmp_path / "out")
    # the error (its traceback holding the stage's frame) is still alive, as it is while `run all` handles it
    assert failed.value is not None and list(leases.glob("*.json")) == []
