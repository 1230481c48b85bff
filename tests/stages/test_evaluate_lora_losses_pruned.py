"""OUT/lora-losses keeps the `KEPT_ASIDE` loss groups set aside most recently used (`stages.evaluate.loss_groups`):
every LoRA, setting, device, library or source change sets one aside, and none was ever removed. The group in place
and the one whose cells a run takes are never removed; a prune killed midway leaves every group readers see
whole."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from schemas.config import EvaluateConfig
from stages.evaluate import loss_groups, stage
from store.loss_array import GROUP, Axes, LossGroup, LossStore, cell_donor, kept_groups
from test_evaluate_checkpoints import CFG, _ckpts, run_and_store  # noqa: F401 (the module fixture)
from test_evaluate_grown_grid import _forwards

AXES = Axes(["k1", "k2"], ["8x8", "8x8"], [0], [0.5])


def _settings(i: int) -> dict:
    return {"evaluate": {"noise_seeds": [0], "timesteps": [0.5]}, "lora_sha256": f"lora {i}"}


def _groups(folder, n: int) -> list:
    """n groups, one per LoRA, each set aside by the next (the last in place), the base of group i all i; each set
    aside recorded as used at second 1000 + i (in that order: no clock read)."""
    aside = []
    for i in range(n):
        settings = _settings(i)
        losses = LossStore(folder, loss_groups.group_hash(settings), AXES, settings, take_back=True, dtype="float64")
        losses.write_base(np.full(AXES.shape, float(i)))
        if losses.kept_aside is not None:
            os.utime(losses.kept_aside, (1000 + i, 1000 + i))
            aside.append(losses.kept_aside)
    return aside


def _bases(folder) -> list[float]:
    return sorted(float(LossGroup(p).base()[0, 0, 0, 0]) for p in folder.glob("losses.*.zarr"))


def test_the_least_recently_used_groups_are_removed_saying_so(tmp_path, capsys):
    folder = tmp_path / "lora-losses"
    aside = _groups(folder, 6)  # 5 aside (groups 0-4), group 5 in place
    os.utime(folder / GROUP, (1, 1))  # the group in place is never removed, however old
    capsys.readouterr()
    gone = loss_groups.prune(folder, keep=3)
    assert gone == [aside[0].name, aside[1].name]  # the least recently used first
    said = capsys.readouterr().out
    assert f"removed 2 loss groups kept aside in {folder} ({aside[0].name}, {aside[1].name})" in said, said
    assert _bases(folder) == [2.0, 3.0, 4.0]  # the three used most recently, whole
    assert float(LossGroup(folder / GROUP).base()[0, 0, 0, 0]) == 5.0
    assert sorted(p.name for p in folder.iterdir()) == sorted([GROUP, *(p.name for p in aside[2:])])
    assert loss_groups.prune(folder, keep=3) == [] and "removed" not in capsys.readouterr().out


def test_the_group_whose_cells_a_run_takes_is_never_removed(tmp_path):
    folder = tmp_path / "lora-losses"
    aside = _groups(folder, 5)  # 4 aside
    assert loss_groups.prune(folder, in_use=(aside[0],), keep=2) == [aside[1].name, aside[2].name]
    assert _bases(folder) == [0.0, 3.0]  # the oldest kept: in use; the most recent beside it


def test_a_killed_prune_leaves_every_group_readers_see_whole(tmp_path, monkeypatch):
    folder = tmp_path / "lora-losses"
    aside = _groups(folder, 4)
    real = shutil.rmtree

    def killed(path, *a, **k):  # half the first group's files removed, then the process killed
        if loss_groups._PRUNING in str(path):
            for f in sorted(p for p in path.rglob("*") if p.is_file())[::2]:
                f.unlink()
            raise KeyboardInterrupt
        real(path, *a, **k)

    monkeypatch.setattr(loss_groups.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        loss_groups.prune(folder, keep=1)
    # what the readers glob holds only whole groups: each opens and is checked, its numbers its own
    assert _bases(folder) == [1.0, 2.0]
    for i, p in ((1, aside[1]), (2, aside[2])):
        assert [g.path for g in kept_groups(folder, loss_groups.group_hash(_settings(i)), AXES)] == [p]
    assert cell_donor(folder, {**_settings(1), "evaluate": {"noise_seeds": [0, 1], "timesteps": [0.5]}}, [0, 1],
                      [0.5], AXES.keys, True, {}).path == aside[1]
    monkeypatch.setattr(loss_groups.shutil, "rmtree", real)
    assert loss_groups.prune(folder, keep=1) == [aside[1].name]
    assert sorted(p.name for p in folder.iterdir()) == sorted([GROUP, aside[2].name])  # the killed one's left gone


def test_single_lora_evaluate_prunes_its_kept_groups(run_and_store, tiny_edit_model, tmp_path, monkeypatch, capsys):
    """Three LoRA scales in turn with one group kept aside: the first scale's group is removed with one line, the
    second's kept and taken back (no loss pass), the first's computed again."""
    from stages.evaluate import lora_losses

    monkeypatch.setattr(loss_groups, "KEPT_ASIDE", 1)
    root, out = run_and_store, tmp_path / "report"
    lora, rows = dict(_ckpts(root))[10], _forwards(monkeypatch)

    def run(scale: float) -> int:
        rows.clear()
        stage.run(EvaluateConfig(**{**CFG, "lora_scale": scale}), root / "store", tiny_edit_model, lora, out)
        return len(rows)

    folder = out / lora_losses.FOLDER
    run(1.0)
    run(0.5)
    capsys.readouterr()
    run(0.25)
    said = [line for line in capsys.readouterr().out.splitlines() if "removed 1 loss group" in line]
    assert len(said) == 1 and str(folder) in said[0], said
    assert len(list(folder.glob("losses.*.zarr"))) == 1
    assert run(0.5) == 0  # kept: taken back, no loss pass (the base from OUT/base-losses)
    assert run(1.0) > 0  # removed: computed again


def test_a_donor_in_place_takes_no_place_of_those_kept_aside(tmp_path):
    """The run's cell donor may be the group in place (`losses.zarr`), which is never among those kept aside: the
    `keep` most recently used stay beside it (it was counted against them, and one fewer stayed)."""
    folder = tmp_path / "lora-losses"
    aside = _groups(folder, 5)  # 4 aside, group 4 in place
    assert loss_groups.prune(folder, in_use=(folder / GROUP,), keep=2) == [aside[0].name, aside[1].name]
    assert _bases(folder) == [2.0, 3.0]


def test_the_group_a_run_sets_aside_is_kept_though_its_date_cannot_be_set(tmp_path, monkeypatch):
    """A shared report folder whose groups another user owns: recording the use (the folder's modification time)
    fails, and the group this run just set aside kept its old date, the oldest: the prune at the end of the same
    run removed it at once."""
    from stages.evaluate import lora_losses

    folder = tmp_path / "lora-losses"
    aside = _groups(folder, 3)  # groups 0 and 1 aside (used at seconds 1000, 1001), group 2 in place
    os.utime(folder / GROUP, (1, 1))  # in place since long ago: older than those kept aside
    monkeypatch.setattr(loss_groups, "KEPT_ASIDE", 2)

    def not_owner(*_a, **_k):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "utime", not_owner)
    lora_losses.grids(folder, _settings(3), tmp_path / "lora", AXES, lambda _name, _cells: np.full(AXES.shape, 3.0),
                      None, lambda _base: None)
    assert [g.path.name for g in kept_groups(folder, loss_groups.group_hash(_settings(2)), AXES)]  # set aside, kept
    assert _bases(folder) == [1.0, 2.0] and not (folder / aside[0].name).exists()  # the oldest aside removed
