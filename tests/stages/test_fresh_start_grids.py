"""A start killed before its first checkpoint, then started afresh (not resumed) in the same folder: the killed
start's sample grids, TensorBoard events and profiler traces go, as its damaged list and validation curve do. Before, its
RUN/samples/step-N.png stayed, and a resume of the new start at step N took one for "this step's grid is done"
(`Validator._grid_recorded`): a grid of another run stood in for this one's. Its event files stayed beside the new
run's too (hidden by TensorBoard's purge, read by any other reader of RUN/logs), and its RUN/profile traces when
the new start did not profile (read as this run's). A resumed run loses nothing."""

from __future__ import annotations

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pipeline.config import load_config
from stages.train import recipe
from stages.train.recipe import run
from stages.train.validate import Validator
from train_store import make_train_store, mixed_specs
from test_validation_after_checkpoint import SETS, run_till_the_grid_fails


def _raw_steps(run_dir, tag: str) -> list[int]:
    """Every point of `tag` in RUN/logs as written, without TensorBoard's purges."""
    events = EventAccumulator(str(run_dir / "logs"), purge_orphaned_data=False)
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


def test_a_fresh_start_drops_the_killed_starts_grids_events_and_traces(tiny_edit_model, tmp_path, monkeypatch):
    store, out = tmp_path / "store", tmp_path / "run"
    make_train_store(store, tiny_edit_model, mixed_specs(5, 2))
    real_log = recipe.log

    def killed_at_step_3(r, stats):  # after step 2's grid, before any checkpoint
        if r.step == 3:
            raise KeyboardInterrupt("killed before the first checkpoint (test)")
        real_log(r, stats)

    monkeypatch.setattr(recipe, "log", killed_at_step_3)
    try:  # every step sampled, step 1 profiled, no checkpoint
        run(load_config(None, {**SETS, "train.sample_every": 1, "train.checkpoint_every": 100,
                               "train.max_steps": 4, "train.profile": 1}), store, tiny_edit_model, out)
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    assert sorted(p.name for p in (out / "samples").iterdir()) == ["step-000001.png", "step-000002.png"]
    assert (out / "profile" / "trace-rank0.json").is_file()

    # afresh (sample_every 2): step 2's checkpoint is written, its grid fails after it
    run_till_the_grid_fails(store, tiny_edit_model, out, monkeypatch)
    monkeypatch.undo()
    assert not (out / "samples").exists() or not any((out / "samples").iterdir())
    assert _raw_steps(out, "train/loss") == [1, 2]  # this start's points only
    assert not list((out / "profile").iterdir())  # this start profiled nothing

    grids = []
    real_grid = Validator.samples_grid

    def counted(self, transformer):
        grids.append(1)
        return real_grid(self, transformer)

    monkeypatch.setattr(Validator, "samples_grid", counted)
    result = run(load_config(None, {**SETS, "train.max_steps": 4}), store, tiny_edit_model, out, resume=True)
    assert result.start_step == 2
    assert len(grids) == 2  # step 2's grid made by this run at the resume (not the killed start's), then step 4's
    assert sorted(p.name for p in (out / "samples").iterdir()) == ["step-000002.png", "step-000004.png"]
    assert _raw_steps(out, "train/loss") == [1, 2, 3, 4]  # the resume kept the resumed run's events
