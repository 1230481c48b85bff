"""Evaluate's settings as they run: the model family's guidance default, every setting the config and the model
decide checked before anything is read or loaded, and the device, dtype and attention backend resolved (agreed on
by every rank of a launch)."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from features.decode import read_image_file
from models.loading import parse_dtype
from models.precision import Precision
from schemas.config import EvaluateConfig
from schemas.errors import UserError


def resolved_config(cfg: EvaluateConfig, model: str) -> EvaluateConfig:
    """This rank's device, the concrete dtype (`auto` decided by the device) and the attention backend (unset: the
    device's default): what runs, is hashed and is recorded."""
    return agreed_config(cfg, model)[0]


def agreed_config(cfg: EvaluateConfig, model: str, world: int = 1) -> tuple[EvaluateConfig, Precision]:
    """(`resolved_config`, the precision with its reason). With several ranks (`world`, --all-checkpoints) the
    dtype and the attention backend are each one decision of all (`models.precision.agreed_precision`,
    `models.attention.agreed_choice`: collectives, every rank calls them): their rows of one loss grid are
    computed in one precision and backend, the ones recorded. A rank without its device stops every rank with its
    line there. The backend is set as resolved (its choice kept for `load_transformer`), so that every hash of
    the settings names the backend used, not its spelling: unset on a CPU and `native` are one report."""
    from models.attention import agreed_choice
    from models.loading import model_variant
    from models.precision import agreed_precision, device_for_rank, resolve_precision

    device = ""

    def own():
        nonlocal device
        device = device_for_rank(cfg.device, what="evaluate.device")
        return resolve_precision(cfg.dtype, device, what="evaluate.dtype")

    precision = agreed_precision(own, world, "evaluate.dtype")
    choice = cfg._attention_choice  # resolved already: the choice made then (a resolved name reads "configured")
    if choice is None:
        dtype = parse_dtype(precision.weights)
        # Qwen-Image-2.1 takes native only; its files are read only where the default could be another backend
        qwen21 = cfg.attention_backend is None and torch.device(device).type == "cuda" and \
            dtype in (torch.bfloat16, torch.float16) and model_variant(model) == "qwen-image-2.1"
        choice = agreed_choice(cfg.attention_backend, "evaluate.attention_backend", torch.device(device), dtype,
                               world, qwen21)
    resolved = cfg.model_copy(update={"device": device, "dtype": precision.weights, "attention_backend": choice.backend})
    resolved._attention_choice = choice
    return resolved, precision


def check_sampling(cfg: EvaluateConfig, model: str) -> None:
    """`evaluate.num_inference_steps` against the model's scheduler, where images are made (else the steps are
    unused; `models.loading.check_sampling_steps`; `pipeline run all` asks before its first stage)."""
    if cfg.num_samples or cfg.extra_prompts:
        from models.loading import check_sampling_steps

        check_sampling_steps(cfg.num_inference_steps, "evaluate.num_inference_steps", model)


def for_model(cfg: EvaluateConfig, model: str, check: bool = True) -> EvaluateConfig:
    """`evaluate.true_cfg_scale` left unset: the model family's own default, as predict and the training sample
    grid take it (Qwen-Image-2.1: no guidance, its pipeline's default; the Edit models: 4.0). Resolved before
    anything is fingerprinted, so a report records the scale its images were made with; then every setting
    checked (`check_settings`; `check` False: not on this rank, which makes no images)."""
    from models.loading import model_variant
    from models.qwen21_predict import TRUE_CFG_21

    if model_variant(model) == "qwen-image-2.1" and "true_cfg_scale" not in cfg.model_fields_set:
        cfg = cfg.model_copy(update={"true_cfg_scale": TRUE_CFG_21})
    if check:
        check_settings(cfg, model)
    return cfg


def say_unused_negative(cfg: EvaluateConfig, model: str) -> None:
    """One line where `evaluate.negative_prompt` is set but the extra prompts run without true CFG (a scale of 1 or
    less: on Qwen-Image-2.1 the default, its pipeline's 1.0): it is then dropped, as the stock call warns."""
    if cfg.extra_prompts and cfg.true_cfg_scale <= 1 and cfg.negative_prompt.strip():
        tqdm.write(f"note: evaluate.negative_prompt is unused: the extra prompts' images on {model} are made without "
                   f"guidance (evaluate.true_cfg_scale {cfg.true_cfg_scale}); set it above 1 for true CFG")


def check_settings(cfg: EvaluateConfig, model: str) -> None:
    """Every evaluate setting that the config and the model decide, refused before anything is read or loaded,
    and by `pipeline run all` before its first stage (not hours later, after training): the denoising steps
    (`check_sampling`) and each extra prompt: as many images as the model takes, each image and target a file
    that decodes (before, a missing one stopped evaluate when its picture was made, after the held-out loss
    passes) and that the stock resize can size (`models.control_shapes`: a too elongated one was a traceback
    there), its height / width a size the pipeline does not round down (predict's rule), and on a 2.1 model
    the prompt within the RoPE table. `cfg` as `for_model` resolves it (the 2.1 guidance decides whether the
    negative prompt is encoded)."""
    check_sampling(cfg, model)
    if not cfg.extra_prompts:
        return
    from models.control_shapes import check_control_shapes, check_output_size
    from models.loading import model_variant
    from models.qwen21_predict import check_reference_count

    qwen21 = model_variant(model) == "qwen-image-2.1"
    for i, extra in enumerate(cfg.extra_prompts):
        if qwen21:  # none: text-to-image, the stock pipeline's image=None call (`edit_21`)
            check_reference_count(len(extra.images), model, f"evaluate.extra_prompts[{i}].images",
                                  "list at most 10 images in that extra prompt")
        elif not extra.images:
            raise UserError(f"evaluate.extra_prompts[{i}].images: none listed, but {model} "
                            f"({model_variant(model)}) edits control images; list at least one (a Qwen-Image-2.1 "
                            "model also takes none: text-to-image)")
        elif model_variant(model) == "edit" and len(extra.images) != 1:
            raise UserError(f"evaluate.extra_prompts[{i}].images: {len(extra.images)} control images, but "
                            f"Qwen-Image-Edit ({model}) takes exactly one; list one image in that extra prompt")
        check_output_size(model, extra.height, extra.width,  # as predict's --height / --width
                          (f"evaluate.extra_prompts[{i}].height", f"evaluate.extra_prompts[{i}].width"))
        if extra.target:
            read_image_file(extra.target, what=f"evaluate.extra_prompts[{i}] target")
        if not qwen21:  # a 2.1 model's are read by check_extra_prompts_21, as its generation reads them
            what = f"evaluate.extra_prompts[{i}] image"
            check_control_shapes(extra.images, [read_image_file(p, what=what) for p in extra.images],
                                 model_variant(model), extra.height, extra.width, what)
    if qwen21:
        from stages.evaluate.qwen21 import check_extra_prompts_21

        check_extra_prompts_21(cfg, model)  # the tokenizer only, before the transformer loads
    else:  # the processor alone: its ValueError came when the images were made, after the held-out loss passes
        from models.qwen21_predict import check_placeholders_before_loading

        check_placeholders_before_loading(model, [(f"evaluate.extra_prompts[{i}]: ", extra.prompt) for i, extra in
                                                  enumerate(cfg.extra_prompts)],
                                          cfg.negative_prompt if cfg.true_cfg_scale > 1 else None)
