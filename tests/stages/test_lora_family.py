"""A LoRA of one model family (Qwen-Image-2.1 vs the Edit models: different transformer classes) applied to the
other is refused in one line by predict and `lora merge`, whatever --strict-base says. The tiny models of the
two families happen to share module names and shapes (to_q... of 2 blocks, width 64), so without a record the
LoRA loaded silently and predict wrote an image from a meaningless adapter; on the real models the key mismatch
gave a line blaming the train.lora settings."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from safetensors import safe_open
from typer.testing import CliRunner


def _lora(model: str, out) -> str:
    from models.loading import load_component, model_fingerprint
    from models.lora import add_lora, save_lora
    from pipeline.config import load_config

    transformer = load_component(model, "transformer")
    add_lora(transformer, load_config(None, {"train.lora.rank": 4}).train.lora)
    save_lora(transformer, out, fold_alpha=True, base_fingerprint=model_fingerprint(model))
    return str(out)


@pytest.fixture(scope="module")
def loras(tiny_21_model, tiny_plus_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    return {"21": _lora(tiny_21_model, root / "l21"), "plus": _lora(tiny_plus_model, root / "lplus")}


def _cli(*args):
    from pipeline.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def test_the_lora_records_its_transformer_class(loras):
    with safe_open(f"{loras['21']}/pytorch_lora_weights.safetensors", framework="pt") as f:
        assert f.metadata()["base_model_class"] == "QwenImage21Transformer2DModel"
    with safe_open(f"{loras['plus']}/pytorch_lora_weights.safetensors", framework="pt") as f:
        assert f.metadata()["base_model_class"] == "QwenImageTransformer2DModel"


@pytest.mark.parametrize("lora,model", [("21", "plus"), ("plus", "21")])
def test_a_lora_of_another_family_is_refused_by_predict_and_merge(loras, tiny_21_model, tiny_plus_model, tmp_path,
                                                                  lora, model):
    """Refused from the folder's transformer/config.json before any component loads (minutes for the real
    model), and without the base-fingerprint warning first; before, after the whole pipeline had loaded."""
    from models.loading import LOAD_LOG
    from schemas.errors import UserError
    from stages.evaluate.other_base import warn_other_base

    model = {"21": tiny_21_model, "plus": tiny_plus_model}[model]
    ref = tmp_path / "ref.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(ref)
    out = tmp_path / "out.png"
    loaded = len(LOAD_LOG)
    result = _cli("predict", "--model", model, "--lora", loras[lora], "--image", ref, "--prompt", "x", "--steps", 2,
                  "--height", 64, "--width", 64, "--out", out)
    assert result.exit_code == 1 and not out.exists(), result.output
    [line] = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert "another model family" in line and "Transformer2DModel" in line, line
    assert "Traceback" not in result.output and "fingerprint" not in result.output, result.output
    assert LOAD_LOG[loaded:] == []

    merged = tmp_path / "merged"
    result = _cli("lora", "merge", "--model", model, "--lora", loras[lora], "--out", merged)
    assert result.exit_code == 1 and not merged.exists(), result.output
    assert "another model family" in result.output and LOAD_LOG[loaded:] == []
    with pytest.raises(UserError, match="another model family"):  # evaluate's check before it loads the model
        warn_other_base([loras[lora]], model)


def test_a_lora_of_the_same_family_still_applies(loras, tiny_21_model, tmp_path):
    ref = tmp_path / "ref.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 255, (64, 64, 4), dtype=np.uint8), "RGBA").save(ref)
    out = tmp_path / "out.png"
    result = _cli("predict", "--model", tiny_21_model, "--lora", loras["21"], "--image", ref, "--prompt", "x",
                  "--steps", 2, "--height", 64, "--width", 64, "--out", out)
    assert result.exit_code == 0 and out.is_file(), result.output


def test_train_init_lora_of_another_family_is_refused(loras, tiny_plus_model):
    from models.loading import load_component
    from models.lora import add_lora, init_from_lora
    from pipeline.config import load_config
    from schemas.errors import UserError

    transformer = load_component(tiny_plus_model, "transformer")
    add_lora(transformer, load_config(None, {"train.lora.rank": 4}).train.lora)
    with pytest.raises(UserError, match="another model family"):
        init_from_lora(transformer, loras["21"])
    init_from_lora(transformer, loras["plus"])  # its own family: starts from it


def test_a_store_of_one_family_never_trains_the_other(tiny_21_model, tiny_plus_model, plus_store, tmp_path):
    """A 2.1 store with an Edit-Plus --model, and an Edit-Plus store with a 2.1 --model: train refuses each in
    one line (the tables record the model that encoded them) and writes no LoRA."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_qwen21_stages import MIXED, write_store21

    from pipeline.config import load_config
    from stages.encode import text as encode_text
    from stages.encode import vae as encode_vae

    s21 = write_store21(tmp_path / "s21", MIXED[:2])
    cfg = load_config(None, {"encode_text.dtype": "float32", "encode_vae.dtype": "float32"})
    encode_text.run(cfg, s21, tiny_21_model)
    encode_vae.run(cfg, s21, tiny_21_model)
    encode_text.run(cfg, plus_store, tiny_plus_model)
    encode_vae.run(cfg, plus_store, tiny_plus_model)
    for store, model in ((s21, tiny_plus_model), (plus_store, tiny_21_model)):
        run_dir = tmp_path / f"run-{len(str(model))}-{store.name}"
        result = _cli("run", "train", "--store", store, "--model", model, "--out", run_dir, "--max-steps", 1,
                      "--device", "cpu")
        assert result.exit_code == 1, result.output
        [line] = [x for x in result.output.splitlines() if x.startswith("error:")]
        assert "built with a different model" in line and "Traceback" not in result.output
        assert not (run_dir / "lora").exists()


