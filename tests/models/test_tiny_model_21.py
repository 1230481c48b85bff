"""The tiny Qwen-Image-2.1 model is a real diffusers folder: plain `QwenImage21Pipeline` loads and runs it."""

from __future__ import annotations

import shutil
import sys

import pytest

from models.loading import load_component, model_variant
from rehearse import rehearse
import warm_start

# Runs in a new process (started warm: tests/warm_start.py preloads only third-party libraries) so that nothing
# from this project is imported.
_LOAD_AND_RUN_21 = r"""
import sys, numpy as np, torch
from PIL import Image
from diffusers import QwenImage21Pipeline
pipe = QwenImage21Pipeline.from_pretrained(sys.argv[1])
assert type(pipe.processor).__name__ == "Qwen3VLProcessor", type(pipe.processor)
assert type(pipe.text_encoder).__name__ == "Qwen3VLForConditionalGeneration"
rng = np.random.RandomState(0)
rgba = Image.fromarray((rng.rand(64, 96, 4) * 255).astype("uint8"), "RGBA")
rgb = Image.fromarray((rng.rand(96, 64, 3) * 255).astype("uint8"))
# two references of different aspect, RGBA among them; the output follows the last reference's aspect
out = pipe(image=[rgba, rgb], prompt="make the square red", output_resolution=96, num_inference_steps=2,
           output_type="np", generator=torch.Generator().manual_seed(0))
assert out.images.shape == (1, 128, 64, 4), out.images.shape
# text to image (no reference) with guidance
out = pipe(prompt="a red square", negative_prompt="blurry", true_cfg_scale=2.0, height=64, width=96,
           num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0))
assert out.images.shape == (1, 64, 96, 4), out.images.shape
assert np.isfinite(out.images).all()
assert not any(m.startswith(("models", "pipeline", "stages", "store", "schemas")) for m in sys.modules), "project import"
print("OK")
"""


def test_tiny_21_model_loads_with_plain_diffusers_and_runs(tiny_21_model):
    proc = warm_start.run([sys.executable, "-c", _LOAD_AND_RUN_21, tiny_21_model], cwd="/", timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_loader_detects_21_and_loads_its_classes(tiny_21_model, tiny_plus_model):
    assert model_variant(tiny_21_model) == "qwen-image-2.1"
    assert model_variant(tiny_plus_model) == "edit-plus"
    tr = load_component(tiny_21_model, "transformer")
    assert type(tr).__name__ == "QwenImage21Transformer2DModel" and tr.config.causal_condition
    vae = load_component(tiny_21_model, "vae")
    assert type(vae).__name__ == "AutoencoderKLQwenImage21"
    assert vae.config.z_dim == 64 and vae.config.in_channels == 4 and vae.spatial_compression_ratio == 16
    assert type(load_component(tiny_21_model, "text_encoder")).__name__ == "Qwen3VLForConditionalGeneration"
    assert type(load_component(tiny_21_model, "processor")).__name__ == "Qwen3VLProcessor"
    # another model's classes still come from their own table
    assert type(load_component(tiny_plus_model, "transformer")).__name__ == "QwenImageTransformer2DModel"


def test_cli_make_tiny_model_21_same_seed_same_bytes(tmp_path, tiny_21_model):
    import hashlib
    from pathlib import Path

    from typer.testing import CliRunner

    from pipeline.cli import app

    r = CliRunner().invoke(app, ["make-tiny-model", str(tmp_path / "m"), "--variant", "qwen-image-2.1"])
    assert r.exit_code == 0, r.output

    def digest(folder):
        return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
                for f in sorted(Path(folder).rglob("*")) if f.is_file()}

    assert digest(tmp_path / "m") == digest(tiny_21_model)


@pytest.fixture(scope="module")
def full_width_21(tmp_path_factory):
    """`make-tiny-model --variant qwen-image-2.1 --full-width --layers 1` (with the minimal text encoder the
    rehearsals use): 1.3 GB on disk, so built once for this module (its widths, plan and the 2.1 rehearsal read
    it) and removed after it."""
    from models.full_width import make_full_width_model

    folder = tmp_path_factory.mktemp("full-width-21")
    yield make_full_width_model(folder / "m", "qwen-image-2.1", layers=1, minimal_text_encoder=True)
    shutil.rmtree(folder, ignore_errors=True)


def test_full_width_21_has_the_real_widths_and_loads(full_width_21):
    """Real transformer / VAE / Qwen3-VL-8B text widths, loaded with the stock classes."""
    import json

    model = full_width_21
    assert model_variant(str(model)) == "qwen-image-2.1"
    tr = json.loads((model / "transformer" / "config.json").read_text())
    assert (tr["num_layers"], tr["num_attention_heads"], tr["attention_head_dim"], tr["context_in_dim"],
            tuple(tr["axes_dims_rope"]), tr["in_channels"], tr["mlp_ratio"], tr["causal_condition"]) == (
        1, 32, 128, 4096, (16, 56, 56), 64, 3, True)
    vae = json.loads((model / "vae" / "config.json").read_text())
    assert (vae["base_dim"], vae["z_dim"], vae["in_channels"], vae["dim_mult"]) == (96, 64, 4, [1, 2, 4, 8, 8])
    te = json.loads((model / "text_encoder" / "config.json").read_text())
    assert (te["text_config"]["hidden_size"], te["vision_config"]["out_hidden_size"]) == (4096, 4096)
    loaded = load_component(str(model), "transformer")
    assert type(loaded).__name__ == "QwenImage21Transformer2DModel" and len(loaded.transformer_blocks) == 1


