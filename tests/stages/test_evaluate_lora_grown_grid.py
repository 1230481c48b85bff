"""Single-LoRA evaluate, as --all-checkpoints: a noise seed (or σ) added computes only its (seed, σ) cells, for the
base and the LoRA, the others taken from the grids the earlier report kept (OUT/lora-losses, `cell_donor`); a
seed removed computes nothing; a rerun for the pictures alone runs no loss pass. The report is a fresh run's to
the bit. Before, every cell of both passes was computed again (the base too: its cached grid is keyed by the
whole grid)."""

from __future__ import annotations

import shutil

import pytest

from schemas.config import EvaluateConfig
from stages.evaluate import base_losses, stage
from test_evaluate_checkpoints import CFG, _ckpts, run_and_store  # noqa: F401 (the module fixture)
from test_evaluate_grown_grid import _forwards, forwards_counted

ONE = EvaluateConfig(**{**CFG, "noise_seeds": [0]})
TWO = EvaluateConfig(**{**CFG, "noise_seeds": [0, 1]})


@pytest.fixture(scope="module")
def fresh(run_and_store, tiny_edit_model, tmp_path_factory):
    """A fresh single-LoRA report with seeds [0, 1] (checkpoint 20's LoRA), and its forwards' rows."""
    root, out = run_and_store, tmp_path_factory.mktemp("fresh") / "report"
    with forwards_counted() as rows:
        res = stage.run(TWO, root / "store", tiny_edit_model, dict(_ckpts(root))[20], out)
    return out, res, rows


def test_an_added_seed_computes_its_cells_alone_and_equals_a_fresh_report(run_and_store, tiny_edit_model, tmp_path,
                                                                         monkeypatch, capsys, fresh):
    root, out = run_and_store, tmp_path / "report"
    lora = dict(_ckpts(root))[20]
    _, fresh_res, fresh_rows = fresh
    stage.run(ONE, root / "store", tiny_edit_model, lora, out)
    rows = _forwards(monkeypatch)
    capsys.readouterr()
    grown = stage.run(TWO, root / "store", tiny_edit_model, lora, out, skip_if_done=True)
    said = capsys.readouterr().out
    # the base and the LoRA, each only at seed 1's two σ cells: half the fresh report's forwards and rows
    assert len(rows) * 2 == len(fresh_rows) and sum(rows) * 2 == sum(fresh_rows), (rows, fresh_rows)
    assert "(the base and the LoRA): computing 2 new (seed, σ) cells of 4" in said, said
    assert grown.metrics["loss"] == fresh_res.metrics["loss"]  # every figure, to the bit
    # a rerun for the pictures alone runs no loss pass (it ran the LoRA's again)
    rows.clear()
    stage.run(EvaluateConfig(**{**TWO.model_dump(), "num_samples": 1}), root / "store", tiny_edit_model, lora, out,
              skip_if_done=True)
    assert rows == []


def test_a_removed_seed_computes_nothing(run_and_store, tiny_edit_model, tmp_path, monkeypatch, fresh):
    root, out = run_and_store, tmp_path / "report"
    lora = dict(_ckpts(root))[20]
    shutil.copytree(fresh[0], out)
    rows = _forwards(monkeypatch)
    one = EvaluateConfig(**{**CFG, "noise_seeds": [1]})
    res = stage.run(one, root / "store", tiny_edit_model, lora, out, skip_if_done=True)
    assert rows == [] and not res.up_to_date
    alone = stage.run(one, root / "store", tiny_edit_model, lora, tmp_path / "alone")
    assert rows and res.metrics["loss"] == alone.metrics["loss"]


def test_grids_of_another_release_or_device_are_computed_again(run_and_store, tiny_edit_model, tmp_path,
                                                               monkeypatch, fresh):
    """The kept grids are keyed by what computed them too (device, libraries, this project's source: as the
    base-losses file): a rerun after an update computes both passes whole, as a fresh report would. Before, the
    earlier grids were taken as this run's (no forward at all)."""
    from stages.evaluate import base_images

    root, out = run_and_store, tmp_path / "report"
    shutil.copytree(fresh[0], out)
    monkeypatch.setattr(base_images, "_sources_digest", lambda: "another release")
    rows = _forwards(monkeypatch)
    stage.run(TWO, root / "store", tiny_edit_model, dict(_ckpts(root))[20], out)
    assert sum(rows) == sum(fresh[2]), (rows, fresh[2])


def test_a_base_from_the_base_losses_file_is_not_said_to_come_from_a_kept_group(run_and_store, tiny_edit_model,
                                                                                tmp_path, monkeypatch, capsys, fresh):
    """Checkpoint 20's report of seeds [0, 1] kept the base in OUT/base-losses; checkpoint 10 (other bytes)
    evaluated at seeds [0, 1] after [0]: its base is the file's, only the LoRA's cells come from its group of
    seed [0]. The line named "the base and the LoRA" as taken from that group; the figures are a fresh report's."""
    root, out = run_and_store, tmp_path / "report"
    lora = dict(_ckpts(root))[10]
    stage.run(ONE, root / "store", tiny_edit_model, lora, out)
    # the base losses of seeds [0, 1] (checkpoint 20's report computed them: the LoRA is no input of them)
    shutil.copy2(fresh[0] / base_losses.FILE, out / base_losses.FILE)
    rows = _forwards(monkeypatch)
    capsys.readouterr()
    grown = stage.run(TWO, root / "store", tiny_edit_model, lora, out, skip_if_done=True)
    said = capsys.readouterr().out
    assert "base held-out loss: unchanged inputs, reused from " in said, said
    assert "(the LoRA): computing 2 new (seed, σ) cells of 4" in said and "the base and" not in said, said
    assert len(rows) * 2 == len(fresh[2]) // 2  # the LoRA's seed-1 cells alone: a quarter of a fresh report's
    alone = stage.run(TWO, root / "store", tiny_edit_model, lora, tmp_path / "alone")
    assert grown.metrics["loss"] == alone.metrics["loss"]


def test_a_damaged_group_of_lora_losses_is_set_aside_saying_so(run_and_store, tiny_edit_model, tmp_path, capsys,
                                                               fresh):
    """A cut-short OUT/lora-losses/losses.zarr/zarr.json: the group is set aside and the grids computed again, as a
    fresh report's, and one line says what was found and where the earlier losses are kept (--all-checkpoints says
    it; single-LoRA evaluate said nothing)."""
    from stages.evaluate import lora_losses

    root, out = run_and_store, tmp_path / "report"
    shutil.copytree(fresh[0], out)
    group = out / lora_losses.FOLDER / "losses.zarr"
    (group / "zarr.json").write_bytes((group / "zarr.json").read_bytes()[:100])
    capsys.readouterr()
    res = stage.run(TWO, root / "store", tiny_edit_model, dict(_ckpts(root))[20], out)
    said = [line for line in capsys.readouterr().out.splitlines() if "losses are kept in" in line]
    assert len(said) == 1 and f"held-out loss: {group} could not be read" in said[0], said
    aside = said[0].rsplit("kept in ", 1)[1]
    assert aside.startswith(str(group.parent / "losses.")) and (group.parent / aside.rsplit("/", 1)[1]).is_dir()
    assert res.metrics["loss"] == fresh[1].metrics["loss"]