def test_a_store_holding_both_families_names_the_version_this_model_encoded(tiny_21_model, tiny_edit_model, tmp_path):
    """One store used by a 2.1 run and then by an Edit run with other resize settings (images v1 -> v2): the
    current text/vae are the Edit model's, encoded from images v2. Train with the 2.1 model is refused, and the line
    names the versions the 2.1 model encoded (from images v1) and resize-bucket as the way back to them. Before, it
    said only "re-run encode-text --model M21", which encodes the current images v2 (the Edit run's resize
    settings: its reference limit, its alpha handling) into a new table, unsaid."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_qwen21_stages import MIXED, write_store21

    from pipeline.config import load_config
    from stages.encode import text as encode_text
    from stages.encode import vae as encode_vae
    from store import Store

    store = write_store21(tmp_path / "s", MIXED[:3])
    cfg = load_config(None, {"encode_text.dtype": "float32", "encode_vae.dtype": "float32"})
    encode_text.run(cfg, store, tiny_21_model)
    encode_vae.run(cfg, store, tiny_21_model)
    write_store21(store, MIXED[:2])  # another run's resize-bucket: images v2, current
    encode_text.run(cfg, store, tiny_edit_model)
    encode_vae.run(cfg, store, tiny_edit_model)
    assert Store(store).tables() == {"images": 2, "text": 2, "vae": 2}
    result = _cli("run", "train", "--store", store, "--model", tiny_21_model, "--out", tmp_path / "run",
                  "--max-steps", 1, "--device", "cpu")
    assert result.exit_code == 1, result.output
    [line] = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert "built with a different model" in line and "Traceback" not in result.output, line
    assert "text v1" in line and "from images v1" in line and "current images v2" in line, line
    assert "pipeline run resize-bucket" in line, line


def test_an_encoder_on_another_runs_images_says_so_and_names_the_configs_version(tiny_21_model, tmp_path, capsys):
    """The same store, stage by stage: the 2.1 config's encode-text / encode-vae reading the current images
    version an Edit run's resize-bucket made (its reference limit, no alpha) while the 2.1 config's own version
    is there: one line each, naming the settings that differ and resize-bucket as the way to the config's version;
    the encoders still encode the current one. Before, not a word (the Edit run's samples, fewer references)."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_qwen21_stages import MIXED, write_store21

    from pipeline.config import load_config
    from stages.encode import text as encode_text
    from stages.encode import vae as encode_vae
    from stages.encode.other_images import config_resize

    cfg21 = load_config(None, {"encode_text.dtype": "float32", "encode_vae.dtype": "float32",
                               "resize.max_controls": 10, "resize.keep_alpha": True, "resize.vl_views": False})
    edit = load_config(None, {"resize.max_controls": 2})
    store = write_store21(tmp_path / "s", MIXED[:3], resize=config_resize(cfg21))
    write_store21(store, MIXED[:2], resize=config_resize(edit))  # the Edit run's resize-bucket: images v2, current
    capsys.readouterr()
    for encode, stage in ((encode_text, "encode-text"), (encode_vae, "encode-vae")):
        summary = encode.run(cfg21, store, tiny_21_model)
        assert summary.encoded == 2  # the current images v2, as before
        [line] = [x for x in capsys.readouterr().out.splitlines() if "other resize settings" in x]
        assert line.startswith(f"{stage}: the current images v2 ") and "images v1 with this config's" in line, line
        assert "resize.max_controls: 2 -> 10" in line and "pipeline run resize-bucket" in line, line
    summary = encode_text.run(edit, store, tiny_21_model)  # the current images' own config: nothing said
    assert "other resize settings" not in capsys.readouterr().out
