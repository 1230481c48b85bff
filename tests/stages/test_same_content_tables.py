"""A trained run is named by what it read, not by the version numbers it was read under. An `images` rerun that
changes no sample (resize.max_controls raised above the data's maximum: an identity setting) gives new `text` /
`vae` versions that carry every sample forward (hard-linked shards); the finished LoRA stays up to date (`run
all` trains nothing) and a killed run resumes. Before: the new version ids retrained the LoRA from scratch and
refused the resume. Other pixels under the same keys, a sample moved to another split or other bytes still make
another run; a record written before contents were recorded compares version ids as it did."""

from __future__ import annotations

import shutil
from dataclasses import asdict

import pytest

from pipeline.config import load_config
from stages.encode import text as encode_text
from stages.encode import vae as encode_vae
from stages.resize import stage as resize_stage
from stages.train import state as train_state
from store import Store
from store.checksum import seal
from train_store import Spec, make_train_store, mixed_specs, open_split

SETTINGS = {"resize.target_area": 64 * 64, "resize.control_vae_area": 64 * 64, "resize.control_vl_area": 64 * 64,
            "resize.multiple": 16, "resize.min_side": 16, "resize.val_fraction": 0.25, "resize.max_controls": 2,
            "encode_text.dtype": "float32", "encode_vae.dtype": "float32",
            "train.device": "cpu", "train.batch_size": 2, "train.lora.rank": 4, "train.sigma.sampling": "uniform",
            "train.max_steps": 2, "train.checkpoint_every": 1, "train.keep_checkpoints": 3}
LORA = "lora/pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def trained(tiny_plus_model, tmp_path_factory):
    """A store built by the stages (resize-bucket, both encoders) and a finished 2-step run on it."""
    from pipeline.demo_data import make_demo_data
    from stages.train.recipe import run as train

    root = tmp_path_factory.mktemp("same-content")
    make_demo_data(root / "src", n=8, fmt="folder", max_controls=1, seed=3)
    cfg = load_config(None, SETTINGS)
    resize_stage.run(cfg, root / "src", root / "store")
    encode_text.run(cfg, root / "store", tiny_plus_model)
    encode_vae.run(cfg, root / "store", tiny_plus_model)
    assert train(cfg, root / "store", tiny_plus_model, root / "run").steps == 2
    return root


def _copy(trained, tmp_path):
    for name in ("src", "store", "run"):
        shutil.copytree(trained / name, tmp_path / name, symlinks=True)
    return tmp_path / "store", tmp_path / "run"


def _rebuild(cfg, src, store, model):
    """resize-bucket, then both encoders: their summaries."""
    return resize_stage.run(cfg, src, store), encode_text.run(cfg, store, model), encode_vae.run(cfg, store, model)


def test_an_images_rerun_that_changes_no_sample_keeps_the_run_and_its_resume(trained, tiny_plus_model, tmp_path):
    from stages.train.recipe import run as train, up_to_date

    store, run = _copy(trained, tmp_path)
    lora = (run / LORA).read_bytes()
    cfg = load_config(None, {**SETTINGS, "resize.max_controls": 3})  # above every sample's 1 control
    images, text, vae = _rebuild(cfg, tmp_path / "src", store, tiny_plus_model)
    assert not images.up_to_date and images.written == 0 and images.reused == 8
    assert (text.version, text.reused, vae.version, vae.reused) == (2, 8, 2, 8)  # new versions, nothing encoded

    assert up_to_date(cfg, store, tiny_plus_model, run)
    again = train(cfg, store, tiny_plus_model, run, skip_if_done=True, new_run=True)  # `pipeline run all`
    assert again.up_to_date and again.kept_previous is None and (run / LORA).read_bytes() == lora
    assert not (tmp_path / "run.previous").exists()

    # a run to more steps continues from the last checkpoint, read under the old versions
    resumed = train(load_config(None, {**SETTINGS, "resize.max_controls": 3, "train.max_steps": 3}), store,
                    tiny_plus_model, run, resume=True)
    assert (resumed.start_step, resumed.steps) == (2, 3)
    record = train_state.ResumeRecord.read(run / "checkpoints" / "step-3" / train_state.RESUME_JSON)
    assert record.tables["text"].startswith("v2-") and record.table_contents is not None


