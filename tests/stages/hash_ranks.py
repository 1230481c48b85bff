"""Run by each of two gloo processes (tests/stages/test_evaluate_reads.py, not a test module itself): the
checkpoint check of `evaluate --all-checkpoints` over two ranks. Prints `RESULT ok: {json}` with the bytes this
rank read per weight file and the sha256 per step it holds afterwards, then, after one file was damaged,
`RESULT damaged: <the line both ranks stop with>`.

    hash_ranks.py FOLDER   (FOLDER/step-N/lora/pytorch_lora_weights.safetensors, sealed FOLDER/step-N/resume.json)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from read_counter import WEIGHTS, count_lora_reads
from schemas.config import EvaluateConfig
from schemas.errors import UserError
from stages.evaluate.checkpoint_files import check_and_hash
from stages.evaluate.ranks import launched


def main() -> None:
    folder = Path(sys.argv[1])
    ckpts = sorted(((int(p.name.split("-")[1]), p / "lora") for p in folder.glob("step-*")))
    ranks = launched(EvaluateConfig(device="cpu"))
    patch = pytest.MonkeyPatch()
    counts = count_lora_reads(patch)
    kept, shas = check_and_hash(ckpts, ranks)
    print(f"RESULT ok: {json.dumps({'read': dict(counts), 'shas': shas, 'kept': [s for s, _ in kept]})}", flush=True)
    patch.undo()
    if ranks.main:  # rank 1's file (the second checkpoint) damaged: a flipped bit in its first weight
        weights = ckpts[1][1] / WEIGHTS
        data = bytearray(weights.read_bytes())
        data[8 + int.from_bytes(data[:8], "little")] ^= 1
        weights.write_bytes(bytes(data))
    from models.collective import together

    with together(ranks.world, "damage"):  # rank 1 hashes after the damage only
        pass
    try:
        check_and_hash(ckpts, ranks)
        print("RESULT damaged: accepted", flush=True)
    except UserError as e:
        print(f"RESULT damaged: {e}", flush=True)


if __name__ == "__main__":
    main()
