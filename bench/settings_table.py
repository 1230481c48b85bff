"""What a changed setting does, key by key, on the tiny demo: `python bench/settings_table.py [--only SECTION|KEY ...]`.

A baseline `pipeline run all` (configs/demo.yaml, shortened: 8 samples, 4 steps, a small evaluation) is restored
into one work folder for each flip (so every recorded path is the baseline's); every stage then runs as `run all`
runs it (`pipeline.orchestrate.stages`), and the table records what each did (`reuse` = up to date, skipped;
`rerun`, for a table stage with its computed / carried sample counts) and whether the flipped stage's output
differs from the baseline's (`same` bit for bit, `~` within 1e-2, `differs`). Where the stage reused its output,
the effect is measured on a fresh run of that stage alone (from the snapshot taken before it).

Verdicts: WRONG = the output changes but the stage reused the old one (a changed setting silently reused);
WASTE = recomputed but bit for bit the same (an unchanged output recomputed; some only on this data: no masks, no
alpha, one val sample). Nothing here is a test: it prints the table (markdown) for a review; the defects it finds
get their own cheap tests.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STAGES = ("resize-bucket", "encode-text", "encode-vae", "train", "evaluate")
SHORT = {"train.max_steps": 4, "train.checkpoint_every": 2, "train.keep_checkpoints": 2, "train.batch_size": 2,
         "evaluate.timesteps": [0.3, 0.7], "evaluate.noise_seeds": [0], "evaluate.num_samples": 1,
         "evaluate.num_inference_steps": 2, "evaluate.max_loss_samples": 4}

# (key, the value flipped to); the stage is the key's section. Values the demo can run (a CPU, no extra packages).
FLIPS: list[tuple[str, Any]] = [
    ("(none)", None),  # the baseline's own config on its copy: every stage up to date (the copy is sound)
    ("resize.target_area", 12544), ("resize.multiple", 64), ("resize.min_side", 64), ("resize.max_aspect", 1.5),
    ("resize.control_vl_area", 4096), ("resize.control_vae_area", 4096), ("resize.max_controls", 1),
    ("resize.min_controls", 1), ("resize.max_image_pixels", 30000), ("resize.max_image_frames", 5),
    ("resize.max_file_bytes", 2000), ("resize.keep_alpha", True), ("resize.val_fraction", 0.5),
    ("resize.split_by", "key"), ("resize.shard_size_mb", 0.01), ("resize.workers", 2),
    ("resize.columns.target", "image"), ("resize.vl_views", False),
    ("encode_text.device", "cpu"), ("encode_text.dtype", "bfloat16"), ("encode_text.batch_size", 1),
    ("encode_text.prompt_template_start_idx", 10), ("encode_text.batching", "padded"),
    ("encode_text.shard_size_mb", 0.01), ("encode_text.num_workers", 0), ("encode_text.no_control_embeds", True),
    ("encode_text.on_damaged", "skip"), ("encode_text.max_damaged_fraction", 0.5),
    ("encode_vae.device", "cpu"), ("encode_vae.dtype", "bfloat16"), ("encode_vae.batch_size", 1),
    ("encode_vae.shard_size_mb", 0.01), ("encode_vae.num_workers", 0), ("encode_vae.on_damaged", "skip"),
    ("encode_vae.max_damaged_fraction", 0.5),
    ("train.device", "cpu:0"), ("train.dtype", "bfloat16"), ("train.seed", 1), ("train.batch_size", 3),
    ("train.grad_accum", 2), ("train.max_steps", 6), ("train.learning_rate", 0.001), ("train.weight_decay", 0.1),
    ("train.adam_betas", [0.8, 0.99]), ("train.adam_eps", 1e-6), ("train.warmup_steps", 2),
    ("train.lr_schedule", "cosine"), ("train.max_grad_norm", 0.01), ("train.mixed_precision", "bf16"),
    ("train.gradient_checkpointing", True), ("train.caption_dropout", 0.5), ("train.checkpoint_every", 1),
    ("train.keep_checkpoints", 3), ("train.log_every", 2), ("train.log_with", []), ("train.sampler_window", 1),
    ("train.on_damaged", "skip"), ("train.max_damaged_fraction", 0.5), ("train.on_nonfinite", "skip_step"),
    ("train.lora.rank", 4), ("train.lora.alpha", 4.0), ("train.lora.dropout", 0.1),
    ("train.lora.target_modules", ["to_k", "to_q", "to_v", "to_out.0"]), ("train.lora.init_weights", "default"),
    ("train.sigma.sampling", "uniform"), ("train.sigma.logit_mean", 0.5), ("train.sigma.logit_std", 2.0),
    ("train.sigma.shift", 5.0), ("train.sigma.max_shift", 1.2), ("train.sigma.base_shift", 0.3),
    ("train.sigma.base_image_seq_len", 128), ("train.loss.mask_weight.foreground", 2.0),
    ("train.loss.mask_weight.background", 0.5), ("train.lora.kind", "dora"), ("train.control_dropout", 0.5),
    ("train.validate_noise_seeds", [1]),
    ("train.max_dropped_fraction", 0.5), ("train.max_open_shards", 1), ("train.optimizer", "adafactor"),
    ("train.ema_decay", 0.9), ("train.validate_every", 2), ("train.validate_max_samples", 1),
    ("train.validate_timesteps", [0.5]), ("train.sample_every", 2), ("train.sample_count", 1),
    ("train.sample_steps", 2), ("train.max_tokens_per_batch", 4096), ("train.prefetch", 2),
    ("train.attention_backend", "native"), ("train.check_ahead", 0),
    ("evaluate.device", "cpu"), ("evaluate.dtype", "bfloat16"), ("evaluate.seed", 7),
    ("evaluate.timesteps", [0.7, 0.3]), ("evaluate.noise_seeds", [0, 1]), ("evaluate.batch_size", 1),
    ("evaluate.max_loss_samples", 2), ("evaluate.num_samples", 2), ("evaluate.num_inference_steps", 3),
    ("evaluate.true_cfg_scale", 1.0), ("evaluate.negative_prompt", "blurry"), ("evaluate.lora_scale", 0.5),
    ("evaluate.attention_backend", "native"), ("evaluate.on_damaged", "skip"), ("evaluate.max_damaged_fraction", 0.5),
    ("evaluate.on_nonfinite", "skip"), ("evaluate.max_dropped_fraction", 0.5), ("evaluate.max_open_shards", 1),
    ("evaluate.score_ema", False),
]
STAGE_OF = {"(none)": "resize-bucket", "resize": "resize-bucket", "encode_text": "encode-text", "encode_vae": "encode-vae", "train": "train",
            "evaluate": "evaluate"}


def config(work: Path, flip: dict[str, Any] | None = None):
    from pipeline.config import load_config

    paths = {f"paths.{k}": str(work / k) for k in ("store", "run", "report")}
    paths.update({"paths.source": str(work.parent / "data"), "paths.model": str(work.parent / "model")})
    return load_config(REPO / "configs" / "demo.yaml", sets={**SHORT, **paths, **(flip or {})})  # the flip last


def run_stages(cfg, until: str | None = None, start: str | None = None) -> dict[str, dict]:
    """Each stage as `run all` runs it, from `start` up to `until`: {stage: {up_to_date, summary json}}."""
    from pipeline.orchestrate import check_config, stages

    paths, out, started = check_config(cfg), {}, start is None
    for name, call in stages():
        started = started or name == start
        if not started:
            continue
        summary = call(cfg, paths)
        record = summary.to_json() if hasattr(summary, "to_json") else {}
        out[name] = {"up_to_date": bool(summary.up_to_date), "record": record}
        if name == until:
            break
    return out


def output_of(stage: str, work: Path) -> Any:
    """The stage's output as comparable values: {name: bytes or tensor}."""
    from store import Store

    if stage in ("resize-bucket", "encode-text", "encode-vae"):
        table = {"resize-bucket": "images", "encode-text": "text", "encode-vae": "vae"}[stage]
        reader = Store(work / "store").reader(table)
        if table == "images":
            return {(k, n): hashlib.sha256(b).hexdigest() for k in reader.keys() for n, b in reader.files(k).items()} \
                | {(k, "split"): reader.meta(k)["split"] for k in reader.keys()}
        return {(k, n): t.float() for k in reader.keys() for n, t in reader.get(k)["tensors"].items()}
    if stage == "train":
        from models.lora import read_lora

        return {n: t.float() for n, t in read_lora(work / "run" / "lora")[0].items()}
    from stages.evaluate.report import checked_metrics

    metrics = checked_metrics(work / "report", "run the bench again")
    return {"loss": numbers(metrics.get("loss")), "generation": numbers(metrics.get("generation"))}


