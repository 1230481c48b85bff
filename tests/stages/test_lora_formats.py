"""LoRA files in other formats: `pipeline lora export --format comfyui` (keys + per-module alphas that ComfyUI's
Qwen-Image loader maps; diffusers' own converter for that format reproduces the trainer's prediction), and
`train.init_lora` from the diffusers, ComfyUI and kohya formats (the starting adapter is the file's delta)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.config import load_config
from train_store import make_train_store, mixed_specs, trainer_vs_stock
import warm_start

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
        assert result.exit_code == 2 and "is the LoRA being exported" in result.output, result.output
    assert src.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == [
        "lone-A.safetensors", "lone-B.safetensors", "ranks.safetensors", "whole.safetensors"]


def test_export_refuses_an_out_that_is_the_weight_file_of_a_lora_folder_named_like_a_file(tmp_path):
    """A LoRA folder whose name ends in .safetensors: --out naming the weight file inside it is the LoRA being
    exported, with --overwrite too (the command line's one check took the folder's name for the weight file)."""
    from models.lora_files import WEIGHT_NAME

    q = "transformer.transformer_blocks.0.attn.to_q"
    folder = tmp_path / "mine.safetensors"
    folder.mkdir()
    save_file({f"{q}.lora_A.weight": torch.ones(2, 8), f"{q}.lora_B.weight": torch.ones(8, 2)}, folder / WEIGHT_NAME)
    before = (folder / WEIGHT_NAME).read_bytes()
    result = CliRunner().invoke(app, ["lora", "export", str(folder), "--out", str(folder / WEIGHT_NAME),
                                      "--overwrite"])
    assert result.exit_code == 2 and "is the LoRA being exported" in result.output, result.output
    assert (folder / WEIGHT_NAME).read_bytes() == before


def test_export_refuses_a_lora_with_no_weight_pairs(tmp_path):
    """A LoRA file of no tensors exported an empty ComfyUI file and reported success: one line naming the file now,
    and nothing is written."""
    src, out = tmp_path / "empty.safetensors", tmp_path / "out" / "empty-comfy.safetensors"
    save_file({}, src, metadata={"format": "pt"})
    result = CliRunner().invoke(app, ["lora", "export", str(src), "--out", str(out)])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert f"{src}: no lora_A / lora_B weight pairs" in result.output.replace("\n", ""), result.output
    assert not out.exists() and not out.parent.exists()


def test_export_checks_its_out_once_on_the_command_line_and_export_lora_still_checks_it(tmp_path, monkeypatch):
    """`lora export` checked --out on the command line, then again inside `export_lora`: once per command now,
    and `export_lora`'s other callers are still refused an --out that is the LoRA."""
    import models.lora_export as lora_export
    import models.lora_files as lora_files
    from schemas.errors import UserError

    q = "transformer.transformer_blocks.0.attn.to_q"
    src, out = tmp_path / "lora.safetensors", tmp_path / "comfy.safetensors"
    save_file({f"{q}.lora_A.weight": torch.ones(2, 8), f"{q}.lora_B.weight": torch.ones(8, 2)}, src)
    checks, real = [], lora_files.check_export_out
    spy = lambda *a: checks.append(a) or real(*a)  # noqa: E731
    monkeypatch.setattr(lora_files, "check_export_out", spy)
    monkeypatch.setattr(lora_export, "check_export_out", spy)
    _cli("lora", "export", src, "--out", out)
    assert len(checks) == 1 and out.is_file(), checks
    with pytest.raises(UserError, match="is the LoRA being exported"):
        lora_export.export_lora(src, "comfyui", src, overwrite=True)
    assert len(checks) == 2


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