def test_other_pixels_under_the_same_keys_retrain_and_refuse_a_resume(trained, tiny_plus_model, tmp_path):
    from stages.train.recipe import run as train, up_to_date

    store, run = _copy(trained, tmp_path)
    cfg = load_config(None, {**SETTINGS, "resize.target_area": 48 * 48})  # other renders of the same sources
    images, text, vae = _rebuild(cfg, tmp_path / "src", store, tiny_plus_model)
    # the text encoder reads no target picture: its features are carried (tests/stages/test_encode_text_carry.py)
    assert images.written == 8 and (text.encoded, text.reused) == (0, 8) and (vae.encoded, vae.reused) == (8, 0)
    st = Store(store, create=False)
    with st.reader("vae", 1) as old, st.reader("vae", 2) as new:
        assert old.keys() == new.keys()  # the same keys: only the contents tell them apart

    assert not up_to_date(cfg, store, tiny_plus_model, run)
    with pytest.raises(train_state.ResumeMismatch, match="store tables"):
        train(load_config(None, {**SETTINGS, "resize.target_area": 48 * 48, "train.max_steps": 3}), store,
              tiny_plus_model, run, resume=True)


# ------------------------------------------------------------------- the identity itself, on written tables

ENCODED = {"feature_lineage": "encoded-by-a-stage"}


def _contents(root, model, **kw):
    make_train_store(root, model, kw.pop("specs", mixed_specs(6, 2)), attrs=kw.pop("attrs", ENCODED), **kw)
    with open_split(root, model) as tables:
        return tables.content_ids(), tables.versions()


def test_content_ids_name_the_samples_read_not_their_shards(tiny_edit_model, tmp_path):
    one, one_ids = _contents(tmp_path / "one-shard", tiny_edit_model)
    many, many_ids = _contents(tmp_path / "many-shards", tiny_edit_model, shard_size_mb=1e-6)  # a shard a sample
    assert one_ids != many_ids and one == many  # other manifests, the same samples

    poisoned, _ = _contents(tmp_path / "poisoned", tiny_edit_model, poison={1: 3.0})  # one latent value
    assert poisoned["vae"] != one["vae"] and poisoned["text"] == one["text"]
    specs = mixed_specs(6, 2)
    specs[2] = Spec(specs[2].target, specs[2].controls, specs[2].text_len, "val")  # one sample leaves the split
    moved, _ = _contents(tmp_path / "moved", tiny_edit_model, specs=specs)
    assert moved["text"] != one["text"] and moved["vae"] != one["vae"]
    # the same bytes with other sequence lengths (what orders and batches them) are another run
    with open_split(tmp_path / "one-shard", tiny_edit_model) as tables:
        tables.lengths = tables.lengths[::-1].copy()
        assert tables.content_ids()["text"] != one["text"]
    # tables no encode stage wrote (no feature lineage: a hand-written layout) are named by their versions alone
    assert _contents(tmp_path / "by-hand", tiny_edit_model, attrs={})[0] is None


def test_the_shards_a_sample_lies_in_do_not_change_the_trained_weights(tiny_edit_model, tmp_path):
    """Why the content ids leave the shard grouping out: train orders samples by index and length alone."""
    from safetensors.torch import load_file

    from stages.train.recipe import run as train

    cfg = load_config(None, {k: v for k, v in SETTINGS.items() if k.startswith("train.")})
    for name, size in (("one", 256), ("many", 1e-6)):
        make_train_store(tmp_path / name, tiny_edit_model, mixed_specs(6, 2), attrs=ENCODED, shard_size_mb=size)
        train(cfg, tmp_path / name, tiny_edit_model, tmp_path / f"run-{name}")
    one, many = (load_file(tmp_path / f"run-{name}" / LORA) for name in ("one", "many"))
    assert one.keys() == many.keys() and all(one[k].equal(many[k]) for k in one)  # bit for bit


