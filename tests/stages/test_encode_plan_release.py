"""An encode job whose planning fails after it took its read lease on `images` and opened the reader (a model
whose fingerprint cannot be taken) leaves neither behind: before, the lease file stayed until the process exited
(a `run all`, or the tests, goes on: `store gc` kept that images version meanwhile) and the reader stayed open."""

from __future__ import annotations

from pathlib import Path

import pytest

from models.loading import ModelNotFoundError
from stages.encode.plan import _open_job
from stages.encode.ranks import Ranks
from store import lease
from store.reader import TableReader


def test_a_failing_model_fingerprint_releases_the_lease_and_closes_the_images_reader(edit_store: Path, tmp_path: Path,
                                                                                     monkeypatch) -> None:
    closed: list[str] = []
    real_close = TableReader.close
    monkeypatch.setattr(TableReader, "close", lambda self: closed.append(self.table) or real_close(self))
    not_a_model = tmp_path / "model"
    not_a_model.mkdir()  # a folder without model_index.json: model_fingerprint raises
    with pytest.raises(ModelNotFoundError, match="no model_index.json"):
        _open_job(edit_store, "encode-vae", "vae", {}, str(not_a_model), "r1", Ranks())
    assert sorted((edit_store / lease.LEASES_DIR).glob("*.json")) == []
    assert closed == ["images"]