def test_export_keeps_an_existing_out_file_unless_told_and_never_replaces_a_runs_own(tmp_path, monkeypatch):
    """`--out` naming an existing file (the user's other LoRA, any file) was replaced by the export without a
    word. Now one line naming it and --overwrite, the file as it was, exit 2 (a mistake on the command line, as
    merge's used --out; it was 1); --overwrite replaces it (whole, by a rename). The LoRA being exported and a run's own sealed weights (RUN/lora, a checkpoint's) stay refused even
    with --overwrite; a file made at --out while the export was written is not replaced either."""
    import models.lora_export as lora_export
    from models.lora import WEIGHT_NAME
    from store.checksum import folder_checksums, seal, write_folder_record

    q = "transformer.transformer_blocks.0.attn.to_q"
    src = tmp_path / "lora.safetensors"
    save_file({f"{q}.lora_A.weight": torch.ones(2, 8), f"{q}.lora_B.weight": torch.ones(8, 2)}, src)

    def export(out: Path, *flags: str):
        return CliRunner().invoke(app, ["lora", "export", str(src), "--out", str(out), *flags])

    other = tmp_path / "my-other-lora.safetensors"
    other.write_bytes(b"the user's other LoRA")
    result = export(other)  # a mistake on the command line: exit 2, as merge's --out that is not empty
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    line = " ".join(result.output.split())
    assert f"--out {other} exists" in line and "--overwrite" in line, result.output
    assert other.read_bytes() == b"the user's other LoRA"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora.safetensors", "my-other-lora.safetensors"]
    assert export(other, "--overwrite").exit_code == 0
    assert set(load_file(other)) == {f"diffusion_model.transformer_blocks.0.attn.to_q.{k}"
                                     for k in ("lora_down.weight", "lora_up.weight", "alpha")}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora.safetensors", "my-other-lora.safetensors"]

    folder = tmp_path / "folder.safetensors"
    folder.mkdir()
    result = export(folder, "--overwrite")
    assert result.exit_code == 2 and "is a folder" in result.output and "Traceback" not in result.output, result.output
    folder.rmdir()

    # the LoRA being exported, and a run's own weights (a final LoRA's checksums.json, a checkpoint's resume.json)
    before = src.read_bytes()
    result = export(src, "--overwrite")
    assert result.exit_code == 2 and "is the LoRA being exported" in result.output and src.read_bytes() == before
    final, step = tmp_path / "run" / "lora", tmp_path / "run" / "checkpoints" / "step-2"
    for folder in (final, step / "lora"):
        folder.mkdir(parents=True)
        (folder / WEIGHT_NAME).write_bytes(b"a run's weights")
    write_folder_record(final)
    (step / "resume.json").write_bytes(seal({"files": folder_checksums(step)}))
    for weights in (final / WEIGHT_NAME, step / "lora" / WEIGHT_NAME):
        result = export(weights, "--overwrite")
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert "is a run's own file" in " ".join(result.output.split()) and weights.read_bytes() == b"a run's weights"

    # a file made at --out after the export looked (another process): kept, and no temp file left
    late = tmp_path / "late" / "comfy.safetensors"
    real = lora_export.canonicalize

    def another_writer_meanwhile(path, *a, **k):
        real(path, *a, **k)
        late.write_bytes(b"written meanwhile")

    monkeypatch.setattr(lora_export, "canonicalize", another_writer_meanwhile)
    result = export(late)
    assert result.exit_code == 1 and f"--out {late} exists" in " ".join(result.output.split()), result.output
    assert late.read_bytes() == b"written meanwhile" and [p.name for p in late.parent.iterdir()] == [late.name]


