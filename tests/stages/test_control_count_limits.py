"""Control-image counts a model cannot take, refused in one line (what, which model, what to do) before it loads.
Qwen-Image-2.1 takes 0..10 reference images (encode quarantines a sample with more, `control-count`): predict
and evaluate's extra prompts took any number, the stock pipeline running 11 references through the transformer,
a layout the model never saw, after minutes of loading. Qwen-Image-Edit takes one control: two were refused only
after every component had loaded."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from pipeline.cli import app


def _refs(tmp_path, n: int) -> list:
    ref = tmp_path / "ref.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(ref)
    return [ref] * n


def test_21_predict_refuses_11_references_before_loading_anything(tiny_21_model, tmp_path):
    from models.loading import LOAD_LOG

    out = tmp_path / "out.png"
    args = ["predict", "--model", tiny_21_model, "--prompt", "p", "--steps", "2", "--height", "32", "--width", "32",
            "--out", str(out)]
    LOAD_LOG.clear()
    result = CliRunner().invoke(app, args + [a for r in _refs(tmp_path, 11) for a in ("--image", str(r))])
    assert result.exit_code == 2, result.output  # a usage mistake, judged from the model folder's configs
    assert "--image: 11 reference images" in result.output and "at most 10" in result.output
    assert "Traceback" not in result.output and not out.exists() and LOAD_LOG == []


def test_21_predict_takes_10_references(tiny_21_model, tmp_path):
    """The limit is the model's: 10 still run (the stock pipeline call)."""
    out = tmp_path / "out.png"
    result = CliRunner().invoke(app, ["predict", "--model", tiny_21_model, "--prompt", "p", "--steps", "2",
                                      "--height", "32", "--width", "32", "--out", str(out)]
                                + [a for r in _refs(tmp_path, 10) for a in ("--image", str(r))])
    assert result.exit_code == 0, result.output
    assert out.is_file()


def test_21_evaluate_refuses_an_extra_prompt_with_11_references(tiny_21_model, tiny_edit_model, tmp_path):
    """Both evaluate entries resolve the config through `for_model` before reading or loading anything."""
    from pipeline.config import load_config
    from schemas.errors import UserError
    from stages.evaluate.settings import for_model

    images = [str(r) for r in _refs(tmp_path, 11)]
    size = {"height": 64, "width": 64}  # within the tiny model's processor (its default 1024² is not)
    cfg = load_config(None, {"evaluate.extra_prompts": [{"prompt": "p", "images": images[:1], **size},
                                                         {"prompt": "q", "images": images, **size}]}).evaluate
    with pytest.raises(UserError, match=r"evaluate.extra_prompts\[1\].images: 11 reference images.*at most 10"):
        for_model(cfg, tiny_21_model)
    for_model(cfg.model_copy(update={"extra_prompts": cfg.extra_prompts[:1]}), tiny_21_model)  # 1 reference: fine


def test_edit_predict_refuses_two_controls_before_loading_anything(tiny_edit_model, tmp_path):
    """Qwen-Image-Edit takes one control: two were refused by `models.edit.prepare`, after the transformer, the
    text encoder and the VAE had loaded (minutes for the 20B model). Now one line before any load."""
    from models.loading import LOAD_LOG

    out = tmp_path / "out.png"
    LOAD_LOG.clear()
    result = CliRunner().invoke(app, ["predict", "--model", tiny_edit_model, "--prompt", "p", "--steps", "2",
                                      "--out", str(out)] + [a for r in _refs(tmp_path, 2) for a in ("--image", str(r))])
    assert result.exit_code == 2, result.output
    assert "--image: 2 control images" in result.output and "takes exactly one" in result.output
    assert "Traceback" not in result.output and not out.exists() and LOAD_LOG == []


