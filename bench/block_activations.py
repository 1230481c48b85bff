"""What one transformer block keeps for the backward, per token and block width, at the families' full widths
(the figures beside `ActivationUnits` in models/memory_plan.py).

    PYTHONPATH=. python bench/block_activations.py [--tokens 320,640,1280] [--family edit|qwen-image-2.1]

Each family's block (Edit: 24 x 128 = 3072, the published configs; Qwen-Image-2.1: 32 x 128 = 4096, diffusers'
defaults, which are the released widths: no 2.1 config ships in models/published/) is set up as the trainer sets
it up (bf16 base, LoRA on `train.lora.target_modules`, bf16 autocast; tests/models/block_activations.py) and runs one
sample of each token count. Prints the saved bytes per token per D (and in the plan's bf16 units), the S² part
(2.1's mask copy, planned by `qwen21_mask_bytes`), the block's backward peak above its saved tensors and the plan's
units for the family. CPU only; about a minute per family and 3 GiB of memory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "models")]

from block_activations import block_backward_peak, block_saved, lora_model  # noqa: E402

from models.memory_plan import counts_from_model  # noqa: E402

FULL_HEADS = {"edit": 24, "qwen-image-2.1": 32}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="320,640,1280", help="token counts per sample, comma-separated")
    ap.add_argument("--family", choices=sorted(FULL_HEADS), action="append")
    args = ap.parse_args()
    for family in args.family or sorted(FULL_HEADS):
        model = lora_model(family, FULL_HEADS[family])
        units = counts_from_model(model).activations
        for tokens in (int(t) for t in args.tokens.split(",")):
            s = block_saved(model, tokens)
            print(f"{family} D={s.width} tokens={s.tokens}: saved {s.per_token / (s.tokens * s.width):.2f} bytes per "
                  f"token per D = {s.units:.2f} bf16 units (plan {units.per_token_block}), S² part {s.square} bytes, "
                  f"backward peak above the saved {block_backward_peak(model, tokens):.2f} units", flush=True)
        del model


if __name__ == "__main__":
    main()
