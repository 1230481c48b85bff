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


@pytest.fixture
def small_vae_view(monkeypatch):
    """Edit / Edit-Plus controls VAE-encoded at a ~256² view instead of the stock ~1024² (at 1024², ~2 s of the
    tiny VAE per control on one core), for tests whose property does not depend on that size: an image compared
    with one made by the same code, a picture read before encoding, a save. Predict's equality with the stock
    pipeline at the real area is test_predict_equals_stock_pipeline's."""
    from models import edit

    monkeypatch.setattr(edit, "VAE_AREA", 256 * 256)


def _extra_prompt_pictures(model: str, path):
    """The control and target evaluate shows for an extra prompt whose image and target are both `path`."""
    from models.loading import load_component
    from pipeline.config import load_config
    from stages.evaluate.sample_images import extra_prompt_inputs

    # evaluate resolves its dtype for its device before this (agreed_config): the helper does the same
    cfg = load_config(None, {"evaluate.dtype": "float32",
                             "evaluate.extra_prompts": [{"prompt": PROMPT, "images": [str(path)],
                                                          "target": str(path)}]}).evaluate
    transformer = load_component(model, "transformer", dtype=torch.float32, device="cpu")
    vae = load_component(model, "vae", dtype=torch.float32, device="cpu")
    _, _, controls, target, *_ = next(extra_prompt_inputs(model, transformer, vae, cfg))
    return controls, target



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


def test_predict_in_bfloat16_equals_stock_pipeline(tiny_edit_model, tmp_path):
    """`--dtype bfloat16` (the default on a bf16 GPU) against the stock pipeline loaded in bf16: the decoded image
    is mapped to [0, 1] in the VAE's dtype, as the stock `postprocess` does, before it becomes float. Mapped in
    float32 instead, pixels came out one level off wherever bf16 rounds x / 2 + 0.5 (here at 64x48, 2 steps)."""
    from diffusers import QwenImageEditPipeline

    control = _control(tmp_path / "control.png")
    out = tmp_path / "out.png"
    _cli("predict", "--model", tiny_edit_model, "--image", control, "--prompt", PROMPT, "--steps", 2, "--cfg", 4.0,
         "--seed", 3, "--height", 64, "--width", 48, "--dtype", "bfloat16", "--out", out)
    pipe = QwenImageEditPipeline.from_pretrained(tiny_edit_model, torch_dtype=torch.bfloat16)
    ref = pipe(Image.open(control).convert("RGB"), PROMPT, negative_prompt=" ", true_cfg_scale=4.0,
               num_inference_steps=2, height=64, width=48, generator=torch.Generator().manual_seed(3)).images[0]
    np.testing.assert_array_equal(np.asarray(Image.open(out)), np.asarray(ref))


