"""`lora merge` reads the LoRA file once: its bias check (`check_mergeable`) and the attach parse the same bytes
(`fused_transformer`). Before, each read the whole file (hundreds of MB for a large LoRA), and the family check a
header once more."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

_watched: list[tuple[str, list[str]]] = []  # (path, the reads seen) while a test watches a file


def _audit(event: str, args) -> None:  # Python-level opens (open, Path.read_bytes, os.open)
    if event == "open" and _watched and isinstance(args[0], (str, bytes, Path)):
        for path, seen in _watched:
            if str(args[0]) == path:
                seen.append("open")


sys.addaudithook(_audit)  # hooks cannot be removed: it records only while `_watched` names a file


def _write_lora(model: str, folder: Path) -> dict[str, torch.Tensor]:
    """A LoRA of alpha 8, rank 4 on the attention's q/v with non-zero B (diffusers' writer); its peft state."""
    from diffusers import QwenImageEditPipeline, QwenImageTransformer2DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    transformer = QwenImageTransformer2DModel.from_pretrained(model, subfolder="transformer")
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_v"], init_lora_weights="gaussian")
    transformer.add_adapter(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    state = get_peft_model_state_dict(transformer)
    QwenImageEditPipeline.save_lora_weights(folder, transformer_lora_layers=state,
                                            transformer_lora_adapter_metadata=cfg.to_dict())
    return {k: v.clone() for k, v in state.items()}


def test_merge_reads_the_lora_file_once_and_fuses_the_same_weights(tiny_edit_model, tmp_path, monkeypatch):
    import models.lora as lora
    from models.loading import load_component

    state = _write_lora(tiny_edit_model, tmp_path / "lora")
    weight_file = str(tmp_path / "lora" / lora.WEIGHT_NAME)
    reads: list[str] = []

    def counted(real, what):
        def wrapper(path, *a, **k):
            if str(path) == weight_file:
                reads.append(what)
            return real(path, *a, **k)
        return wrapper

    # safetensors' own readers (Rust: no Python-level open to see)
    monkeypatch.setattr(lora, "load_file", counted(lora.load_file, "load_file"))
    monkeypatch.setattr(lora, "safe_open", counted(lora.safe_open, "safe_open"))
    _watched.append((weight_file, reads))
    try:
        merged = lora.fused_transformer(tiny_edit_model, tmp_path / "lora", scale=0.5)
    finally:
        _watched.clear()
    assert reads == ["open"], reads  # one read of the bytes; before: load_file twice and a header (safe_open)

    base = load_component(tiny_edit_model, "transformer").state_dict()
    fused = merged.state_dict()
    assert fused.keys() == base.keys()  # the LoRA layers unloaded
    for name in base:
        module = name.removesuffix(".weight")
        if f"{module}.lora_A.weight" in state:  # W + scale * alpha / r * B @ A
            delta = 0.5 * (8 / 4) * state[f"{module}.lora_B.weight"] @ state[f"{module}.lora_A.weight"]
            torch.testing.assert_close(fused[name], base[name] + delta, rtol=1e-5, atol=1e-6)
            assert delta.abs().max() > 1e-2
        else:
            assert torch.equal(fused[name], base[name]), name
