"""The final LoRA file: every loader applies the same weights (alpha folded into lora_B), its bytes are checked
against the record train sealed beside it and its values for being finite on every load (evaluate, predict,
lora merge, lora export, init_lora), and it names the base model it was trained on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from damage import flip_bit
from pipeline.cli import app
from pipeline.config import load_config
from train_store import make_train_store, mixed_specs

RANK, ALPHA = 4, 6  # alpha / r = 1.5: not a power of two, so a wrong scale cannot hide in rounding


def _cli(*args, code: int = 0) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return result.output


@pytest.fixture(scope="module")
def trained(tiny_edit_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("lorafiles")
    make_train_store(root / "store", tiny_edit_model, mixed_specs(6, 2))
    _cli("run", "train", "--store", root / "store", "--model", tiny_edit_model, "--out", root / "run",
         "--max-steps", 2, "--batch-size", 3, "--device", "cpu", "--set", "train.learning_rate=0.02",
         "--set", f"train.lora.rank={RANK}", "--set", f"train.lora.alpha={ALPHA}", "--set", "train.checkpoint_every=2")
    return root


def _deltas(module) -> dict[str, torch.Tensor]:
    out = {}
    for name, m in module.named_modules():
        if hasattr(m, "get_delta_weight") and m.active_adapters:
            out[name.removeprefix("transformer.")] = m.get_delta_weight(m.active_adapters[0]).detach().float()
    return out


def _file_convention(path: Path) -> dict[str, torch.Tensor]:
    """What ComfyUI's loader (comfy/lora.py: `transformer.<module>.lora_B.weight` keys, scale = `<module>.alpha` / rank,
    1.0 without an alpha key) and musubi-tuner's converter ("Diffusers has no alpha, so alpha is set to rank")
    apply: both ignore the safetensors metadata."""
    sd = load_file(path)
    out = {}
    for key, a in sd.items():
        if key.endswith(".lora_A.weight"):
            module = key[: -len(".lora_A.weight")]
            alpha = sd.get(f"{module}.alpha")
            scale = float(alpha) / a.shape[0] if alpha is not None else 1.0
            out[module.removeprefix("transformer.")] = (sd[f"{module}.lora_B.weight"].float() @ a.float()) * scale
    return out


def test_every_loader_applies_the_same_weights(trained, tiny_edit_model):
    from diffusers import QwenImageEditPipeline

    from models.lora import load_lora, lora_state_dict
    from stages.train.recipe import setup_transformer

    final = trained / "run" / "lora" / "pytorch_lora_weights.safetensors"
    checkpoint = trained / "run" / "checkpoints" / "step-2" / "lora"
    # the trainer's own adapter (config alpha 6) holding the exact trained values of the last checkpoint
    cfg = load_config(None, {"train.lora.rank": RANK, "train.lora.alpha": ALPHA})
    ours = setup_transformer(tiny_edit_model, cfg.train, torch.device("cpu"))
    load_lora(ours, checkpoint)
    trainer = _deltas(ours)
    assert any(d.abs().max() > 0 for d in trainer.values())

    pipe = QwenImageEditPipeline.from_pretrained(tiny_edit_model)
    pipe.load_lora_weights(final.parent, adapter_name="ref")
    diffusers_deltas = _deltas(pipe.transformer)
    # diffusers holds the file's tensors bit for bit (metadata: alpha = r, scale 1)
    held = lora_state_dict(pipe.transformer, "ref")
    file_tensors = {k.removeprefix("transformer."): v for k, v in load_file(final).items()}
    assert held.keys() == file_tensors.keys() and all(torch.equal(held[k], file_tensors[k]) for k in held)
    comfy = _file_convention(final)
    assert trainer.keys() == diffusers_deltas.keys() == comfy.keys()
    for name in trainer:
        torch.testing.assert_close(diffusers_deltas[name], trainer[name], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(comfy[name], trainer[name], rtol=1e-6, atol=1e-7)
    # the unfolded checkpoint file is what metadata-blind loaders got before: 1.5x too weak there
    unfolded = _file_convention(checkpoint / "pytorch_lora_weights.safetensors")
    name = next(n for n in trainer if trainer[n].abs().max() > 0)
    torch.testing.assert_close(unfolded[name] * ALPHA / RANK, trainer[name], rtol=1e-5, atol=1e-7)

    with safe_open(final, framework="pt") as f:
        meta = f.metadata()
    assert meta["base_model_fingerprint"] and json.loads(meta["lora_adapter_metadata"])["transformer.lora_alpha"] == RANK


def test_a_flipped_bit_or_a_nan_in_the_lora_is_refused_by_every_command(trained, tiny_edit_model, tmp_path):
    import shutil

    from PIL import Image

    good = trained / "run" / "lora"
    flipped = tmp_path / "flipped"
    shutil.copytree(good, flipped)
    weights = flipped / "pytorch_lora_weights.safetensors"
    # a high exponent bit of one value: 1e36-like, finite, so only the checksum can tell
    size = weights.stat().st_size
    flip_bit(weights, size - 2, 6)
    nan = tmp_path / "nan"
    shutil.copytree(good, nan)
    sd = load_file(nan / "pytorch_lora_weights.safetensors")
    with safe_open(nan / "pytorch_lora_weights.safetensors", framework="pt") as f:
        meta = f.metadata()
    key = next(k for k in sd if k.endswith("lora_A.weight"))
    sd[key][0, 0] = float("nan")
    (nan / "checksums.json").unlink()  # e.g. a copy of the file alone: the finite check still holds
    save_file(sd, nan / "pytorch_lora_weights.safetensors", metadata=meta)

    img = tmp_path / "in.png"
    Image.new("RGB", (64, 48), (200, 10, 10)).save(img)
    for bad, expect in ((flipped, "damaged"), (nan, "NaN or infinite")):
        runs = {
            "evaluate": ["run", "evaluate", "--store", trained / "store", "--model", tiny_edit_model, "--lora", bad,
                         "--out", tmp_path / f"eval-{bad.name}", "--set", "evaluate.device=cpu"],
            "predict": ["predict", "--model", tiny_edit_model, "--image", img, "--prompt", "x", "--steps", "2",
                        "--lora", bad, "--out", tmp_path / f"{bad.name}.png"],
            "merge": ["lora", "merge", "--model", tiny_edit_model, "--lora", bad, "--out", tmp_path / f"merged-{bad.name}"],
            "export": ["lora", "export", bad, "--out", tmp_path / f"{bad.name}.safetensors"],
            "init_lora": ["run", "train", "--store", trained / "store", "--model", tiny_edit_model, "--out",
                          tmp_path / f"init-{bad.name}", "--max-steps", 1, "--device", "cpu",
                          "--set", f"train.init_lora={bad}", "--set", f"train.lora.rank={RANK}"],
        }
        for what, args in runs.items():
            out = _cli(*args, code=1)
            assert expect in out, (what, out)
        assert not (tmp_path / f"{bad.name}.png").exists() and not (tmp_path / f"{bad.name}.safetensors").exists()
        assert not (tmp_path / f"merged-{bad.name}").exists()
        assert not (tmp_path / f"init-{bad.name}" / "lora").exists()


def test_a_lora_of_another_base_model_warns_or_is_refused(trained, tiny_edit_model, tiny_plus_model, tmp_path):
    from PIL import Image

    img = tmp_path / "in.png"
    Image.new("RGB", (64, 48), (200, 10, 10)).save(img)
    lora = trained / "run" / "lora"
    args = ["predict", "--model", tiny_plus_model, "--image", img, "--prompt", "x", "--steps", "2", "--lora", lora]
    out = _cli(*args, "--strict-base", "--out", tmp_path / "a.png", code=1)
    assert "fingerprint" in out and not (tmp_path / "a.png").exists()
    out = _cli("lora", "merge", "--model", tiny_plus_model, "--lora", lora, "--out", tmp_path / "m", "--strict-base",
               code=1)
    assert "trained on a base model" in out and not (tmp_path / "m").exists()
    # the same model: no warning
    out = _cli("lora", "merge", "--model", tiny_edit_model, "--lora", lora, "--out", tmp_path / "m2")
    assert "warning" not in out



def test_a_lora_of_another_model_family_is_one_line(tiny_edit_model, tmp_path):
    """A LoRA for modules this model does not have (here a Flux-style `single_transformer_blocks` file): predict
    and lora merge stop with one line naming it, not peft's NoMatchingPeftModuleError traceback."""
    from PIL import Image

    img = tmp_path / "in.png"
    Image.new("RGB", (64, 48), (200, 10, 10)).save(img)
    lora = tmp_path / "flux.safetensors"
    save_file({"transformer.single_transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 32),
               "transformer.single_transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(32, 4)}, lora)
    for args in (["predict", "--model", tiny_edit_model, "--image", img, "--prompt", "x", "--steps", "2",
                  "--lora", lora, "--out", tmp_path / "a.png"],
                 ["lora", "merge", "--model", tiny_edit_model, "--lora", lora, "--out", tmp_path / "m"]):
        out = _cli(*args, code=1)
        assert f"error: LoRA {lora} adapts modules this model does not have" in out, out
        assert "made for another model" in out
    assert not (tmp_path / "a.png").exists() and not (tmp_path / "m").exists()


def test_init_lora_summary_and_a_refusal_that_prints_the_list_to_paste(trained, tiny_edit_model, tmp_path):
    lora = trained / "run" / "lora"
    base = ["run", "train", "--store", trained / "store", "--model", tiny_edit_model, "--max-steps", 1,
            "--device", "cpu", "--set", f"train.init_lora={lora}", "--set", f"train.lora.rank={RANK}"]
    out = _cli(*base, "--out", tmp_path / "a", "--set", "train.lora.target_modules=[to_q]", code=1)
    assert "--set 'train.lora.target_modules=[" in out
    paste = out.split("--set '", 1)[1].split("'", 1)[0]
    assert paste.startswith("train.lora.target_modules=[") and "to_out.0" in paste
    out = _cli(*base, "--out", tmp_path / "b", "--set", paste)
    assert "trained from init_lora" in out and "from scratch" not in out


def test_a_checkpoint_lora_is_checked_against_its_resume_json(trained, tmp_path):
    import shutil

    from schemas.errors import UserError
    from store.checksum import check_recorded

    ck = tmp_path / "step-2"
    shutil.copytree(trained / "run" / "checkpoints" / "step-2", ck)
    weights = ck / "lora" / "pytorch_lora_weights.safetensors"
    check_recorded(weights)  # intact
    flip_bit(weights, weights.stat().st_size - 3, 1)
    with pytest.raises(UserError, match="resume.json"):
        check_recorded(weights)
    (ck / "resume.json").write_text(json.dumps({"step": 2}))  # a record from before checksums: not refused
    check_recorded(weights)


def test_a_resume_json_cut_short_before_its_checksum_is_damaged_not_a_legacy_record(trained, tmp_path):
    """A sealed resume.json cut short before its `checksum` field has no checksum, as a record from before
    checksums has none: it passed as one, so evaluate --all-checkpoints used the checkpoint's LoRA unchecked.
    No JSON at all is no such record: refused, naming the record."""
    import shutil

    from schemas.errors import UserError
    from store.checksum import check_recorded

    ck = tmp_path / "step-2"
    shutil.copytree(trained / "run" / "checkpoints" / "step-2", ck)
    weights = ck / "lora" / "pytorch_lora_weights.safetensors"
    record = ck / "resume.json"
    cut = record.read_bytes()[: record.read_bytes().index(b'"checksum"')]
    record.write_bytes(cut)
    flip_bit(weights, weights.stat().st_size - 3, 1)
    with pytest.raises(UserError, match="resume.json is damaged"):
        check_recorded(weights)