def test_a_runs_own_file_is_found_by_a_relative_out_and_a_relative_lora_too(tmp_path, monkeypatch):
    """The sealed record covering a file was looked up by walking its path's names up: from a relative path that
    stopped at "." (`Path(".").parent` is "."), so `--out adapter weights` named from inside a checkpoint's lora/
    missed the checkpoint's resume.json and --overwrite replaced the checkpoint's weights; and `--out ../x` from
    inside RUN/lora (a new file beside the run) was looked up in RUN/lora's checksums.json: a ValueError traceback.
    check_recorded walked the same way: a damaged checkpoint named from inside its lora/ passed."""
    from models.lora import WEIGHT_NAME
    from schemas.errors import UserError
    from store.checksum import check_recorded, folder_checksums, seal, write_folder_record

    q = "transformer.transformer_blocks.0.attn.to_q"
    state = {f"{q}.lora_A.weight": torch.ones(2, 8), f"{q}.lora_B.weight": torch.ones(8, 2)}
    other = tmp_path / "other.safetensors"
    save_file(state, other)
    final, step = tmp_path / "run" / "lora", tmp_path / "run" / "checkpoints" / "step-2"
    for folder in (final, step / "lora"):
        folder.mkdir(parents=True)
        save_file(state, folder / WEIGHT_NAME)
    write_folder_record(final)
    (step / "resume.json").write_bytes(seal({"files": folder_checksums(step)}))
    weights = (step / "lora" / WEIGHT_NAME).read_bytes()

    monkeypatch.chdir(step / "lora")
    result = CliRunner().invoke(app, ["lora", "export", str(other), "--out", WEIGHT_NAME, "--overwrite"])
    assert result.exit_code == 2 and "is a run's own file" in " ".join(result.output.split()), (
        result.output, result.exception)
    assert (step / "lora" / WEIGHT_NAME).read_bytes() == weights and os.listdir(".") == [WEIGHT_NAME]
    (step / "lora" / WEIGHT_NAME).write_bytes(weights[:-1] + bytes([weights[-1] ^ 1]))
    with pytest.raises(UserError, match="damaged"):
        check_recorded(Path(WEIGHT_NAME))

    monkeypatch.chdir(final)
    result = CliRunner().invoke(app, ["lora", "export", ".", "--out", "../comfy.safetensors"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert set(load_file(tmp_path / "run" / "comfy.safetensors")) == {
        f"diffusion_model.transformer_blocks.0.attn.to_q.{k}" for k in ("lora_down.weight", "lora_up.weight", "alpha")}
    check_recorded(Path("../comfy.safetensors"))  # no record names it: nothing to check, no traceback


def _writing(p: Path) -> bool:
    """`p` (beside --out) an export's temp file, or its temp folder with a file in it (safetensors' `.tmpXXXX` or
    the LoRA's name): the folder alone is made before its LoRA is read, nothing written yet."""
    if not p.name.startswith(".lora.safetensors."):
        return False
    return not p.is_dir() or any(p.iterdir())


def test_two_exports_to_one_out_never_link_in_the_others_lora(tmp_path, monkeypatch):
    """Every export to one --out wrote the same temp name (`.NAME.tmp`): a second export started meanwhile
    renamed its file over the first one's finished temp file, which the first then linked in as --out, saying it
    wrote its LoRA: --out held the other LoRA (the one the user's second command was refused for, or killed).
    Here the other is a real process, killed once its export is in its temp file (its own temp folder holds a
    file: before, this export's own folder ended the wait at once, the other killed before it wrote anything)."""
    import signal
    import subprocess
    import sys
    import time

    import models.lora_export as lora_export

    q = "transformer.transformer_blocks.{}.attn.to_q"
    mine, big = tmp_path / "mine.safetensors", tmp_path / "big.safetensors"
    save_file({f"{q.format(0)}.lora_A.weight": torch.ones(2, 8), f"{q.format(0)}.lora_B.weight": torch.ones(8, 2)},
              mine)
    save_file({f"{q.format(i)}.lora_{ab}.weight": torch.rand(*shape) for i in range(16)
               for ab, shape in (("A", (256, 4096)), ("B", (4096, 256)))}, big)  # 128 MB: written for a while
    out = tmp_path / "comfy" / "lora.safetensors"
    out.parent.mkdir()
    real, exported = lora_export.canonicalize, {}

    def the_other_writes_meanwhile(path, *a, **k):
        real(path, *a, **k)
        exported["bytes"], mine_stat = Path(path).read_bytes(), _stat(Path(path))
        other = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "lora", "export", str(big), "--out", str(out)],
                                 env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and other.poll() is None:
                if _stat(Path(path)) != mine_stat or any(_writing(p) for p in out.parent.iterdir()
                                                          if p != Path(path).parent):
                    break  # its export is in its temp file: its own folder (not this one's) holds a file
                time.sleep(0.001)
            else:
                pytest.fail(f"the other export did not start writing (exit {other.poll()})")
        finally:
            other.send_signal(signal.SIGKILL)
            other.wait()

    monkeypatch.setattr(lora_export, "canonicalize", the_other_writes_meanwhile)
    lora_export.export_lora(mine, "comfyui", out)
    assert out.read_bytes() == exported["bytes"]  # what this export wrote, whole


def _stat(path: Path) -> tuple[int, int, int]:
    try:
        st = path.stat()
    except FileNotFoundError:
        return (0, 0, 0)
    return st.st_ino, st.st_size, st.st_mtime_ns


def test_a_killed_exports_temp_is_removed_by_the_next_export_and_a_live_ones_kept(tmp_path):
    """A SIGKILLed export left its temp file beside --out for good (safetensors' own `.tmpXXXXXX`, a LoRA's size,
    named by no rule anyone could tell was litter). Now each export writes in a pid-named folder of its own, and
    the next export to that --out removes a dead writer's folder; a live writer's is kept."""
    import signal
    import subprocess
    import sys
    import time

    import models.lora_export as lora_export

    q = "transformer.transformer_blocks.0.attn.to_q"
    src = tmp_path / "lora.safetensors"
    save_file({f"{q}.lora_A.weight": torch.rand(4, 64), f"{q}.lora_B.weight": torch.rand(64, 4)}, src)
    out, ready = tmp_path / "comfy" / "lora.safetensors", tmp_path / "ready"
    stuck = ("import sys, time, pathlib\nimport models.lora_export as e\n"
             "def stuck(path, *a, **k):\n    ready = pathlib.Path(sys.argv[3])\n"
             "    ready.with_suffix('.part').write_text(str(path))\n    ready.with_suffix('.part').rename(ready)\n"
             "    time.sleep(600)\n"
             "e.canonicalize = stuck\ne.export_lora(sys.argv[1], 'comfyui', sys.argv[2])\n")
    # started warm (tests/warm_start.py: models.lora_export imports torch cold); a process and pid of its own
    killed = warm_start.WarmProcess([sys.executable, "-c", stuck, str(src), str(out), str(ready)],
                                    env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # imports nothing heavy
    try:
        deadline = time.monotonic() + 120
        # the killed one's file is written, in its temp folder; `ready` appears whole (renamed in: a file seen
        # between its creation and its write read as '' once under load)
        while not ready.exists():
            assert killed.poll() is None and time.monotonic() < deadline, killed.returncode
            time.sleep(0.01)
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert Path(ready.read_text()).is_file()  # what the kill leaves beside --out
        live_folder = out.with_name(f".{out.name}.tmp-{live.pid}")
        live_folder.mkdir()
        lora_export.export_lora(src, "comfyui", out)
        assert sorted(p.name for p in out.parent.iterdir()) == sorted([out.name, live_folder.name])
        clean = tmp_path / "clean" / "lora.safetensors"
        lora_export.export_lora(src, "comfyui", clean)
        assert out.read_bytes() == clean.read_bytes()
    finally:
        killed.kill()
        live.kill()
        live.wait()


def test_a_comfyui_21_export_reads_back_in_this_projects_loaders_with_every_module(tiny_21_model, tmp_path):
    """The 2.1 export writes the MLP halves as `transformer.<module>.lora_down/up/alpha` (ComfyUI maps them only so).
    diffusers' converter prefixes those `transformer.` once more: its own loader drops them (a logged "unexpected
    keys"), and this project's loaders refused the file it had written ("does not match the adapter"). Read back
    now, every module applies the source's delta (alpha 6 over rank 2, from the source's adapter config)."""
    import json

    from models.loading import load_component
    from models.lora import attach_lora

    torch.manual_seed(0)
    stock = load_component(tiny_21_model, "transformer").float().eval()
    modules = [f"transformer_blocks.{b}.{m}" for b in range(len(stock.transformer_blocks))
               for m in ("attn.to_q", "img_mlp.gate_layer", "img_mlp.proj")]
    lora = {}
    for m in modules:
        lin = stock.get_submodule(m)
        lora[f"transformer.{m}.lora_A.weight"] = torch.randn(2, lin.in_features) * 0.1
        lora[f"transformer.{m}.lora_B.weight"] = torch.randn(lin.out_features, 2) * 0.1
    config = {"transformer.r": 2, "transformer.lora_alpha": 6, "transformer.peft_type": "LORA",
              "transformer.target_modules": ["to_q", "gate_layer", "proj"]}
    src = tmp_path / "lora21.safetensors"
    save_file(lora, src, metadata={"format": "pt", "lora_adapter_metadata": json.dumps(config)})
    out = tmp_path / "comfy21.safetensors"
    _cli("lora", "export", src, "--format", "comfyui", "--out", out)
    assert any(k.startswith("transformer.") for k in load_file(out))  # the MLP halves, as ComfyUI reads them

    for f in (src, out):
        t = load_component(tiny_21_model, "transformer").float().eval()
        attach_lora(t, f)
        for m in modules:
            want = 3.0 * lora[f"transformer.{m}.lora_B.weight"] @ lora[f"transformer.{m}.lora_A.weight"]
            torch.testing.assert_close(t.get_submodule(m).get_delta_weight("lora"), want, rtol=1e-6, atol=1e-7)


def test_export_to_a_name_near_the_limit_is_written_and_one_over_it_refused_up_front(tmp_path, monkeypatch):
    """A 250-byte --out (multibyte UTF-8) got temp names ~40 bytes longer (the export's temp folder, the canonical
    rewrite's temp file): "File name too long" at the final write. Now written; a name over 255 bytes is one line
    before the LoRA is read."""
    import models.lora_export as lora_export

    q = "transformer.transformer_blocks.0.attn.to_q"
    src = tmp_path / "lora.safetensors"
    save_file({f"{q}.lora_A.weight": torch.ones(2, 8), f"{q}.lora_B.weight": torch.ones(8, 2)}, src)
    out = tmp_path / "out" / ("ü" * 119 + ".safetensors")  # 250 bytes
    _cli("lora", "export", src, "--out", out)
    assert set(load_file(out)) == {f"diffusion_model.transformer_blocks.0.attn.to_q.{k}"
                                   for k in ("lora_down.weight", "lora_up.weight", "alpha")}
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temp left beside it

    def never(*a, **k):
        raise AssertionError("the LoRA was read")

    monkeypatch.setattr(lora_export, "comfyui_state_dict", never)
    too_long = tmp_path / "out" / ("ü" * 123 + ".safetensors")  # 258 bytes
    output = " ".join(_cli("lora", "export", src, "--out", too_long, code=2).replace("│", " ").split())
    assert "its name is 258 bytes, over the 255 bytes" in output and "Traceback" not in output, output


def test_an_exported_lora_keeps_its_name_after_a_power_loss(tmp_path, monkeypatch):
    """--out's folder is fsynced once the file is linked in (before: never), so the export it reported survives a
    power loss; `--overwrite`'s rename too."""
    from fsync_record import fsynced

    import models.lora_export as lora_export

    q = "transformer.transformer_blocks.0.attn.to_q"
    lora = tmp_path / "lora.safetensors"
    save_file({f"{q}.lora_A.weight": torch.ones(2, 8), f"{q}.lora_B.weight": torch.ones(8, 2)}, lora)
    out = tmp_path / "comfy" / "lora.safetensors"
    for overwrite in (False, True):
        paths = fsynced(monkeypatch)
        lora_export.export_lora(lora, "comfyui", out, overwrite=overwrite)
        assert paths[-1] == str(out.parent.resolve()), paths
