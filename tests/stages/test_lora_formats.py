"""LoRA files in other formats: `pipeline lora export --format comfyui` (keys + per-module alphas that ComfyUI's
Qwen-Image loader maps; diffusers' own converter for that format reproduces the trainer's prediction), and
`train.init_lora` from the diffusers, ComfyUI and kohya formats (the starting adapter is the file's delta)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.config import load_config
from train_store import make_train_store, mixed_specs, trainer_vs_stock

TRAIN = ["--set", "train.learning_rate=0.02", "--set", "train.lora.rank=4", "--set", "train.lora.alpha=8",
         "--set", "train.sigma.sampling=uniform", "--set", "train.checkpoint_every=2"]


def _cli(*args, code: int = 0) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == code, result.output
    return result.output


@pytest.fixture(scope="module")
def trained(tiny_edit_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    make_train_store(root / "store", tiny_edit_model, mixed_specs(6, 2))
    _cli("run", "train", "--store", root / "store", "--model", tiny_edit_model, "--out", root / "run",
         "--max-steps", 2, "--batch-size", 3, "--device", "cpu", *TRAIN)
    return root


def _trainer_and_stock(model: str, store: Path, lora_for_trainer: Path, lora_for_stock: Path):
    """(trainer's prediction with its LoRA, stock pipeline's prediction with `lora_for_stock`, stock base)."""
    from models.lora import load_lora
    from stages.train.recipe import setup_transformer

    cfg = load_config(None, {"train.lora.rank": 4, "train.lora.alpha": 8})
    ours_model = setup_transformer(model, cfg.train, torch.device("cpu")).eval()
    load_lora(ours_model, lora_for_trainer)
    return trainer_vs_stock(model, store, ours_model, lora_for_stock)

def test_comfyui_export_loads_in_diffusers_and_reproduces_the_trainer(trained, tiny_edit_model, tmp_path):
    out = tmp_path / "comfy.safetensors"
    _cli("lora", "export", trained / "run" / "lora", "--format", "comfyui", "--out", out)
    sd = load_file(out)
    assert all(k.startswith("diffusion_model.transformer_blocks.") for k in sd)
    alphas = {k: v for k, v in sd.items() if k.endswith(".alpha")}
    # the final LoRA has alpha / r folded into lora_up: alpha = rank here
    assert len(alphas) == 2 * 4 and all(v.ndim == 0 and float(v) == 4.0 for v in alphas.values())  # 2 blocks x 4
    assert {k.rsplit(".", 2)[-2] for k in sd if k.endswith(".weight")} == {"lora_down", "lora_up"}

    from diffusers import QwenImagePipeline

    converted = QwenImagePipeline.lora_state_dict(str(out))  # diffusers' converter for this format
    assert all(k.startswith("transformer.") and k.endswith(("lora_A.weight", "lora_B.weight")) for k in converted)
    # the trainer with its exact (unfolded, alpha 8) values of the last checkpoint
    ours, theirs, base = _trainer_and_stock(tiny_edit_model, trained / "store",
                                            trained / "run" / "checkpoints" / "step-2" / "lora", out)
    assert not torch.equal(theirs, base)
    torch.testing.assert_close(theirs, ours, rtol=1e-6, atol=1e-6)  # alpha/r baked into A and B: fp32 rounding
    _cli("lora", "export", trained / "run" / "lora", "--format", "a1111", "--out", out, code=2)


def _kohya(comfy: Path, out: Path) -> Path:
    """The same LoRA with kohya's flat `lora_unet_*` module names (what musubi/kohya scripts write)."""
    sd = load_file(comfy)
    renamed = {}
    for k, v in sd.items():
        module, suffix = k[len("diffusion_model."):].split(".lora_") if ".lora_" in k else (k[len("diffusion_model."):-len(".alpha")], None)
        name = "lora_unet_" + module.replace(".", "_")
        renamed[f"{name}.lora_{suffix}" if suffix else f"{name}.alpha"] = v
    save_file(renamed, out)
    return out


