"""Hostile flags and files through the CLI: each is one line and a non-zero exit, never a traceback, and
nothing is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image
from typer.testing import CliRunner

from pipeline.cli import app
from train_store import make_train_store, mixed_specs


def _run(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), type(result.exception).__name__
    return result


@pytest.fixture(scope="module")
def features(tiny_edit_model, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile") / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(4, 2))
    return root


@pytest.fixture
def garbage_lora(tmp_path) -> Path:
    path = tmp_path / "garbage.safetensors"
    path.write_bytes(b"\x93NUMPY not a safetensors file at all" * 40)
    return path


def test_binary_config_is_one_line(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_bytes(bytes(range(256)) * 8)
    r = _run("config", "show", "--config", cfg)
    assert r.exit_code == 2 and str(cfg) in r.output


def test_out_or_store_naming_a_file(tmp_path, edit_store, features, tiny_edit_model):
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    r = _run("run", "resize-bucket", "--source", edit_store, "--store", a_file)
    assert r.exit_code in (1, 2) and "a_file" in r.output
    r = _run("run", "train", "--store", features, "--model", tiny_edit_model, "--out", a_file, "--max-steps", 1,
             "--device", "cpu")
    assert r.exit_code in (1, 2) and "a_file" in r.output
    assert a_file.read_text() == "keep me"


def test_garbage_safetensors_as_lora_for_every_command(tiny_edit_model, features, garbage_lora, tmp_path):
    img = tmp_path / "in.png"
    Image.new("RGB", (64, 48)).save(img)
    for args in (
        ["predict", "--model", tiny_edit_model, "--image", img, "--prompt", "x", "--lora", garbage_lora,
         "--out", tmp_path / "o.png"],
        ["lora", "merge", "--model", tiny_edit_model, "--lora", garbage_lora, "--out", tmp_path / "m"],
        ["lora", "export", garbage_lora, "--out", tmp_path / "e.safetensors"],
        ["run", "evaluate", "--store", features, "--model", tiny_edit_model, "--lora", garbage_lora,
         "--out", tmp_path / "ev", "--set", "evaluate.device=cpu"],
    ):
        r = _run(*args)
        assert r.exit_code == 1 and "not a readable .safetensors file" in r.output, (args, r.output)
    assert not any((tmp_path / n).exists() for n in ("o.png", "m", "e.safetensors"))


def test_decompression_bomb_image_for_predict(tiny_edit_model, tmp_path):
    bomb = tmp_path / "bomb.png"
    Image.new("1", (20000, 20000)).save(bomb)  # 400 Mpx: over Pillow's hard limit (2x MAX_IMAGE_PIXELS)
    r = _run("predict", "--model", tiny_edit_model, "--image", bomb, "--prompt", "x", "--out", tmp_path / "o.png")
    assert r.exit_code == 1 and "bomb.png" in r.output and not (tmp_path / "o.png").exists()


@pytest.mark.parametrize("targets", ["[nosuch]", "[to_q, to_v, gate_layer]"])
def test_unknown_target_modules(tiny_edit_model, features, tmp_path, targets):
    """A name that matches no layer is refused even beside names that do: peft adapts what matches and drops the
    rest without a word, so Qwen-Image-2.1's MLP names (gate_layer, proj, out) on an Edit model, or the Edit
    MLP's (net.0.proj, net.2) on 2.1, trained the attention alone."""
    r = _run("run", "train", "--store", features, "--model", tiny_edit_model, "--out", tmp_path / "run",
             "--max-steps", 1, "--device", "cpu", "--set", f"train.lora.target_modules={targets}")
    assert r.exit_code == 1 and "train.lora.target_modules" in r.output and "to_q" in r.output, r.output
    assert targets.strip("[]").split(", ")[-1] in r.output.split("named")[0], r.output  # the name matching nothing
    assert not (tmp_path / "run" / "lora").exists()


@pytest.mark.parametrize("command", ["repair", "inspect", "verify"])
def test_a_garbage_store_json_is_not_a_store(tmp_path, command):
    folder = tmp_path / "notastore"
    folder.mkdir()
    (folder / "store.json").write_bytes(b"\x00\xffgarbage{")
    r = _run("store", command, folder)
    assert r.exit_code != 0 and "store.json" in r.output, r.output


@pytest.mark.parametrize("command", ["repair", "inspect", "verify", "gc"])
def test_a_file_as_the_store_is_no_store(tmp_path, command):
    """`store repair FILE` named `FILE/source-url.txt` (a path the user never gave) as 'a file, not a folder':
    every store command says there is no store at the path given."""
    path = tmp_path / "notes.txt"
    path.write_text("x")
    r = _run("store", command, path)
    assert r.exit_code == 1 and f"no store at {path}" in r.output and "source-url" not in r.output, r.output


@pytest.mark.parametrize("prompt", ["", "   ", "\x1b[31m\x07"], ids=["empty", "spaces", "controls-only"])
def test_an_empty_prompt_is_refused_before_any_loading(tmp_path, prompt):
    """`--prompt "$P"` with P unset generated from an empty instruction, which no training sample has (an empty
    caption is quarantined), and wrote the picture as if asked; an extra prompt of the config likewise."""
    control = tmp_path / "c.png"
    Image.new("RGB", (32, 32), (200, 0, 0)).save(control)
    r = _run("predict", "--model", tmp_path / "no-model", "--image", control, "--prompt", prompt,
             "--out", tmp_path / "o.png")
    assert r.exit_code == 2 and "error: --prompt is empty" in r.output, r.output
    assert not (tmp_path / "o.png").exists()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"evaluate:\n  extra_prompts:\n    - prompt: {json.dumps(prompt)}\n      images: [{control}]\n")
    r = _run("config", "show", "--config", cfg)
    assert r.exit_code == 2 and "evaluate.extra_prompts[0].prompt is empty" in r.output, r.output
