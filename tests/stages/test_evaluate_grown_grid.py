"""A noise seed (or σ) added to `evaluate.noise_seeds` / `evaluate.timesteps`: only the new (seed, σ) cells are
computed, for the base and every checkpoint, the others taken from the group kept aside (a row's loss depends on
its sample, seed and σ alone: noise from (seed, key), batches of one cell). Before, every checkpoint and the base
were evaluated again from scratch. The result is the fresh evaluation's to the bit; a kill mid-pass loses no row
written; a seed removed computes nothing."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import xarray as xr

import models.held_out as held_out
from schemas.config import EvaluateConfig
from stages.evaluate import checkpoint_load, checkpoints as ev
from store.loss_array import GROUP, LossGroup
from test_evaluate_checkpoints import CFG, _ckpts, run_and_store  # noqa: F401 (the module fixture)
from test_evaluate_checkpoints_base_cache import _counting

ONE = EvaluateConfig(**{**CFG, "noise_seeds": [0]})
TWO = EvaluateConfig(**{**CFG, "noise_seeds": [0, 1]})


def _forwards(monkeypatch) -> list[int]:
    """The rows of every forward of a held-out loss pass."""
    rows, real = [], held_out.target_predictions
    monkeypatch.setattr(held_out, "target_predictions", lambda t, fb: (rows.append(len(fb.targets)), real(t, fb))[1])
    return rows


@contextmanager
def forwards_counted() -> Iterator[list[int]]:
    """`_forwards` for a module's fixture (no monkeypatch there)."""
    with pytest.MonkeyPatch.context() as mp:
        yield _forwards(mp)


def _arrays(out) -> xr.Dataset:
    return xr.open_zarr(out / GROUP).sortby("step").load()


def _same(a, b) -> None:
    da, db = _arrays(a), _arrays(b)
    for name in ("loss", "base_loss", "step", "lora_sha256", "seed", "sigma", "sample"):
        np.testing.assert_array_equal(da[name].values, db[name].values)


def _report(res) -> dict:
    checkpoints = {k: v for k, v in res.metrics["checkpoints"].items() if k != "losses"}  # the folder's path
    return {"loss": res.metrics["loss"], "checkpoints": checkpoints}


@pytest.fixture(scope="module")
def fresh(run_and_store, tiny_edit_model, tmp_path_factory):
    """A fresh evaluation with seeds [0, 1], and the forwards it ran."""
    root, out = run_and_store, tmp_path_factory.mktemp("fresh") / "report"
    with forwards_counted() as rows:
        res = ev.run(TWO, root / "store", tiny_edit_model, _ckpts(root), out)
    assert res.evaluated == 3
    return out, res, rows


def test_an_added_seed_computes_its_cells_alone_and_equals_a_fresh_evaluation(run_and_store, tiny_edit_model,
                                                                              tmp_path, monkeypatch, capsys, fresh):
    root, out = run_and_store, tmp_path / "report"
    fresh_out, fresh_res, fresh_rows = fresh
    ev.run(ONE, root / "store", tiny_edit_model, _ckpts(root), out)
    passes, rows = _counting(monkeypatch), _forwards(monkeypatch)
    capsys.readouterr()
    grown = ev.run(TWO, root / "store", tiny_edit_model, _ckpts(root), out, skip_if_done=True)
    said = capsys.readouterr()
    # the base and three checkpoints, each only at seed 1's two σ cells: half the fresh run's forwards and rows
    assert sorted(passes) == sorted(["held-out loss (base)"] + [f"held-out loss (step {s})" for s in (10, 20, 30)])
    assert len(rows) * 2 == len(fresh_rows) and sum(rows) * 2 == sum(fresh_rows)
    # the line saying why the report is not current says what is computed, as `_plan` then computes it
    line = "): computing 2 new (seed, σ) cells of 4 for the base and 3 of 3 checkpoints (the cells "
    assert line in said.out, said.out
    assert "every checkpoint" not in said.out + said.err
    _same(out, fresh_out)
    assert _report(grown) == _report(fresh_res)
    # the group of seed [0] is kept aside as it was, for a return to [0]
    kept = [p for p in out.glob("losses.*.zarr") if p.name != GROUP]
    assert len(kept) == 1 and [int(s) for s in LossGroup(kept[0]).group["seed"][:]] == [0]


