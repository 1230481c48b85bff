"""evaluate.attention_backend is hashed as the backend evaluate resolved it to, not as written: `native` spelled out
after an unset run on the CPU (where unset resolves to native) evaluates nothing new, a single-LoRA report stays
current, `pipeline compare` takes the two as one scale; a name that resolves to another backend (`packed`, which
runs on the CPU too) evaluates every checkpoint again. Reports recorded unset before (the name hashed as written)
are reused where their evidence says which backend they used, computed again where it cannot."""

from __future__ import annotations

import json

import pytest
import zarr

from schemas.config import EvaluateConfig
from schemas.errors import UserError
from stages.evaluate import checkpoints as ev, stage
from stages.evaluate.compare import check_same_held_out, read_curves
from stages.evaluate.loss_groups import group_hash
from store.loss_array import GROUP
from test_evaluate_checkpoints import CFG, _ckpts, run_and_store  # noqa: F401 (the fixture)


def cfg(**kw) -> EvaluateConfig:
    return EvaluateConfig(**{**CFG, **kw})


def test_native_spelled_out_evaluates_nothing_new_and_packed_everything(run_and_store, tiny_edit_model, tmp_path):
    root, out = run_and_store, tmp_path / "report"
    first = ev.run(cfg(), root / "store", tiny_edit_model, _ckpts(root), out)
    assert first.evaluated == 3
    forced = ev.run(cfg(attention_backend="native"), root / "store", tiny_edit_model, _ckpts(root), out)
    assert forced.evaluated == 0 and forced.best["loss"] == first.best["loss"]
    assert not list(out.glob("losses.*.zarr"))  # nothing set aside
    assert ev.run(cfg(attention_backend="native"), root / "store", tiny_edit_model, _ckpts(root), out,
                  skip_if_done=True).up_to_date
    assert first.metrics["run"]["config"]["attention_backend"] == "native"  # recorded as resolved
    assert forced.metrics["run"]["attention"]["reason"].startswith("configured")
    assert first.metrics["run"]["attention"]["reason"].startswith("default on cpu")  # the choice as made
    native = tmp_path / "native"  # compare: unset and native one scale, packed another
    ev.run(cfg(attention_backend="native"), root / "store", tiny_edit_model, _ckpts(root)[:1], native)
    check_same_held_out([read_curves(out, "unset"), read_curves(native, "native")])
    other = ev.run(cfg(attention_backend="packed"), root / "store", tiny_edit_model, _ckpts(root), out,
                   skip_if_done=True)
    assert not other.up_to_date and other.evaluated == 3
    with pytest.raises(UserError, match="attention_backend: packed vs native"):
        check_same_held_out([read_curves(out, "packed"), read_curves(native, "native")])


def test_a_single_lora_report_stays_current_with_native_spelled_out(run_and_store, tiny_edit_model, tmp_path):
    root, out = run_and_store, tmp_path / "report"
    lora = _ckpts(root)[0][1]
    stage.run(cfg(), root / "store", tiny_edit_model, lora, out)
    assert stage.run(cfg(attention_backend="native"), root / "store", tiny_edit_model, lora, out,
                     skip_if_done=True).up_to_date
    assert not stage.run(cfg(attention_backend="packed"), root / "store", tiny_edit_model, lora, out,
                         skip_if_done=True).up_to_date


def _as_recorded_unset(out, checkpoints: bool = True) -> None:
    """OUT's report (and loss array) as the release before recorded an unset backend: the name hashed as written."""
    metrics = json.loads((out / "metrics.json").read_text())
    old_cfg = EvaluateConfig(**{**metrics["run"]["config"], "attention_backend": None})
    if checkpoints:
        group = zarr.open_group(out / GROUP, mode="r+", use_consolidated=True)
        settings = dict(group.attrs["settings"])
        settings["evaluate"] = {**settings["evaluate"], "attention_backend": None}
        group.attrs.update({"fingerprint": group_hash(settings), "settings": settings})
        zarr.consolidate_metadata(out / GROUP)
        metrics["run"]["settings"] = settings
        metrics["checkpoints"].update(fingerprint=group_hash(settings), config_fingerprint=old_cfg.fingerprint())
    else:
        metrics["run"]["inputs"]["config_fingerprint"] = old_cfg.fingerprint()
    metrics["run"]["config"]["attention_backend"] = None
    metrics.pop("checksum", None)  # edited by hand: unsealed, as a report of an earlier release
    (out / "metrics.json").write_text(json.dumps(metrics))


