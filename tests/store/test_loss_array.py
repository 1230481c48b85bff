"""The zarr group of held-out losses: what is appended reads back through xarray by dimension name; other
samples or another fingerprint start a new group (the old one kept beside it); dropped steps are gone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import xarray as xr

from schemas.temp_files import temp_of
from store.loss_array import GROUP, Axes, LossStore, recorded_steps
import warm_start

AXES = Axes(["k1", "k2", "k3"], ["32x32", "32x64", "32x32"], [0, 1], [0.25, 0.75])


def _grid(v: float) -> np.ndarray:
    g = np.full(AXES.shape, v)
    g[1, ..., 1:] = np.nan  # k2 has no mask
    return g


def test_append_reads_back_in_xarray_and_drop_from(tmp_path):
    s = LossStore(tmp_path, "fp", AXES, {"what": "test"})
    s.write_base(_grid(2.0))
    for step in (10, 20, 30):
        s.append(step, f"ckpt-{step}", f"sha{step}", _grid(step / 10))
    ds = xr.open_zarr(tmp_path / GROUP)
    assert ds.loss.dims == ("step", "sample", "seed", "sigma", "region")
    np.testing.assert_array_equal(ds.loss.sel(step=20).values, _grid(2.0).astype("float32"))
    assert list(ds.bucket.values) == AXES.buckets and list(ds.checkpoint.values) == ["ckpt-10", "ckpt-20", "ckpt-30"]
    assert recorded_steps(tmp_path, "fp") == {10: "sha10", 20: "sha20", 30: "sha30"}
    assert recorded_steps(tmp_path, "other") is None

    s.drop_from(20)  # a resumed run redoes steps 20 and 30
    assert list(xr.open_zarr(tmp_path / GROUP).step.values) == [10]
    s.append(20, "ckpt-20", "new", _grid(5.0))
    again = LossStore(tmp_path, "fp", AXES, {})
    assert again.steps() == {10: "sha10", 20: "new"} and again.kept_aside is None
    np.testing.assert_array_equal(again.base(), _grid(2.0))


def test_other_samples_or_fingerprint_start_a_new_group_and_keep_the_old(tmp_path):
    s = LossStore(tmp_path, "fp", AXES, {})
    s.append(10, "c", "h", _grid(1.0))
    fewer = Axes(AXES.keys[:2], AXES.buckets[:2], AXES.seeds, AXES.sigmas)
    t = LossStore(tmp_path, "fp", fewer, {})
    assert t.kept_aside is not None and t.steps() == {} and xr.open_zarr(t.kept_aside).sizes["sample"] == 3
    u = LossStore(tmp_path, "fp2", fewer, {})
    assert u.kept_aside is not None and u.kept_aside != t.kept_aside
    assert len(list(tmp_path.glob("losses.*.zarr"))) == 2 and xr.open_zarr(tmp_path / GROUP).sizes["sample"] == 2


def test_a_drop_killed_before_its_commit_leaves_every_recorded_row_readable(tmp_path, monkeypatch):
    """`drop_from` shrinks each array, then commits (the consolidated metadata). zarr's resize deleted the chunks
    past the new end at once: a kill before the commit left the recorded rows reading as NaN losses and step 0,
    which the next drop took for earlier steps and kept for good. Now the rows stay whole until the commit, and
    the rerun's drop does the same again."""
    import zarr

    s = LossStore(tmp_path, "fp", AXES, {"what": "test"})
    s.write_base(_grid(2.0))
    for step in (10, 20, 30):
        s.append(step, f"ckpt-{step}", f"sha{step}", _grid(step / 10))

    def killed(*a, **k):
        raise KeyboardInterrupt("killed before the drop's commit (test)")

    monkeypatch.setattr(zarr, "consolidate_metadata", killed)
    try:
        s.drop_from(20)
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    again = LossStore(tmp_path, "fp", AXES, {})
    assert again.steps() == {10: "sha10", 20: "sha20", 30: "sha30"}
    steps, _, losses = again.losses()
    np.testing.assert_array_equal(losses[2], _grid(3.0).astype("float32"))
    again.drop_from(20)
    assert LossStore(tmp_path, "fp", AXES, {}).steps() == {10: "sha10"}