def test_edit_evaluate_refuses_an_extra_prompt_with_two_controls(tiny_edit_model, tiny_plus_model, tmp_path):
    from pipeline.config import load_config
    from schemas.errors import UserError
    from stages.evaluate.settings import for_model

    images = [str(r) for r in _refs(tmp_path, 2)]
    cfg = load_config(None, {"evaluate.extra_prompts": [{"prompt": "q", "images": images}]}).evaluate
    with pytest.raises(UserError, match=r"evaluate.extra_prompts\[0\].images: 2 control images.*exactly one"):
        for_model(cfg, tiny_edit_model)
    for_model(cfg, tiny_plus_model)  # Edit-Plus takes several


def test_21_predict_refuses_a_prompt_past_the_rope_table_before_loading_the_model(tiny_21_model, tmp_path):
    """The RoPE-table check (`check_prompt_fits`, tested at its exact boundary in test_qwen21_stages.py) needs the
    tokenizer only: it ran inside `edit_21`, after the transformer, text encoder and VAE had loaded. Now only the
    processor is read before the line."""
    from models.loading import LOAD_LOG

    out = tmp_path / "out.png"
    LOAD_LOG.clear()
    result = CliRunner().invoke(app, ["predict", "--model", tiny_21_model, "--image", str(_refs(tmp_path, 1)[0]),
                                      "--prompt", " ".join(["a"] * 9000), "--steps", "2", "--height", "32",
                                      "--width", "32", "--out", str(out)])
    assert result.exit_code == 1 and "shorten the prompt" in result.output, result.output
    assert "Traceback" not in result.output and not out.exists()
    assert [component for _, component in LOAD_LOG] == ["processor"]


def test_21_predict_refuses_a_prompt_holding_the_processors_placeholder_before_loading_the_model(tiny_21_model,
                                                                                                  tmp_path):
    """A prompt holding `<|image_pad|>` (which encode-text quarantines in a caption): predict loaded every
    component, then the stock call failed with the processor's ValueError traceback ("The total number of
    <|image_pad|> tokens ... should be the same as the number of images passed"). Now one line, the processor
    alone read; so for the negative prompt under true CFG."""
    _assert_predict_refuses_placeholders(tiny_21_model, tmp_path, true_cfg=["--cfg", "4"])


def _assert_predict_refuses_placeholders(model: str, tmp_path, true_cfg: list[str]) -> None:
    """`predict` with `<|image_pad|>` in its prompt, then `<|video_pad|>` in its negative prompt (under true CFG:
    `true_cfg`'s flags, none where it is the model's default): each refused in one line, no image written, the
    processor alone read."""
    from models.loading import LOAD_LOG

    out = tmp_path / "out.png"
    for flags in (["--prompt", "make <|image_pad|> red"], ["--prompt", "p", *true_cfg, "--negative-prompt",
                                                            "<|video_pad|>"]):
        LOAD_LOG.clear()
        result = CliRunner().invoke(app, ["predict", "--model", model, "--image", str(_refs(tmp_path, 1)[0]),
                                          *flags, "--steps", "2", "--height", "32", "--width", "32", "--out", str(out)])
        assert result.exit_code == 1 and "a placeholder the model's processor reserves" in result.output, result.output
        assert "Traceback" not in result.output and not out.exists()
        assert [component for _, component in LOAD_LOG] == ["processor"]


def test_21_evaluate_refuses_an_extra_prompt_past_the_rope_table_before_loading(tiny_21_model, tmp_path):
    """evaluate's 2.1 extra prompts met the same check only when their images were made: after the transformer
    had loaded and every held-out loss pass had run. Now at the start, naming the extra prompt."""
    from models.loading import LOAD_LOG
    from pipeline.config import load_config
    from schemas.errors import UserError
    from stages.evaluate.settings import for_model

    ref = str(_refs(tmp_path, 1)[0])
    size = {"height": 64, "width": 64}  # within the tiny model's processor (its default 1024² is not)
    cfg = load_config(None, {"evaluate.extra_prompts": [{"prompt": "fine", "images": [ref], **size},
                                                         {"prompt": " ".join(["a"] * 9000), "images": [ref],
                                                          **size}]}).evaluate
    LOAD_LOG.clear()
    with pytest.raises(UserError, match=r"evaluate.extra_prompts\[1\]: the prompt is \d+ text tokens.*shorten"):
        for_model(cfg, tiny_21_model)
    assert [component for _, component in LOAD_LOG] == ["processor"]
    for_model(cfg.model_copy(update={"extra_prompts": cfg.extra_prompts[:1]}), tiny_21_model)


