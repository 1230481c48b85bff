"""Throughput of the encode stages on the tiny model: samples/s, mean batch (prompts or images per forward; a
text sample is 2 prompts: instruction + empty), and the share of the encode loop spent outside the model
forward (reading, PNG decode, preprocessing, writing; target <= 10% at batch 8).

Two data sets, each encoded by both stages into a fresh store:
  uniform  every sample the same sizes and instruction length (every batch can be full)
  demo     `pipeline make-demo-data` through the real resize-bucket stage: mixed sizes, 0..3 controls
           (Edit-Plus) - exact batching holds only identical shapes, so the fill shows what exactness costs
encode-text runs twice per data set: `encode_text.batching` exact (default) and padded (same image grids, text
right-padded; a second table version in the same store), with padded's samples/s as a ratio of exact's.
Baseline, measured in the same run on the same samples: the unmodified diffusers pipeline one sample at a time
(`encode_prompt` for the prompt and the empty prompt; `_encode_vae_image` per image), data already decoded.

    python bench/encode.py --samples 64 --batch-size 8
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from pipeline.config import load_config  # noqa: E402
from schemas import FieldSpec, Lineage, TableSchema  # noqa: E402
from stages.encode import text as encode_text, vae as encode_vae  # noqa: E402
from stages.encode.common import Summary  # noqa: E402
from store import Store  # noqa: E402


def _png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def write_uniform(store: Path, n: int, target: tuple[int, int], control: tuple[int, int], vl: tuple[int, int]) -> None:
    rng = np.random.default_rng(0)
    schema = TableSchema(
        name="images", lineage=Lineage("bench", "uniform"),
        fields=[FieldSpec("target.png", "png", kind="file"), FieldSpec("control_{i}.png", "png", kind="file"),
                FieldSpec("control_{i}_vl.png", "png", kind="file"), FieldSpec("caption", "string", kind="column"),
                FieldSpec("num_controls", "int64", kind="column")],
    )
    w = Store(store).writer("images", schema)
    for i in range(n):
        files = {"target.png": _png(rng.integers(0, 255, (*target, 3), dtype=np.uint8)),
                 "control_0.png": _png(rng.integers(0, 255, (*control, 3), dtype=np.uint8)),
                 "control_0_vl.png": _png(rng.integers(0, 255, (*vl, 3), dtype=np.uint8))}
        key = hashlib.sha256(b"".join(files.values()) + str(i).encode()).hexdigest()[:32]
        shapes = [[1, target[0] // 16, target[1] // 16], [1, control[0] // 16, control[1] // 16]]
        w.add(key, files=files, meta={"caption": "make the square red", "num_controls": 1, "split": "train",
                                      "img_shapes": shapes})
    w.commit()


def write_demo(store: Path, n: int, work: Path) -> None:
    from pipeline.demo_data import make_demo_data
    from stages.resize import stage as resize_bucket

    make_demo_data(work / "demo-src", n=n, fmt="folder", max_controls=3, seed=0, with_masks=True)
    cfg = load_config(None, {"resize.target_area": 128 * 128, "resize.control_vae_area": 128 * 128,
                             "resize.control_vl_area": 168 * 168, "resize.val_fraction": 0.0})
    resize_bucket.run(cfg, work / "demo-src", store)


def baseline_text(model: str, store: Path, variant: str) -> float:
    """The stock pipeline, one sample at a time: samples/s (prompt + empty prompt each)."""
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline

    cls = QwenImageEditPlusPipeline if variant == "edit-plus" else QwenImageEditPipeline
    pipe = cls.from_pretrained(model, torch_dtype=torch.float32)
    images = Store(store).reader("images")
    inputs = []
    for key in images.keys():
        s = images.get(key)
        n = s["meta"]["num_controls"]
        if variant == "edit" and n != 1:
            continue
        names = [f"control_{i}.png" if variant == "edit" else f"control_{i}_vl.png" for i in range(n)]
        ims = [Image.open(io.BytesIO(s["files"][f])).convert("RGB") for f in names]
        inputs.append((s["meta"]["caption"], ims[0] if variant == "edit" else (ims or None)))
    t0 = time.perf_counter()
    with torch.no_grad():
        for caption, image in inputs:
            pipe.encode_prompt(caption, image=image, device="cpu")
            pipe.encode_prompt("", image=image, device="cpu")
    return len(inputs) / (time.perf_counter() - t0)


def baseline_vae(model: str, store: Path) -> float:
    from diffusers import QwenImageEditPipeline

    pipe = QwenImageEditPipeline.from_pretrained(model, torch_dtype=torch.float32)
    images = Store(store).reader("images")
    tensors = []
    for key in images.keys():
        s = images.get(key)
        for name in ["target"] + [f"control_{i}" for i in range(s["meta"]["num_controls"])]:
            im = Image.open(io.BytesIO(s["files"][f"{name}.png"])).convert("RGB")
            tensors.append((key, pipe.image_processor.preprocess(im, im.height, im.width).unsqueeze(2)))
    t0 = time.perf_counter()
    with torch.no_grad():
        for _, x in tensors:
            pipe._encode_vae_image(x, generator=None)
    return len({k for k, _ in tensors}) / (time.perf_counter() - t0)


def report(name: str, s: Summary, baseline: float) -> None:
    rate = s.encoded / s.loop_seconds
    outside = 1.0 - s.forward_seconds / s.loop_seconds
    mean_batch = s.forward_items / max(1, s.forwards)
    print(f"  {name:<12} {rate:8.1f} samples/s   outside forward {outside:6.1%}   "
          f"{s.forwards:4d} forwards, mean batch {mean_batch:4.2f}   baseline {baseline:7.1f} samples/s   "
          f"x{rate / baseline:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--workers", type=int, default=2, help="prefetch threads (encode_*.num_workers)")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp dir, removed)")
    args = ap.parse_args()

    from models.tiny import make_tiny_model

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-encode-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        models = {v: str(make_tiny_model(work / f"tiny-{v}", variant=v, seed=0)) for v in ("edit", "edit-plus")}
        settings = {
            "encode_text.dtype": args.dtype, "encode_text.batch_size": args.batch_size,
            "encode_text.num_workers": args.workers, "encode_vae.dtype": args.dtype,
            "encode_vae.batch_size": args.batch_size, "encode_vae.num_workers": args.workers,
        }
        cfg = load_config(None, settings)
        padded_cfg = load_config(None, {**settings, "encode_text.batching": "padded"})
        datasets = {"uniform": ("edit", lambda p: write_uniform(p, args.samples, (128, 128), (160, 160), (160, 160))),
                    "demo": ("edit-plus", lambda p: write_demo(p, args.samples, work))}
        print(f"tiny model, {args.samples} samples, batch {args.batch_size}, {args.dtype}, "
              f"{torch.get_num_threads()} torch threads, {args.workers} prefetch thread(s)")
        for name, (variant, build) in datasets.items():
            store = work / f"store-{name}"
            shutil.rmtree(store, ignore_errors=True)
            build(store)
            model = models[variant]
            print(f"{name} ({variant}, {len(Store(store).reader('images'))} samples):")
            text_baseline = baseline_text(model, store, variant)
            text = encode_text.run(cfg, store, model)
            report("text exact", text, text_baseline)
            padded = encode_text.run(padded_cfg, store, model)
            report("text padded", padded, text_baseline)
            speedup = (padded.encoded / padded.loop_seconds) / (text.encoded / text.loop_seconds)
            print(f"  text padded / exact: x{speedup:.2f} samples/s")
            vae = encode_vae.run(cfg, store, model)
            report("encode-vae", vae, baseline_vae(model, store))
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
