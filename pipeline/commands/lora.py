"""`pipeline lora …`: LoRA utilities."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from pipeline.commands.common import echo, user_errors

lora_app = typer.Typer(no_args_is_help=True)


@lora_app.command("merge", help="Fuse a LoRA into the model's transformer and write a standalone model folder.")
def merge(
    model: str = typer.Option(..., "--model", help="Base model folder or hub id."),
    lora: Path = typer.Option(..., "--lora", help="LoRA folder (RUN/lora) or .safetensors file."),
    out: Path = typer.Option(..., "--out", help="New model folder (must not exist or be empty)."),
    scale: float = typer.Option(1.0, "--scale", help="LoRA strength baked into the weights."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="auto | float32 | bfloat16 | float16 (default: as stored)."),
    device: str = typer.Option("cpu", "--device", help="Device the transformer loads onto for the fuse (cpu, cuda:N)."),
) -> None:
    with user_errors():
        from stages.lora_merge import merge_lora

        path = merge_lora(model, lora, out, scale=scale, dtype=dtype, device=device)
    echo(f"wrote merged model to {path} (loads with diffusers' from_pretrained)")