def test_edit_plus_predict_with_four_controls_equals_stock_pipeline(tiny_plus_model, tmp_path, monkeypatch):
    """Edit-Plus takes any number of controls as the stock pipeline does (each one a "Picture N" of the prompt and
    a latent of its own; the models were trained with up to 3, resize.max_controls admits more): 4 controls, the
    same image as the stock __call__ makes. Both encode each control's VAE view at 256² here, not the stock 1024²
    (four 1 MP controls through the tiny VAE's full-resolution attention took ~40 s of CPU); the real area is
    test_edit_2511.py's."""
    from diffusers import QwenImageEditPlusPipeline
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as stock

    from models import edit

    assert stock.VAE_IMAGE_SIZE == edit.VAE_AREA  # the constant both read, patched alike
    monkeypatch.setattr(stock, "VAE_IMAGE_SIZE", 256 * 256)
    monkeypatch.setattr(edit, "VAE_AREA", 256 * 256)

    controls = [_control(tmp_path / f"c{i}.png", w=32 + 8 * i, h=48, seed=i) for i in range(4)]
    out = tmp_path / "out.png"
    _cli("predict", "--model", tiny_plus_model, *[a for c in controls for a in ("--image", c)], "--prompt", PROMPT,
         "--steps", 2, "--seed", 3, "--height", 32, "--width", 32, "--out", out)
    pipe = QwenImageEditPlusPipeline.from_pretrained(tiny_plus_model)
    ref = pipe([Image.open(c).convert("RGB") for c in controls], PROMPT, negative_prompt=" ", true_cfg_scale=4.0,
               num_inference_steps=2,
               height=32, width=32, generator=torch.Generator().manual_seed(3)).images[0]
    np.testing.assert_array_equal(np.asarray(Image.open(out)), np.asarray(ref))


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
    # a name that is no image type is a usage mistake (exit 2, at parsing); JPEG for 2.1 too, judged from its
    # model folder's model_index.json right after parsing (it was exit 1), before any weights load
    # a name over the 255 bytes a file system allows in one name: PIL's save failed after the work too
    for model, out, why, code in ((tiny_edit_model, tmp_path / "edited", "the name has no image extension", 2),
                                  (tiny_21_model, tmp_path / "edited.jpg", "JPEG has no alpha", 2),
                                  (tiny_edit_model, tmp_path / ("ü" * 128 + ".png"), "260 bytes, over the 255", 2)):
        LOAD_LOG.clear()
        result = CliRunner().invoke(app, ["predict", "--model", model, "--image", str(control), "--prompt", PROMPT,
                                          "--steps", "2", "--height", "64", "--width", "64", "--out", str(out)])
        said = " ".join(result.output.replace("│", " ").split())
        assert result.exit_code == code and why in said, (result.output, result.exception)
        assert isinstance(result.exception, SystemExit) and out.name not in {p.name for p in out.parent.iterdir()} \
            and LOAD_LOG == []


def test_a_model_family_mistake_is_judged_before_the_lora_is_read(tiny_edit_model, tmp_path):
    """Two controls for Qwen-Image-Edit is a usage mistake (exit 2) judged from the model folder right after
    parsing: before, the --lora was checked first (its whole file hashed) and a bad one hid the mistake (exit 1)."""
    not_lora = tmp_path / "not-a-lora"
    not_lora.mkdir()
    control = _control(tmp_path / "c.png")
    result = CliRunner().invoke(app, ["predict", "--model", tiny_edit_model, "--image", str(control), "--image",
                                      str(control), "--prompt", PROMPT, "--lora", str(not_lora), "--out",
                                      str(tmp_path / "o.png")])
    assert result.exit_code == 2 and "error: --image: 2 control images" in result.output, result.output


def test_a_hub_id_is_checked_where_it_was_not_fetched_to_check(tiny_21_model, tmp_path, monkeypatch):
    """A hub id is no folder here: the early check leaves it alone (no download just to check); predict's own
    check refuses the JPEG before loading, exit 1 as before. The hub is stood in for by the tiny 2.1 folder."""
    import models.loading

    resolved = []
    real = models.loading.resolve_model
    monkeypatch.setattr(models.loading, "resolve_model",
                        lambda m: resolved.append(m) or real(tiny_21_model if m == "org/hub-model" else m))
    result = CliRunner().invoke(app, ["predict", "--model", "org/hub-model", "--image",
                                      str(_control(tmp_path / "c.png")), "--prompt", PROMPT, "--out",
                                      str(tmp_path / "o.jpg")])
    assert result.exit_code == 1 and "JPEG has no alpha" in result.output, result.output
    assert resolved and set(resolved) == {"org/hub-model"}


def test_predict_and_merge_refuse_a_read_only_out_folder_before_loading(tiny_edit_model, tmp_path, monkeypatch):
    """A read-only --out folder was met when the image (or the merged model) was written: after the models were
    loaded and every denoising step had run (minutes on a real model), the result lost. Now one line naming the
    folder before anything loads (simulated: the tests run as root, whom file modes do not stop)."""
    import errno
    import os

    from models.loading import LOAD_LOG

    control = _control(tmp_path / "control.png")
    (tmp_path / "ro").mkdir()
    real_open = os.open

    def read_only_open(path, flags, *a):  # EROFS for writes under ro/, as a read-only mount gives
        if str(path).startswith(str(tmp_path / "ro")) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", read_only_open)
    lora = tmp_path / "lora.safetensors"  # never read: the folder is refused first
    for args in (["predict", "--model", tiny_edit_model, "--image", str(control), "--prompt", PROMPT, "--steps", "2",
                  "--height", "64", "--width", "64", "--out", str(tmp_path / "ro" / "edited.png")],
                 ["lora", "merge", "--model", tiny_edit_model, "--lora", str(lora), "--out",
                  str(tmp_path / "ro" / "merged")]):
        LOAD_LOG.clear()
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 1 and "not writable" in result.output, (result.output, result.exception)
        assert str(tmp_path / "ro") in result.output and "Traceback" not in result.output
        assert LOAD_LOG == []


