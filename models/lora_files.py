"""Where a LoRA's weights are: the rule for a --lora path, without torch (a mistyped path is told before the
model stack loads: ~2 s and ~700 MB for a path that is not there)."""

from __future__ import annotations

from pathlib import Path

from schemas.errors import UserError

WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # diffusers' default LoRA file name
EXPORT_FORMATS = ("comfyui",)  # `pipeline lora export --format` (models/lora_export.py writes them)
#: why a checkpoint listed or named before is gone: one wording in every line that says so (here, evaluate)
KEEPS_NEWEST = "the training keeps only its newest checkpoints (train.keep_checkpoints)"


def lora_weight_file(lora: str | Path) -> Path:
    """RUN/lora (a folder holding WEIGHT_NAME) or the .safetensors file itself; a clear error otherwise."""
    given = Path(lora)
    path = given / WEIGHT_NAME if given.is_dir() else given
    if not path.is_file() or path.suffix != ".safetensors":
        inside = given / "lora" / WEIGHT_NAME  # a run folder or a checkpoint folder (RUN/checkpoints/step-N)
        if given.is_dir() and inside.is_file():
            raise UserError(f"no LoRA weights at {path}: {given} is a run or checkpoint folder; pass its LoRA "
                            f"folder {inside.parent}")
        step = given.parent if given.name == "lora" else given  # RUN/checkpoints/step-N[/lora]
        if not given.exists() and step.parent.name == "checkpoints" and step.parent.is_dir():
            # a checkpoint the training pruned (train.keep_checkpoints) since a report named it
            kept = sorted((p.name for p in step.parent.iterdir() if p.name.startswith("step-")),
                          key=lambda n: int(n[5:]) if n[5:].isdigit() else -1)
            raise UserError(f"no LoRA weights at {path}: {step} does not exist (removed: {KEEPS_NEWEST}; or moved); "
                            f"{step.parent} holds {', '.join(kept) or 'no checkpoint'}")
        raise UserError(
            f"no LoRA weights at {path}: pass a folder written by `pipeline run train` (RUN/lora) "
            f"holding {WEIGHT_NAME}, or the .safetensors file itself"
        )
    return path


def weight_file_name(lora: str | Path) -> Path:
    """The weight file `lora` names, not looked up: its bytes are already read (`data=`), and a checkpoint a
    training pruned after they were read is loaded from them, not refused as missing (evaluate --all-checkpoints
    beside a training: pruned while loading is not damaged)."""
    given = Path(lora)
    return given if given.suffix == ".safetensors" else given / WEIGHT_NAME


def check_export_out(lora: str | Path, out: str | Path, overwrite: bool) -> None:
    """`lora export`'s --out as the command line names it, before the LoRA is read: not the LoRA being exported
    (even with `overwrite`), not a folder, and no file there unless `overwrite`. UserError naming what to pass."""
    # the name, not looked up (a missing --lora is told after), but a folder is a folder whatever its name ends in
    out, source = Path(out), Path(lora) / WEIGHT_NAME if Path(lora).is_dir() else weight_file_name(lora)
    if out.resolve() == source.resolve() or (out.exists() and source.exists() and out.samefile(source)):
        raise UserError(f"--out {out} is the LoRA being exported ({source}): the export would replace it; pass "
                        "another --out")
    if out.is_dir():  # --overwrite too: it names a file to replace, not a folder (a traceback at the rename)
        raise UserError(f"--out {out} is a folder; pass the file to write, e.g. {out / 'lora-comfyui.safetensors'}")
    if not overwrite:
        refuse_existing_out(out)


def refuse_existing_out(out: Path) -> None:
    if out.exists() or out.is_symlink():
        raise UserError(f"--out {out} exists (it is not the LoRA being exported): the export would replace it; "
                        "pass another --out, or --overwrite to replace it")