def _real_params(model: str, component: str) -> int:
    return sum(p.numel() for p in load_component(model, component).parameters())


def _assert_plan_counts_are_the_loaded_models(model: str) -> None:
    """`pipeline plan`'s counts (configs on the meta device, models/memory_plan.py) equal the parameter counts
    of the components the stages load; before, plan built the Edit classes from a 2.1 folder and failed."""
    import torch

    from models.memory_plan import component_params, transformer_counts

    c = transformer_counts(model)
    tr = load_component(model, "transformer")
    assert c.params == sum(p.numel() for p in tr.parameters())
    assert (c.blocks, c.width) == (len(tr.transformer_blocks), tr.config.num_attention_heads * tr.config.attention_head_dim)
    # single-stream blocks: every token passes all the block's linears (attention + gated MLP)
    assert c.token_linear_params == sum(m.weight.numel() for m in tr.transformer_blocks[0].modules()
                                        if isinstance(m, torch.nn.Linear))
    assert component_params(model, "text_encoder") == _real_params(model, "text_encoder")
    assert component_params(model, "vae") == _real_params(model, "vae")


def _plan_cli(model: str) -> str:
    from typer.testing import CliRunner

    from pipeline.cli import app

    r = CliRunner().invoke(app, ["plan", "--model", model, "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert "encode-text" in r.output and "encode-vae" in r.output and "train" in r.output, r.output
    return r.output


def test_plan_reads_the_tiny_21_folder(tiny_21_model):
    _assert_plan_counts_are_the_loaded_models(tiny_21_model)
    _plan_cli(tiny_21_model)


def test_plan_reads_the_full_width_21_folder(full_width_21):
    """The `--full-width --layers 1` 2.1 folder (minimal text encoder): the real block, plus the real-size
    count of the released 32-block transformer from the same code path on the meta device."""
    from accelerate import init_empty_weights
    from diffusers import QwenImage21Transformer2DModel

    from models.memory_plan import counts_from_model

    model = str(full_width_21)
    _assert_plan_counts_are_the_loaded_models(model)
    assert "transformer 0." in _plan_cli(model)
    with init_empty_weights():
        full = QwenImage21Transformer2DModel()  # diffusers' defaults = the released widths, 32 blocks
    c = counts_from_model(full)
    assert c.params == sum(p.numel() for p in full.parameters()) and c.blocks == 32 and c.width == 4096
    assert 7.0e9 < c.params < 7.5e9  # the "7B"


def test_rehearsal_on_the_full_width_21_folder(full_width_21, tmp_path):
    """`bench/rehearsal.py --model` on the full-width 2.1 folder (this module's: a second build took ~30-70 s of
    the suite): its store encoded with the 2.1 settings and one int8 training step; plan's int8 weight bytes
    equal the transformer as the run loaded it."""
    from models.memory_plan import transformer_counts, transformer_weight_bytes

    (run,) = rehearse(tmp_path, "--model", str(full_width_21))
    assert run["layers"] == 1 and run["s_per_step"] > 0 and 0 < run["mfu"]
    assert all(map(lambda x: x == x, run["losses"]))
    counts = transformer_counts(str(full_width_21))
    assert (counts.blocks, counts.width) == (1, 4096)
    assert transformer_weight_bytes(counts, "bfloat16", "int8") == pytest.approx(run["base_weight_bytes"], rel=0.001)


def test_the_21_train_plan_counts_the_block_causal_mask(tiny_21_model, tiny_plus_model):
    """2.1 trains with a dense [B, 1, S, S] mask (models/qwen21_multires.py): S² bytes per sample that no
    per-token constant covers (1.9 GiB per sample for the bool mask alone at S ~ 45k, 10 references of 1024²).
    The plan counts it for 2.1 (the bool mask, its logical_not and SDPA's bf16 copy; the copy once per block
    that saves its inputs without checkpointing) and not for the Edit models. Before: absent."""
    from models.memory_plan import train_plan

    S = 45_000
    ckpt = train_plan(tiny_21_model, "bfloat16", "none", 2, S, True, 16)
    assert ckpt.parts["block-causal mask"] == 2 * S * S * (1 + 1 + 2)
    plain = train_plan(tiny_21_model, "bfloat16", "none", 2, S, False, 16)
    assert plain.parts["block-causal mask"] == 2 * S * S * (2 + 2 * 2)  # the tiny model's 2 blocks
    assert "block-causal mask" not in train_plan(tiny_plus_model, "bfloat16", "none", 2, S, True, 16).parts