def _record(**kw) -> train_state.ResumeRecord:
    base = dict(step=2, epoch=0, batch_in_epoch=2, config_fingerprint="c", tables={"text": "v1-a", "vae": "v1-b"},
                store="/s", model_fingerprint="m", world_size=1)
    return train_state.ResumeRecord(**{**base, **kw})


def test_a_record_without_contents_compares_version_ids_as_before(tmp_path):
    moved = {"text": "v2-a", "vae": "v2-b"}
    same = {"text": "c1", "vae": "c2"}
    calls = []

    def contents():
        calls.append(1)
        return same

    # written before contents were recorded: other ids are other tables (refused), whatever the contents now
    old = _record()
    with pytest.raises(train_state.ResumeMismatch, match="store tables"):
        old.check_matches(_record(tables=moved), tmp_path, contents=contents)
    old.check_matches(_record(), tmp_path, contents=contents)
    assert not calls  # nothing hashed when the ids say it all
    # with contents: the same samples under other ids continue; other contents do not
    new = _record(table_contents=same)
    new.check_matches(_record(tables=moved), tmp_path, contents=contents)
    with pytest.raises(train_state.ResumeMismatch, match="store tables"):
        new.check_matches(_record(tables=moved), tmp_path, contents=lambda: {**same, "vae": "c3"})
    with pytest.raises(train_state.ResumeMismatch):  # tables without contents now: the ids decide
        new.check_matches(_record(tables=moved), tmp_path, contents=lambda: None)
    # a resume.json written before the field existed still reads
    fields = {k: v for k, v in asdict(old).items() if k != "table_contents"}
    (tmp_path / train_state.RESUME_JSON).write_bytes(seal({**fields, "files": {}}))
    assert train_state.ResumeRecord.read(tmp_path / train_state.RESUME_JSON) == old


# ------------------------------------------------------------------- evaluate: its report, loss array and caches

EVAL = dict(noise_seeds=[0], timesteps=[0.5], batch_size=4, num_samples=1, num_inference_steps=2, device="cpu")


def _steps(run):
    return [(s, run / "checkpoints" / f"step-{s}" / "lora") for s in (1, 2)]


def _evaluated(trained, tiny_plus_model, tmp_path):
    """The copied store and run, a single-LoRA report and an --all-checkpoints report of it."""
    from schemas.config import EvaluateConfig
    from stages.evaluate import checkpoints as ev
    from stages.evaluate import stage

    store, run = _copy(trained, tmp_path)
    single, every = tmp_path / "report", tmp_path / "checkpoints"
    stage.run(EvaluateConfig(**EVAL), store, tiny_plus_model, run / "lora", single)
    assert ev.run(EvaluateConfig(**EVAL), store, tiny_plus_model, _steps(run), every).evaluated == 2
    return store, run, single, every


def _reevaluate(store, run, single, every, model, monkeypatch):
    """Both reports again as `pipeline run all` does (skip_if_done), counting the loss passes."""
    from models import held_out
    from schemas.config import EvaluateConfig
    from stages.evaluate import checkpoints as ev
    from stages.evaluate import loss_pass, loss_section, stage

    passes = []
    grid = held_out.loss_grid
    monkeypatch.setattr(held_out, "loss_grid", lambda *a, **k: passes.append(1) or grid(*a, **k))
    monkeypatch.setattr(loss_section, "loss_grid", held_out.loss_grid)
    monkeypatch.setattr(loss_pass, "loss_grid", held_out.loss_grid)
    one = stage.run(EvaluateConfig(**EVAL), store, model, run / "lora", single, skip_if_done=True)
    every_ = ev.run(EvaluateConfig(**EVAL), store, model, _steps(run), every, skip_if_done=True)
    return one, every_, len(passes)


