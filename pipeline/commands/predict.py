"""`pipeline predict`: edit image(s) with the model and an optional LoRA; settings from flags or `predict.*`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from pipeline.commands.common import ConfigOpt, config_from, echo, user_errors


def command(
    model: str = typer.Option(..., "--model", help="Model folder or hub id."),
    image: list[Path] = typer.Option(..., "--image", help="Control image; repeat for Edit-Plus (up to 3)."),
    prompt: str = typer.Option(..., "--prompt", help="Edit instruction."),
    out: Path = typer.Option(..., "--out", help="Output PNG."),
    lora: Optional[Path] = typer.Option(None, "--lora", help="LoRA folder (RUN/lora) or .safetensors file."),
    lora_scale: float = typer.Option(1.0, "--lora-scale", help="LoRA strength."),
    negative_prompt: Optional[str] = typer.Option(None, "--negative-prompt", help="[predict.negative_prompt]"),
    steps: Optional[int] = typer.Option(None, "--steps", help="Inference steps [predict.steps]."),
    cfg_scale: Optional[float] = typer.Option(None, "--cfg", help="true_cfg_scale; <= 1 disables CFG [predict.true_cfg_scale]."),
    seed: Optional[int] = typer.Option(None, "--seed", help="[predict.seed]"),
    height: Optional[int] = typer.Option(None, "--height", help="Output height (default: the control's ~1024² size)."),
    width: Optional[int] = typer.Option(None, "--width", help="Output width."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="auto | float32 | bfloat16 | float16 [predict.dtype]; auto = bf16 on a bf16 GPU, float32 on CPU."),
    transformer_device: Optional[str] = typer.Option(None, "--transformer-device", help="[predict.devices.transformer]"),
    text_encoder_device: Optional[str] = typer.Option(None, "--text-encoder-device", help="[predict.devices.text_encoder]"),
    vae_device: Optional[str] = typer.Option(None, "--vae-device", help="[predict.devices.vae]"),
    config: Optional[Path] = ConfigOpt,
) -> None:
    cfg = config_from(
        config,
        {
            "predict.negative_prompt": negative_prompt,
            "predict.steps": steps,
            "predict.true_cfg_scale": cfg_scale,
            "predict.seed": seed,
            "predict.dtype": dtype,
            "predict.devices.transformer": transformer_device,
            "predict.devices.text_encoder": text_encoder_device,
            "predict.devices.vae": vae_device,
        },
    )
    with user_errors():
        from stages.predict import run

        path = run(
            cfg.predict, model, list(image), prompt, out,
            lora=str(lora) if lora else None, lora_scale=lora_scale, height=height, width=width,
        )
    echo(f"wrote {path}")