def test_predict_applies_the_exif_orientation_of_a_control(tiny_edit_model, tmp_path, small_vae_view):
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
        # a small output (the control alone sets the default size, ~1024², minutes of a tiny model on 2 cores):
        # the control's own encoding still differs when it is read another way
        _cli("predict", "--model", tiny_edit_model, "--image", control, "--prompt", PROMPT, "--steps", 2,
             "--seed", 1, "--height", 64, "--width", 48, "--out", outs[-1])
    np.testing.assert_array_equal(np.asarray(Image.open(outs[0])), np.asarray(Image.open(outs[1])))




def test_predict_shows_a_transparent_control_as_training_did(tiny_edit_model, tmp_path, small_vae_view):
    """A cutout (RGBA, transparent background stored as black): resize-bucket composites training images over
    white; predict dropped the alpha (`convert("RGB")`), so the model saw a black background it never trained on.
    Reference: the control as resize-bucket decodes it."""
    from features.decode import decode_image

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
        # a small output (the control alone sets the default size, ~1024², minutes of a tiny model on 2 cores):
        # the control's own encoding still differs when it is read another way
        _cli("predict", "--model", tiny_edit_model, "--image", control, "--prompt", PROMPT, "--steps", 2,
             "--seed", 1, "--height", 64, "--width", 48, "--out", outs[-1])
    np.testing.assert_array_equal(np.asarray(Image.open(outs[0])), np.asarray(Image.open(outs[1])))


def test_evaluate_extra_prompts_apply_the_exif_orientation(tiny_edit_model, tmp_path, small_vae_view):
    """evaluate.extra_prompts read their control and target files the same way (predict's reader)."""
    from diffusers.utils import load_image

    tagged = tmp_path / "phone.png"
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.open(_control(tmp_path / "raw.png", w=64, h=48)).save(tagged, exif=exif)
    controls, target = _extra_prompt_pictures(tiny_edit_model, tagged)
    upright = np.asarray(load_image(str(tagged)))
    np.testing.assert_array_equal(np.asarray(controls[0]), upright)
    np.testing.assert_array_equal(np.asarray(target), upright)


def test_evaluate_extra_prompts_show_a_transparent_control_as_training_did(tiny_edit_model, tmp_path,
                                                                           small_vae_view):
    """A cutout given to evaluate.extra_prompts (Edit / Edit-Plus) is composited over white, as resize-bucket
    decodes the training images (before: its transparent pixels reached the model as the black they store)."""
    from features.decode import decode_image

    rgba = np.zeros((48, 64, 4), dtype=np.uint8)
    rgba[12:36, 16:48] = (200, 30, 30, 255)
    cutout = tmp_path / "cutout.png"
    Image.fromarray(rgba, "RGBA").save(cutout)
    controls, target = _extra_prompt_pictures(tiny_edit_model, cutout)
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
    assert result.exit_code == 2 and "not empty" in result.output


