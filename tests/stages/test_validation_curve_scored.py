"""Train's validation curve (RUN/losses.zarr) is named by the val samples it reads: the first
`validate_max_samples` (sorted keys) and the damaged ones left out, as evaluate names its loss arrays
(`features.damaged.rows_read`). Before, it was named by the whole val split's content: a val sample added or
changed past those rows (an `images` rerun) gave the curve another setting, so a resume set it aside and began
anew, and `pipeline compare` refused two runs' curves of the same samples ("store tables"). A curve recorded under
the whole split's name is continued."""

from __future__ import annotations

import numpy as np

from schemas.config import TrainConfig
from stages.train.val_curve import ValidationCurve
from stages.train.validate import Validator
from train_store import key_of, make_train_store, mixed_specs

ENCODED = {"feature_lineage": "encoded-by-a-stage"}  # content ids are recorded for tables an encode stage wrote
VAL = (4, 5, 6)  # mixed_specs(4, 3)'s val samples
CFG = TrainConfig(device="cpu", validate_every=1, validate_max_samples=1)


def _validator(tmp_path, model, name: str, poison: dict | None = None, start_step: int = 0) -> Validator:
    store = tmp_path / name
    if not store.exists():
        make_train_store(store, model, mixed_specs(4, 3), attrs=ENCODED, poison=poison)
    (tmp_path / "run").mkdir(exist_ok=True)
    return Validator(CFG, store, model, tmp_path / "run", start_step=start_step)


def test_the_curve_is_named_by_the_samples_it_reads(tiny_edit_model, tmp_path) -> None:
    first = _validator(tmp_path, tiny_edit_model, "store")
    read = [i for i in VAL if key_of(i) == first.samples[0].key]
    unread = [i for i in VAL if i not in read]
    assert len(first.samples) == 1 and len(read) == 1
    past = _validator(tmp_path, tiny_edit_model, "changed-past", {unread[0]: 3.0})  # another val sample's latent
    assert past.curve.settings["tables"] == first.curve.settings["tables"]
    assert past.curve.fingerprint == first.curve.fingerprint
    scored = _validator(tmp_path, tiny_edit_model, "changed-read", {read[0]: 3.0})  # the sample it reads
    assert scored.curve.fingerprint != first.curve.fingerprint


def test_a_curve_named_by_the_whole_split_is_continued(tiny_edit_model, tmp_path) -> None:
    from features.open import open_configured
    from models.loading import model_files

    today = _validator(tmp_path, tiny_edit_model, "store")
    with open_configured(CFG, "train", tmp_path / "store", tiny_edit_model, model_files(tiny_edit_model),
                         "val") as tables:
        whole = tables.content_names()
    assert whole != today.curve.settings["tables"]
    earlier = ValidationCurve(CFG, tmp_path / "run", today.samples, whole, today.curve.versions,
                              today.curve.settings["model_fingerprint"])  # as the curve was named before
    grid = np.zeros((1, 1, 3, 3))
    earlier.record(2, grid, grid)
    resumed = _validator(tmp_path, tiny_edit_model, "store", start_step=2)
    assert resumed.curve.recorded_fingerprint() == earlier.fingerprint  # its curve, not set aside
    assert resumed.curve.has_step(2)