def test_a_base_from_the_base_losses_file_is_not_said_to_come_from_the_kept_group(run_and_store, tiny_edit_model,
                                                                                  tmp_path, monkeypatch, capsys,
                                                                                  fresh):
    """Seeds [0] then [0, 1] with the base losses of [0, 1] in OUT/base-losses (as a single-LoRA report of that
    grid keeps them): the base is read from the file, only the checkpoints take the kept group's cells, and both
    lines say so (they said "the base and 3 checkpoints" were taken from the group)."""
    from stages.evaluate import base_losses

    root, out = run_and_store, tmp_path / "report"
    fresh_out, fresh_res, fresh_rows = fresh
    ev.run(ONE, root / "store", tiny_edit_model, _ckpts(root), out)
    shutil.copy2(fresh_out / base_losses.FILE, out / base_losses.FILE)  # [0, 1]'s, computed whole
    passes = _counting(monkeypatch)
    capsys.readouterr()
    grown = ev.run(TWO, root / "store", tiny_edit_model, _ckpts(root), out, skip_if_done=True)
    said = capsys.readouterr().out
    assert sorted(passes) == sorted(f"held-out loss (step {s})" for s in (10, 20, 30))
    assert "base held-out loss: unchanged inputs, reused from " in said, said
    assert "): computing 2 new (seed, σ) cells of 4 for 3 of 3 checkpoints (the cells " in said, said
    assert " (3 checkpoints): computing 2 new (seed, σ) cells of 4" in said and "the base and" not in said, said
    assert _report(grown) == _report(fresh_res)


def test_a_removed_seed_is_served_from_the_recorded_cells(run_and_store, tiny_edit_model, tmp_path, monkeypatch,
                                                          fresh):
    root, out = run_and_store, tmp_path / "report"
    fresh_out, _, _ = fresh
    shutil.copytree(fresh_out, out)
    rows = _forwards(monkeypatch)
    res = ev.run(EvaluateConfig(**{**CFG, "noise_seeds": [1]}), root / "store", tiny_edit_model, _ckpts(root), out)
    assert rows == [] and res.evaluated == 0
    now, full = _arrays(out), _arrays(fresh_out)
    np.testing.assert_array_equal(now.loss.values, full.loss.sel(seed=[1]).values)
    np.testing.assert_array_equal(now.base_loss.values, full.base_loss.sel(seed=[1]).values)


def test_a_kill_while_growing_loses_no_row_and_the_rerun_computes_the_rest(run_and_store, tiny_edit_model, tmp_path,
                                                                          monkeypatch, fresh):
    root, out = run_and_store, tmp_path / "report"
    fresh_out, fresh_res, fresh_rows = fresh
    ev.run(ONE, root / "store", tiny_edit_model, _ckpts(root), out)
    real, loads = checkpoint_load._load_if_unchanged, []

    def killed_at_the_second(*a, **k):
        loads.append(a[1])
        if len(loads) == 2:
            raise KeyboardInterrupt  # a kill while the second checkpoint is loaded
        return real(*a, **k)

    monkeypatch.setattr(checkpoint_load, "_load_if_unchanged", killed_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        ev.run(TWO, root / "store", tiny_edit_model, _ckpts(root), out)
    monkeypatch.setattr(checkpoint_load, "_load_if_unchanged", real)
    # what was written is whole: the base and the newest checkpoint, every cell of them the fresh run's
    part, full = _arrays(out), _arrays(fresh_out)
    assert [int(s) for s in part.step.values] == [30]
    np.testing.assert_array_equal(part.loss.values, full.loss.sel(step=[30]).values)
    np.testing.assert_array_equal(part.base_loss.values, full.base_loss.values)
    rows = _forwards(monkeypatch)
    res = ev.run(TWO, root / "store", tiny_edit_model, _ckpts(root), out)
    assert res.evaluated == 2 and len(rows) * 4 == len(fresh_rows)  # two checkpoints' new cells, no base
    _same(out, fresh_out)
    assert _report(res) == _report(fresh_res)