def test_evaluate_extra_prompts_scale_a_16_bit_control_as_training_does(tiny_edit_model, tmp_path, small_vae_view):
    """A 16-bit grayscale PNG (a scan, a depth-like map) as an extra prompt's control and target. resize-bucket
    scales it 65535 -> 255; evaluate read it with Pillow's own convert, which clips: everything above 255 came out
    white. Both now use one decoder (features/decode.py)."""
    from features.decode import decode_image

    ramp = (np.linspace(0, 65535, 48 * 64).reshape(48, 64)).astype(np.uint16)
    scan = tmp_path / "scan16.png"
    Image.fromarray(ramp).save(scan)  # mode I;16
    controls, target = _extra_prompt_pictures(tiny_edit_model, scan)
    as_trained = np.asarray(decode_image(scan.read_bytes(), 64 * 1024 * 1024).image)
    assert as_trained.min() == 0 and as_trained.max() == 255 and len(np.unique(as_trained)) > 200  # a real ramp
    np.testing.assert_array_equal(np.asarray(controls[0]), as_trained)
    np.testing.assert_array_equal(np.asarray(target), as_trained)


def test_21_extra_prompts_keep_a_palette_cutouts_alpha_and_show_targets_over_white(tiny_21_model, tmp_path):
    """Qwen-Image-2.1 extra prompts: a palette PNG with a transparent entry reached the 2.1 pipeline as RGB (the
    transparent pixels as the colour they store), and a transparent target was shown in the report on black.
    Now: the reference stays RGBA, as resize.keep_alpha stores training pictures, and the target is over white."""
    from models.loading import load_component
    from pipeline.config import load_config
    from stages.evaluate.qwen21 import extra_inputs_21
    from features.decode import decode_image, decode_keeping_alpha

    pal = np.zeros((48, 64), dtype=np.uint8)
    pal[12:36, 16:48] = 1
    cutout = Image.fromarray(pal, "P")
    cutout.putpalette([0, 0, 0, 200, 30, 30] + [0] * 762)
    cutout.info["transparency"] = 0
    ref_path = tmp_path / "palette-cutout.png"
    cutout.save(ref_path, transparency=0)
    rgba = np.zeros((48, 64, 4), dtype=np.uint8)
    rgba[12:36, 16:48] = (30, 200, 30, 255)
    target_path = tmp_path / "target.png"
    Image.fromarray(rgba, "RGBA").save(target_path)
    # an output size the tiny model's processor keeps the reference at (its default 1024² is past its 512²)
    cfg = load_config(None, {"evaluate.dtype": "float32",  # resolved, as evaluate does before this
                             "evaluate.extra_prompts": [{"prompt": PROMPT, "images": [str(ref_path)],
                                                          "target": str(target_path),
                                                          "height": 48, "width": 64}]}).evaluate
    transformer = load_component(tiny_21_model, "transformer", dtype=torch.float32, device="cpu")
    vae = load_component(tiny_21_model, "vae", dtype=torch.float32, device="cpu")
    captured = {}
    import models.qwen21_predict as qp

    def fake_edit_21(pipe, refs, *a, **k):  # what the stock pipeline is given; the generation itself is tested
        captured["refs"] = refs
        return Image.new("RGBA", (64, 48))

    orig, qp.edit_21 = qp.edit_21, fake_edit_21
    try:
        _, _, shown, target, cond, *_ = next(extra_inputs_21(tiny_21_model, transformer, vae, cfg))
        cond()
    finally:
        qp.edit_21 = orig
    given = captured["refs"][0]
    assert given.mode == "RGBA"
    np.testing.assert_array_equal(np.asarray(given), np.asarray(decode_keeping_alpha(ref_path.read_bytes(), 1 << 22).image))
    np.testing.assert_array_equal(np.asarray(target), np.asarray(decode_image(target_path.read_bytes(), 1 << 22).image))
    assert np.asarray(target)[0, 0].tolist() == [255, 255, 255]  # transparent corner: white, as training shows it
    assert np.asarray(shown[0])[0, 0].tolist() == [255, 255, 255]


def test_predict_names_a_control_it_cannot_use(tiny_edit_model, tmp_path):
    """A control that is not a picture, or missing: one line naming it, before any model loads."""
    from models.loading import LOAD_LOG

    junk = tmp_path / "notes.png"
    junk.write_text("not an image")
    for bad, why in ((junk, "cannot use --image"), (tmp_path / "missing.png", "cannot read --image")):
        LOAD_LOG.clear()
        result = CliRunner().invoke(app, ["predict", "--model", tiny_edit_model, "--image", str(bad), "--prompt",
                                          PROMPT, "--out", str(tmp_path / "o.png")])
        assert result.exit_code == 1 and why in result.output and str(bad) in result.output, result.output
        assert LOAD_LOG == []