def test_every_write_is_durable_before_its_commit_and_the_commit_before_it_returns(tmp_path, monkeypatch):
    """zarr writes each file by temp file + rename and never fsyncs: after a power loss the renamed root zarr.json
    (the commit, counting the new step) could be on disk while the step's chunk files were not, and the step,
    taken as recorded (a resumed training does not validate it again, evaluate does not redo it), read as NaN /
    step 0. Checked on the order of operations: every file an operation wrote (found by comparing the folder's
    files before and after, not from the code's own list) and every folder holding one is fsynced before the
    consolidated metadata is rewritten; that file and the group's folder are fsynced before the call returns."""
    import os

    import zarr

    events: list[tuple[str, str]] = []
    real_fsync, real_consolidate = os.fsync, zarr.consolidate_metadata

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def consolidate(*a, **k):
        out = real_consolidate(*a, **k)
        events.append(("commit", ""))
        return out

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(zarr, "consolidate_metadata", consolidate)
    group = tmp_path / GROUP

    def files() -> dict[str, tuple[int, int]]:
        return {str(p): (p.stat().st_ino, p.stat().st_mtime_ns) for p in group.rglob("*") if p.is_file()}

    def check(op) -> None:
        before = files()
        events.clear()
        op()
        written = {p for p, st in files().items() if before.get(p) != st and p != str(group / "zarr.json")}
        assert written, "the operation wrote nothing"
        commit = max(i for i, (what, _) in enumerate(events) if what == "commit")
        synced_before = {path for what, path in events[:commit] if what == "fsync"}
        synced_after = {path for what, path in events[commit:] if what == "fsync"}
        folders = {str(f) for p in written for f in Path(p).parents if f.is_relative_to(group)}
        assert written | folders <= synced_before, sorted((written | folders) - synced_before)
        assert {str(group / "zarr.json"), str(group)} <= synced_after

    s = LossStore(tmp_path, "fp", AXES, {"what": "test"})
    created = {str(p) for p in group.rglob("*")} | {str(group)}
    # a new group is fsynced whole in its temp folder, then renamed in and its parent folder fsynced
    tmp = temp_of(group).name
    synced = {path.replace(tmp, GROUP) for what, path in events if what == "fsync"}
    assert created <= synced and str(tmp_path) in synced
    check(lambda: s.write_base(_grid(2.0)))
    for step in (10, 20, 30):
        check(lambda: s.append(step, f"ckpt-{step}", f"sha{step}", _grid(step / 10)))
    check(lambda: s.drop_from(20))
    check(lambda: s.append(20, "ckpt-20", "new", _grid(5.0)))
    assert LossStore(tmp_path, "fp", AXES, {}).steps() == {10: "sha10", 20: "new"}


def test_a_damaged_group_is_set_aside_saying_so_not_as_changed_settings(tmp_path):
    """A cut-short root zarr.json: the group is set aside and a new one begun, and the reason names the damage
    (evaluate said "evaluation settings changed", with every setting as it was); other samples say so too."""
    s = LossStore(tmp_path, "fp", AXES, {})
    s.append(10, "c", "h", _grid(1.0))
    root = tmp_path / GROUP / "zarr.json"
    root.write_bytes(root.read_bytes()[:100])
    t = LossStore(tmp_path, "fp", AXES, {})
    assert t.kept_aside is not None and t.steps() == {}
    assert "could not be read" in t.aside_reason and "damaged" in t.aside_reason and str(tmp_path / GROUP) in t.aside_reason
    t.append(10, "c", "h", _grid(1.0))
    fewer = Axes(AXES.keys[:2], AXES.buckets[:2], AXES.seeds, AXES.sigmas)
    assert LossStore(tmp_path, "fp", fewer, {}).aside_reason == "the val samples changed (3 recorded, 2 now)"
    assert LossStore(tmp_path, "fp2", fewer, {}).aside_reason == "the settings changed"