def test_init_lora_from_diffusers_comfyui_and_kohya_files(trained, tiny_edit_model, tmp_path):
    from diffusers import QwenImageEditPipeline

    from stages.train.recipe import setup

    src = trained / "run" / "lora"
    comfy = tmp_path / "comfy.safetensors"
    _cli("lora", "export", src, "--format", "comfyui", "--out", comfy)
    kohya = _kohya(comfy, tmp_path / "kohya.safetensors")
    assert next(iter(load_file(kohya))).startswith("lora_unet_transformer_blocks_")

    pipe = QwenImageEditPipeline.from_pretrained(tiny_edit_model)
    pipe.load_lora_weights(src, adapter_name="ref")
    ref = {n: m.get_delta_weight("ref") for n, m in pipe.transformer.named_modules() if hasattr(m, "get_delta_weight")}
    assert any(d.abs().max() > 0 for d in ref.values())
    # config alpha 4 (= rank) while the diffusers file says 8: the starting delta is still the file's
    for i, f in enumerate((src, comfy, kohya)):
        cfg = load_config(None, {"train.device": "cpu", "train.lora.rank": 4, "train.init_lora": str(f)})
        r = setup(cfg, trained / "store", tiny_edit_model, tmp_path / f"setup{i}", resume=False)
        mine = {n: m.get_delta_weight("default") for n, m in r.transformer.named_modules() if hasattr(m, "get_delta_weight")}
        assert mine.keys() == ref.keys()
        for n in ref:
            torch.testing.assert_close(mine[n], ref[n], rtol=1e-6, atol=1e-7)
        r.writer.close()

    # through the CLI: trains from the kohya file; a rank that does not match is one line naming the setting
    _cli("run", "train", "--store", trained / "store", "--model", tiny_edit_model, "--out", tmp_path / "run",
         "--max-steps", 1, "--device", "cpu", "--set", f"train.init_lora={kohya}", "--set", "train.lora.rank=4")
    out = _cli("run", "train", "--store", trained / "store", "--model", tiny_edit_model, "--out", tmp_path / "run2",
               "--max-steps", 1, "--device", "cpu", "--set", f"train.init_lora={kohya}", code=1)
    assert "train.lora.rank" in out


def _comfy_key_map(sd: dict[str, torch.Tensor]) -> dict:
    """ComfyUI's `comfy/lora.py::model_lora_keys_unet` for a QwenImage-family model (Comfy-Org/ComfyUI, the 2.1
    support): the generic `diffusion_model.<module>` names, then the QwenImage branch, where a fused 2.1
    `img_mlp.gate_up` is addressed by its halves `gate_layer` (rows [0, half)) and `proj` (rows [half, 2 half))."""
    key_map: dict = {}
    for k in sd:
        if k.startswith("diffusion_model.") and k.endswith(".weight"):
            key_map[k[: -len(".weight")]] = k
    for k in sd:
        if k.startswith("diffusion_model.") and k.endswith(".weight"):
            key_lora = k[len("diffusion_model."): -len(".weight")]
            targets = [(key_lora, k)]
            if key_lora.endswith(".img_mlp.gate_up"):
                half = sd[k].shape[0] // 2
                targets = [(key_lora.replace(".gate_up", ".gate_layer"), (k, (0, 0, half))),
                           (key_lora.replace(".gate_up", ".proj"), (k, (0, half, half)))]
            for key_lora, to in targets:
                key_map[key_lora] = to
                key_map[f"transformer.{key_lora}"] = to
    return key_map


