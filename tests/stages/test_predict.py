"""predict and lora merge against the unmodified diffusers pipelines (tiny offline model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from pipeline.cli import app

PROMPT = "make the square red"


def _control(path, w=64, h=48, seed=0):
    rng = np.random.default_rng(seed)
    Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")).save(path)
    return path


def _cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result


def test_predict_equals_stock_pipeline(tiny_edit_model, tmp_path):
    """Per-component staging (encode_prompt / VAE encode / own denoise loop / decode) == the stock __call__."""
    from diffusers import QwenImageEditPipeline

    control = _control(tmp_path / "control.png")
    out = tmp_path / "out.png"
    _cli("predict", "--model", tiny_edit_model, "--image", control, "--prompt", PROMPT, "--negative-prompt", " ",
         "--steps", 2, "--cfg", 4.0, "--seed", 3, "--height", 64, "--width", 48, "--out", out,
         "--transformer-device", "cpu", "--vae-device", "cpu", "--text-encoder-device", "cpu")
    pipe = QwenImageEditPipeline.from_pretrained(tiny_edit_model)
    ref = pipe(Image.open(control).convert("RGB"), PROMPT, negative_prompt=" ", true_cfg_scale=4.0,
               num_inference_steps=2, height=64, width=48, generator=torch.Generator().manual_seed(3)).images[0]
    got = np.asarray(Image.open(out))
    assert got.shape == (64, 48, 3)
    np.testing.assert_array_equal(got, np.asarray(ref))


def test_predict_rejects_unknown_device_component(tiny_edit_model, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("predict:\n  devices: {unet: cpu}\n")
    result = CliRunner().invoke(app, ["predict", "--model", tiny_edit_model, "--image", str(_control(tmp_path / "c.png")),
                                      "--prompt", PROMPT, "--out", str(tmp_path / "o.png"), "--config", str(cfg)])
    # refused while the config loads (exit 2, as every config error), before the model is read
    assert result.exit_code == 2 and "unknown component 'unet'" in result.output


def _make_lora(model: str, out_dir) -> None:
    """A LoRA with alpha != rank and non-zero B (peft's gaussian init leaves B = 0), saved the diffusers way."""
    from diffusers import QwenImageEditPipeline, QwenImageTransformer2DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    transformer = QwenImageTransformer2DModel.from_pretrained(model, subfolder="transformer")
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights="gaussian")
    transformer.add_adapter(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    QwenImageEditPipeline.save_lora_weights(
        out_dir, transformer_lora_layers=get_peft_model_state_dict(transformer),
        transformer_lora_adapter_metadata=cfg.to_dict(),
    )


def _forward(transformer) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 4 * 3 + 4 * 2, 16, generator=g)  # target 4x3 tokens + control 4x2
    text = torch.randn(1, 7, 32, generator=g)
    with torch.no_grad():
        return transformer(hidden_states=hidden, encoder_hidden_states=text, timestep=torch.tensor([0.6]),
                           img_shapes=[[(1, 4, 3), (1, 4, 2)]], return_dict=False)[0]


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_lora_merge_equals_base_plus_lora(tiny_edit_model, tmp_path, scale):
    from diffusers import QwenImageEditPipeline

    lora = tmp_path / "lora"
    _make_lora(tiny_edit_model, lora)
    merged = tmp_path / "merged"
    _cli("lora", "merge", "--model", tiny_edit_model, "--lora", lora, "--out", merged, "--scale", scale)

    ref_pipe = QwenImageEditPipeline.from_pretrained(tiny_edit_model)
    base = _forward(ref_pipe.transformer)
    ref_pipe.load_lora_weights(lora, adapter_name="x")
    ref_pipe.set_adapters(["x"], adapter_weights=[scale])
    reference = _forward(ref_pipe.transformer)

    merged_pipe = QwenImageEditPipeline.from_pretrained(merged)  # plain diffusers, no project code
    got = _forward(merged_pipe.transformer)
    assert (reference - base).abs().max() > 1e-2  # the LoRA really changes the output
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)
    # predict's loader (`--lora L --lora-scale S`) applies the same LoRA at the same scale
    from models.edit import load_pipeline

    predict_pipe = load_pipeline(tiny_edit_model, torch.float32, {"transformer": "cpu"}, str(lora), scale)
    torch.testing.assert_close(_forward(predict_pipe.transformer), reference, rtol=1e-6, atol=1e-6)
    assert not any("lora" in n for n, _ in merged_pipe.transformer.named_parameters())


def test_lora_merge_refuses_non_empty_out(tiny_edit_model, tmp_path):
    lora = tmp_path / "lora"
    _make_lora(tiny_edit_model, lora)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    result = CliRunner().invoke(app, ["lora", "merge", "--model", tiny_edit_model, "--lora", str(lora),
                                      "--out", str(tmp_path / "busy")])
    assert result.exit_code == 1 and "not empty" in result.output
