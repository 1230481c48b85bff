"""LoRA IO: only adapter weights are saved, diffusers' own loader reads them unchanged, key checks on load."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.loading import load_component
from models.lora import WEIGHT_NAME, add_lora, load_lora, lora_parameters, lora_state_dict, save_lora
from schemas.config import LoraConfig
from schemas import UserError


def _lora_transformer(model: str, cfg: LoraConfig, seed: int = 0):
    t = load_component(model, "transformer", dtype=torch.float32)
    add_lora(t, cfg)
    g = torch.Generator().manual_seed(seed)
    for p in lora_parameters(t):  # non-zero B so the adapter changes outputs
        p.data = torch.randn(p.shape, generator=g) * 0.1
    return t


def test_add_lora_freezes_base_and_trains_only_targets(tiny_edit_model):
    t = _lora_transformer(tiny_edit_model, LoraConfig(rank=4, target_modules=["to_q", "to_v"]))
    trainable = [n for n, p in t.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n and (".to_q." in n or ".to_v." in n) for n in trainable)
    assert len(trainable) == 2 * 2 * 2  # 2 blocks x 2 targets x (A, B)
    assert all(p.dtype == torch.float32 for p in lora_parameters(t))


def test_saved_lora_is_adapter_only_and_diffusers_loads_it_unchanged(tiny_edit_model, tmp_path):
    from diffusers import QwenImageEditPipeline

    t = _lora_transformer(tiny_edit_model, LoraConfig(rank=4, alpha=8.0))
    path = save_lora(t, tmp_path / "lora")
    assert path.name == WEIGHT_NAME
    saved = load_file(path)
    ours = lora_state_dict(t)
    assert set(saved) == {f"transformer.{k}" for k in ours} and all(".lora_" in k for k in saved)

    pipe = QwenImageEditPipeline.from_pretrained(tiny_edit_model)
    pipe.load_lora_weights(tmp_path / "lora")
    (name,) = pipe.transformer.peft_config
    assert pipe.transformer.peft_config[name].r == 4 and pipe.transformer.peft_config[name].lora_alpha == 8.0
    theirs = lora_state_dict(pipe.transformer, name)
    assert set(theirs) == set(ours) and all(torch.equal(theirs[k], ours[k]) for k in ours)


def test_load_lora_round_trip_and_key_checks(tiny_edit_model, tmp_path):
    cfg = LoraConfig(rank=4)
    src = _lora_transformer(tiny_edit_model, cfg, seed=1)
    save_lora(src, tmp_path / "lora")
    dst = _lora_transformer(tiny_edit_model, cfg, seed=2)
    load_lora(dst, tmp_path / "lora")
    a, b = lora_state_dict(src), lora_state_dict(dst)
    assert all(torch.equal(a[k], b[k]) for k in a)

    # A LoRA for other target modules: missing and unexpected keys are both an error, naming them.
    other = _lora_transformer(tiny_edit_model, LoraConfig(rank=4, target_modules=["to_q", "add_k_proj"]))
    with pytest.raises(UserError, match=r"missing \['transformer_blocks.0.attn.add_k_proj.lora_A.weight'.*unexpected \['transformer_blocks.0.attn.to_k"):
        load_lora(other, tmp_path / "lora")
    # A different rank: same keys, other shapes.
    with pytest.raises(UserError, match="shapes differ"):
        load_lora(_lora_transformer(tiny_edit_model, LoraConfig(rank=2)), tmp_path / "lora")
    # A file that is not a diffusers transformer LoRA.
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file({"lora_A.weight": torch.zeros(1)}, bad / WEIGHT_NAME)
    with pytest.raises(UserError, match="prefix"):
        load_lora(dst, bad)


def test_saved_adapter_config_reads_back_and_attach_rebuilds_the_same_adapter(tiny_edit_model, tmp_path):
    """The config travels under diffusers' own metadata key; `attach_lora` rebuilds rank, alpha and targets from
    it (alpha != rank would be mis-scaled otherwise) and the attached adapter predicts like the trained one."""
    from models.lora import attach_lora, read_lora

    src = _lora_transformer(tiny_edit_model, LoraConfig(rank=4, alpha=2.0, target_modules=["to_q", "to_v"]))
    save_lora(src, tmp_path / "lora")
    state, config = read_lora(tmp_path / "lora")
    assert config is not None and config["r"] == 4 and config["lora_alpha"] == 2.0
    assert sorted(config["target_modules"]) == ["to_q", "to_v"]

    dst = load_component(tiny_edit_model, "transformer", dtype=torch.float32)
    attach_lora(dst, tmp_path / "lora", scale=1.0, adapter_name="loaded")
    cfg = dst.peft_config["loaded"]
    assert (cfg.r, cfg.lora_alpha, sorted(cfg.target_modules)) == (4, 2.0, ["to_q", "to_v"])
    a, b = lora_state_dict(src), lora_state_dict(dst, "loaded")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    q_src, q_dst = src.transformer_blocks[0].attn.to_q, dst.transformer_blocks[0].attn.to_q
    x = torch.randn(2, q_src.in_features)
    assert torch.equal(q_src(x), q_dst(x))


def test_rslora_and_alpha_pattern_files_export_and_init_with_the_scale_diffusers_reads(tiny_edit_model, tmp_path):
    """A diffusers LoRA written by another trainer with `use_rslora` (scale alpha / sqrt(r)) and an
    `alpha_pattern`: diffusers' own loader applies peft's per-module scale; the ComfyUI export (alpha / rank in
    ComfyUI) and `train.init_lora` now start from the same deltas (both took alpha / r of `lora_alpha`: 0.5x
    or 2x the delta on every module here)."""
    import warnings

    from diffusers import QwenImageEditPipeline
    from peft import LoraConfig as PeftLoraConfig

    from models.lora import init_from_lora
    from models.lora_export import export_lora

    def deltas(model, adapter):
        return {n: m.get_delta_weight(adapter) for n, m in model.named_modules() if hasattr(m, "get_delta_weight")}

    src = load_component(tiny_edit_model, "transformer", dtype=torch.float32)
    src.add_adapter(PeftLoraConfig(r=4, lora_alpha=8, use_rslora=True, alpha_pattern={"to_k": 2.0},
                                   target_modules=["to_q", "to_k", "to_v", "to_out.0"]), adapter_name="default")
    g = torch.Generator().manual_seed(0)
    for n, p in src.named_parameters():
        if "lora_" in n:
            p.data = torch.randn(p.shape, generator=g) * 0.1
    save_lora(src, tmp_path / "lora")
    ref = deltas(src, "default")

    pipe = QwenImageEditPipeline.from_pretrained(tiny_edit_model)
    pipe.load_lora_weights(tmp_path / "lora", adapter_name="ref")  # the reference reader of the file
    theirs = deltas(pipe.transformer, "ref")
    assert theirs.keys() == ref.keys()
    for n in ref:
        torch.testing.assert_close(theirs[n], ref[n], rtol=1e-6, atol=1e-7)

    comfy = load_file(export_lora(tmp_path / "lora", "comfyui", tmp_path / "comfy.safetensors"))
    for n in ref:  # ComfyUI: up @ down * alpha / rank
        up, down = comfy[f"diffusion_model.{n}.lora_up.weight"], comfy[f"diffusion_model.{n}.lora_down.weight"]
        torch.testing.assert_close(up @ down * (float(comfy[f"diffusion_model.{n}.alpha"]) / down.shape[0]), ref[n],
                                   rtol=1e-5, atol=1e-6)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mine = _lora_transformer(tiny_edit_model, LoraConfig(rank=4, alpha=4))
    init_from_lora(mine, tmp_path / "lora")
    started = deltas(mine, "default")
    for n in ref:
        torch.testing.assert_close(started[n], ref[n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["dora", "lora_bias"])
def test_a_file_without_its_adapter_config_applies_as_diffusers_applies_it(kind, tiny_edit_model, tmp_path):
    """A LoRA saved without the adapter config (diffusers' `save_lora_weights` without the metadata, as older
    trainers wrote it): diffusers' `load_lora_weights` reads DoRA from the `lora_magnitude_vector` keys and a
    LoRA bias from `lora_B.bias`; `attach_lora` (predict, evaluate, merge) built a plain LoRA and refused the
    file's keys as unexpected. Now both give the stock transformer's output."""
    import warnings

    from diffusers import QwenImageEditPipeline
    from peft import LoraConfig as PeftLoraConfig
    from peft.utils.warning import PeftWarning

    from models.lora import attach_lora

    src = load_component(tiny_edit_model, "transformer", dtype=torch.float32)
    src.add_adapter(PeftLoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                   use_dora=kind == "dora", lora_bias=kind == "lora_bias"), adapter_name="default")
    g = torch.Generator().manual_seed(0)
    for n, p in src.named_parameters():
        if "lora_" in n:
            p.data = p.data + torch.randn(p.shape, generator=g) * 0.1
    QwenImageEditPipeline.save_lora_weights(tmp_path / "lora", transformer_lora_layers=lora_state_dict(src))
    tag = {"dora": "lora_magnitude_vector", "lora_bias": "lora_B.bias"}[kind]
    assert any(k.endswith(tag) for k in load_file(tmp_path / "lora" / WEIGHT_NAME))

    def out(transformer) -> torch.Tensor:
        g = torch.Generator().manual_seed(1)
        hidden, text = torch.randn(1, 20, 16, generator=g), torch.randn(1, 7, 32, generator=g)
        with torch.no_grad():
            return transformer(hidden_states=hidden, encoder_hidden_states=text, timestep=torch.tensor([0.6]),
                               img_shapes=[[(1, 4, 3), (1, 4, 2)]], return_dict=False)[0]

    pipe = QwenImageEditPipeline.from_pretrained(tiny_edit_model)
    base = out(pipe.transformer)
    pipe.load_lora_weights(tmp_path / "lora")
    want = out(pipe.transformer)
    assert not torch.allclose(want, base)
    ours = load_component(tiny_edit_model, "transformer", dtype=torch.float32)
    with warnings.catch_warnings():  # peft's "invalid shape" (ZeRO-3 shards) for the 1-D bias: a false alarm
        warnings.simplefilter("error", PeftWarning)
        attach_lora(ours, tmp_path / "lora")
    torch.testing.assert_close(out(ours), want, rtol=0, atol=0)


def test_a_pruned_checkpoint_is_named_as_missing_with_the_kept_ones(tmp_path):
    """A report (or an earlier listing) names RUN/checkpoints/step-10/lora; the training has pruned it since
    (train.keep_checkpoints). predict / lora export / merge said 'pass a folder written by `pipeline run train`',
    as if the folder were of the wrong kind; now the line says it does not exist and which checkpoints are kept."""
    from models.lora import lora_weight_file

    ckpts = tmp_path / "run" / "checkpoints"
    for step in (30, 100, 40):
        (ckpts / f"step-{step}" / "lora").mkdir(parents=True)
    for given in (ckpts / "step-10" / "lora", ckpts / "step-10"):
        with pytest.raises(UserError) as e:
            lora_weight_file(given)
        assert f"{ckpts / 'step-10'} does not exist (removed: the training keeps only its newest " \
               "checkpoints (train.keep_checkpoints); or moved)" in str(e.value)  # it said "pruned by train.keep_checkpoints"
        assert str(e.value).endswith(f"{ckpts} holds step-30, step-40, step-100")


@pytest.mark.parametrize("meta, says", [
    ("{not json", "is not JSON"),
    ('["transformer.r", 4]', "is a JSON list, not an object"),
    ('{"transformer.r": 4, "transformer.lora_alpha": "four"}', "gives lora_alpha 'four', not a number"),
    ('{"transformer.r": 4.5, "transformer.lora_alpha": 4}', "gives r 4.5, not a rank"),
    ('{"transformer.r": 4, "transformer.lora_alpha": NaN}', "gives lora_alpha nan, not a number"),
    ('{"transformer.r": 4, "transformer.alpha_pattern": {"to_q": null}}', "alpha_pattern {'to_q': None}, not a mapping"),
])
def test_a_damaged_adapter_config_is_one_line_in_every_reader(tmp_path, meta, says):
    """The adapter config in a LoRA's metadata is read by every loader (predict, merge, evaluate, init_lora) and by
    the export: JSON that does not parse was json's traceback, a rank or alpha of another type peft's or torch's
    (`lora_alpha / r`) after the model had loaded. Now read_lora refuses the file in one line naming it, and the
    export writes nothing."""
    from typer.testing import CliRunner

    from models.lora import read_lora
    from pipeline.cli import app

    q = "transformer.transformer_blocks.0.attn.to_q"
    src = tmp_path / "damaged.safetensors"
    save_file({f"{q}.lora_A.weight": torch.ones(4, 8), f"{q}.lora_B.weight": torch.ones(8, 4)}, src,
              metadata={"format": "pt", "lora_adapter_metadata": meta})
    with pytest.raises(UserError) as e:
        read_lora(src)
    assert str(src) in str(e.value) and says in str(e.value), str(e.value)
    out = tmp_path / "comfy.safetensors"
    result = CliRunner().invoke(app, ["lora", "export", str(src), "--out", str(out)])
    assert result.exit_code == 1 and says in result.output and "Traceback" not in result.output, result.output
    assert not out.exists()


def test_init_from_a_bf16_lora_scales_it_in_float32(tiny_edit_model, tmp_path):
    """`train.init_lora` from a bf16 file (what many trainers write) with another alpha than the config's: its
    lora_B was multiplied by the scale ratio in bf16 and rounded again before the float32 adapter took it, so the
    start was not the file's delta (a 0.75 ratio moved values by up to 2^-9 relative). Now lora_B is the file's
    value times the ratio in float32, exactly."""
    import warnings

    from safetensors import safe_open

    from models.lora import init_from_lora

    src = _lora_transformer(tiny_edit_model, LoraConfig(rank=4, alpha=3))  # scale 0.75
    save_lora(src, tmp_path / "lora")
    path = tmp_path / "lora" / WEIGHT_NAME
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    bf16 = {k: v.to(torch.bfloat16) for k, v in load_file(path).items()}
    save_file(bf16, tmp_path / "bf16.safetensors", metadata=meta)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mine = _lora_transformer(tiny_edit_model, LoraConfig(rank=4, alpha=4))  # scale 1: ratio 0.75
    init_from_lora(mine, tmp_path / "bf16.safetensors")
    got = lora_state_dict(mine)
    for k, v in bf16.items():
        want = v.float() * 0.75 if k.endswith(".lora_B.weight") else v.float()
        assert torch.equal(got[k.removeprefix("transformer.")], want), k


def test_a_lora_holding_fewer_layers_than_its_config_adapts_is_refused_in_one_clear_line(tiny_edit_model, tmp_path):
    """A file whose adapter config (metadata) adapts more layers than it holds weights for: diffusers (peft 0.17+
    injects from the state dict) applies the layers present with one RuntimeWarning; no writer found makes such a
    file (each saves its model's whole peft state with that model's config; the config-less formats take their
    targets from the keys), so it was edited. It stays refused, but the line said 'does not match the adapter
    built from the config ... Use the same train.lora settings', which predict / merge / evaluate have none of;
    now it says how many layers are absent, which, and what to pass."""
    import warnings

    from diffusers import QwenImageEditPipeline
    from safetensors import safe_open
    from typer.testing import CliRunner

    from models.lora import attach_lora
    from pipeline.cli import app

    t = _lora_transformer(tiny_edit_model, LoraConfig(rank=4, target_modules=["to_q", "to_k"]))
    whole = save_lora(t, tmp_path / "whole")
    with safe_open(whole, framework="pt") as f:
        meta = f.metadata()
    state = load_file(whole)
    (tmp_path / "pruned").mkdir()
    pruned = tmp_path / "pruned" / WEIGHT_NAME
    save_file({k: v for k, v in state.items() if ".transformer_blocks.1." not in k}, pruned, metadata=meta)

    pipe = QwenImageEditPipeline.from_pretrained(tiny_edit_model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe.load_lora_weights(tmp_path / "pruned")  # the reference: loaded, the absent layers named in a warning
    assert any("additional target modules" in str(w.message) for w in caught)

    with pytest.raises(UserError) as refused:
        attach_lora(load_component(tiny_edit_model, "transformer", dtype=torch.float32), tmp_path / "pruned")
    line = str(refused.value)
    assert "adapts 4 layers and the file holds weights for 2 of them (2 absent, e.g. transformer_blocks.1.attn" in line
    assert "train.lora" not in line and "\n" not in line, line
    result = CliRunner().invoke(app, ["lora", "merge", "--model", tiny_edit_model, "--lora", str(tmp_path / "pruned"),
                                      "--out", str(tmp_path / "merged")])
    assert result.exit_code == 1 and "2 absent" in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "merged").exists()
