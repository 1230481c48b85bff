"""train.attention_backend decides reuse by the backend a run resolved to, not by its spelling: `native` spelled
out after an unset run on the CPU (where unset resolves to native) is that run - a resume continues it and a
finished one is up to date - while a name that resolves to another backend (`packed`, which runs on the CPU too)
is another run. Records written before the backend was recorded are read through RUN/attention.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from schemas import UserError
from stages.train import state as train_state
from stages.train.current import up_to_date
from stages.train.recipe import run
from test_train import assert_same_lora, cfg_of, lora_of, store_dir  # noqa: F401 (the fixture: test_train's store)


@pytest.fixture(scope="module")
def unset_run(store_dir, tiny_edit_model, tmp_path_factory):
    """2 steps, attention_backend unset (native on the CPU), a checkpoint at step 2."""
    out = tmp_path_factory.mktemp("unset") / "run"
    run(cfg_of(max_steps=2, checkpoint_every=2), store_dir, tiny_edit_model, out)
    return out


def test_spelled_out_default_resumes_the_unset_run(unset_run, store_dir, tiny_edit_model, tmp_path):
    plain, spelled = tmp_path / "plain", tmp_path / "spelled"
    shutil.copytree(unset_run, plain)
    shutil.copytree(unset_run, spelled)
    run(cfg_of(max_steps=4, checkpoint_every=2), store_dir, tiny_edit_model, plain, resume=True)
    result = run(cfg_of(max_steps=4, checkpoint_every=2, attention_backend="native"), store_dir, tiny_edit_model,
                 spelled, resume=True, new_run=True)
    assert result.kept_previous is None and result.start_step == 2  # continued, not trained afresh
    assert_same_lora(lora_of(spelled), lora_of(plain))
    record = train_state.ResumeRecord.read(spelled / "checkpoints" / "step-4" / train_state.RESUME_JSON)
    assert record.attention_backend == "native"
    # finished: up to date whichever way the default is spelled, and unset again too
    for backend in (None, "native"):
        assert up_to_date(cfg_of(max_steps=4, attention_backend=backend), store_dir, tiny_edit_model, spelled)


def test_another_backend_is_another_run(unset_run, store_dir, tiny_edit_model, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(unset_run, out)
    assert up_to_date(cfg_of(max_steps=2), store_dir, tiny_edit_model, out)
    assert not up_to_date(cfg_of(max_steps=2, attention_backend="packed"), store_dir, tiny_edit_model, out)
    with pytest.raises(UserError, match=r"attention backend \(as resolved\) native -> packed"):
        run(cfg_of(max_steps=4, attention_backend="packed"), store_dir, tiny_edit_model, out, resume=True)
    result = run(cfg_of(max_steps=2, checkpoint_every=2, attention_backend="packed"), store_dir, tiny_edit_model, out,
                 resume=True, new_run=True)
    assert result.kept_previous is not None and result.start_step == 0


def _as_before(run_dir: Path, backend_set: str | None) -> None:
    """The run's checkpoint records as written before the backend was recorded (the fingerprint then hashed the
    name as set), resealed."""
    from dataclasses import asdict, replace

    from schemas.lineage import hashed_settings, settings_hash
    from stages.train.settings import resolve_precision

    tc = resolve_precision(cfg_of(max_steps=2, checkpoint_every=2).train, "cpu")
    fingerprint = settings_hash({**hashed_settings(tc), "attention_backend": backend_set})
    for _, folder in train_state.complete_checkpoints(run_dir / "checkpoints"):
        record = train_state.ResumeRecord.read(folder / train_state.RESUME_JSON)
        old = {k: v for k, v in asdict(replace(record, config_fingerprint=fingerprint)).items()
               if k != "attention_backend"}
        from store.checksum import seal

        (folder / train_state.RESUME_JSON).write_bytes(seal({**old, "files": train_state.file_checksums(folder)}))
    import os

    from models.lora import WEIGHT_NAME

    os.utime(run_dir / "lora" / WEIGHT_NAME)  # written after its last checkpoint, as it was


def test_records_from_before(unset_run, store_dir, tiny_edit_model, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(unset_run, out)
    _as_before(out, None)
    # unset then: RUN/attention.json names the backend it used
    assert json.loads((out / "attention.json").read_text())["backend"] == "native"
    assert up_to_date(cfg_of(max_steps=2), store_dir, tiny_edit_model, out)
    assert up_to_date(cfg_of(max_steps=2, attention_backend="native"), store_dir, tiny_edit_model, out)
    assert not up_to_date(cfg_of(max_steps=2, attention_backend="packed"), store_dir, tiny_edit_model, out)
    # no attention.json (a run older than it): unset now is taken as before, a name set now is not known to be it
    (out / "attention.json").unlink()
    assert up_to_date(cfg_of(max_steps=2), store_dir, tiny_edit_model, out)
    assert not up_to_date(cfg_of(max_steps=2, attention_backend="native"), store_dir, tiny_edit_model, out)
    # a name set then: its fingerprint hashed the name, used as named
    _as_before(out, "native")
    assert up_to_date(cfg_of(max_steps=2, attention_backend="native"), store_dir, tiny_edit_model, out)
    assert not up_to_date(cfg_of(max_steps=2, attention_backend="packed"), store_dir, tiny_edit_model, out)


# rank 1 reads no RUN/attention.json, as a node whose view of the run folder lacks it
_NO_ATTENTION_JSON_ON_RANK_1 = """
import os, pathlib
if os.environ.get('RANK') == '1':
    real = pathlib.Path.read_text
    def read_text(self, *a, **k):
        if self.name == 'attention.json':
            raise FileNotFoundError(2, 'No such file or directory', str(self))
        return real(self, *a, **k)
    pathlib.Path.read_text = read_text