def test_run_all_refuses_an_extra_prompt_evaluate_cannot_take_before_its_first_stage(tiny_edit_model, tmp_path):
    """`pipeline run all` checks evaluate's extra prompts before resize-bucket, as it does the one-step setting:
    before, two control images for Qwen-Image-Edit (or an image file that is not there) stopped evaluate when it
    started, after resize-bucket, both encoders and the whole training."""
    import yaml

    store, run = tmp_path / "store", tmp_path / "run"
    two = [str(r) for r in _refs(tmp_path, 2)]
    for extra, said in (({"prompt": "q", "images": two}, "error: evaluate.extra_prompts[0].images: 2 control images"),
                        ({"prompt": "q", "images": [str(tmp_path / "gone.png")]},
                         f"error: cannot read evaluate.extra_prompts[0] image {tmp_path / 'gone.png'}"),
                        ({"prompt": "q", "images": two[:1], "target": str(tmp_path / "gone.png")},
                         f"error: cannot read evaluate.extra_prompts[0] target {tmp_path / 'gone.png'}")):
        config = tmp_path / "c.yaml"
        config.write_text(yaml.safe_dump({
            "paths": {"source": str(tmp_path / "src"), "store": str(store), "model": tiny_edit_model,
                      "run": str(run), "report": str(tmp_path / "report")},
            "evaluate": {"extra_prompts": [extra]}}))
        r = CliRunner().invoke(app, ["run", "all", "--config", str(config)])
        lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
        assert r.exit_code == 1 and len(lines) == 1 and lines[0].startswith(said), r.output
        assert "== resize-bucket" not in r.output and not store.exists() and not run.exists(), r.output


def test_edit_plus_predict_refuses_a_prompt_holding_the_processors_placeholder_before_loading_the_model(
        tiny_plus_model, tmp_path):
    """The 2.1 rule above, for the Edit models: predict loaded every component, then the stock Edit-Plus call
    failed with the processor's ValueError traceback ("The total number of <|image_pad|> tokens ... should be the
    same as the number of images passed"; "Found 1 <|video_pad|> tokens in the text but no videos were passed").
    Now one line, the processor alone read; so for the negative prompt under true CFG (the Edit default 4.0)."""
    _assert_predict_refuses_placeholders(tiny_plus_model, tmp_path, true_cfg=[])


def test_edit_evaluate_refuses_an_extra_prompt_holding_the_processors_placeholder(tiny_edit_model, tmp_path):
    """evaluate's extra prompts met the processor's ValueError when their images were made, after the held-out
    loss passes; now `for_model` refuses it first, naming the extra prompt."""
    from pipeline.config import load_config
    from schemas.errors import UserError
    from stages.evaluate.settings import for_model

    image = str(_refs(tmp_path, 1)[0])
    cfg = load_config(None, {"evaluate.extra_prompts": [{"prompt": "p", "images": [image], "height": 64, "width": 64},
                                                        {"prompt": "a <|image_pad|>", "images": [image], "height": 64,
                                                         "width": 64}]}).evaluate
    with pytest.raises(UserError, match=r"^evaluate.extra_prompts\[1\]: the prompt holds <\|image_pad\|>"):
        for_model(cfg, tiny_edit_model)
    for_model(cfg.model_copy(update={"extra_prompts": cfg.extra_prompts[:1]}), tiny_edit_model)