def numbers(value: Any, at: str = "") -> dict[str, Any]:
    """The numbers of a metrics.json section by their path (its wording - e.g. the settings described - left out)."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in numbers(item, f"{at}.{key}").items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in numbers(item, f"{at}[{i}]").items()}
    return {at: value} if isinstance(value, (int, float)) and not isinstance(value, bool) else {}


def effect(a: Any, b: Any) -> str:
    import torch

    if a.keys() != b.keys():
        return "differs (keys)"
    if all(not isinstance(v, torch.Tensor) for v in a.values()):  # evaluate's numbers: seconds left out by name
        a, b = ({k: v for k, v in d.items() if "second" not in k} for d in (a, b))
        return "same" if a == b else "differs"
    close = True
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape:
                return "differs"
            if not torch.equal(x, y):
                close = close and bool(((x - y).abs() <= 1e-2 * (1 + y.abs())).all())
                if not close:
                    return "differs"
        elif x != y:
            return "differs"
    return "same" if all((a[k] == b[k]) if not hasattr(a[k], "shape") else torch.equal(a[k], b[k]) for k in a) \
        else "~ (within 1e-2)"


def decision(status: dict) -> str:
    if status["up_to_date"]:
        return "reuse"
    r = status["record"]  # the table stages count their samples (a train / evaluate record holds no such counts)
    counts = f"{r['encoded']} computed / {r['reused']} carried" if r.get("stage") in STAGES[:3] else ""
    return f"rerun {counts}".strip()


def snapshot(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def restore(snap: Path, work: Path) -> None:
    shutil.rmtree(work, ignore_errors=True)
    snapshot(snap, work)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", default=None, help="sections (resize, encode_text, ...) or keys")
    parser.add_argument("--keep", type=Path, default=None, help="work folder (kept); default: a temp folder")
    args = parser.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="settings-table-"))
    from models.tiny import make_tiny_model
    from pipeline.demo_data import make_demo_data

    if not (root / "data").exists():
        make_demo_data(root / "data", n=8, max_controls=2, seed=0)
        make_tiny_model(root / "model", variant="edit-plus", seed=0)
    work = root / "work"  # every run in this one folder: the paths records hold are the baseline's
    snaps = {stage: root / f"before-{stage}" for stage in STAGES}
    if not (root / "after-all").exists():
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        for stage in STAGES:  # the snapshot before each stage: where a fresh run of it starts
            snapshot(work, snaps[stage])
            run_stages(config(work), until=stage, start=stage)
        snapshot(work, root / "after-all")
    restore(root / "after-all", work)
    baseline = {stage: output_of(stage, work) for stage in STAGES}
    rows = []
    for key, value in FLIPS:
        if args.only and key.split(".")[0] not in args.only and key not in args.only:
            continue
        stage = STAGE_OF[key.split(".")[0]]
        rows.append(flip_row(root, key, value, stage, baseline, snaps))
        print(rows[-1], file=sys.stderr, flush=True)
    print("| key | -> | own stage | effect | verdict | downstream |\n|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in ("key", "value", "own", "effect", "verdict", "downstream")) + " |")


def flip_row(root: Path, key: str, value: Any, stage: str, baseline: dict, snaps: dict) -> dict:
    from schemas.errors import UserError

    work, sets = root / "work", ({key: value} if key != "(none)" else {})
    restore(root / "after-all", work)
    t0 = time.perf_counter()
    try:
        statuses = run_stages(config(work, sets))
    except (UserError, ValueError) as e:
        return {"key": key, "value": json.dumps(value), "own": f"refused: {str(e).splitlines()[0][:100]}",
                "effect": "-", "verdict": "", "downstream": ""}
    own = statuses[stage]
    if own["up_to_date"]:  # measure what the flip would compute: the stage alone, afresh, from its snapshot
        restore(snaps[stage], work)
        run_stages(config(work, sets), until=stage, start=stage)
    changed = effect(output_of(stage, work), baseline[stage])
    verdict = "WRONG" if own["up_to_date"] and changed.startswith("differs") else \
        "WASTE" if not own["up_to_date"] and changed == "same" else ""
    after = STAGES[STAGES.index(stage) + 1:]
    return {"key": key, "value": json.dumps(value), "own": decision(own), "effect": changed, "verdict": verdict,
            "downstream": ", ".join(f"{s}: {decision(statuses[s])}" for s in after if s in statuses),
            "seconds": round(time.perf_counter() - t0, 1)}


if __name__ == "__main__":
    main()
