"""`--all-checkpoints`' loss array is not keyed by the device and libraries that computed it (a curve of hundreds
of checkpoints is not evaluated again for float rounding; the single-LoRA grids and the base caches, a few passes,
are keyed by them): it records them (`computed_on`) and a rerun elsewhere says in one line that the rows it keeps
were computed on another machine (`stages.evaluate.loss_groups.note_computed_on`). Before, nothing said it."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

from schemas.config import EvaluateConfig
from schemas.errors import UserError
from stages.evaluate import base_images
from stages.evaluate import checkpoint_load, checkpoints as ev
from stages.evaluate.loss_groups import COMPUTED_ON
from store.loss_array import GROUP
from test_evaluate_checkpoints import CFG, _ckpts, run_and_store  # noqa: F401 (the module fixture)


def test_a_rerun_with_other_libraries_keeps_the_array_and_says_so(run_and_store, tiny_edit_model, tmp_path,
                                                                  monkeypatch, capsys):
    """The machine is recorded, and the line said, when a rerun computes rows: one that computes none records
    nothing (it recorded the machine it ran on, which computed nothing)."""
    root, out = run_and_store, tmp_path / "report"
    cfg = EvaluateConfig(**CFG)
    ev.run(cfg, root / "store", tiny_edit_model, _ckpts(root)[:2], out)
    first = xr.open_zarr(out / GROUP).load()
    (here,) = first.attrs[COMPUTED_ON]
    assert here["device"][0] == "cpu" and "torch" in here["libraries"]

    real = base_images.machine

    def libraries(torch: str):
        monkeypatch.setattr(base_images, "machine",
                            lambda c: {**real(c), "libraries": {**real(c)["libraries"], "torch": torch}})
        return {**here, "libraries": {**here["libraries"], "torch": torch}}

    libraries("8.8.8")
    capsys.readouterr()
    res = ev.run(cfg, root / "store", tiny_edit_model, _ckpts(root)[:2], out)
    assert res.evaluated == 0 and "were computed on" not in capsys.readouterr().out
    assert xr.open_zarr(out / GROUP).attrs[COMPUTED_ON] == [here]  # computed nothing: not recorded

    other = libraries("9.9.9")
    res = ev.run(cfg, root / "store", tiny_edit_model, _ckpts(root), out)
    said = [line for line in capsys.readouterr().out.splitlines() if "were computed on" in line]
    assert len(said) == 1 and "torch 9.9.9" in said[0] and f"held-out loss: the losses in {out / GROUP}" in said[0]
    assert res.evaluated == 1  # step 30 alone: the two rows recorded are kept
    again = xr.open_zarr(out / GROUP).load()
    xr.testing.assert_identical(again.loss.sel(step=[10, 20]), first.loss.sel(step=[10, 20]))
    assert again.attrs[COMPUTED_ON] == [here, other]

    capsys.readouterr()
    ev.run(cfg, root / "store", tiny_edit_model, _ckpts(root), out)  # recorded now: said once
    assert "were computed on" not in capsys.readouterr().out


def test_rows_taken_from_a_kept_group_record_its_machines(run_and_store, tiny_edit_model, tmp_path, monkeypatch,
                                                          capsys):
    """A shrunk seed grid computes nothing (every cell taken from the group of the earlier grid, kept aside): the
    new array records the machines that computed those cells, not the one the rerun ran on."""
    root, out = run_and_store, tmp_path / "report"
    ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, _ckpts(root), out)
    (here,) = xr.open_zarr(out / GROUP).attrs[COMPUTED_ON]
    real = base_images.machine
    monkeypatch.setattr(base_images, "machine",
                        lambda c: {**real(c), "libraries": {**real(c)["libraries"], "torch": "9.9.9"}})
    res = ev.run(EvaluateConfig(**{**CFG, "noise_seeds": [0]}), root / "store", tiny_edit_model, _ckpts(root), out)
    assert "nothing to compute" in capsys.readouterr().out and res.evaluated == 0  # none computed
    shrunk = xr.open_zarr(out / GROUP)
    assert list(shrunk.seed.values) == [0] and shrunk.attrs[COMPUTED_ON] == [here]


def test_base_losses_taken_from_the_kept_file_record_the_machine(run_and_store, tiny_edit_model, tmp_path,
                                                                 monkeypatch):
    """A base row read from OUT/base-losses.safetensors (no pass: `stages.evaluate.base_losses`) was computed on
    this very machine (the file's key holds the device and libraries, every rank's where they differ): the array
    records it, as it does for a row computed. Before, an array whose only row came from the file recorded none."""
    from stages.evaluate import stage

    root, cfg, out = run_and_store, EvaluateConfig(**CFG), tmp_path / "report"
    stage.run(cfg, root / "store", tiny_edit_model, dict(_ckpts(root))[10], out)  # records the base losses
    # every checkpoint rewritten by a training beside it before it was loaded: left out, the base row alone
    monkeypatch.setattr(checkpoint_load, "_load_if_unchanged", lambda *a, **k: False)
    for folder in (out, tmp_path / "fresh"):  # from the file; computed
        with pytest.raises(UserError, match="no checkpoint recorded in .* is still on disk"):
            ev.run(cfg, root / "store", tiny_edit_model, _ckpts(root), folder)
    fresh, kept = (xr.open_zarr(folder / GROUP) for folder in (tmp_path / "fresh", out))
    (here,) = fresh.attrs[COMPUTED_ON]
    assert kept.attrs[COMPUTED_ON] == [here]  # before: []
    np.testing.assert_array_equal(kept.base_loss.values, fresh.base_loss.values)