def test_comfyui_export_21_maps_every_module_onto_comfyuis_fused_21_model(tiny_21_model, tmp_path):
    """A 2.1 LoRA on attention and the gated MLP: every exported key is one ComfyUI's loader maps for its 2.1 model
    (gate_layer / proj fused into gate_up); the weights ComfyUI patches (W += alpha / r * up @ down, on the
    half) give each layer the output of the stock transformer with the diffusers LoRA attached."""
    from models.loading import load_component

    torch.manual_seed(0)
    stock = load_component(tiny_21_model, "transformer").float().eval()
    modules = ["attn.to_q", "attn.to_out.0", "img_mlp.gate_layer", "img_mlp.proj", "img_mlp.out"]
    rank, lora = 2, {}
    for b in range(len(stock.transformer_blocks)):
        for m in modules:
            lin = stock.get_submodule(f"transformer_blocks.{b}.{m}")
            lora[f"transformer.transformer_blocks.{b}.{m}.lora_A.weight"] = torch.randn(rank, lin.in_features) * 0.1
            lora[f"transformer.transformer_blocks.{b}.{m}.lora_B.weight"] = torch.randn(lin.out_features, rank) * 0.1
    src = tmp_path / "lora21.safetensors"
    save_file(lora, src)
    out = tmp_path / "comfy21.safetensors"
    _cli("lora", "export", src, "--format", "comfyui", "--out", out)
    exported = load_file(out)

    # ComfyUI's 2.1 state dict: the diffusers names under diffusion_model., gate_layer and proj fused
    sd = {f"diffusion_model.{k}": v.clone() for k, v in stock.state_dict().items()}
    for b in range(len(stock.transformer_blocks)):
        p = f"diffusion_model.transformer_blocks.{b}.img_mlp."
        sd[p + "gate_up.weight"] = torch.cat([sd.pop(p + "gate_layer.weight"), sd.pop(p + "proj.weight")])
    key_map = _comfy_key_map(sd)
    names = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in exported}
    assert len(names) == len(modules) * len(stock.transformer_blocks)
    unmapped = sorted(n for n in names if n not in key_map)
    assert not unmapped, unmapped  # ComfyUI would skip these ("lora key not loaded")
    for n in names:
        to = key_map[n]
        key, (dim, start, length) = (to, (0, 0, None)) if isinstance(to, str) else to
        w = sd[key] if length is None else sd[key].narrow(dim, start, length)
        up, down = exported[f"{n}.lora_up.weight"], exported[f"{n}.lora_down.weight"]
        w += float(exported[f"{n}.alpha"]) / down.shape[0] * (up @ down)

    reference = load_component(tiny_21_model, "transformer").float().eval()
    reference.load_lora_adapter(str(src), prefix="transformer")  # diffusers' own loader, unmodified
    for b in range(len(stock.transformer_blocks)):
        gate_up = sd[f"diffusion_model.transformer_blocks.{b}.img_mlp.gate_up.weight"]
        half = gate_up.shape[0] // 2
        merged = {"img_mlp.gate_layer": gate_up[:half], "img_mlp.proj": gate_up[half:]}
        for m in modules:
            x = torch.randn(3, stock.get_submodule(f"transformer_blocks.{b}.{m}").in_features)
            w = merged.get(m, sd.get(f"diffusion_model.transformer_blocks.{b}.{m}.weight"))
            with torch.no_grad():
                theirs = reference.get_submodule(f"transformer_blocks.{b}.{m}")(x)
                base = stock.get_submodule(f"transformer_blocks.{b}.{m}")(x)
            assert not torch.allclose(theirs, base)
            torch.testing.assert_close(torch.nn.functional.linear(x, w), theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("oserror, says", [(13, "is not writable"), (28, "disk full")])
def test_export_that_cannot_write_is_one_line_and_leaves_no_temp_file(tmp_path, monkeypatch, oserror, says):
    """safetensors' writer fails with its own SafetensorError ("... (os error N) ..."), not an OSError: a read-only
    --out folder (os error 13/1/30) was a traceback, and a full disk mid-write left `.OUT.tmp` beside it."""
    import models.lora_export as lora_export
    from safetensors import SafetensorError

    src = tmp_path / "lora.safetensors"
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(2, 8),
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.ones(8, 2)}, src)
    text = {13: "Permission denied", 28: "No space left on device"}[oserror]

    def failing_save(state, path, metadata=None):
        Path(path).write_bytes(b"partial")  # what a write cut short leaves
        raise SafetensorError(f"Error while serializing: I/O error: {text} (os error {oserror}) at path {path}")

    monkeypatch.setattr(lora_export, "save_file", failing_save)
    out = tmp_path / "out" / "comfy.safetensors"
    result = CliRunner().invoke(app, ["lora", "export", str(src), "--format", "comfyui", "--out", str(out)])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert says in result.output and str(out.parent) in result.output, result.output
    assert list(out.parent.iterdir()) == []


