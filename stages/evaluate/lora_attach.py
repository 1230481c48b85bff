"""The LoRA on evaluate's transformer: attached from the bytes checked at the start, switched off (the base) and on
around a pass."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from models.lora import attach_lora, lora_weight_file
from schemas.errors import UserError
from stages.evaluate.lora_bytes import read_for_load


@contextmanager
def lora_enabled(transformer, enabled: bool):
    """Run with the LoRA on or off (peft layers stay in place, only bypassed)."""
    if enabled:
        transformer.enable_lora()
    else:
        transformer.disable_lora()
    try:
        yield
    finally:
        transformer.enable_lora()


def attach_checked(transformer, lora: str | Path, scale: float, sha256: str) -> None:
    """`attach_lora` from the file's bytes read once, refused when they are not the bytes checked and recorded
    (the LoRA rewritten while evaluate ran): the report's recorded hash is that of the weights evaluated."""
    data, now = read_for_load(lora_weight_file(lora))
    if now != sha256:
        raise UserError(f"{lora_weight_file(lora)} changed while evaluate ran (its bytes are not the ones checked "
                        "at the start): rerun evaluate once whatever writes it has finished")
    attach_lora(transformer, lora, scale, data=data)