def test_an_images_rerun_that_changes_no_sample_keeps_the_evaluate_reports(trained, tiny_plus_model, tmp_path,
                                                                          monkeypatch):
    """Before: both reports named the tables by version ids, so the new versions re-ran every held-out loss pass
    (hours at scale) for the same numbers."""
    store, run, single, every = _evaluated(trained, tiny_plus_model, tmp_path)
    cfg = load_config(None, {**SETTINGS, "resize.max_controls": 3})
    _, text, vae = _rebuild(cfg, tmp_path / "src", store, tiny_plus_model)
    assert (text.version, text.reused, vae.version, vae.reused) == (2, 8, 2, 8)

    one, every_, passes = _reevaluate(store, run, single, every, tiny_plus_model, monkeypatch)
    assert one.up_to_date and every_.up_to_date and passes == 0
    # forced: the loss array and the base caches are still this evaluation's
    from schemas.config import EvaluateConfig
    from stages.evaluate import checkpoints as ev

    assert ev.run(EvaluateConfig(**EVAL), store, tiny_plus_model, _steps(run), every).evaluated == 0
    assert not list(every.glob("losses.*.zarr"))  # nothing set aside


def test_another_sample_under_the_same_keys_is_evaluated_again(trained, tiny_plus_model, tmp_path, monkeypatch):
    store, run, single, every = _evaluated(trained, tiny_plus_model, tmp_path)
    cfg = load_config(None, {**SETTINGS, "resize.target_area": 48 * 48})  # other renders of the same sources
    _rebuild(cfg, tmp_path / "src", store, tiny_plus_model)
    one, every_, passes = _reevaluate(store, run, single, every, tiny_plus_model, monkeypatch)
    assert not one.up_to_date and not every_.up_to_date and every_.evaluated == 2
    assert passes == 2 + 3  # single: base + LoRA (its base cache not reused); all: base + 2 checkpoints


def test_a_changed_caption_is_another_report(trained, tiny_plus_model, tmp_path):
    """The pictures' rows are named too: a caption (shown in the report) changed under the same features."""
    from stages.evaluate.table_ids import read_table_ids
    from stages.evaluate.val_pictures import PICTURE_COLUMNS

    from schemas.config import EvaluateConfig

    store, _ = _copy(trained, tmp_path)
    before = read_table_ids(EvaluateConfig(**EVAL), store, tiny_plus_model)
    assert all(v.startswith("content:") for v in before.values()) and set(before) == {"images", "text", "vae"}
    st = Store(store, create=False)
    images = st.tables()["images"]
    import pyarrow as pa

    from store.join import rows_content_id

    with st.reader("images", images) as r:
        keys = pa.array(sorted(r.keys()))
        same = rows_content_id(r, keys, PICTURE_COLUMNS)
        assert rows_content_id(r, keys, PICTURE_COLUMNS) == same
        cap = r.column("caption")
        r.view._arrays["caption"] = pa.array(["another caption"] + cap.to_pylist()[1:], cap.type)
        assert rows_content_id(r, keys, PICTURE_COLUMNS) != same
        assert rows_content_id(r, keys[1:], PICTURE_COLUMNS) != same  # other keys


def test_reports_and_arrays_recorded_under_version_ids_stay_current(trained, tiny_plus_model, tmp_path,
                                                                    monkeypatch):
    """A report and loss array as the earlier release recorded them (the tables named by the version ids read) are
    current while nothing changed, and are recorded under content at their next write: an `images` rerun that
    changes no sample then keeps them too. (The base caches are made again: their keys hold the source digest,
    which that release had another of.)"""
    import zarr

    from schemas.config import EvaluateConfig
    from stages.evaluate import checkpoints as ev
    from stages.evaluate import loss_fingerprint, loss_section, stage, table_ids

    with monkeypatch.context() as old_release:  # every table named by its version id, as before
        old_release.setattr(loss_fingerprint, "read_tables", lambda tables, cap: tables.versions())
        old_release.setattr(table_ids, "images_rows_id", lambda st, tables, first=None: None)
        store, run, single, every = _evaluated(trained, tiny_plus_model, tmp_path)
    import json

    assert json.loads((single / "metrics.json").read_text())["run"]["inputs"]["tables"] == \
        table_ids.version_table_ids(store)  # the earlier release's spelling, exactly
    old = zarr.open_group(every / "losses.zarr", mode="r", use_consolidated=True).attrs["fingerprint"]

    with monkeypatch.context() as m:
        one, every_, passes = _reevaluate(store, run, single, every, tiny_plus_model, m)
    assert one.up_to_date and every_.up_to_date and passes == 0
    with monkeypatch.context() as m:  # forced: recorded again, under content
        passes = []
        grid = loss_section.loss_grid
        m.setattr(loss_section, "loss_grid", lambda *a, **k: passes.append(1) or grid(*a, **k))
        stage.run(EvaluateConfig(**EVAL), store, tiny_plus_model, run / "lora", single)
        assert passes == [1, 1]  # the base's too: no fallback to a base cache keyed by version ids
    assert ev.run(EvaluateConfig(**EVAL), store, tiny_plus_model, _steps(run), every).evaluated == 0
    assert zarr.open_group(every / "losses.zarr", mode="r", use_consolidated=True).attrs["fingerprint"] != old
    assert not list(every.glob("losses.*.zarr"))

    _rebuild(load_config(None, {**SETTINGS, "resize.max_controls": 3}), tmp_path / "src", store, tiny_plus_model)
    one, every_, passes = _reevaluate(store, run, single, every, tiny_plus_model, monkeypatch)
    assert one.up_to_date and every_.up_to_date and passes == 0