def test_a_take_back_killed_between_its_renames_is_taken_back_by_the_next_run(tmp_path):
    """A -> B -> A: the third run sets B's group aside, then renames A's kept group back in. Killed between the two
    renames, no group is left; the next run of A's settings takes A's kept group back, not an empty one (which
    evaluated every checkpoint again)."""
    a = LossStore(tmp_path, "fpA", AXES, {})
    a.append(10, "c", "h", _grid(1.0))
    b = LossStore(tmp_path, "fpB", AXES, {}, take_back=True)
    assert b.kept_aside is not None and b.steps() == {}
    b.append(10, "c", "h", _grid(3.0))
    (tmp_path / GROUP).rename(tmp_path / "losses.fpB.zarr")  # the take-back's first rename, then the kill
    again = LossStore(tmp_path, "fpA", AXES, {}, take_back=True)
    assert again.taken_back is not None and again.steps() == {10: "h"}
    np.testing.assert_array_equal(xr.open_zarr(tmp_path / GROUP).loss.sel(step=10).values,
                                  _grid(1.0).astype("float32"))
    assert LossStore(tmp_path, "fpC", AXES, {}, take_back=True).taken_back is None  # none kept of C: a new group


def _flip_a_byte(chunk: Path) -> None:
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x10
    chunk.write_bytes(bytes(data))


def test_a_flipped_bit_in_a_chunk_is_found_not_read_as_a_loss(tmp_path):
    """A chunk of losses.zarr changed on disk (a flipped bit, a bad sector) decoded without complaint: zstd kept no
    checksum, so a step read back as losses of 7e35 (or slightly off: a wrong best checkpoint), and `compare` and
    the report used them silently. Every chunk now carries a CRC32C: a damaged group is set aside saying so (the
    steps are evaluated again) and is never taken back; a reader of the array names it."""
    import pytest

    from schemas.errors import UserError
    from store.loss_array import open_dataset

    s = LossStore(tmp_path, "fp", AXES, {})
    s.write_base(_grid(2.0))
    for step in (10, 20):
        s.append(step, f"ckpt-{step}", f"sha{step}", _grid(step / 10))
    _flip_a_byte(tmp_path / GROUP / "loss" / "c" / "1" / "0" / "0" / "0" / "0")  # step 20's row
    with pytest.raises(UserError, match=r"losses\.zarr.*damaged"):
        open_dataset(tmp_path / GROUP)
    t = LossStore(tmp_path, "fp", AXES, {}, take_back=True)
    assert t.kept_aside is not None and t.steps() == {} and not t.has_base()
    assert "damaged" in t.aside_reason and str(tmp_path / GROUP) in t.aside_reason
    t.append(10, "ckpt-10", "sha10", _grid(1.0))
    other = LossStore(tmp_path, "fp2", AXES, {}, take_back=True)  # sets the new one aside
    assert LossStore(tmp_path, "fp", AXES, {}, take_back=True).taken_back == other.kept_aside  # the intact one

    base_only = tmp_path / "base"
    LossStore(base_only, "fp", AXES, {}).write_base(_grid(2.0))
    _flip_a_byte(base_only / GROUP / "base_loss" / "c" / "0" / "0" / "0" / "0")
    assert not LossStore(base_only, "fp", AXES, {}).has_base()  # set aside: the base is computed again


