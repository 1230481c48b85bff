"""`pipeline predict`: edit image(s) with the model and an optional LoRA; settings from flags or `predict.*`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from pipeline.commands.common import (ConfigOpt, SetOpt, StrictBaseOpt, checked_lora, config_from, echo, finite,
                                     usage_error, usage_errors, user_errors)
from pipeline.config import cleaned_prompt, empty_prompt
from pipeline.launched import one_process
from schemas.img_shapes import PIXELS_PER_PATCH


def image_format(out: Path) -> str:
    """The image format PIL writes OUT in (picked from its name when it saves), or a UserError."""
    from PIL import Image

    from schemas.errors import UserError
    from schemas.temp_files import check_name_fits

    check_name_fits(out, "--out")  # PIL's save would fail after the minutes of denoising
    out_format = Image.registered_extensions().get(Path(out).suffix.lower())
    if out_format is None:
        what = f"{Path(out).suffix} is not an image type" if Path(out).suffix else "the name has no image extension"
        raise UserError(f"--out {out}: {what}; name it .png (or .webp, .jpg)")
    return out_format


def _image_file(out: Path) -> Path:
    """--out checked when the flag is parsed: a usage error (exit 2) before minutes of loading and denoising."""
    from schemas.errors import UserError

    try:
        image_format(out)
    except UserError as e:
        usage_error(str(e))
    return out


def command(
    model: str = typer.Option(..., "--model", help="Model folder or hub id."),
    image: Optional[list[Path]] = typer.Option(None, "--image", metavar="<path>", help="Control image; repeat for Edit-Plus (any number, as its stock pipeline; trained with up to 3) or Qwen-Image-2.1 (0 to 10 references: none is text-to-image)."),
    prompt: str = typer.Option(..., "--prompt", help="Edit instruction."),
    out: Path = typer.Option(..., "--out", callback=_image_file, help="Output PNG (must not exist, unless --overwrite)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out file (never a control image)."),
    lora: Optional[Path] = typer.Option(None, "--lora", help="LoRA folder (RUN/lora) or .safetensors file."),
    lora_scale: float = typer.Option(1.0, "--lora-scale", callback=finite(), help="LoRA strength."),
    negative_prompt: Optional[str] = typer.Option(None, "--negative-prompt", help="Negative prompt of true CFG (predict.negative_prompt)."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Inference steps (predict.steps)."),
    cfg_scale: Optional[float] = typer.Option(None, "--cfg", help="true_cfg_scale; <= 1 disables CFG (predict.true_cfg_scale)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Generation seed (predict.seed)."),
    height: Optional[int] = typer.Option(None, "--height", min=PIXELS_PER_PATCH,
                                         help="Output height in pixels (default: the control's ~1024² size)."),
    width: Optional[int] = typer.Option(None, "--width", min=PIXELS_PER_PATCH, help="Output width in pixels."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="auto | float32 | bfloat16 | float16 (predict.dtype; auto = bf16 on a bf16 GPU, float32 on CPU)."),
    transformer_device: Optional[str] = typer.Option(None, "--transformer-device", help="Device of the transformer: auto, cpu, cuda:N (predict.devices.transformer)."),
    text_encoder_device: Optional[str] = typer.Option(None, "--text-encoder-device", help="Device of the text encoder (predict.devices.text_encoder)."),
    vae_device: Optional[str] = typer.Option(None, "--vae-device", help="Device of the VAE (predict.devices.vae)."),
    strict_base: bool = StrictBaseOpt,
    config: Optional[Path] = ConfigOpt,
    set_: list[str] = SetOpt,
) -> None:
    one_process("predict")  # every rank would load the model and write the same --out
    images = list(image or [])  # none: Qwen-Image-2.1's text-to-image (the other models refuse it, check_for_model)
    cfg = config_from(config, sets=set_, overrides=
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
    prompt = cleaned_prompt(prompt, "--prompt")  # as a caption is cleaned (the config's prompts: load_config)
    with usage_errors():  # an --out that would destroy an input or cannot be a file: before any loading
        if not prompt.strip():
            from schemas.errors import UserError

            raise UserError(empty_prompt("--prompt"))
        check_out_path(out, images, overwrite)
    _check_local_model(model, len(images), out, cfg.predict.steps, height, width)
    with user_errors(out):
        if lora:  # the LoRA's family from the model's config alone: before anything loads (a processor, below)
            from models.lora import check_family_before_loading

            check_family_before_loading(lora, model)
        # the controls read and judged before the LoRA's base check hashes the model (minutes for a 40 GB one)
        controls = checked_controls(cfg.predict, model, images, prompt, out, height, width)
        if lora:
            checked_lora(lora, model, strict_base)
        path = predict(cfg.predict, model, images, prompt, out, str(lora) if lora else None, lora_scale,
                       height, width, controls=controls)
    echo(f"wrote {path}")


def check_out_path(out: Path, images: list[Path], overwrite: bool) -> None:
    """A UserError when OUT names one of the control images (the edit replaced the user's own photo, without a
    word), an existing folder (PIL's IsADirectoryError, a traceback after every denoising step), or, unless
    `overwrite`, any existing file (an earlier result at that name was replaced without a word)."""
    from schemas.errors import UserError

    out = Path(out)
    for image in images:
        if Path(image).resolve() == out.resolve() or (out.exists() and Path(image).exists()
                                                      and out.samefile(image)):
            raise UserError(f"--out {out} is the control image --image {image}: the edit would replace it; "
                            "pass another --out")
    if out.is_dir():
        raise UserError(f"--out {out} is a folder; pass the image file to write, e.g. {out / 'edited.png'}")
    if not overwrite and (out.exists() or out.is_symlink()):
        raise UserError(f"--out {out} exists: predict would replace it; pass another --out, or --overwrite to "
                        "replace it")


def save_image(image, out: Path) -> None:
    """OUT whole or not at all (temp file + rename): a kill or a full disk mid-save left a cut PNG there, or
    replaced the previous image at that name with one."""
    import io

    from store.format import atomic_write_bytes

    buf = io.BytesIO()
    image.save(buf, format=image_format(out))
    atomic_write_bytes(Path(out), buf.getvalue())


def _check_local_model(model: str, n_images: int, out: Path, steps: int, height: int | None,
                       width: int | None) -> None:
    """`check_for_model` right after parsing when MODEL is a folder here: a usage mistake, exit 2, before the LoRA
    is hashed and the model loaded. A hub id is checked by `predict` (exit 1), not downloaded just for this."""
    if not Path(model).expanduser().is_dir():
        return
    from models.loading import resolve_model

    with user_errors():  # a folder that is no model, or a damaged one: a failure (exit 1), named as before
        resolve_model(model)
    with usage_errors():
        check_for_model(model, n_images, out, steps, height, width)


def check_for_model(model: str, n_images: int, out: Path, steps: int, height: int | None,
                    width: int | None) -> None:
    """What MODEL's configs alone refuse (model_index.json, the scheduler's; no weights read), in one UserError: a
    JPEG --out for Qwen-Image-2.1's RGBA edits, more control images than the model family takes, one denoising
    step where its scheduler cannot take it, and a --height / --width its pipeline would round down."""
    from models.control_shapes import check_output_size
    from models.loading import check_sampling_steps, model_variant
    from schemas.errors import UserError

    variant = model_variant(model)
    if image_format(out) == "JPEG" and variant == "qwen-image-2.1":
        raise UserError(f"--out {out}: Qwen-Image-2.1 edits are RGBA (alpha kept) and JPEG has no alpha; name it "
                        ".png or .webp")
    if variant == "qwen-image-2.1":  # 0 references: text-to-image, as the stock pipeline takes image=None
        from models.qwen21_predict import check_reference_count

        check_reference_count(n_images, model, "--image", "pass at most 10 --image")
    elif n_images == 0:
        raise UserError(f"--image: {model} ({variant}) edits control images; pass at least one --image (a "
                        "Qwen-Image-2.1 model also takes none: text-to-image)")
    elif variant == "edit" and n_images != 1:  # refused before loading, not by the pipeline after
        raise UserError(f"--image: {n_images} control images, but Qwen-Image-Edit ({model}) takes exactly one; "
                        "pass one --image, or use an Edit-Plus model (Qwen-Image-Edit-2509 / -2511)")
    check_sampling_steps(steps, "predict.steps", model)
    check_output_size(model, height, width)


def checked_controls(cfg, model: str, images: list[Path], prompt: str, out: Path, height: int | None,
                     width: int | None) -> list:
    """What predict refuses before loading anything (OUT, its folder, the model's configs, each control's shape;
    for Qwen-Image-2.1 the references against its VLM processor and the prompt against its RoPE table), and the
    control images as PIL images, decoded as resize-bucket decodes the training images."""
    from models.loading import model_variant
    from store.io_errors import check_writable

    check_out_path(out, images, overwrite=True)  # an existing file: the CLI's --overwrite, judged when parsed
    check_writable(Path(out).parent, f"--out {out}")  # so is the folder it goes to (before it was found at the save)
    # before minutes of loading and denoising (the CLI: when parsed, and for a model folder here right after)
    check_for_model(model, len(images), out, cfg.steps, height, width)
    from features.decode import read_image_file
    from models.control_shapes import check_control_shapes

    # Decoded as resize-bucket decodes the training images (EXIF orientation, CMYK via its ICC profile, 16-bit
    # scaled, transparency over white; 2.1 keeps it, the stock 2.1 pipeline's own handling): a phone photo is not
    # shown on its side, a transparent cutout not on the black its transparent pixels store.
    keep_alpha = model_variant(model) == "qwen-image-2.1"
    pil = [read_image_file(p, keep_alpha, what="--image") for p in images]
    check_control_shapes(images, pil, model_variant(model), height, width)
    if model_variant(model) == "qwen-image-2.1":  # the processor alone: before the CLI's LoRA base check too
        from models.qwen21_predict import check_prompt_before_loading

        check_prompt_before_loading(model, pil, prompt, cfg.negative_prompt if _cfg_21(cfg) > 1 else None, height,
                                    width)
    else:  # the Edit models' processor refuses a media placeholder too, once every component has loaded
        from models.qwen21_predict import check_placeholders_before_loading

        check_placeholders_before_loading(model, [("", prompt)],
                                          cfg.negative_prompt if cfg.true_cfg_scale > 1 else None)
    return pil


def _cfg_21(cfg) -> float:
    """The 2.1 true-CFG scale: unset, the 2.1 pipeline's own default (no guidance), not the Edit models' 4.0."""
    from models.qwen21_predict import TRUE_CFG_21

    return cfg.true_cfg_scale if "true_cfg_scale" in cfg.model_fields_set else TRUE_CFG_21


def predict(cfg, model: str, images: list[Path], prompt: str, out: Path, lora: str | None, lora_scale: float,
            height: int | None, width: int | None, controls: list | None = None) -> Path:
    """Read the control images (`controls`: already read by `checked_controls`), load the pipeline (each
    component on its device), edit, write OUT (PNG)."""
    from models.edit import COMPONENTS, edit, load_pipeline
    from models.loading import model_variant
    from schemas.errors import UserError

    pil = controls if controls is not None else checked_controls(cfg, model, images, prompt, out, height, width)
    unknown = set(cfg.devices) - set(COMPONENTS)
    if unknown:
        raise UserError(f"predict.devices: unknown component(s) {sorted(unknown)}; use {list(COMPONENTS)}")
    from tqdm.auto import tqdm

    from models.precision import auto_note, check_loaded_dtype, device_for_rank, resolve_precision

    specs = {name: cfg.devices.get(name, "auto") for name in COMPONENTS}
    devices = {name: device_for_rank(spec, what=f"predict.devices.{name}") for name, spec in specs.items()}
    precision = resolve_precision(cfg.dtype, devices["transformer"])  # auto: decided by where the big model runs
    tqdm.write(precision.describe("predict", devices["transformer"], auto_note(*specs.values()))
               + (f", quantize_base {cfg.quantize_base}" if cfg.quantize_base != "none" else ""))
    if model_variant(model) == "qwen-image-2.1":  # the stock 2.1 pipeline; references keep their alpha
        from models.qwen21_predict import edit_21, load_pipeline_21

        scale = _cfg_21(cfg)
        # the stock call warns of it; edit_21 drops it (the config always lists it as set: compared with " ")
        if scale <= 1 and cfg.negative_prompt.strip():
            tqdm.write(f"note: --negative-prompt / predict.negative_prompt is unused: {model} (Qwen-Image-2.1) samples "
                       "without guidance unless --cfg / predict.true_cfg_scale is above 1 (its pipeline's default 1.0)")
        pipe = load_pipeline_21(model, precision.dtype, devices, lora, lora_scale, quantize=cfg.quantize_base)
        from models.qwen21_generate import pipeline_sample_sigmas

        if (sigmas := pipeline_sample_sigmas(model)) and "steps" in cfg.model_fields_set:
            tqdm.write(f"note: {model} fixes its sampling sigmas ({len(sigmas)} steps, model_index.json "
                       f"sample_sigmas), which the stock pipeline uses: --steps / predict.steps {cfg.steps} is unused")
        result = edit_21(pipe, pil, prompt, cfg.negative_prompt, cfg.steps, scale, cfg.seed, height, width)
    else:
        pipe = load_pipeline(model, precision.dtype, devices, lora, lora_scale, quantize=cfg.quantize_base)
        result = edit(pipe, pil, prompt, cfg.negative_prompt, cfg.steps, cfg.true_cfg_scale, cfg.seed, height, width)
    for name in COMPONENTS:
        check_loaded_dtype(getattr(pipe, name), precision.weights, "predict.dtype")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_image(result, out)
    return out