def test_reports_recorded_unset_before_are_reused_where_the_evidence_allows(run_and_store, tiny_edit_model,
                                                                            tmp_path):
    root, out = run_and_store, tmp_path / "report"
    first = ev.run(cfg(), root / "store", tiny_edit_model, _ckpts(root), out)
    _as_recorded_unset(out)
    before = read_curves(out, "before")
    assert before.held_out["evaluate settings"]["attention_backend"] == "native"  # float32: native on any device
    native = tmp_path / "native"
    ev.run(cfg(attention_backend="native"), root / "store", tiny_edit_model, _ckpts(root)[:1], native)
    check_same_held_out([before, read_curves(native, "native")])  # one scale
    for backend in (None, "native"):
        assert ev.run(cfg(attention_backend=backend), root / "store", tiny_edit_model, _ckpts(root), out,
                      skip_if_done=True).up_to_date
    forced = ev.run(cfg(attention_backend="native"), root / "store", tiny_edit_model, _ckpts(root), out)
    assert forced.evaluated == 0 and forced.best["loss"] == first.best["loss"]  # the array taken, respelled
    assert not list(out.glob("losses.*.zarr"))  # nothing set aside
    _as_recorded_unset(out)
    assert not ev.run(cfg(attention_backend="packed"), root / "store", tiny_edit_model, _ckpts(root), out,
                      skip_if_done=True).up_to_date
    lora, single = _ckpts(root)[0][1], tmp_path / "single"
    stage.run(cfg(), root / "store", tiny_edit_model, lora, single)
    _as_recorded_unset(single, checkpoints=False)
    for backend in (None, "native"):
        assert stage.run(cfg(attention_backend=backend), root / "store", tiny_edit_model, lora, single,
                         skip_if_done=True).up_to_date
    assert not stage.run(cfg(attention_backend="packed"), root / "store", tiny_edit_model, lora, single,
                         skip_if_done=True).up_to_date


def test_a_bf16_report_recorded_unset_without_evidence_is_evaluated_again(run_and_store, tiny_edit_model, tmp_path):
    """In bf16 an unset backend was packed on a GPU whose probe passed: a report that cannot tell is not reused."""
    root, out = run_and_store, tmp_path / "report"
    ev.run(cfg(dtype="bfloat16"), root / "store", tiny_edit_model, _ckpts(root), out)
    _as_recorded_unset(out)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["run"]["attention"]["backend"] == "native"  # its own record: reused
    assert ev.run(cfg(dtype="bfloat16"), root / "store", tiny_edit_model, _ckpts(root), out,
                  skip_if_done=True).up_to_date
    _as_recorded_unset(out)
    metrics = json.loads((out / "metrics.json").read_text())
    del metrics["run"]["attention"]
    metrics["run"]["config"]["device"] = "cuda:0"  # made on a GPU, its backend not recorded
    metrics.pop("checksum", None)  # edited by hand: unsealed, as a report of an earlier release
    (out / "metrics.json").write_text(json.dumps(metrics))
    again = ev.run(cfg(dtype="bfloat16"), root / "store", tiny_edit_model, _ckpts(root), out, skip_if_done=True)
    assert not again.up_to_date and again.evaluated == 3


def test_the_evidence_of_an_unset_backend():
    """bf16/fp16 on CUDA took packed where its probe passed: only the report's own record tells."""
    from stages.evaluate.backend import unset_backend

    assert unset_backend("float32") == "native"
    assert unset_backend("bfloat16") is None
    assert unset_backend("bfloat16", {"run": {"config": {"device": "cpu"}}}) == "native"
    assert unset_backend("bfloat16", {"run": {"config": {"device": "cuda:0"}}}) is None
    cuda = {"run": {"config": {"device": "cuda:0"}, "attention": {"backend": "packed"}, "settings": {"a": 1}}}
    assert unset_backend("bfloat16", cuda) == "packed"
    assert unset_backend("bfloat16", cuda, {"a": 1}) == "packed"
    assert unset_backend("bfloat16", cuda, {"a": 2}) is None  # the report of another array: no evidence