def test_a_damaged_commit_record_is_one_line_naming_the_group(tmp_path):
    """The root zarr.json (the group's commit record) cut short or overwritten: `compare` printed json's or zarr's
    traceback. Now a UserError naming the group and the rerun, as a damaged chunk is."""
    import pytest

    from schemas.errors import UserError
    from store.loss_array import open_dataset

    s = LossStore(tmp_path, "fp", AXES, {})
    s.append(10, "ckpt-10", "sha10", _grid(1.0))
    record = tmp_path / GROUP / "zarr.json"
    whole = record.read_bytes()
    for damaged in (whole[: len(whole) // 2], b"", b"[]", b'{"zarr_format": 3, "node_type": "group"}'):
        record.write_bytes(damaged)
        with pytest.raises(UserError, match=rf"{GROUP}: its zarr.json is damaged.*rerun `pipeline run evaluate`"):
            open_dataset(tmp_path / GROUP)


def _all_nan() -> np.ndarray:
    return np.full(AXES.shape, np.nan)  # a checkpoint whose every loss is non-finite (a diverged LoRA)


@pytest.mark.parametrize("lost", ["loss/c/2/0/0/0/0", "step/c/0", "lora_sha256/c/2", "base_loss/c/0/0/0/0"])
def test_a_lost_chunk_file_is_refused_naming_it_not_read_as_a_non_finite_step(tmp_path, lost):
    """A chunk file deleted or lost on disk (a damaged disk, a partial copy of the run folder) read back as the fill
    value: NaN losses, step 0, an empty sha, as a step whose losses were all non-finite, and every reader used it.
    Every chunk is now written (the all-NaN step's too) and an absent one is refused: `open_dataset` (report,
    `compare`) in one line naming the file, `recorded_steps` as not up to date, an open for writing sets the group
    aside saying so. The genuinely non-finite step still reads as NaN."""
    from schemas.errors import UserError
    from store.loss_array import open_dataset, recorded_base

    s = LossStore(tmp_path, "fp", AXES, {})
    s.write_base(_grid(2.0))
    for step, grid in ((10, _grid(1.0)), (20, _all_nan()), (30, _grid(3.0))):
        s.append(step, f"ckpt-{step}", f"sha{step}", grid)
    group = tmp_path / GROUP
    assert (group / "loss" / "c" / "1" / "0" / "0" / "0" / "0").is_file()  # the all-NaN row is a file too
    ds = open_dataset(group)
    assert list(ds.step.values) == [10, 20, 30] and np.isnan(ds.loss.sel(step=20).values).all()
    np.testing.assert_array_equal(ds.loss.sel(step=30).values, _grid(3.0).astype("float32"))

    (group / lost).unlink()
    with pytest.raises(UserError) as e:
        open_dataset(group)
    line = str(e.value)
    assert "\n" not in line and f"{group / lost} is missing" in line and "rerun `pipeline run evaluate`" in line
    assert recorded_steps(tmp_path, "fp") is None  # not up to date: the next open sets it aside
    assert recorded_base(tmp_path, "fp", AXES) is None
    t = LossStore(tmp_path, "fp", AXES, {}, take_back=True)
    assert t.kept_aside is not None and t.steps() == {} and not t.has_base()
    assert f"{group / lost} is missing" in t.aside_reason and "damaged" in t.aside_reason
    t.append(10, "ckpt-10", "sha10", _grid(1.0))
    other = LossStore(tmp_path, "fp2", AXES, {}, take_back=True)  # sets the new one aside
    assert LossStore(tmp_path, "fp", AXES, {}, take_back=True).taken_back == other.kept_aside  # never the lost one


def _previous_release(monkeypatch) -> None:
    """Write as the previous release did: format 1, zarr's default config (no chunk that is all fill value)."""
    import store.loss_array as la

    monkeypatch.setattr(la, "FORMAT", 1)
    monkeypatch.setattr(la, "WRITE", {"write_empty_chunks": False})


def test_a_group_of_the_previous_release_still_reads_and_says_what_it_cannot_check(tmp_path, monkeypatch):
    """An array written before every chunk was (format 1) has no file for a step whose losses were all NaN (nor
    for a validation's empty sha), so an absent file there proves nothing: it reads as before (NaN), and readers
    say so in one line naming the file; it is kept, not set aside (its checkpoints need not be evaluated again),
    and appended to by this release."""
    from store.loss_array import open_dataset

    _previous_release(monkeypatch)
    s = LossStore(tmp_path, "fp", AXES, {})
    s.write_base(_grid(2.0))
    for step, grid in ((10, _grid(1.0)), (20, _all_nan()), (30, _grid(3.0))):
        s.append(step, f"training step {step}", "", grid)  # a validation curve: its sha is empty
    monkeypatch.undo()
    group = tmp_path / GROUP
    assert not (group / "loss" / "c" / "1" / "0" / "0" / "0" / "0").exists()  # as that release wrote it
    assert not (group / "lora_sha256" / "c" / "0").exists()

    lines: list[str] = []
    ds = open_dataset(group, say=lines.append)
    assert list(ds.step.values) == [10, 20, 30] and np.isnan(ds.loss.sel(step=20).values).all()
    np.testing.assert_array_equal(ds.loss.sel(step=30).values, _grid(3.0).astype("float32"))
    assert len(lines) == 1 and f"no chunk file {group / 'loss/c/1/0/0/0/0'};" in lines[0]
    assert "earlier release" in lines[0]
    assert recorded_steps(tmp_path, "fp") == {10: "", 20: "", 30: ""}

    again = LossStore(tmp_path, "fp", AXES, {})
    assert again.kept_aside is None and again.steps() == {10: "", 20: "", 30: ""} and again.unchecked == lines[0]
    again.append(40, "training step 40", "", _grid(4.0))
    assert list(open_dataset(group).step.values) == [10, 20, 30, 40]
    (group / "loss" / "c" / "0" / "0" / "0" / "0" / "0").unlink()  # lost there: read as NaN, said, never refused
    lines.clear()
    assert np.isnan(open_dataset(group, say=lines.append).loss.sel(step=10).values).all()
    assert f"no chunk file {group / 'loss/c/0/0/0/0/0'} and 1 more" in lines[0]


def test_a_group_replaced_while_it_is_read_is_refused_not_read_as_nan(tmp_path, monkeypatch):
    """`pipeline compare` reading a report while its evaluate (other settings, or a damaged group) sets the group
    aside and begins a new one in its place: xarray had read the old commit's shapes, the chunk check and the load
    then looked at the new group, whose absent chunks read as NaN losses and base - no error, a report of NaN.
    Now the group read must be the same folder from the open to the end of the check, else one line says so."""
    import xarray

    from schemas.errors import UserError
    from store.loss_array import open_dataset

    s = LossStore(tmp_path, "fp", AXES, {})
    s.write_base(_grid(2.0))
    for step in (10, 20, 30):
        s.append(step, f"ckpt-{step}", f"sha{step}", _grid(step / 10))
    real = xarray.open_zarr

    def evaluate_starts_over_meanwhile(*a, **k):
        ds = real(*a, **k)
        LossStore(tmp_path, "fp-other", AXES, {})  # the old group set aside, a new empty one renamed in
        return ds

    monkeypatch.setattr(xarray, "open_zarr", evaluate_starts_over_meanwhile)
    with pytest.raises(UserError) as e:
        open_dataset(tmp_path / GROUP)
    line = str(e.value)
    assert "\n" not in line and f"{tmp_path / GROUP} was replaced while it was read" in line and "rerun" in line
    monkeypatch.undo()
    assert list(open_dataset(tmp_path / GROUP).step.values) == []  # the new group, read whole


def test_a_damaged_validation_curve_says_what_to_do_with_a_run_not_a_report(tmp_path):
    """`pipeline compare RUN` over a training run's validation curve (RUN/losses.zarr) that lost a chunk file, or
    with one changed on disk, said only "rerun `pipeline run evaluate` for that report (its checkpoints are evaluated
    again)": evaluate never writes RUN/losses.zarr, so the advice recomputed nothing. The line now says what
    becomes of a run's curve too (a resumed training begins a new one)."""
    from schemas.errors import UserError
    from store.loss_array import open_dataset

    s = LossStore(tmp_path, "fp", AXES, {"validate": {"keys": AXES.keys}})
    s.write_base(_grid(2.0))
    for step in (100, 200):
        s.append(step, f"training step {step}", "", _grid(step / 100))
    group = tmp_path / GROUP
    for damage in ("lost", "flipped"):
        chunk = group / "loss" / "c" / "1" / "0" / "0" / "0" / "0"
        saved = chunk.read_bytes()
        chunk.unlink() if damage == "lost" else _flip_a_byte(chunk)
        with pytest.raises(UserError) as e:
            open_dataset(group)
        line = str(e.value)
        assert "\n" not in line and str(group) in line and "validation curve" in line and "resumed training" in line
        assert "rerun `pipeline run evaluate`" in line  # a report's remedy still said
        chunk.write_bytes(saved)


# A child that writes the base again over a committed one and is SIGKILLed at one point of it: `deleted`, right
# after zarr deleted a `base_loss` folder's files (before, the group's own: its commit kept naming chunks gone);
# `committing`, as the consolidated metadata is to be rewritten; or a named `store.format.crash_point`.
REWRITE_BASE = """
import os, signal, sys
from pathlib import Path
import numpy as np
import zarr
from zarr.storage import LocalStore
from store.loss_array import Axes, LossStore

folder, at = Path(sys.argv[1]), sys.argv[2]
kill = lambda: os.kill(os.getpid(), signal.SIGKILL)
if at == "deleted":
    real_delete = LocalStore.delete_dir
    async def delete_dir(self, prefix):
        await real_delete(self, prefix)
        if prefix.endswith("base_loss"):
            kill()
    LocalStore.delete_dir = delete_dir
if at == "committing":
    zarr.consolidate_metadata = lambda *a, **k: kill()
axes = Axes(["k1", "k2", "k3"], ["32x32", "32x64", "32x32"], [0, 1], [0.25, 0.75])
grid = np.full(axes.shape, 7.0)
grid[1, ..., 1:] = np.nan  # as `_grid`
LossStore(folder, "fp", axes, {}).write_base(grid)
"""


@pytest.mark.parametrize("at", ["deleted", "committing", "atomic_dir_between_renames", "atomic_dir_removing_old"])
def test_a_base_written_again_and_killed_leaves_the_old_group_or_the_new_never_a_damaged_one(tmp_path, at):
    """A fresh training start over a curve that holds a base writes its own (`write_base`): zarr's overwrite
    deleted the old base's chunk files first, and a kill before the commit left a group whose commit named chunks
    gone: the next open set it aside as damaged, its evaluated steps out of view. Now the group is written anew in
    a temp folder and swapped in: killed anywhere (a real SIGKILL), it opens with its steps and either base, and
    the rerun writes the new base over it (the committed steps only: not a killed append's)."""
    import os
    import signal
    import sys

    from store import format as fmt

    import zarr

    s = LossStore(tmp_path, "fp", AXES, {})
    s.write_base(_grid(2.0))
    for step in (10, 20):
        s.append(step, f"ckpt-{step}", f"sha{step}", _grid(step / 10))

    def killed(*a, **k):
        raise KeyboardInterrupt("killed before the append's commit (test)")

    real_consolidate, zarr.consolidate_metadata = zarr.consolidate_metadata, killed
    try:  # an append killed before its commit: its arrays' own zarr.json hold a step the commit does not
        s.append(30, "ckpt-30", "sha30", _grid(3.0))
    except KeyboardInterrupt:
        pass
    finally:
        zarr.consolidate_metadata = real_consolidate
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), fmt.CRASH_ENV: at}
    # started warm (tests/warm_start.py): numpy and pyarrow already imported; killed by its own SIGKILL
    p = warm_start.run([sys.executable, "-c", REWRITE_BASE, str(tmp_path), at], env=env, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]

    def intact(again: LossStore) -> None:
        assert again.kept_aside is None and not list(tmp_path.glob("losses.*.zarr")), again.aside_reason
        steps, paths, losses = again.losses()
        assert again.steps() == {10: "sha10", 20: "sha20"} and paths == ["ckpt-10", "ckpt-20"]
        np.testing.assert_array_equal(losses, np.stack([_grid(1.0), _grid(2.0)]).astype("float32"))

    again = LossStore(tmp_path, "fp", AXES, {})
    intact(again)
    new = at == "atomic_dir_removing_old"  # past the swap: the new group, the old one's removal left undone
    np.testing.assert_array_equal(again.base(), _grid(7.0 if new else 2.0))
    again.write_base(_grid(7.0))  # the rerun
    rerun = LossStore(tmp_path, "fp", AXES, {})
    intact(rerun)
    np.testing.assert_array_equal(rerun.base(), _grid(7.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == [GROUP]  # no temp or old folder left beside it