def test_predict_out_naming_its_control_or_a_folder_is_refused_before_loading(tiny_edit_model, tmp_path):
    """`--out` naming the control image (by another spelling, or a hard link to it) replaced the user's photo with
    the edit, without a word; `--out` naming an existing folder was PIL's IsADirectoryError, a traceback after
    every denoising step. Both are usage mistakes now (exit 2), before anything loads."""
    import os

    from models.loading import LOAD_LOG

    control = _control(tmp_path / "photo.png")
    photo = control.read_bytes()
    os.link(control, tmp_path / "link.png")
    (tmp_path / "folder.png").mkdir()
    for out, says in ((control, "is the control image"), (tmp_path / "." / "photo.png", "is the control image"),
                      (tmp_path / "link.png", "is the control image"), (tmp_path / "folder.png", "is a folder")):
        LOAD_LOG.clear()
        result = CliRunner().invoke(app, ["predict", "--model", tiny_edit_model, "--image", str(control), "--prompt",
                                          PROMPT, "--steps", "2", "--height", "64", "--width", "64", "--out", str(out)])
        assert result.exit_code == 2 and says in result.output, (result.output, result.exception)
        assert LOAD_LOG == [] and control.read_bytes() == photo
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder.png", "link.png", "photo.png"]


def test_predict_refuses_an_existing_out_before_loading_unless_overwrite(tiny_edit_model, tmp_path, small_vae_view):
    """An existing --out (an earlier result, or any file at that name) was replaced without a word. Now a usage
    mistake (exit 2) before anything loads, as `lora export --out` is; --overwrite replaces it."""
    from models.loading import LOAD_LOG

    control = _control(tmp_path / "control.png")
    out = _control(tmp_path / "earlier.png", seed=1)
    earlier = out.read_bytes()
    args = ["predict", "--model", tiny_edit_model, "--image", str(control), "--prompt", PROMPT, "--steps", "2",
            "--height", "64", "--width", "64", "--out", str(out)]
    LOAD_LOG.clear()
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and f"--out {out} exists" in result.output and "--overwrite" in result.output, (
        result.output, result.exception)
    assert LOAD_LOG == [] and out.read_bytes() == earlier
    _cli(*args, "--overwrite")
    assert out.read_bytes() != earlier and Image.open(out).size == (64, 64)


