"""`pipeline run all` refuses resize settings the model's encoders cannot use before resize-bucket renders the
source (hours at a million samples). Before: the 2.1 config's `resize.vl_views: false` with an Edit-Plus model
resized everything, then encode-text refused the table; `resize.multiple: 16` with a 2.1 model resized and
encoded, encode-text quarantined every reference side not a multiple of 32, and run all stopped on the val split."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.demo_data import make_demo_data


def _refused_before_resizing(tmp_path: Path, model: str, resize: dict | None = None, sets=()) -> tuple[Path, str]:
    """`run all` of `model` on 4 demo samples, with `resize` settings in its config and `sets` as --set flags:
    refused in one error line, no traceback, nothing rendered, nothing trained. (its config, that line)"""
    source, store = tmp_path / "src", tmp_path / "store"
    make_demo_data(source, n=4, seed=0)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"paths": {"source": str(source), "store": str(store), "model": model,
                                                "run": str(tmp_path / "run"), "report": str(tmp_path / "report")},
                                      **({"resize": resize} if resize else {})}))
    r = CliRunner().invoke(app, ["run", "all", "--config", str(config), *(a for s in sets for a in ("--set", s))])
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 1 and len(lines) == 1 and "Traceback" not in r.output, r.output
    assert not store.exists() and not (tmp_path / "run").exists()
    return config, lines[0]


@pytest.mark.parametrize("variant,sets,said", [
    ("plus", ["resize.vl_views=false"], "error: resize.vl_views: false writes no control_{i}_vl.png, which "),
    ("21", ["resize.multiple=16"], "error: resize.multiple = 16: "),
    ("21", ["resize.multiple=48"], "error: resize.multiple = 48: "),
    # references resized to an area the VLM processor resizes again (the tiny one keeps 1024..262144 px): encode-text
    # ran the VLM on each and quarantined every sample with a reference ("VLM grid differs from the VAE grid")
    ("21", ["resize.keep_alpha=true", "resize.max_controls=10", "resize.control_vae_area=331776"], "error: resize.control_vae_area = 331776: "),
    ("21", ["resize.keep_alpha=true", "resize.max_controls=10", "resize.control_vae_area=512"], "error: resize.control_vae_area = 512: "),
    # above the model's 10 references: encode-text quarantined every sample with more, after resizing them all
    ("21", ["resize.keep_alpha=true", "resize.max_controls=11", "resize.control_vae_area=9216"],
     "error: resize.max_controls = 11: "),
])
def test_run_all_refuses_resize_settings_the_model_cannot_read_before_resizing(tiny_plus_model, tiny_21_model,
                                                                                  tmp_path, variant, sets, said):
    model = tiny_plus_model if variant == "plus" else tiny_21_model
    _, line = _refused_before_resizing(tmp_path, model, sets=sets)
    assert line.startswith(said) and model in line, line


def test_run_all_refuses_a_model_whose_transformer_weights_are_gone_before_resizing(tiny_21_model, tmp_path):
    """A partial copy without the transformer's weight file: resize-bucket and both encoders ran (they do not
    read it), then train failed with diffusers' OSError traceback. Now one line naming the folder, first."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_21_model, model)
    (model / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    _, line = _refused_before_resizing(tmp_path, str(model))
    assert line == (f"error: model folder {model} is damaged: transformer/ has no weight file (*.safetensors) "
                    "next to its config.json; restore it from the original download"), line


def test_run_all_refuses_a_21_model_with_keep_alpha_unset_and_takes_either_setting(tiny_21_model, tmp_path):
    """Unset, resize.keep_alpha is false: a 2.1 run composited its cut-outs over white for a VAE that reads their
    alpha, said only in resize's `converted:` line. Now refused first, naming both settings; set either way it
    passes, and false hashes as unset (a store rendered without the setting stays up to date)."""
    from pipeline.config import load_config
    from pipeline.orchestrate import _check_resize

    config, line = _refused_before_resizing(tmp_path, tiny_21_model, {"multiple": 32, "control_vae_area": 96 * 96,
                                                                     "max_controls": 10})
    assert line.startswith("error: resize.keep_alpha is unset") and tiny_21_model in line, line
    assert "resize.keep_alpha: true" in line and "resize.keep_alpha: false" in line, line
    unset = load_config(config)
    for value in (True, False):
        _check_resize(load_config(config, {"resize.keep_alpha": value}), tiny_21_model)
    assert load_config(config, {"resize.keep_alpha": False}).resize.fingerprint() == unset.resize.fingerprint()


def test_run_all_refuses_a_21_model_with_max_controls_unset_and_takes_either_setting(tiny_21_model, tmp_path):
    """Unset, resize.max_controls is Edit-Plus's 3: a 2.1 run (the model takes up to 10 references) quarantined
    every sample with 4..10 of them as control-count, said only in resize's summary. Now refused first, as an
    unset keep_alpha is, naming both settings; set either way it passes, and 3 hashes as unset."""
    from pipeline.config import load_config
    from pipeline.orchestrate import _check_resize

    config, line = _refused_before_resizing(tmp_path, tiny_21_model, {"multiple": 32, "control_vae_area": 96 * 96,
                                                                     "keep_alpha": True})
    assert line.startswith("error: resize.max_controls is unset (3: ") and tiny_21_model in line, line
    assert "resize.max_controls: 10" in line and "resize.max_controls: 3" in line, line
    for value in (3, 10):
        _check_resize(load_config(config, {"resize.max_controls": value}), tiny_21_model)
    unset = load_config(config)
    assert load_config(config, {"resize.max_controls": 3}).resize.fingerprint() == unset.resize.fingerprint()


_AREA_512 = {"resize.keep_alpha": True, "resize.max_controls": 10, "resize.multiple": 32,
             "resize.control_vae_area": 512}


def test_a_21_reference_area_the_processor_resizes_is_refused_only_for_a_run_with_references(tiny_21_model,
                                                                                              tmp_path):
    """Before: refused for every 2.1 run, a text-only dataset's too (whose samples show the VLM no reference).
    Now where the settings (min_controls >= 1; max_controls 0: none) or a folder source's listing tell."""
    from pipeline.config import load_config
    from pipeline.orchestrate import _check_resize
    from schemas.errors import UserError

    text_only, edits = tmp_path / "text-only", tmp_path / "edits"
    make_demo_data(text_only, n=4, max_controls=0, seed=0)
    make_demo_data(edits, n=4, seed=0)

    def cfg(source, **more):
        return load_config(None, {"paths.source": str(source), **_AREA_512, **more})

    _check_resize(cfg(text_only), tiny_21_model)  # runs: no sample has a reference
    _check_resize(cfg(edits, **{"resize.max_controls": 0}), tiny_21_model)  # every reference quarantined
    for refused in (cfg(edits), cfg(text_only, **{"resize.min_controls": 1})):
        with pytest.raises(UserError, match="^resize.control_vae_area = 512: "):
            _check_resize(refused, tiny_21_model)


@pytest.mark.parametrize("max_controls", [0, 3])
def test_a_21_manifest_with_references_at_such_an_area_is_refused_before_the_encoders(tiny_21_model, tmp_path,
                                                                                       max_controls):
    """A JSONL manifest tells its references only once read: its `images` table is asked right after
    resize-bucket, before encode-text (without references the check lets it on to encode-text)."""
    from pipeline.config import load_config
    from pipeline.orchestrate import _check_resize
    from pipeline.reference_area import check_after_resize
    from store import Store

    source, store = tmp_path / "src", tmp_path / "store"
    make_demo_data(source, n=4, fmt="jsonl", max_controls=max_controls, seed=0)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"paths": {"source": str(source), "store": str(store), "model": tiny_21_model,
                                                "run": str(tmp_path / "run"), "report": str(tmp_path / "report")}}))
    sets = [a for k, v in _AREA_512.items() for a in ("--set", f"{k}={str(v).lower()}")]
    if max_controls == 0:  # resize-bucket alone: a full run all of the text-only samples would take minutes
        r = CliRunner().invoke(app, ["run", "resize-bucket", "--config", str(config), *sets])
        assert r.exit_code == 0, r.output
        _check_resize(load_config(config, _AREA_512), tiny_21_model)  # before: refused here, before resizing
        check_after_resize("resize-bucket", load_config(config, _AREA_512), tiny_21_model, str(store))
        return
    r = CliRunner().invoke(app, ["run", "all", "--config", str(config), *sets])
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 1 and len(lines) == 1 and "Traceback" not in r.output, r.output
    assert lines[0].startswith("error: resize.control_vae_area = 512: ") and tiny_21_model in lines[0], lines[0]
    assert set(Store(store).tables()) == {"images"} and "== encode-text" not in r.output  # resized, not encoded


def test_a_21_reference_area_told_by_the_settings_asks_no_table_after_resize(tiny_21_model, tmp_path, monkeypatch):
    """max_controls 0 tells before resize-bucket that no sample keeps a reference: after it, no rank asks the
    processor or the table (before: rank 0 read the manifest under a collective every run); unset, the table is
    asked once (a JSONL or tar source tells only once read)."""
    import pipeline.reference_area as reference_area
    from pipeline.config import load_config

    asked: list[str] = []
    monkeypatch.setattr(reference_area, "_samples_with_references", lambda store: asked.append(store) or 0)
    store = str(tmp_path / "store")
    told = load_config(None, {**_AREA_512, "resize.max_controls": 0})
    reference_area.check_after_resize("resize-bucket", told, tiny_21_model, store)
    assert asked == []
    reference_area.check_after_resize("resize-bucket", load_config(None, _AREA_512), tiny_21_model, store)
    assert asked == [store]