def test_compare_matches_an_array_named_by_content_with_one_named_by_versions(trained, tiny_plus_model, tmp_path,
                                                                               monkeypatch):
    """`pipeline compare` of a report written now (tables named by content) with one named by the version ids read
    (validation while training, an earlier release) on the same tables: one held-out set, as before; after an
    `images` rerun the new report reads other versions, and the two are refused as before (versions alone say
    nothing of the contents of the older one)."""
    from schemas.config import EvaluateConfig
    from schemas.errors import UserError
    from stages.evaluate import checkpoints as ev, loss_fingerprint
    from stages.evaluate.compare import check_same_held_out, read_curves

    store, run = _copy(trained, tmp_path)
    with monkeypatch.context() as old_release:
        old_release.setattr(loss_fingerprint, "read_tables", lambda tables, cap: tables.versions())
        ev.run(EvaluateConfig(**EVAL, max_loss_samples=1), store, tiny_plus_model, _steps(run), tmp_path / "old")
    ev.run(EvaluateConfig(**EVAL, max_loss_samples=1), store, tiny_plus_model, _steps(run), tmp_path / "new")
    old, new = read_curves(tmp_path / "old", "old"), read_curves(tmp_path / "new", "new")
    assert old.held_out["store tables"] != new.held_out["store tables"]
    check_same_held_out([old, new])

    _rebuild(load_config(None, {**SETTINGS, "resize.max_controls": 3}), tmp_path / "src", store, tiny_plus_model)
    ev.run(EvaluateConfig(**EVAL, max_loss_samples=1), store, tiny_plus_model, _steps(run), tmp_path / "new")
    with pytest.raises(UserError, match="store tables"):
        check_same_held_out([old, read_curves(tmp_path / "new", "new")])


# ------------------------------------------------------------------- train: the validation curve (RUN/losses.zarr)

VAL = {**SETTINGS, "train.validate_every": 1, "train.validate_max_samples": 2}


def _curve(run):
    """(steps, fingerprint) of RUN/losses.zarr, and the names of every losses*.zarr in RUN (set-aside ones too)."""
    import xarray as xr

    from store.loss_array import recorded_setting

    steps = [int(s) for s in xr.open_zarr(run / "losses.zarr").step.values]
    return steps, recorded_setting(run)[0], sorted(p.name for p in run.glob("losses*.zarr"))


def _resume(store, model, run, steps, **settings):
    from stages.train.recipe import run as train

    cfg = load_config(None, {**VAL, "train.max_steps": steps, **settings})
    return train(cfg, store, model, run, resume=True)