"""


def test_ranks_that_read_attention_json_differently_decide_together(unset_run, store_dir, tiny_edit_model,
                                                                   tmp_path):
    """A record from before the backend was recorded is read through RUN/attention.json by each rank: rank 0 reads
    native (the run's), rank 1 none (not known to be the run's). Before, rank 0 resumed the run while rank 1 kept it
    and started afresh (`--new-run`): the ranks went into different collectives (a hang, or a failure naming
    neither). Now the ranks decide together: another run on every rank, kept once, trained afresh to the end."""
    from rank_hook import launch_with_hook
    from stages.train import previous
    from test_train import BASE

    out = tmp_path / "run"
    shutil.copytree(unset_run, out)
    _as_before(out, None)
    settings = {**BASE, "train.max_steps": 4, "train.checkpoint_every": 2, "train.attention_backend": "native"}
    args = ["run", "train", "--store", str(store_dir), "--model", tiny_edit_model, "--out", str(out), "--resume",
            "--new-run", *[a for k, v in settings.items() for a in ("--set", f"{k}={v}")]]
    done = launch_with_hook(tmp_path, _NO_ATTENTION_JSON_ON_RANK_1, args, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "attention backend (as resolved) None -> native" in done.stdout + done.stderr, done.stdout[-3000:]
    (kept,) = previous.kept_runs(out)
    assert train_state.latest_checkpoint(kept / "checkpoints").name == "step-2"  # the old run, as it was
    record = train_state.ResumeRecord.read(train_state.latest_checkpoint(out / "checkpoints") / train_state.RESUME_JSON)
    assert (record.step, record.attention_backend) == (4, "native")


def test_a_name_spelled_then_and_resolved_now_unset_is_that_run(unset_run, store_dir, tiny_edit_model, tmp_path):
    """A run recorded with `native` spelled out (hashed by name, before the backend was recorded) is the run of the
    unset setting on the CPU, where unset resolves to native, as the other way round: up to date, and resumed (the
    same LoRA as an unset run continued), not trained afresh. Before, only the name spelled now read such a record:
    unset, its fingerprint passed for another config and the run was kept and trained again from step 0."""
    plain, out = tmp_path / "plain", tmp_path / "run"
    shutil.copytree(unset_run, plain)
    shutil.copytree(unset_run, out)
    _as_before(out, "native")
    (out / "attention.json").unlink()  # the name hashed then is the evidence, not a start's note
    assert up_to_date(cfg_of(max_steps=2), store_dir, tiny_edit_model, out)
    run(cfg_of(max_steps=4, checkpoint_every=2), store_dir, tiny_edit_model, plain, resume=True)
    result = run(cfg_of(max_steps=4, checkpoint_every=2), store_dir, tiny_edit_model, out, resume=True, new_run=True)
    assert result.kept_previous is None and result.start_step == 2
    assert_same_lora(lora_of(out), lora_of(plain))
    # a name that resolves to another backend than unset now is still another run
    _as_before(plain, "packed")
    assert not up_to_date(cfg_of(max_steps=4), store_dir, tiny_edit_model, plain)


def test_a_run_resumed_from_a_name_hashed_then_is_one_training_for_evaluate(unset_run, store_dir, tiny_edit_model,
                                                                              tmp_path):
    """A run whose checkpoints hashed train.attention_backend by name (`packed` / `native` set, before it was
    recorded resolved), resumed under this release: its new checkpoints record the fingerprint without the name.
    Evaluate tells another training from a pruned step of this one by that record (`same_training`); before, once
    keep_checkpoints pruned the old checkpoints, their steps passed for another training's and every earlier point
    of the report went aside ('the run's checkpoints are not the ones evaluated before'), all evaluated again.
    The new records carry the earlier fingerprint (and on through later resumes): one training."""
    from stages.evaluate.whose_losses import same_training, training_of

    out = tmp_path / "run"
    shutil.copytree(unset_run, out)
    _as_before(out, "native")
    run(cfg_of(max_steps=4, checkpoint_every=2, attention_backend="native"), store_dir, tiny_edit_model, out,
        resume=True)
    run(cfg_of(max_steps=6, checkpoint_every=2), store_dir, tiny_edit_model, out, resume=True)
    old, new, newer = (training_of(out / "checkpoints" / f"step-{s}" / "lora") for s in (2, 4, 6))
    assert old["config_fingerprint"] != new["config_fingerprint"]  # the name hashed then, not now
    assert same_training(old, new) and same_training(new, old) and same_training(old, newer)
    assert same_training(new, newer)
    other = {**old, "config_fingerprint": "another config"}  # another training is still another one
    assert not same_training(other, new) and not same_training(new, other)


def test_a_run_resumed_from_records_without_a_backend_carries_the_one_it_took_them_for(unset_run, store_dir,
                                                                                       tiny_edit_model, tmp_path):
    """Evaluate reads a record without `attention_backend` as of the backend its run's resume took it for
    (`UNRECORDED_BACKEND`, schemas/record_formats.py), never as any backend's (tests/stages/
    test_evaluate_checkpoints.py): the resumed run's records carry it, through later resumes too, so its old and
    new checkpoints stay one training once the old ones are pruned."""
    from schemas.record_formats import UNRECORDED_BACKEND
    from stages.evaluate.whose_losses import same_training, training_of

    out = tmp_path / "run"
    shutil.copytree(unset_run, out)
    _as_before(out, None)
    run(cfg_of(max_steps=4, checkpoint_every=2), store_dir, tiny_edit_model, out, resume=True)
    run(cfg_of(max_steps=6, checkpoint_every=2), store_dir, tiny_edit_model, out, resume=True)
    old, new, newer = (training_of(out / "checkpoints" / f"step-{s}" / "lora") for s in (2, 4, 6))
    assert old["attention_backend"] is None and UNRECORDED_BACKEND not in old  # as written before
    assert new[UNRECORDED_BACKEND] == newer[UNRECORDED_BACKEND] == "native"
    assert same_training(old, new) and same_training(new, old) and same_training(old, newer)
