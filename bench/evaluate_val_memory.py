"""What single-LoRA evaluate holds of its val samples with `max_loss_samples: null` (every val sample).

    python bench/evaluate_val_memory.py [N ...]

On the tiny random model (models/tiny.py), a store of N val samples of mixed sizes (half with an edit mask):
the bytes of the tensors `stages.evaluate.val_samples.read_val_samples` hands back (held through both loss passes and
the report), and the most tensor bytes of full samples one loss pass holds at a time (`loss_grid`'s batch).
Bytes, not RSS: the tiny samples are KBs, lost in an RSS of hundreds of MB; the growth with N is the point.
`nbytes` does not see a view keeping its whole buffer alive (a float32 mask read from the store is one:
`val_share.outline` copies it; tests/models/test_held_out_batch_size.py checks the buffer is freed).
"""

from __future__ import annotations

import argparse
import inspect
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "stages"))  # the store builder the tests use

import torch  # noqa: E402

torch.set_num_threads(1)


def tensor_bytes(samples) -> int:
    total = 0
    for s in samples:
        for t in (s.target, *s.controls, s.prompt_embeds, s.empty_embeds, s.mask_weight, s.nocontrol_embeds):
            total += t.nbytes if t is not None else 0
    return total


def main(counts: list[int]) -> None:
    from models import held_out
    from models.loading import load_component
    from models.lora import add_lora, save_lora
    from models.tiny import make_tiny_model
    from schemas.config import EvaluateConfig, LoraConfig
    from stages.evaluate import loss_section, stage
    from train_store import make_train_store, mixed_specs

    tmp = Path(tempfile.mkdtemp(prefix="bench-evalmem-"))
    try:
        model = str(make_tiny_model(tmp / "model"))
        t = load_component(model, "transformer")
        add_lora(t, LoraConfig(rank=4))
        save_lora(t, tmp / "lora")
        cfg = EvaluateConfig(num_samples=0, device="cpu", max_loss_samples=None, noise_seeds=[0], timesteps=[0.5])
        held, batch_peak = {}, [0]
        read, grid = stage.read_val_samples, held_out.loss_grid

        def read_and_weigh(*a, **k):
            tables, got = read(*a, **k)
            held["bytes"] = tensor_bytes(getattr(got, "samples", got))  # a Share now, a list before
            return tables, got

        def grid_and_weigh(transformer, samples, *a, load=None, **k):
            def weighed(i):  # the full samples of one batch: at most batch_size of them
                s = load(i) if load else samples[i]
                batch_peak[0] = max(batch_peak[0], tensor_bytes([s]) * cfg.batch_size)
                return s
            if "load" in inspect.signature(grid).parameters:
                return grid(transformer, samples, *a, load=weighed, **k)
            return grid(transformer, samples, *a, **k)

        stage.read_val_samples, loss_section.loss_grid = read_and_weigh, grid_and_weigh
        for n in counts:
            make_train_store(tmp / f"store-{n}", model, mixed_specs(1, n, masks=True))
            batch_peak[0] = 0
            stage.run(cfg, tmp / f"store-{n}", model, tmp / "lora", tmp / f"report-{n}")
            print(f"{n} val samples: held {held['bytes']} B ({held['bytes'] / n:.0f} B/sample); one batch of "
                  f"{cfg.batch_size} full samples <= {batch_peak[0]} B" if batch_peak[0] else
                  f"{n} val samples: held {held['bytes']} B ({held['bytes'] / n:.0f} B/sample)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("counts", nargs="*", type=int, default=[16, 64], help="val sample counts to measure")
    main(ap.parse_args().counts)