def test_an_images_rerun_that_changes_no_sample_continues_the_validation_curve(trained, tiny_plus_model, tmp_path):
    """The resume the same samples allow continues the run's curve too. Before: the validator named the val split's
    tables by version ids, so the resumed run began a new curve in RUN/losses.zarr and set steps 1-2 aside
    (`losses.<fp>.zarr`): one run, two curves, and `pipeline compare` / a report showed only the later one."""
    from stages.evaluate.compare import read_curves
    from stages.train.recipe import run as train

    store, _ = _copy(trained, tmp_path)
    run = tmp_path / "val-run"
    train(load_config(None, VAL), store, tiny_plus_model, run)
    steps, fingerprint, _ = _curve(run)
    assert steps == [1, 2]
    _, text, vae = _rebuild(load_config(None, {**VAL, "resize.max_controls": 3}), tmp_path / "src", store,
                            tiny_plus_model)
    assert (text.version, text.reused, vae.version, vae.reused) == (2, 8, 2, 8)

    resumed = _resume(store, tiny_plus_model, run, 3, **{"resize.max_controls": 3})
    assert (resumed.start_step, resumed.steps) == (2, 3)
    assert _curve(run) == ([1, 2, 3], fingerprint, ["losses.zarr"])  # one curve, one setting
    curves = read_curves(run, "run")  # what `pipeline compare` reads: the versions read last kept beside
    assert curves.steps == [1, 2, 3] and curves.table_versions["text"].startswith("v2-")


def _as_earlier_release(run, store) -> None:
    """RUN/losses.zarr as the earlier release recorded it: the val split's tables named by the version ids read
    (the settings and their hash), no `table_versions` beside them."""
    import zarr

    from stages.train.val_curve import _fingerprint

    st = Store(store, create=False)
    group = zarr.open_group(run / "losses.zarr", mode="r+", use_consolidated=True)
    settings = {**group.attrs["settings"], "tables": {t: st.version_id(t, st.tables()[t]) for t in ("text", "vae")}}
    group.attrs.update({"fingerprint": _fingerprint(settings), "settings": settings})
    group.attrs.pop("table_versions", None)
    zarr.consolidate_metadata(run / "losses.zarr")


def test_a_validation_curve_recorded_under_version_ids_is_continued(trained, tiny_plus_model, tmp_path):
    """A run whose curve the earlier release began (tables by version ids) resumes into the same array: continued,
    re-recorded under content, so a later `images` rerun that changes no sample keeps it too."""
    from stages.evaluate.compare import read_curves
    from stages.train.recipe import run as train

    store, _ = _copy(trained, tmp_path)
    run = tmp_path / "val-run"
    train(load_config(None, VAL), store, tiny_plus_model, run)
    now = _curve(run)[1]
    _as_earlier_release(run, store)
    assert read_curves(run, "run").table_versions["text"].startswith("v1-")  # read from the settings

    _resume(store, tiny_plus_model, run, 3)
    assert _curve(run) == ([1, 2, 3], now, ["losses.zarr"])  # continued, and recorded under today's spelling
    assert read_curves(run, "run").table_versions["text"].startswith("v1-")  # noted again for `pipeline compare`

    _rebuild(load_config(None, {**VAL, "resize.max_controls": 3}), tmp_path / "src", store, tiny_plus_model)
    _resume(store, tiny_plus_model, run, 4, **{"resize.max_controls": 3})
    assert _curve(run) == ([1, 2, 3, 4], now, ["losses.zarr"])


def test_a_resume_under_other_validation_settings_keeps_the_curve_aside_and_says_so(trained, tiny_plus_model,
                                                                                     tmp_path, capsys):
    """Other noise seeds make other numbers: the curve begun under the old ones is kept aside, not appended to, and
    the run says where it went (before: set aside without a word)."""
    from stages.train.recipe import run as train

    store, _ = _copy(trained, tmp_path)
    run = tmp_path / "val-run"
    train(load_config(None, VAL), store, tiny_plus_model, run)
    _, fingerprint, _ = _curve(run)
    capsys.readouterr()
    _resume(store, tiny_plus_model, run, 3, **{"train.validate_noise_seeds": [7]})
    steps, now, names = _curve(run)
    # step 2 is validated again under the new seeds (its checkpoint is where the resume starts)
    assert steps == [2, 3] and now != fingerprint and names == sorted(["losses.zarr", f"losses.{fingerprint[:12]}.zarr"])
    out = capsys.readouterr()
    assert f"validation curve: the settings changed: the earlier curve is kept in {run / f'losses.{fingerprint[:12]}.zarr'}" in out.out + out.err
