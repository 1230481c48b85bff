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



def test_predict_refuses_an_output_name_it_cannot_write_before_any_work(tiny_edit_model, tiny_21_model, tmp_path):
    """`--out edited` (no extension) or `.jpg` for a 2.1 model (RGBA edits): PIL refused the name only when
    saving, a traceback after the models were loaded and every denoising step had run, and the image was lost.
    Now one line before anything is loaded."""
    from models.loading import LOAD_LOG

    control = _control(tmp_path / "control.png")
    for model, out, why in ((tiny_edit_model, tmp_path / "edited", "no extension is not an image type"),
                            (tiny_21_model, tmp_path / "edited.jpg", "JPEG has no alpha")):
        LOAD_LOG.clear()
        result = CliRunner().invoke(app, ["predict", "--model", model, "--image", str(control), "--prompt", PROMPT,
                                          "--steps", "2", "--height", "64", "--width", "64", "--out", str(out)])
        assert result.exit_code == 1 and why in result.output, (result.output, result.exception)
        assert isinstance(result.exception, SystemExit) and not out.exists() and LOAD_LOG == []



def test_predict_applies_the_exif_orientation_of_a_control(tiny_edit_model, tmp_path):
    """A phone photo stores its pixels sideways with an EXIF rotation tag. Training images get it applied
    (resize-bucket) and so do files read by diffusers' `load_image`; predict read the raw pixels, so the model
    was shown the photo on its side (another output size, too). Reference: the control as `load_image` reads it."""
    from diffusers.utils import load_image

    raw = np.asarray(Image.open(_control(tmp_path / "raw.png", w=64, h=48)))
    tagged = tmp_path / "phone.png"
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to display"
    Image.fromarray(raw).save(tagged, exif=exif)
    upright = tmp_path / "upright.png"
    load_image(str(tagged)).save(upright)  # diffusers' reading of the file, saved without the tag
    assert Image.open(upright).size == (48, 64)
    outs = []
    for control in (tagged, upright):
        outs.append(tmp_path / f"out-{control.stem}.png")
        _cli("predict", "--model", tiny_edit_model, "--image", control, "--prompt", PROMPT, "--steps", 2,
             "--seed", 1, "--out", outs[-1])
    np.testing.assert_array_equal(np.asarray(Image.open(outs[0])), np.asarray(Image.open(outs[1])))




def test_predict_shows_a_transparent_control_as_training_did(tiny_edit_model, tmp_path):
    """A cutout (RGBA, transparent background stored as black): resize-bucket composites training images over
    white; predict dropped the alpha (`convert("RGB")`), so the model saw a black background it never trained on.
    Reference: the control as resize-bucket decodes it."""
    from stages.resize.imaging import decode_image

    rgba = np.zeros((48, 64, 4), dtype=np.uint8)
    rgba[12:36, 16:48] = (200, 30, 30, 255)  # an opaque object; the rest transparent (0, 0, 0, 0)
    cutout = tmp_path / "cutout.png"
    Image.fromarray(rgba, "RGBA").save(cutout)
    decoded = decode_image(cutout.read_bytes(), 64 * 1024 * 1024).image
    assert np.asarray(decoded)[0, 0].tolist() == [255, 255, 255]  # over white, as in the training data
    decoded.save(tmp_path / "as-trained.png")
    outs = []
    for control in (cutout, tmp_path / "as-trained.png"):
        outs.append(tmp_path / f"out-{control.stem}.png")
        _cli("predict", "--model", tiny_edit_model, "--image", control, "--prompt", PROMPT, "--steps", 2,
             "--seed", 1, "--out", outs[-1])
    np.testing.assert_array_equal(np.asarray(Image.open(outs[0])), np.asarray(Image.open(outs[1])))


def test_evaluate_extra_prompts_apply_the_exif_orientation(tiny_edit_model, tmp_path):
    """evaluate.extra_prompts read their control and target files the same way (predict's reader)."""
    from diffusers.utils import load_image

    from models.loading import load_component
    from pipeline.config import load_config
    from stages.evaluate.stage import extra_prompt_inputs

    tagged = tmp_path / "phone.png"
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.open(_control(tmp_path / "raw.png", w=64, h=48)).save(tagged, exif=exif)
    cfg = load_config(None, {"evaluate.extra_prompts": [{"prompt": PROMPT, "images": [str(tagged)],
                                                          "target": str(tagged)}]}).evaluate
    transformer = load_component(tiny_edit_model, "transformer", dtype=torch.float32, device="cpu")
    vae = load_component(tiny_edit_model, "vae", dtype=torch.float32, device="cpu")
    _, _, controls, target, *_ = next(extra_prompt_inputs(tiny_edit_model, transformer, vae, cfg))
    upright = np.asarray(load_image(str(tagged)))
    np.testing.assert_array_equal(np.asarray(controls[0]), upright)
    np.testing.assert_array_equal(np.asarray(target), upright)


def test_evaluate_extra_prompts_show_a_transparent_control_as_training_did(tiny_edit_model, tmp_path):
    """A cutout given to evaluate.extra_prompts (Edit / Edit-Plus) is composited over white, as resize-bucket
    decodes the training images (before: its transparent pixels reached the model as the black they store)."""
    from models.loading import load_component
    from pipeline.config import load_config
    from stages.evaluate.stage import extra_prompt_inputs
    from stages.resize.imaging import decode_image

    rgba = np.zeros((48, 64, 4), dtype=np.uint8)
    rgba[12:36, 16:48] = (200, 30, 30, 255)
    cutout = tmp_path / "cutout.png"
    Image.fromarray(rgba, "RGBA").save(cutout)
    cfg = load_config(None, {"evaluate.extra_prompts": [{"prompt": PROMPT, "images": [str(cutout)],
                                                          "target": str(cutout)}]}).evaluate
    transformer = load_component(tiny_edit_model, "transformer", dtype=torch.float32, device="cpu")
    vae = load_component(tiny_edit_model, "vae", dtype=torch.float32, device="cpu")
    _, _, controls, target, *_ = next(extra_prompt_inputs(tiny_edit_model, transformer, vae, cfg))
    as_trained = np.asarray(decode_image(cutout.read_bytes(), 64 * 1024 * 1024).image)
    np.testing.assert_array_equal(np.asarray(controls[0]), as_trained)
    np.testing.assert_array_equal(np.asarray(target), as_trained)


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