def test_a_disk_filling_while_predict_saves_keeps_the_previous_image(tiny_edit_model, tmp_path, small_vae_view,
                                                                    monkeypatch):
    """PIL wrote the edit straight into --out: a disk that filled mid-write left a cut PNG where the previous
    image at that name was (PIL removes only a file it created). Now a temp file renamed over --out: the old
    image stays whole, no temp file is left, one line. Simulated: every write into out/ stops half-way, ENOSPC."""
    import builtins
    import errno

    control = _control(tmp_path / "control.png")
    out = tmp_path / "out" / "edited.png"
    out.parent.mkdir()
    _control(out, seed=1)
    previous = out.read_bytes()
    real_open = builtins.open

    class FillsUp:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            self.f.write(bytes(data)[: len(data) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device", self.f.name)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def filling_open(file, mode="r", *a, **k):
        f = real_open(file, mode, *a, **k)
        return FillsUp(f) if str(file).startswith(str(out.parent)) and any(c in mode for c in "wa+") else f

    monkeypatch.setattr(builtins, "open", filling_open)
    result = CliRunner().invoke(app, ["predict", "--model", tiny_edit_model, "--image", str(control), "--prompt",
                                      PROMPT, "--steps", "2", "--height", "64", "--width", "64", "--out", str(out),
                                      "--overwrite"])
    monkeypatch.undo()
    assert result.exit_code == 1 and "disk full" in result.output and "Traceback" not in result.output, result.output
    assert out.read_bytes() == previous and [p.name for p in out.parent.iterdir()] == ["edited.png"]


@pytest.mark.parametrize("variant_model, size", [("tiny_edit_model", (1990, 10)), ("tiny_plus_model", (1, 3000)),
                                                 ("tiny_21_model", (3000, 1))])
def test_a_control_too_elongated_for_the_model_is_one_line_before_loading(variant_model, size, tmp_path, request):
    """A control whose view for the text encoder the stock resize rounds to 0 px, or beyond the VL processor's
    200:1: PIL's or transformers' ValueError, a traceback after every model had loaded (2.1: while checking the
    prompt). Now one line naming the file, before any weights load."""
    from models.loading import LOAD_LOG

    model = request.getfixturevalue(variant_model)
    control = tmp_path / "strip.png"
    Image.new("RGB", size, "gray").save(control)
    LOAD_LOG.clear()
    result = CliRunner().invoke(app, ["predict", "--model", model, "--image", str(control), "--prompt", PROMPT,
                                      "--steps", "2", "--out", str(tmp_path / "o.png")])
    assert result.exit_code == 1 and f"--image {control}" in result.output, (result.output, result.exception)
    assert "too elongated" in result.output and "Traceback" not in result.output and LOAD_LOG == []
    assert not (tmp_path / "o.png").exists()


def test_lora_merge_refuses_an_out_inside_the_model_folder(tiny_edit_model, tmp_path):
    """`--out MODEL/merged`: the merge links every entry of MODEL into OUT's temp folder, which is one of them: it
    recursed until the path was too long (a traceback). Now one line; the model folder is left as it was."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_edit_model, model)
    before = sorted(p.relative_to(model) for p in model.rglob("*"))
    lora = tmp_path / "lora"
    _make_lora(str(model), lora)
    for out in (model / "merged", model / "transformer" / ".." / "merged"):
        result = CliRunner().invoke(app, ["lora", "merge", "--model", str(model), "--lora", str(lora),
                                          "--out", str(out)])
        assert result.exit_code == 2 and "is inside the model folder" in result.output, result.output
        assert "Traceback" not in result.output
    assert sorted(p.relative_to(model) for p in model.rglob("*")) == before


@pytest.mark.parametrize("variant_model, inside, outside, size", [
    # Edit / Edit-Plus view a control at fixed areas, whatever the output size: a 32² output keeps every view of
    # it (the default, the control's ~1024² size, decoded a 12704x96 image: ~15 s of the tiny VAE on one core)
    ("tiny_edit_model", (2000, 13), (2000, 12), [32, 32]),  # the ~1024² view: 12704x96 (132:1) / 12800x64 (200:1 +)
    ("tiny_plus_model", (2000, 8), (2000, 7), [32, 32]),  # the ~384² view: 6080x32 (190:1) / 6432x32
    # 2.1 sizes its references at the output's area: 256² keeps a 255.9:1 control (3968x32), 256:1 rounds to 0 px
    ("tiny_21_model", (2559, 10), (2560, 10), [256, 256])])
def test_a_control_one_pixel_inside_the_stock_resize_limit_is_edited_one_outside_refused(
        variant_model, inside, outside, size, tmp_path, request):
    """The limit is the stock pipeline's own (its `calculate_dimensions`, then the VL processor's 200:1): a control
    one pixel inside it is edited end to end, one pixel outside is one line before loading. A 2.1 control was
    judged as it is, not at the size the pipeline gives it: 2559x10 at a 256² output was refused (255.9:1),
    though the pipeline makes a 3968x32 view of it."""
    from models.control_shapes import control_views
    from models.loading import LOAD_LOG, model_variant

    model = request.getfixturevalue(variant_model)
    variant = model_variant(model)
    if variant != "qwen-image-2.1":  # the premise of the small output above: the views are the default output's
        assert control_views(variant, inside, *size) == control_views(variant, inside)
    height, width = size
    size = ["--height", str(height), "--width", str(width)]
    for shape, ok in ((inside, True), (outside, False)):
        control, out = tmp_path / f"{shape[0]}x{shape[1]}.png", tmp_path / f"{shape[0]}x{shape[1]}-out.png"
        Image.new("RGB", shape, "gray").save(control)
        LOAD_LOG.clear()
        result = CliRunner().invoke(app, ["predict", "--model", model, "--image", str(control), "--prompt", PROMPT,
                                          "--steps", "2", *size, "--out", str(out)])
        if ok:
            assert result.exit_code == 0 and out.is_file(), (result.output, result.exception)
        else:
            assert result.exit_code == 1 and f"--image {control}" in result.output, (result.output, result.exception)
            assert "too elongated" in result.output and LOAD_LOG == [] and not out.exists()


def test_a_21_reference_beyond_the_processor_limits_is_one_line_not_the_search_for_a_size(tiny_21_model, tmp_path):
    """A reference within 200:1 but past the processor's pixel limits is refused with an output size to pass; the
    search for that size tried smaller ones at which the reference is past 200:1, and smart_resize's ValueError
    came out as a traceback (2010x9 at 1200²: its 17920x96 view, 186.7:1, but 219:1 at a smaller output; asked
    at 1216², as 1200 is no multiple of the 2.1 output's 32 px and is refused first)."""
    control = tmp_path / "strip.png"
    Image.new("RGB", (2010, 9), "gray").save(control)
    result = CliRunner().invoke(app, ["predict", "--model", tiny_21_model, "--image", str(control), "--prompt", PROMPT,
                                      "--steps", "2", "--height", "1216", "--width", "1216",
                                      "--out", str(tmp_path / "o.png")])
    assert result.exit_code == 1 and "outside the model's VLM processor limits" in result.output, (
        result.output, result.exception)
    assert "Traceback" not in result.output and not (tmp_path / "o.png").exists()


def test_a_too_elongated_control_is_refused_before_the_loras_base_check_hashes_the_model(tiny_edit_model, tmp_path,
                                                                                         monkeypatch):
    """With --lora, the LoRA's base check hashed the model (minutes for the 20B one) before the control's shape
    was judged: a too-elongated control was refused only after it. Now the controls first; the hash stands in
    for itself here by a line of its own (asked only when a control passes)."""
    from safetensors.torch import save_file

    import models.loading
    from schemas.errors import UserError

    hashed = []

    def hash_model(model):
        hashed.append(model)
        raise UserError("the model was hashed")

    monkeypatch.setattr(models.loading, "model_fingerprint", hash_model)
    q = "transformer.transformer_blocks.0.attn.to_q"
    lora = tmp_path / "lora.safetensors"  # records a base, so the check hashes the model to compare
    save_file({f"{q}.lora_A.weight": torch.ones(2, 8), f"{q}.lora_B.weight": torch.ones(8, 2)}, lora,
              metadata={"format": "pt", "base_model_fingerprint": "0123456789abcdef"})
    strip, fine = tmp_path / "strip.png", _control(tmp_path / "fine.png")
    Image.new("RGB", (1990, 10), "gray").save(strip)
    for control, says, hashes in ((strip, f"--image {strip}: 1990x10 px is too elongated", []),
                                  (fine, "the model was hashed", [tiny_edit_model])):
        hashed.clear()
        result = CliRunner().invoke(app, ["predict", "--model", tiny_edit_model, "--image", str(control), "--prompt",
                                          PROMPT, "--lora", str(lora), "--steps", "2", "--out", str(tmp_path / "o.png")])
        assert result.exit_code == 1 and says in " ".join(result.output.split()), (result.output, result.exception)
        assert hashed == hashes and not (tmp_path / "o.png").exists()


def test_a_21_reference_past_the_processor_limits_is_refused_before_the_loras_base_check(tiny_21_model, tmp_path,
                                                                                        monkeypatch):
    """The Qwen-Image-2.1 check of the references against the VLM processor (and of the prompt against the RoPE
    table) ran inside `predict`, after the CLI's LoRA base check had hashed the model (minutes for a 20B one): with
    --lora, a reference past the processor's limits was refused only after that hash. Now with the controls."""
    from safetensors.torch import save_file

    import models.loading

    hashed = []
    monkeypatch.setattr(models.loading, "model_fingerprint", lambda model: hashed.append(model) or "fedcba9876543210")
    q = "transformer.transformer_blocks.0.attn.to_q"
    lora = tmp_path / "lora.safetensors"  # records a base, so the check hashes the model to compare
    save_file({f"{q}.lora_A.weight": torch.ones(2, 8), f"{q}.lora_B.weight": torch.ones(8, 2)}, lora,
              metadata={"format": "pt", "base_model_fingerprint": "0123456789abcdef"})
    control = tmp_path / "strip.png"
    Image.new("RGB", (2010, 9), "gray").save(control)
    result = CliRunner().invoke(app, ["predict", "--model", tiny_21_model, "--image", str(control), "--prompt", PROMPT,
                                      "--lora", str(lora), "--steps", "2", "--height", "1216", "--width", "1216",
                                      "--out", str(tmp_path / "o.png")])
    assert result.exit_code == 1 and "outside the model's VLM processor limits" in result.output, (
        result.output, result.exception)
    assert hashed == [] and not (tmp_path / "o.png").exists()


@pytest.mark.parametrize("variant,multiple", [("21", 32), ("plus", 16)])
def test_an_output_size_the_pipeline_would_round_down_is_refused_before_loading(tiny_21_model, tiny_plus_model,
                                                                              tmp_path, variant, multiple):
    """--height 100 was written as 96 px (2.1: a warning in the pipeline's log; Edit-Plus: not a word). Now one
    line naming the flag, the model's multiple and the sizes to pass, before the transformer loads: a flag the
    model folder's configs refuse, exit 2 as README says (it was 1); a multiple of the model's own is written at
    that size."""
    from models.loading import LOAD_LOG

    model = tiny_21_model if variant == "21" else tiny_plus_model
    control, out = _control(tmp_path / "c.png"), tmp_path / "o.png"
    loaded = len(LOAD_LOG)
    result = CliRunner().invoke(app, [str(a) for a in ("predict", "--model", model, "--image", control, "--prompt",
                                                       PROMPT, "--steps", 2, "--height", 64, "--width", 100,
                                                       "--out", out)])
    down = 100 // multiple * multiple
    assert result.exit_code == 2 and not out.exists(), result.output
    [line] = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert line == (f"error: --width 100: {model} makes images in multiples of {multiple} px, and its pipeline "
                    f"would write {down} px instead; pass --width {down} or {down + multiple}"), line
    assert all(component != "transformer" for _, component in LOAD_LOG[loaded:])
    _cli("predict", "--model", model, "--image", control, "--prompt", PROMPT, "--steps", 2, "--height", 64,
         "--width", 3 * multiple, "--out", out)
    assert Image.open(out).size == (3 * multiple, 64)


def test_a_prompt_flag_is_cleaned_of_control_characters_as_a_caption_is(tiny_edit_model, tmp_path, monkeypatch):
    """`--prompt` with an ANSI colour sequence, a NUL and a form feed (a prompt pasted from a coloured log): the
    text encoder got them as text. Now cleaned by the captions' rule, with a note line; a clean prompt: no note."""
    from pipeline.commands import predict as predict_cmd

    given: list[str] = []
    monkeypatch.setattr(predict_cmd, "predict", lambda cfg, model, images, prompt, out, *a, **k: given.append(prompt)
                        or out)
    control = _control(tmp_path / "control.png")
    args = ["predict", "--model", tiny_edit_model, "--image", str(control), "--out", str(tmp_path / "o.png")]
    result = CliRunner().invoke(app, [*args, "--prompt", "\x1b[31mmake the car\x1b[0m red\x00\x0cnow"])
    assert result.exit_code == 0, result.output
    assert given == ["make the car red\nnow"]
    assert "note: --prompt: control characters removed" in result.stderr, result.stderr
    result = CliRunner().invoke(app, [*args, "--prompt", PROMPT])
    assert result.exit_code == 0 and given[-1] == PROMPT and "note:" not in result.stderr, result.output
