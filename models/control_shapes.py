"""The views the stock pipelines make of a control image, and the refusal of one they cannot make: a side their
resize rounds to 0 px (PIL's ValueError), or a view for the text encoder beyond the VL processor's aspect limit
(transformers' ValueError). `pipeline predict` and evaluate's start check (`evaluate.extra_prompts`) ask it
before any weights load; before, both failed after loading (evaluate: after training and the held-out passes)."""

from __future__ import annotations

from pathlib import Path

from schemas.errors import UserError

# The vision-language processors' limit (transformers' Qwen2-VL `smart_resize`, which Qwen3-VL's uses too): a
# longer side over 200x the shorter raises there.
MAX_VL_ASPECT = 200


def reference_area_21(height: int | None, width: int | None) -> int:
    """The area the 2.1 pipeline resizes each reference to: `output_resolution`², which `edit_21` passes as
    round(sqrt(height x width)) when both are given, else the pipeline's default 1024."""
    return round((height * width) ** 0.5) ** 2 if height and width else 1024 * 1024


def control_views(variant: str, size: tuple[int, int], height: int | None = None,
                  width: int | None = None) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(every (w, h) view the stock pipeline resizes a control of `size` to, those of them the VL processor sees),
    by the pipeline's own `calculate_dimensions`. `height` / `width`: the output size, which only 2.1 sizes its
    references by."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions as edit_dims
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions as plus_dims
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions as dims_21

    from models.edit import VAE_AREA, VL_AREA_PLUS  # the areas `prepare_controls` resizes to
    from models.loading import pipeline_family

    ratio = size[0] / size[1]
    if variant == "qwen-image-2.1":  # one resize feeds the VLM and the VAE, at the output's area
        view = dims_21(reference_area_21(height, width), ratio)[:2]
        return [view], [view]
    if pipeline_family(variant) == "edit-plus":  # a ~384² view for the text encoder, a ~1024² one for the VAE
        to_processor = plus_dims(VL_AREA_PLUS, ratio)
        return [to_processor, plus_dims(VAE_AREA, ratio)], [to_processor]
    view = edit_dims(VAE_AREA, ratio)[:2]  # one ~1024² view for the text encoder and the VAE
    return [view], [view]


def check_control_shapes(paths: list[Path], images: list, variant: str, height: int | None = None,
                         width: int | None = None, what: str = "--image") -> None:
    """A UserError naming the first control (`what` and its path) whose views the pipeline cannot make."""
    for path, image in zip(paths, images):
        w, h = image.size
        views, to_processor = control_views(variant, (w, h), height, width)
        if any(min(v) < 1 for v in views) or any(max(v) / min(v) > MAX_VL_ASPECT for v in to_processor):
            larger = (" or pass a larger output size (--height / --width; height / width in evaluate.extra_prompts)"
                      if variant == "qwen-image-2.1" else "")
            raise UserError(f"{what} {path}: {w}x{h} px is too elongated for the model (the pipeline resizes it to "
                            f"{' and '.join(f'{a}x{b}' for a, b in views)} px; its view for the text encoder must be "
                            f"within {MAX_VL_ASPECT}:1, and no side may round to 0 px); crop it to a less extreme "
                            f"aspect ratio{larger}")


def check_output_size(model: str, height: int | None, width: int | None,
                      names: tuple[str, str] = ("--height", "--width")) -> None:
    """An output size (`names`: predict's flags, or evaluate.extra_prompts[i].height / .width) that the
    pipeline would round down (a warning in its log at most): 100 x 100 was written as 96 x 96. Its multiple:
    2.1's stock pipeline, 2 x its VAE's fixed scale factor 16; Edit, the patch `models.edit.prepare` rounds to
    (one rule: the same constant)."""
    from models.loading import model_variant
    from schemas.img_shapes import PIXELS_PER_PATCH

    multiple = 32 if model_variant(model) == "qwen-image-2.1" else PIXELS_PER_PATCH
    for name, value in zip(names, (height, width)):
        if value is not None and value % multiple:
            down, up = value // multiple * multiple, (value // multiple + 1) * multiple
            sizes = f"{down or up}{f' or {up}' if down else ''}"
            fix = f"pass {name} {sizes}" if name.startswith("--") else f"set {name} to {sizes}"
            raise UserError(f"{name}{' ' if name.startswith('--') else ' = '}{value}: {model} makes images in "
                            f"multiples of {multiple} px, and its pipeline would write {down} px instead; {fix}")
