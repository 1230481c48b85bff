"""LoRA export for other runtimes: ComfyUI's Qwen-Image LoRA format.

ComfyUI ignores safetensors metadata, where the diffusers format keeps alpha, so alpha != rank would be
mis-scaled there. The export writes what ComfyUI's loader maps for a Qwen-Image model (`comfy/lora.py`
`model_lora_keys_unet`: `diffusion_model.<module>` is the module's own key) with per-module `.alpha` tensors:

    diffusion_model.transformer_blocks.0.attn.to_q.lora_down.weight   [r, in]   (= peft lora_A)
    diffusion_model.transformer_blocks.0.attn.to_q.lora_up.weight     [out, r]  (= peft lora_B)
    diffusion_model.transformer_blocks.0.attn.to_q.alpha              []        (scale = alpha / r)

Qwen-Image-2.1 (ComfyUI's own `comfy/ldm/qwen_image21/model.py`, loaded through the same `QwenImage` branch of
`model_lora_keys_unet`) has the diffusers module names, except that ComfyUI fuses each block's `img_mlp.gate_layer`
and `img_mlp.proj` into one `img_mlp.gate_up` at load: its loader maps a LoRA on either half only from the name
`transformer.<module>` (or the bare module name), never from `diffusion_model.<module>`. Those two modules (2.1
only; the Edit MLP is `img_mlp.net.*`) are therefore written as `transformer.<module>.lora_down.weight` etc.

diffusers' Qwen-Image loader reads the same file (`QwenImagePipeline.lora_state_dict` converts it), which is
how the export is tested, except those two 2.1 halves: its converter names them `transformer.transformer.<module>`
and its loader drops them (a logged "unexpected keys"); this project's loaders read them (`models.lora.read_lora`).
For diffusers, use the diffusers file (RUN/lora). Only plain LoRA exports: DoRA / LoHa / LoKr have no such key
layout here.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from models.canonical_safetensors import canonicalize
from models.lora import lora_weight_file, module_scale, provenance, read_lora
from models.lora_files import EXPORT_FORMATS as FORMATS
from models.lora_files import check_export_out, refuse_existing_out
from schemas import atomic_write
from schemas.errors import UserError
from schemas.temp_files import check_name_fits, remove_dead_temps, temp_of

COMFY_PREFIX = "diffusion_model."
# ComfyUI's 2.1 model holds these two as the halves of a fused `img_mlp.gate_up` (see the module docstring)
COMFY_FUSED_HALVES = (".img_mlp.gate_layer", ".img_mlp.proj")


def _alpha(module: str, rank: int, config: dict | None) -> float:
    """The `.alpha` that makes ComfyUI's alpha / rank the scale peft applies to the module (`module_scale`:
    alpha_pattern, use_rslora); a file without a config (converted, alpha baked in) has alpha = rank."""
    return module_scale(module, rank, config) * rank


def comfyui_state_dict(lora: str | Path) -> dict[str, torch.Tensor]:
    state, config = read_lora(lora)
    if config and (config.get("use_dora") or config.get("peft_type", "LORA") != "LORA"):
        raise UserError(f"{lora}: only a plain LoRA exports to ComfyUI (this one is "
                        f"{'DoRA' if config.get('use_dora') else config.get('peft_type')})")
    other = [k for k in state if not k.endswith((".lora_A.weight", ".lora_B.weight"))]
    if other:
        raise UserError(f"{lora}: keys other than lora_A/lora_B ({other[:3]}): not a plain LoRA")
    if not state:  # else a ComfyUI file of no tensors, reported as written: a runtime applies it as nothing
        raise UserError(f"{lora_weight_file(lora)}: no lora_A / lora_B weight pairs, nothing to export; pass the LoRA "
                        "written by `pipeline run train` (RUN/lora) or a checkpoint's")
    _check_pairs(lora, state)
    out: dict[str, torch.Tensor] = {}
    for key, a in state.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[: -len(".lora_A.weight")]
        name = f"transformer.{module}" if module.endswith(COMFY_FUSED_HALVES) else f"{COMFY_PREFIX}{module}"
        out[f"{name}.lora_down.weight"] = a.contiguous()
        out[f"{name}.lora_up.weight"] = state[f"{module}.lora_B.weight"].contiguous()
        out[f"{name}.alpha"] = torch.tensor(_alpha(module, a.shape[0], config), dtype=torch.float32)
    return out


def _check_pairs(lora: str | Path, state: dict[str, torch.Tensor]) -> None:
    """Every module's lora_A with its lora_B, of one rank: the loaders refuse such a file (missing keys, shapes),
    but the export wrote it: a lone lora_B dropped without a word (a module gone from the ComfyUI file), a lone
    lora_A a KeyError traceback, ranks that differ a file no runtime can apply."""
    def modules(suffix: str) -> set[str]:
        return {k[: -len(suffix)] for k in state if k.endswith(suffix)}

    a, b = modules(".lora_A.weight"), modules(".lora_B.weight")
    if a != b:
        lone = sorted(a ^ b)
        raise UserError(f"{lora}: {len(lone)} module(s) have only one of lora_A / lora_B (e.g. {lone[0]}): the file "
                        "is cut or damaged; export an intact copy (RUN/lora, or a checkpoint's)")
    if bad := sorted(m for m in a if state[f"{m}.lora_A.weight"].shape[0] != state[f"{m}.lora_B.weight"].shape[-1]):
        raise UserError(f"{lora}: lora_A and lora_B of {bad[0]} have different ranks "
                        f"({state[f'{bad[0]}.lora_A.weight'].shape[0]} vs {state[f'{bad[0]}.lora_B.weight'].shape[-1]}): "
                        "the file is damaged; export an intact copy")


def export_lora(lora: str | Path, fmt: str, out: str | Path, overwrite: bool = False) -> Path:
    """Write LORA in format FMT to OUT, whole or not at all (temp file + rename). An existing OUT is refused unless
    `overwrite` (it may be another LoRA of the user's: it was replaced without a word); OUT naming the LoRA being
    exported is refused even then (the export would replace its own input)."""
    if fmt not in FORMATS:
        raise UserError(f"unknown export format {fmt!r}: use one of {', '.join(FORMATS)}")
    out = Path(out)
    if out.suffix != ".safetensors":
        raise UserError(f"--out {out}: the export is one .safetensors file; name it *.safetensors")
    check_name_fits(out, "--out")
    check_export_out(lora_weight_file(lora), out, overwrite)
    return write_export(lora, out, overwrite)


def write_export(lora: str | Path, out: Path, overwrite: bool) -> Path:
    """`export_lora`'s write, for a caller that has checked OUT itself (`pipeline lora export`, before the LoRA is
    read: `check_export_out`), in comfyui, the one format."""
    state = comfyui_state_dict(lora)
    out.parent.mkdir(parents=True, exist_ok=True)
    # A folder of its own, the file in it: safetensors writes its own temp file (`.tmpXXXXXX`) beside the path it
    # is given, which a killed export left beside --out under a name no one could tell was litter. pid-named: a
    # killed export's folder is removed by the next export to OUT (never a live one's); another export to OUT
    # meanwhile never links in this one's file.
    folder = temp_of(out)
    remove_dead_temps(out, own=folder)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    tmp = folder / out.name
    try:
        # ComfyUI ignores metadata; this project's loaders read the base and family from it (refused / warned)
        save_file(state, tmp, metadata={"format": "pt", "exported_by": "qwen-edit-lora-pipeline", "target": "comfyui",
                                        **provenance(lora)})
        canonicalize(tmp)  # the same LoRA exports the same bytes (one sha256 to publish), as `save_lora` writes
        if overwrite:
            tmp.replace(out)
        else:
            _link_new(tmp, out)
        atomic_write.fsync_dir(out.parent)  # OUT's name survives a power loss, as its bytes (`canonicalize`)
    finally:  # a full disk or a kill mid-write: no partial file left beside --out (renamed or linked: gone too)
        shutil.rmtree(folder, ignore_errors=True)
    return out


def _link_new(tmp: Path, out: Path) -> None:
    """TMP becomes OUT only where no OUT exists (`rename_new`): a file made at OUT since `check_export_out` looked
    is not replaced either."""
    try:
        atomic_write.rename_new(tmp, out)
    except FileExistsError:
        refuse_existing_out(out)
        raise
