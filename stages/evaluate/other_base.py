"""The warning when a LoRA records another base model than the one it is evaluated on."""

from __future__ import annotations

from tqdm.auto import tqdm


def warn_other_base(loras: list, model: str, steps: list[int] | None = None) -> None:
    """One warning line when the LoRA(s) record another base model than MODEL (as predict and merge warn): the
    store may be shared with that model (same VAE and text encoder), so nothing else stops the run, and the
    numbers would say nothing about the LoRA."""
    from models.loading import model_fingerprint
    from models.lora import check_family_before_loading, lora_base_fingerprint

    for lora in loras:  # the other family refused before the transformer loads, not after
        check_family_before_loading(lora, model)
    now = model_fingerprint(model)
    other = [(i, fp) for i, lora in enumerate(loras) if (fp := lora_base_fingerprint(lora)) not in (None, now)]
    if other:
        shown = [str(steps[i]) for i, _ in other][:10] if steps else []
        which = f" (checkpoints {', '.join(shown)}{' …' if len(other) > 10 else ''})" if steps else ""
        tqdm.write(f"warning: LoRA {loras[other[0][0]]} was trained on a base model with fingerprint {other[0][1]}, "
                   f"but {model} has {now}{which}: its held-out loss and images do not show what training did")