def test_export_refuses_a_cut_lora_and_an_out_that_is_the_lora(tmp_path):
    """A file with a module's lora_B but not its lora_A exported without that module (no word: the ComfyUI file
    silently lacked it), a lone lora_A was a KeyError traceback, ranks that differ made a file no runtime applies;
    `--out` naming the LoRA itself replaced it with the export. Each is one line now and nothing is written."""
    q, k = "transformer.transformer_blocks.0.attn.to_q", "transformer.transformer_blocks.0.attn.to_k"
    whole = {f"{q}.lora_A.weight": torch.ones(2, 8), f"{q}.lora_B.weight": torch.ones(8, 2),
             f"{k}.lora_A.weight": torch.ones(2, 8), f"{k}.lora_B.weight": torch.ones(8, 2)}
    cases = {"lone-B": ({n: v for n, v in whole.items() if n != f"{k}.lora_A.weight"}, "only one of lora_A / lora_B"),
             "lone-A": ({n: v for n, v in whole.items() if n != f"{k}.lora_B.weight"}, "only one of lora_A / lora_B"),
             "ranks": ({**whole, f"{k}.lora_B.weight": torch.ones(8, 3)}, "different ranks (2 vs 3)")}
    for name, (state, says) in cases.items():
        src, out = tmp_path / f"{name}.safetensors", tmp_path / "out" / f"{name}-comfy.safetensors"
        save_file(state, src)
        result = CliRunner().invoke(app, ["lora", "export", str(src), "--out", str(out)])
        assert result.exit_code == 1 and says in result.output and "Traceback" not in result.output, result.output
        assert "transformer_blocks.0.attn.to_k" in result.output and not out.exists(), result.output
    src = tmp_path / "whole.safetensors"
    save_file(whole, src)
    before = src.read_bytes()
    for out in (src, tmp_path / "." / "whole.safetensors"):
        result = CliRunner().invoke(app, ["lora", "export", str(src), "--out", str(out)])
        assert result.exit_code == 1 and "is the LoRA being exported" in result.output, result.output
    assert src.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == [
        "lone-A.safetensors", "lone-B.safetensors", "ranks.safetensors", "whole.safetensors"]


def test_an_exported_lora_still_names_its_model_to_this_projects_loaders(tiny_21_model, tmp_path):
    """The export kept none of the metadata naming the model the LoRA was trained on: an Edit LoRA exported and
    merged (or predicted with) on a Qwen-Image-2.1 model of the same module shapes applied without a word, where
    the diffusers file is refused. ComfyUI ignores metadata; the export now carries both records over."""
    from safetensors import safe_open

    with safe_open(next((Path(tiny_21_model) / "transformer").glob("*.safetensors")), framework="pt") as f:
        out_dim, in_dim = f.get_slice("transformer_blocks.0.attn.to_q.weight").get_shape()
    q = "transformer.transformer_blocks.0.attn.to_q"
    src = tmp_path / "edit-lora.safetensors"
    save_file({f"{q}.lora_A.weight": torch.ones(2, in_dim), f"{q}.lora_B.weight": torch.ones(out_dim, 2)}, src,
              metadata={"format": "pt", "base_model_class": "QwenImageTransformer2DModel",
                        "base_model_fingerprint": "0123456789abcdef"})
    comfy = tmp_path / "comfy.safetensors"
    _cli("lora", "export", src, "--out", comfy)
    with safe_open(comfy, framework="pt") as f:
        assert f.metadata()["base_model_fingerprint"] == "0123456789abcdef"
    result = CliRunner().invoke(app, ["lora", "merge", "--model", tiny_21_model, "--lora", str(comfy),
                                      "--out", str(tmp_path / "merged")])
    assert result.exit_code == 1 and "a LoRA of another model family does not apply" in result.output, result.output
    assert not (tmp_path / "merged").exists()
    from models.lora import lora_base_fingerprint

    # the base record the fingerprint warning reads (the family refusal now comes first, before any load)
    assert lora_base_fingerprint(comfy) == "0123456789abcdef"
