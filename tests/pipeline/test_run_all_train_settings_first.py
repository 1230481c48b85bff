"""`pipeline run all` refuses, before its first stage, a setting that train (after resize-bucket and both
encoders: hours at a million samples) or evaluate (after the training too) would refuse, by that stage's own check.
Before: with `train.control_dropout > 0` and encode-text run without `encode_text.no_control_embeds`, resize-bucket,
encode-text and encode-vae ran (every encoder loaded), then train refused the text table it opened; and so for the
others below, each refused by train or evaluate at its start."""

from __future__ import annotations

import sys

import pytest
import yaml
from typer.testing import CliRunner

import models.loading
from pipeline.cli import app
from pipeline.demo_data import make_demo_data


def _refused(tmp_path, monkeypatch, model: str, code: int, *sets: str) -> str:
    """`run all` with `--set`s on a small source: it exits `code` with one error line (returned) and no traceback,
    no model component ever loaded (`load_component`: the encoders' and train's loader) and nothing resized."""
    loaded, real_load = [], models.loading.load_component
    monkeypatch.setattr(models.loading, "load_component", lambda *a, **k: loaded.append(a[1]) or real_load(*a, **k))
    source = tmp_path / "src"
    make_demo_data(source, n=4, seed=0)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "paths": {"source": str(source), "store": str(tmp_path / "store"), "model": model,
                  "run": str(tmp_path / "run"), "report": str(tmp_path / "report")},
        "resize": {"target_area": 64 * 64, "control_vae_area": 64 * 64, "val_fraction": 0.5},
        "train": {"max_steps": 1}}))
    r = CliRunner().invoke(app, ["run", "all", "--config", str(config), *(a for s in sets for a in ("--set", s))])
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == code and len(lines) == 1 and "Traceback" not in r.output, r.output
    assert loaded == [], loaded  # no encoder (nor the transformer) loaded
    assert not (tmp_path / "store").exists() and not (tmp_path / "run").exists()  # nothing resized, nothing trained
    return lines[0]


def test_control_dropout_without_nocontrol_embeds_is_refused_before_any_encoder_loads(tiny_plus_model, tmp_path,
                                                                                      monkeypatch):
    line = _refused(tmp_path, monkeypatch, tiny_plus_model, 2, "train.control_dropout=0.5")
    # names the setting, why, and both ways on
    assert line.startswith("error: train.control_dropout 0.5 needs the text table's nocontrol_embeds"), line
    assert "set encode_text.no_control_embeds: true" in line and "train.control_dropout: 0" in line, line


@pytest.mark.parametrize("sets,hidden,code,said", [
    (["train.dtype=float16"], None, 2, "error: train.dtype float16 is not supported"),
    (["train.attention_backend=nonsense"], None, 2, "error: train.attention_backend 'nonsense' is not an attention"),
    (["evaluate.attention_backend=nonsense"], None, 2, "error: evaluate.attention_backend 'nonsense' is not an "),
    (["train.log_with=[wandb]"], "wandb", 1, "error: train.log_with: wandb is not installed"),
    (["train.optimizer=prodigy"], "prodigyopt", 1, "error: train.optimizer 'prodigy' needs the package 'prodigyopt'"),
    (["evaluate.quantize_base=nf4"], "bitsandbytes", 1,
     "error: evaluate.quantize_base 'nf4' needs the package 'bitsandbytes'"),
    (["train.init_lora=/nonexistent/lora"], None, 1, "error: train.init_lora: no LoRA weights at /nonexistent/lora"),
    (["train.device=cuda:99"], None, 1, "error: train.device: 'cuda:99' requested but this machine has"),
    (["evaluate.device=cuda:99"], None, 1, "error: evaluate.device: 'cuda:99' requested but this machine has"),
])
def test_train_and_evaluate_refusals_come_before_the_first_stage(tiny_plus_model, tmp_path, monkeypatch, sets,
                                                                 hidden, code, said):
    if hidden is not None:  # not installed on this node (None in sys.modules: its import raises ImportError)
        monkeypatch.setitem(sys.modules, hidden, None)
        if hidden == "wandb":
            import accelerate.utils.imports

            monkeypatch.setattr(accelerate.utils.imports, "is_wandb_available", lambda: False)
    line = _refused(tmp_path, monkeypatch, tiny_plus_model, code, *sets)
    assert line.startswith(said), line


@pytest.mark.parametrize("section", ["train", "evaluate"])
def test_an_attention_backend_a_21_model_does_not_take_is_refused_before_the_first_stage(tiny_21_model, tmp_path,
                                                                                          monkeypatch, section):
    """Before: refused by train (or evaluate, after the training) once the transformer had loaded."""
    line = _refused(tmp_path, monkeypatch, tiny_21_model, 1, "resize.multiple=32", "resize.vl_views=false",
                    f"{section}.attention_backend=flex")
    assert line.startswith(f"error: {section}.attention_backend 'flex': Qwen-Image-2.1's padded batches"), line
    assert f"set {section}.attention_backend: null (or native)" in line, line


def test_an_init_lora_with_another_adapter_kind_is_refused_before_the_first_stage(tiny_plus_model, tmp_path,
                                                                                   monkeypatch):
    """Before: refused once train had loaded the transformer (`models.lora.init_from_lora`), after both encoders."""
    import torch
    from safetensors.torch import save_file

    lora = tmp_path / "init.safetensors"  # a file there: train.init_lora's own checks pass
    save_file({"x": torch.zeros(1)}, lora)
    line = _refused(tmp_path, monkeypatch, tiny_plus_model, 2, f"train.init_lora={lora}", "train.lora.kind=dora")
    assert line == (f"error: train.init_lora {lora}: starting from a file works for train.lora.kind 'lora' only, "
                    "not 'dora'; set train.lora.kind: lora, or drop train.init_lora"), line


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_a_lycoris_adapter_for_an_nf4_evaluate_is_refused_before_the_first_stage(tiny_plus_model, tmp_path,
                                                                                 monkeypatch, kind):
    """evaluate.quantize_base nf4 with train.lora.kind loha / lokr: before, run all trained fully and evaluate
    then refused the trained file on its NF4 base (models/lora.py). Not a config rule: `pipeline evaluate --lora`
    on nf4 takes a plain LoRA file under the same config."""
    line = _refused(tmp_path, monkeypatch, tiny_plus_model, 1, "evaluate.quantize_base=nf4", f"train.lora.kind={kind}")
    assert line.startswith(f"error: evaluate.quantize_base nf4 with train.lora.kind {kind} on an NF4 base"), line
    assert "use quantize_base int8, fp8 or none, or a lora / dora adapter" in line, line
