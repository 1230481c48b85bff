"""Train-stage benchmarks, one section per function, all run by `main` in one process.

    /work/venv/bin/python bench/train.py

Padding section: padding efficiency (valid / computed tokens, linear and weighted by seq_len², the attention
cost) of the length-aware sampler vs plain random batching at batch 8, on the realistic Edit / Edit-Plus mix of
DESIGN §5 — target areas 512²/768²/1024² (20/30/50 %), aspect ratios 1, 4:3, 3:4, 16:9, 9:16, 3:2, 2:3,
0/1/2/3 controls (10/50/25/15 %) each at ~1024² with its own aspect ratio, text 20–120 tokens + ~188 per
control image. A token is a 16×16-pixel patch (VAE ×8, 2×2 packing); buckets are multiples of 32 px.
Target: ≥ 0.97 linear for the sampler.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.sampler import LengthAwareBatchSampler, padding_efficiency, random_batches  # noqa: E402

ASPECTS = [1.0, 4 / 3, 3 / 4, 16 / 9, 9 / 16, 3 / 2, 2 / 3]
TARGET_AREAS = ([512 * 512, 768 * 768, 1024 * 1024], [0.2, 0.3, 0.5])
CONTROL_COUNTS = ([0, 1, 2, 3], [0.10, 0.50, 0.25, 0.15])
VL_TOKENS_PER_CONTROL = 188


def bucket_tokens(area: int, aspect: float, multiple: int = 32) -> int:
    """Image tokens of a bucket with this pixel area and width/height aspect."""
    h = max(multiple, round(math.sqrt(area / aspect) / multiple) * multiple)
    w = max(multiple, round(math.sqrt(area * aspect) / multiple) * multiple)
    return (h // 16) * (w // 16)


def realistic_mix(n: int, seed: int) -> tuple[list[int], list[int], list[int]]:
    """Per sample: (total sequence length, image tokens, text tokens) for the DESIGN §5 mix."""
    rng = random.Random(seed)
    totals, images, texts = [], [], []
    for _ in range(n):
        area = rng.choices(*TARGET_AREAS)[0]
        image = bucket_tokens(area, rng.choice(ASPECTS))
        controls = rng.choices(*CONTROL_COUNTS)[0]
        image += sum(bucket_tokens(1024 * 1024, rng.choice(ASPECTS)) for _ in range(controls))
        text = rng.randint(20, 120) + VL_TOKENS_PER_CONTROL * controls
        totals.append(image + text)
        images.append(image)
        texts.append(text)
    return totals, images, texts


def two_stream_efficiency(batches: list[list[int]], images: list[int], texts: list[int]) -> float:
    """Linear efficiency as the model computes it: image and text are padded separately."""
    valid = sum(images[i] + texts[i] for b in batches for i in b)
    computed = sum(len(b) * (max(images[i] for i in b) + max(texts[i] for i in b)) for b in batches if b)
    return valid / computed


def bench_padding(n: int = 20_000, batch_size: int = 8, window: int = 64, seeds: int = 3) -> dict[str, float]:
    rows = []
    for seed in range(seeds):
        totals, images, texts = realistic_mix(n, seed)
        sampler = LengthAwareBatchSampler(totals, batch_size, seed=seed, window=window)
        ours = sampler.epoch_batches(0)
        base = random_batches(n, batch_size, seed)
        rows.append(
            (
                *padding_efficiency(base, totals),
                two_stream_efficiency(base, images, texts),
                *padding_efficiency(ours, totals),
                two_stream_efficiency(ours, images, texts),
            )
        )
    mean = [sum(col) / len(col) for col in zip(*rows)]
    keys = ["random_linear", "random_quadratic", "random_two_stream", "sampler_linear", "sampler_quadratic", "sampler_two_stream"]
    result = dict(zip(keys, mean))
    print(f"== padding efficiency: {n} samples x {seeds} seeds, batch {batch_size}, window {window} batches")
    print(f"{'':8s} {'linear':>8s} {'quadratic':>10s} {'two-stream':>11s}")
    print(f"{'random':8s} {result['random_linear']:8.3f} {result['random_quadratic']:10.3f} {result['random_two_stream']:11.3f}")
    print(f"{'sampler':8s} {result['sampler_linear']:8.3f} {result['sampler_quadratic']:10.3f} {result['sampler_two_stream']:11.3f}")
    print(
        f"sampler / random: linear x{result['sampler_linear'] / result['random_linear']:.2f}, "
        f"quadratic x{result['sampler_quadratic'] / result['random_quadratic']:.2f}; "
        f"target sampler linear >= 0.97: {'met' if result['sampler_linear'] >= 0.97 else 'NOT met'}"
    )
    return result


def main() -> None:
    bench_padding()


if __name__ == "__main__":
    main()
