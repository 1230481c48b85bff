"""Cost of `evaluate --all-checkpoints` against N single-LoRA evaluations (issue 21: N checkpoints must cost at
most N x one LoRA's loss pass).

    python bench/evaluate_checkpoints.py [--checkpoints N]

On the tiny random model (models/tiny.py) and a store of 24 val samples of mixed sizes, half with an edit mask,
noise seeds [0, 1] x 5 σ (evaluate's defaults), num_samples 0 (held-out loss only):
- single: `stages.evaluate.stage.run` on one LoRA (load, base + LoRA loss, report), today's code;
- single, old loss protocol: the loss part as it was before one forward per row (masked samples: 3 passes);
- all: `stages.evaluate.checkpoints.run` on N checkpoints into a fresh report (load once, base once, N appends).
Timed in process CPU time on one thread (the box is shared; wall time is printed too). The fastest of 3 runs.

    python bench/evaluate_checkpoints.py --split-rows 1000000

The up-to-date check's val split part at scale instead: what `loss_fingerprint.content_fingerprint` computes once the
split is open (`read_fingerprint` + `earlier_settings`), on a synthetic join of `--split-rows` manifest rows per
table (bench/content_ids.py's manifests: 90% of them in the joined split), with max_loss_samples 256 (the default)
and unset, OUT without a loss array, with one of today's spelling, and with one of the whole split's spelling (an
earlier release's). Each in a fresh process: CPU and wall s, tracemalloc peak and peak RSS over the RSS before it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "stages"))  # the store builder the tests use

import torch  # noqa: E402

torch.set_num_threads(1)


def timed(fn, repeat: int = 3) -> tuple[float, float]:
    best = (float("inf"), float("inf"))
    for _ in range(repeat):
        c, w = time.process_time(), time.perf_counter()
        fn()
        best = min(best, (time.process_time() - c, time.perf_counter() - w))
    return best


def old_loss_pass(transformer, samples, cfg) -> None:
    """The loss before this change: rows through flow_loss for base and LoRA, then again per mask region."""
    from models.held_out import has_two_regions
    from stages.evaluate.loss_section import LossRow, row_losses
    from stages.evaluate.lora_attach import lora_enabled

    rows = [LossRow(s, k, float(t)) for s in samples for k in cfg.noise_seeds for t in cfg.timesteps]
    masked = [r for r in rows if has_two_regions(r.sample)]
    for on in (False, True):
        with lora_enabled(transformer, on):
            row_losses(transformer, rows, cfg.batch_size)
            for w in ((1.0, 0.0), (0.0, 1.0)):
                row_losses(transformer, masked, cfg.batch_size, w)


def main(n: int = 4) -> None:
    from models.loading import load_component
    from models.lora import add_lora, attach_lora, save_lora
    from models.tiny import make_tiny_model
    from schemas.config import EvaluateConfig, LoraConfig
    from stages.evaluate import checkpoints, stage
    from stages.evaluate.loss_section import held_out_loss
    from stages.evaluate.settings import resolved_config
    from stages.evaluate.transformer_load import load_transformer
    from stages.evaluate.val_samples import read_val_samples
    from train_store import make_train_store, mixed_specs

    tmp = Path(tempfile.mkdtemp(prefix="bench-eval-"))
    try:
        model = str(make_tiny_model(tmp / "model"))
        make_train_store(tmp / "store", model, mixed_specs(2, 24, masks=True))
        t = load_component(model, "transformer")
        add_lora(t, LoraConfig(rank=4))
        ckpts = []
        for i in range(n):
            g = torch.Generator().manual_seed(i)
            with torch.no_grad():
                for name, p in t.named_parameters():
                    if "lora_B" in name:
                        p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            save_lora(t, tmp / "run" / f"step-{(i + 1) * 10}" / "lora")
            ckpts.append(((i + 1) * 10, tmp / "run" / f"step-{(i + 1) * 10}" / "lora"))
        cfg = EvaluateConfig(num_samples=0, device="cpu")

        k = [0]

        def single() -> None:
            k[0] += 1
            stage.run(cfg, tmp / "store", model, ckpts[0][1], tmp / f"single-{k[0]}")

        def all_checkpoints() -> None:
            k[0] += 1
            checkpoints.run(cfg, tmp / "store", model, ckpts, tmp / f"all-{k[0]}")

        resolved = resolved_config(cfg, model)
        from stages.evaluate.val_share import reader

        tables, share = read_val_samples(resolved, tmp / "store", model)
        samples = [reader(tables, share)(i) for i in range(len(share.samples))]  # in full, as the old pass took
        tr = load_transformer(resolved, model)
        attach_lora(tr, ckpts[0][1])
        old = timed(lambda: old_loss_pass(tr, samples, resolved))
        new = timed(lambda: held_out_loss(tr, samples, resolved))
        one = timed(single)
        many = timed(all_checkpoints)
        # a rerun into the last report: nothing new (every step skipped), then one more checkpoint (only it runs)
        last = tmp / f"all-{k[0]}"
        rerun = timed(lambda: checkpoints.run(cfg, tmp / "store", model, ckpts, last), repeat=1)
        shutil.copytree(ckpts[-1][1], tmp / "run" / "step-999" / "lora")
        one_more = timed(lambda: checkpoints.run(cfg, tmp / "store", model, [*ckpts, (999, tmp / "run" / "step-999" / "lora")],
                                                 last), repeat=1)
        print(f"{len(samples)} val samples ({sum(s.mask_weight is not None for s in samples)} masked), "
              f"seeds {list(cfg.noise_seeds)} x σ {list(cfg.timesteps)}, N = {n} checkpoints; CPU s (wall s)")
        print(f"loss part, one LoRA, old protocol (3 passes on masked): {old[0]:.2f} ({old[1]:.2f})")
        print(f"loss part, one LoRA, one forward per row:                {new[0]:.2f} ({new[1]:.2f})  "
              f"ratio {new[0] / old[0]:.2f}")
        print(f"single-LoRA evaluate (load + base + LoRA + report):       {one[0]:.2f} ({one[1]:.2f})")
        print(f"--all-checkpoints, N = {n} (load + base + N + report):      {many[0]:.2f} ({many[1]:.2f})")
        print(f"rerun, nothing new (N skipped, summary + report):        {rerun[0]:.2f} ({rerun[1]:.2f})")
        print(f"rerun with one more checkpoint (only it evaluated):      {one_more[0]:.2f} ({one_more[1]:.2f})")
        print(f"ratio all / (N x single evaluate): {many[0] / (n * one[0]):.2f}   "
              f"all / (N x old loss part): {many[0] / (n * old[0]):.2f}   target <= 1")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _split_join(manifests: Path):
    """The synthetic join over the manifests saved at `manifests` (bench/content_ids.py), as an opened split is."""
    sys.path.insert(0, str(ROOT / "tests" / "store"))
    from store_samples import joined_over_manifests  # the storeless join bench/content_ids.py times too

    j = joined_over_manifests({t: (manifests / f"{t}.parquet").read_bytes() for t in ("text", "vae")})
    j._versions, j.damaged = None, {}  # what JoinedTables.__init__ sets and the storeless join leaves out
    return j


def _split_check_once(manifests: Path, cap: str, recorded: str) -> None:
    """One measurement (in its own process): `read_fingerprint` + `earlier_settings` of the join, OUT holding
    `recorded` ("none", "today", "whole": a loss array of that spelling)."""
    import resource
    import tracemalloc

    from schemas.config import EvaluateConfig
    from stages.evaluate import loss_fingerprint as fp
    from stages.evaluate.loss_groups import group_hash
    from store.loss_array import Axes, LossStore

    cfg = EvaluateConfig(num_samples=0, device="cpu", max_loss_samples=None if cap == "none" else int(cap))
    settings = {"tables": {}, "model_fingerprint": "bench", "evaluate": fp._loss_settings(cfg),
                "evaluation_revision": fp.EVALUATION_REVISION}
    out = Path(tempfile.mkdtemp(prefix="bench-evalsplit-"))
    try:
        if recorded != "none":  # written from another join: this one's content ids not computed yet
            setup = _split_join(manifests)
            fingerprint, now = fp.read_fingerprint(settings, setup)
            if recorded == "whole":
                now = {**now, "tables": setup.content_names()}
                fingerprint = group_hash(now)
            LossStore(out, fingerprint, Axes(["k"], ["b"], *cfg.loss_axes), now)
            del setup
        j = _split_join(manifests)
        page = os.sysconf("SC_PAGE_SIZE")
        rss_before = int(Path("/proc/self/statm").read_text().split()[1]) * page
        tracemalloc.start()
        w, c = time.perf_counter(), time.process_time()
        fingerprint, now = fp.read_fingerprint(settings, j)
        earlier = fp.earlier_settings(now, j, cfg, out)
        wall, cpu = time.perf_counter() - w, time.process_time() - c
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(f"max_loss_samples {cap:>4}, OUT's array {recorded:>5}: CPU {cpu:6.2f} s (wall {wall:6.2f} s), tracemalloc peak "
              f"{peak / 1e6:7.1f} MB, peak RSS over before {max(0, rss_peak - rss_before) / 1e6:7.1f} MB "
              f"({len(earlier)} earlier spellings)", flush=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def split_check(rows: int) -> None:
    import subprocess

    sys.path.insert(0, str(ROOT / "bench"))
    import numpy as np
    from content_ids import manifest

    tmp = Path(tempfile.mkdtemp(prefix="bench-evalsplit-"))
    try:
        rng = np.random.default_rng(0)
        for t in ("text", "vae"):
            (tmp / f"{t}.parquet").write_bytes(manifest(rows, t, rng))
        print(f"{rows} manifest rows per table (joined split: {len(_split_join(tmp))} rows)")
        for cap in ("256", "none"):
            for recorded in ("none", "today", "whole"):
                subprocess.run([sys.executable, __file__, "--split-once", str(tmp), cap, recorded], check=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--split-once"]:
        _split_check_once(Path(sys.argv[2]), sys.argv[3], sys.argv[4])
        sys.exit(0)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoints", type=int, default=4, help="N checkpoints evaluated in one --all-checkpoints run")
    ap.add_argument("--split-rows", type=int, default=0,
                    help="instead: the up-to-date check's val split part on a synthetic split of this many rows")
    args = ap.parse_args()
    if args.split_rows:
        split_check(args.split_rows)
    else:
        main(args.checkpoints)
