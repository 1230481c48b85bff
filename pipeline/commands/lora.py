"""`pipeline lora …`: LoRA utilities (thin commands over `models.lora`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, get_args

import typer

from pipeline.commands.common import (StrictBaseOpt, checked_lora, echo, finite, one_of, refuse_a_used_folder,
                                     usage_error, usage_errors, user_errors)
from schemas.config import DType
from pipeline.launched import one_process

lora_app = typer.Typer(no_args_is_help=True)


def _export_formats() -> tuple[str, ...]:
    from models.lora_files import EXPORT_FORMATS  # not models.lora_export: it imports torch

    return EXPORT_FORMATS


def _safetensors_file(out: Path) -> Path:
    from schemas.errors import UserError
    from schemas.temp_files import check_name_fits

    if out is not None and out.suffix != ".safetensors":  # export_lora refuses it too (its callers outside the CLI)
        usage_error(f"--out {out}: the export is one .safetensors file; name it *.safetensors")
    try:
        if out is not None:
            check_name_fits(out, "--out")  # export_lora too
    except UserError as e:
        usage_error(str(e))
    return out


@lora_app.command("merge", help="Fuse a LoRA into the model's transformer and write a standalone model folder.")
def merge(
    model: str = typer.Option(..., "--model", help="Base model folder or hub id."),
    lora: Path = typer.Option(..., "--lora", help="LoRA folder (RUN/lora) or .safetensors file."),
    out: Path = typer.Option(..., "--out", help="New model folder (must not exist or be empty)."),
    scale: float = typer.Option(1.0, "--scale", callback=finite(), help="LoRA strength baked into the weights."),
    dtype: Optional[str] = typer.Option(None, "--dtype", callback=one_of(lambda: get_args(DType)),
                                        help="auto | float32 | bfloat16 | float16 (default: as stored)."),
    device: str = typer.Option("cpu", "--device", help="Device the transformer loads onto for the fuse (cpu, cuda:N). "
                               "cpu, not auto as the stages: it loads whole (the 20B model ~41 GB in bf16, more than "
                               "a 24-32 GB GPU holds, about all of a 40 GB one), and its fuse is little work next to "
                               "reading and writing it."),
    strict_base: bool = StrictBaseOpt,
) -> None:
    one_process("lora merge")  # every rank would fuse the same model into the same --out
    from schemas.temp_files import check_name_fits
    from store.io_errors import check_writable

    # --out named on the command line: a mistake there (exit 2), before the LoRA's base check hashes the model
    # (minutes for a 40 GB one) and before anything is written
    with usage_errors():
        refuse_a_used_folder(out, "--out ", "pass a new folder")
        check_name_fits(out, "--out")  # the fused model's folder is renamed to it last, after the fuse
        if Path(model).expanduser().is_dir():  # a hub id: checked once resolved (merge_lora, exit 1)
            refuse_inside_model(out, Path(model).expanduser())
    with user_errors(out):
        check_writable(out.parent, f"--out {out}")  # and the folder the fused model goes to
        checked_lora(lora, model, strict_base)  # the paths before torch's import: a mistyped one is told at once
        path = merge_lora(model, lora, out, scale=scale, dtype=dtype, device=device)
    echo(f"wrote merged model to {path} (loads with diffusers' from_pretrained)")


def merge_lora(model: str, lora: Path, out: Path, scale: float = 1.0, dtype: str | None = None,
               device: str = "cpu") -> Path:
    """OUT = MODEL with only `transformer/` replaced by the fused weights; every other component is hard-linked
    (or copied) unchanged, so plain diffusers loads it like the original and a 7B text encoder is never loaded
    just to be written back. The folder appears complete or not at all. Refuses a non-empty OUT. The transformer
    loads straight onto `device` (a GPU fuses a 20B model in seconds; host RAM holds no copy)."""
    import json

    from models.loading import resolve_model
    from models.lora import fused_transformer, lora_weight_file
    from models.precision import resolve_dtype
    from store.format import atomic_dir, link_or_copy

    out = Path(out)
    # (again: the base check's minutes ran since the command's; atomic_dir would replace a folder made meanwhile)
    refuse_a_used_folder(out, "--out ", "pass a new folder")
    root = resolve_model(model)
    refuse_inside_model(out, root)
    transformer = fused_transformer(model, lora, scale, resolve_dtype(dtype, device) if dtype else None, device)
    with atomic_dir(out) as tmp:
        for child in root.iterdir():
            if child.name != "transformer":
                link_or_copy(child, tmp / child.name)
        save_transformer(transformer, tmp / "transformer")
        (tmp / "merged_lora.json").write_text(
            json.dumps({"base": str(model), "lora": str(lora_weight_file(lora)), "scale": scale}, indent=2) + "\n"
        )
    return out


def refuse_inside_model(out: Path, root: Path) -> None:
    """OUT inside the model folder: the merge links the folder's every entry into OUT's temp folder, which is one
    of them (a traceback once the path grew too long), and a model folder holding another model is no longer
    that model."""
    from schemas.errors import UserError

    if Path(out).resolve().is_relative_to(Path(root).resolve()):
        raise UserError(f"--out {out} is inside the model folder {root}: pass a folder outside it")


def save_transformer(transformer, folder: Path, max_shard_size: int | str = "10GB") -> None:
    """What diffusers' `save_pretrained(folder, safe_serialization=True)` writes (config, the same shards, the same
    index), with a progress bar in bytes: a 20B bf16 transformer is ~40 GB, minutes of writing that diffusers does
    without one."""
    import json

    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    from schemas.byte_bar import byte_bar

    folder.mkdir(parents=True, exist_ok=True)
    transformer.save_config(folder)
    state = transformer.state_dict()
    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size,
                                               filename_pattern="diffusion_pytorch_model{suffix}.safetensors")
    total = sum(t.numel() * t.element_size() for t in state.values())
    with byte_bar(total, "write merged transformer") as bar:
        for filename, names in split.filename_to_tensors.items():
            shard = {name: state[name].contiguous() for name in names}
            save_file(shard, folder / filename, metadata={"format": "pt"})
            bar.update(sum(t.numel() * t.element_size() for t in shard.values()))
    if split.is_sharded:
        index = {"metadata": dict(split.metadata), "weight_map": split.tensor_to_filename}
        (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(
            json.dumps(index, indent=2, sort_keys=True) + "\n")


@lora_app.command("export", help="Write a LoRA in another runtime's format (comfyui: diffusion_model.* keys + alphas).")
def export(
    lora: Path = typer.Argument(..., help="LoRA folder (RUN/lora) or .safetensors file."),
    format: str = typer.Option("comfyui", "--format", callback=one_of(_export_formats),
                               help="Target format: comfyui (the only one so far)."),
    out: Path = typer.Option(..., "--out", callback=_safetensors_file, help="Output .safetensors file (must not exist, unless --overwrite)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out file (never the LoRA being exported, nor a run's own LoRA or checkpoint)."),
) -> None:
    one_process("lora export")  # every rank would write the same --out
    from store.format import widen_private_file

    from models.lora_files import check_export_out

    with usage_errors():  # --out named on the command line: a mistake there (exit 2, as merge's), before any read
        refuse_a_recorded_file(out, lora)
        check_export_out(lora, out, overwrite)
    with user_errors(out):
        checked_lora(lora)  # before torch's import: a mistyped --lora is told at once
        from models.lora_export import write_export

        path = write_export(lora, out, overwrite)  # --format and --out checked above, once
        widen_private_file(path)  # safetensors writes 0600: readable as the umask says (by ComfyUI's user too)
    echo(f"wrote {format} LoRA to {path}")


def refuse_a_recorded_file(out: Path, lora: Path) -> None:
    """OUT a file a run wrote and sealed (RUN/lora's weights, a checkpoint's): refused even with --overwrite, as
    the LoRA being exported is (`export_lora`, which names that case itself): the run's own weights would be lost
    and its record name other bytes."""
    from models.lora_files import weight_file_name
    from schemas.errors import UserError
    from store.checksum import recorded_by

    if Path(out).resolve() == weight_file_name(lora).resolve():
        return
    if (record := recorded_by(Path(out))) is not None:
        raise UserError(f"--out {out} is a run's own file (recorded in {record}): the export would replace it, "
                        "even with --overwrite; pass another --out")
