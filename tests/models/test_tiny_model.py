"""The tiny model is a real diffusers folder: plain diffusers loads it (no project import) and it runs."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

from models.loading import ModelNotFoundError, load_component, model_variant, resolve_model
from models.tiny import make_tiny_model
from schemas.errors import UserError
import warm_start

# Runs in a new process (started warm: tests/warm_start.py preloads only third-party libraries) so that nothing
# from this project is imported.
_LOAD_AND_RUN = r"""
import sys, numpy as np, torch
from PIL import Image
import diffusers
import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as edit
import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus
# The control's views at 256² rather than the stock ~1024² (Edit: its one view, text encoder and VAE; Edit-Plus: the
# VAE's, its module constant, as tests/stages/test_encode_from_source_files.py sets it): ~4k control tokens went
# through every step (and Edit's VL encoder saw ~5k patches); the output's size is given, and the views' sizes
# are nothing this run checks
dims = edit.calculate_dimensions
edit.calculate_dimensions = lambda area, ratio: dims(min(area, 256 * 256), ratio)
plus.VAE_IMAGE_SIZE = 256 * 256
cls = getattr(diffusers, sys.argv[2])
pipe = cls.from_pretrained(sys.argv[1])
assert type(pipe.processor).__name__ == "Qwen2VLProcessor", type(pipe.processor)
assert pipe.vae_scale_factor == 8
img = Image.fromarray((np.random.RandomState(0).rand(64, 96, 3) * 255).astype("uint8"))
images = [img, img.resize((64, 64))] if "Plus" in sys.argv[2] else img
out = pipe(image=images, prompt="make the square red", negative_prompt="blurry", true_cfg_scale=2.0,
           height=64, width=96, num_inference_steps=2, output_type="np",
           generator=torch.Generator().manual_seed(0))
assert out.images.shape == (1, 64, 96, 3), out.images.shape
assert np.isfinite(out.images).all()
assert not any(m.startswith(("models", "pipeline", "stages", "store", "schemas")) for m in sys.modules), "project import"
print("OK")
"""


@pytest.mark.parametrize(
    "fixture,cls", [("tiny_edit_model", "QwenImageEditPipeline"), ("tiny_plus_model", "QwenImageEditPlusPipeline")]
)
def test_tiny_model_loads_with_plain_diffusers_and_runs(request, fixture, cls):
    folder = request.getfixturevalue(fixture)
    proc = warm_start.run([sys.executable, "-c", _LOAD_AND_RUN, folder, cls], cwd="/", timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.rglob("*"))
        if f.is_file()
    }


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = make_tiny_model(tmp_path / "a", "edit", seed=3)
    b = make_tiny_model(tmp_path / "b", "edit", seed=3)
    c = make_tiny_model(tmp_path / "c", "edit", seed=4)
    da, db, dc = _digest(a), _digest(b), _digest(c)
    assert da == db
    assert da["transformer/diffusion_pytorch_model.safetensors"] != dc["transformer/diffusion_pytorch_model.safetensors"]


def test_loader_reads_components_and_variant(tiny_edit_model, tiny_plus_model):
    assert model_variant(tiny_edit_model) == "edit"
    assert model_variant(tiny_plus_model) == "edit-plus"
    vae = load_component(tiny_edit_model, "vae")
    assert 2 ** len(vae.temperal_downsample) == 8
    tr = load_component(tiny_edit_model, "transformer")
    assert tr.config.axes_dims_rope == [8, 12, 12] or tuple(tr.config.axes_dims_rope) == (8, 12, 12)


def test_missing_model_offline_names_id_and_suggests_make_tiny_model(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    resolve_model.cache_clear()
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("Qwen/Qwen-Image-Edit-does-not-exist")
    assert "Qwen/Qwen-Image-Edit-does-not-exist" in str(e.value) and "make-tiny-model" in str(e.value)
    with pytest.raises(ModelNotFoundError, match="make-tiny-model"):
        resolve_model("./no/such/folder")


def test_cli_make_tiny_model_matches_function(tmp_path, tiny_plus_model):
    from typer.testing import CliRunner

    from pipeline.cli import app

    r = CliRunner().invoke(app, ["make-tiny-model", str(tmp_path / "m"), "--variant", "edit-plus", "--seed", "0"])
    assert r.exit_code == 0, r.output
    assert _digest(tmp_path / "m") == _digest(Path(tiny_plus_model))
    r = CliRunner().invoke(app, ["make-tiny-model", str(tmp_path / "x"), "--variant", "bogus"])
    assert r.exit_code != 0


def test_fingerprint_sees_a_change_in_the_middle_of_a_large_weight_file(tmp_path, tiny_edit_model):
    import shutil

    from models.loading import model_fingerprint

    a = tmp_path / "a"
    shutil.copytree(tiny_edit_model, a)
    big = a / "transformer" / "extra.safetensors"
    big.write_bytes(bytes(6 << 20))
    before = model_fingerprint(str(a))
    b = tmp_path / "b"
    shutil.copytree(a, b)
    data = bytearray((b / "transformer" / "extra.safetensors").read_bytes())
    data[(6 << 20) // 2 + 123] ^= 0xFF  # one byte, far from both ends
    (b / "transformer" / "extra.safetensors").write_bytes(bytes(data))
    assert model_fingerprint(str(b)) != before
    assert model_fingerprint(str(a)) == before


@pytest.mark.parametrize("pipeline", ["QwenImageLayeredPipeline", "QwenImagePipeline", "QwenImageEditInpaintPipeline"])
def test_a_model_of_another_qwen_image_pipeline_is_refused_not_taken_for_edit(tiny_edit_model, tmp_path, pipeline):
    """Qwen-Image-Layered (its processor, Qwen2.5-VL, QwenImageTransformer2DModel and VAE classes are the Edit
    model's) or the text-to-image Qwen-Image: any model_index class without "Plus" was the Edit variant, so such a
    model encoded and trained as Qwen-Image-Edit without a word. Refused in one line naming its class."""
    import json

    model = tmp_path / "other"
    model.mkdir()
    for entry in Path(tiny_edit_model).iterdir():
        if entry.name != "model_index.json":
            (model / entry.name).symlink_to(entry)
    index = json.loads((Path(tiny_edit_model) / "model_index.json").read_text())
    (model / "model_index.json").write_text(json.dumps({**index, "_class_name": pipeline}))
    with pytest.raises(UserError, match=f"{pipeline}.*QwenImageEditPipeline") as e:
        model_variant(str(model))
    assert "\n" not in str(e.value)
