"""`models.quantize.load_quantized_transformer`'s cyclic garbage collection while it loads: a full `gc.collect()`
after every shard (the former loader: 9 x ~0.9 s in int8 rehearsals, where the process holds the pipeline's
objects) against other policies, each load in a fresh process, interleaved, the baseline in the same run:

  per_shard  gc.collect() after every shard (the former loader: the baseline)
  once       one gc.collect() after the last shard (the loader now)
  gen0       gc.collect(0) after every shard (the youngest generation only), one full collect at the end
  every_mb   gc.collect() once --every-mb MB of weights were read since the last one, and at the end
  none       no explicit collection (what the interpreter's own thresholds do alone)

Per load: the growth of the process's peak RSS over its RSS before the load (VmHWM, reset through
/proc/self/clear_refs after the imports), the load's seconds, the seconds spent in explicit collections, the
objects they found unreachable, and a checksum of the loaded weights (all policies must load the same model).
`--ballast` keeps that many million small objects alive, as the pipeline's process does (each full collection
walks them all). The model: a QwenImage transformer of --layers blocks at --width, saved in shards of
--shard-mb (built once under --dir).

    python bench/quantized_load_gc.py --dir /tmp/qgc --layers 3 --width 1024 --shard-mb 32 --repeat 2

2026-12-05, 2-core machine shared with other helpers (load average ~10: load seconds swing 12-75 s per run, the
collections' own seconds are the figure to read), 9 shards, 225 MiB bf16, int8, medians of 2, 0.59M objects:
  per_shard  load 54.6 s (1.00x)  gc 12.9 s in 9 (1.4 s each)  peak +771 MB (1.00x)  2045 unreachable
  once       load 42.0 s (0.77x)  gc  1.6 s in 1               peak +613 MB (0.79x)   178 unreachable
  gen0       load 27.7 s (0.51x)  gc  1.0 s in 10              peak +713 MB (0.92x)
  every_mb   load 25.6 s (0.47x)  gc  0.9 s in 1 (256 MB: the end only)  peak +756 MB (0.98x)
  none       load 25.5 s (0.47x)  gc  0 s                      peak +771 MB (1.00x)
The peak swung 533-817 MB between runs of one policy: per-shard collections did not lower it (their median is the
no-collection one's); the cycles they find would be found by the interpreter's own collections as the load
goes. The loader now collects once, after the last shard (`models.quantize._collect_garbage`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

POLICIES = ["per_shard", "once", "gen0", "every_mb", "none"]


def build(folder: Path, layers: int, width: int, shard_mb: int) -> None:
    import torch
    from diffusers import QwenImageTransformer2DModel

    if (folder / "config.json").is_file():
        return
    heads = width // 128
    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(num_layers=layers, attention_head_dim=128, num_attention_heads=heads,
                                        joint_attention_dim=width, in_channels=64, out_channels=16,
                                        axes_dims_rope=(16, 56, 56)).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size=f"{shard_mb}MB")


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _policy(name: str, every_mb: int, spent: dict):
    """(after_shard, after_load) for a policy; each explicit collection's seconds and finds go to `spent`."""
    import gc

    def collect(generation: int = 2) -> None:
        t = time.perf_counter()
        spent["unreachable"] += gc.collect(generation)
        spent["seconds"] += time.perf_counter() - t
        spent["collections"] += 1

    read = {"bytes": 0}

    def every(path) -> None:
        read["bytes"] += path.stat().st_size
        if read["bytes"] >= every_mb << 20:
            read["bytes"] = 0
            collect()

    return {"per_shard": (lambda p: collect(), lambda: None),
            "once": (lambda p: None, collect),
            "gen0": (lambda p: collect(0), collect),
            "every_mb": (every, collect),
            "none": (lambda p: None, lambda: None)}[name]


def _install(q, policy: str, every_mb: int, spent: dict) -> None:
    """The policy in the loader: its per-shard action runs when the loader lists the next shard's tensors (the
    loader's one call per shard: so after each shard but the last), the last shard's and the end-of-load action
    in place of the loader's own end-of-load collection (`_collect_garbage`)."""
    after_shard, after_load = _policy(policy, every_mb, spent)
    names, done = q._tensor_names, []

    def tensor_names(path):
        if done:
            after_shard(done[-1])
        done.append(Path(path))
        return names(path)

    def end() -> None:
        after_shard(done[-1])
        after_load()

    q._tensor_names, q._collect_garbage = tensor_names, end


def _checksum(model) -> str:
    import hashlib

    import torch

    from models.quantize import is_quantized

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        parts = [getattr(p, n) for n in p.__tensor_flatten__()[0]] if is_quantized(p) else [p.data]
        for t in parts:
            h.update(name.encode())
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.dtype != torch.bfloat16
                     else t.contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


def one(folder: str, policy: str, quantize: str, every_mb: int, ballast_millions: float) -> dict:
    """One load in this process (a child of `main`): its figures as a dict."""
    import gc

    import torch

    from models import quantize as q

    ballast = [{"i": i} for i in range(int(ballast_millions * 1e6))]  # kept alive until the figures are taken
    spent = {"seconds": 0.0, "unreachable": 0, "collections": 0}
    _install(q, policy, every_mb, spent)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    before = _rss_kb("VmRSS")
    t = time.perf_counter()
    model = q.load_quantized_transformer(folder, torch.bfloat16, torch.device("cpu"), quantize)
    seconds = time.perf_counter() - t
    return {"policy": policy, "load_s": seconds, "peak_growth_mb": (_rss_kb("VmHWM") - before) / 1024,
            "gc_s": spent["seconds"], "collections": spent["collections"], "unreachable": spent["unreachable"],
            "objects": len(gc.get_objects()), "checksum": _checksum(model), "ballast": len(ballast)}


def _run_child(args, policy: str) -> dict:
    cmd = [sys.executable, __file__, "--child", policy, "--dir", str(args.dir), "--quantize", args.quantize,
           "--every-mb", str(args.every_mb), "--ballast", str(args.ballast)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--shard-mb", type=int, default=64)
    ap.add_argument("--quantize", default="int8")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--every-mb", type=int, default=256)
    ap.add_argument("--ballast", type=float, default=0.0, help="millions of small objects kept alive")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--child", choices=POLICIES)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one(str(args.dir), args.child, args.quantize, args.every_mb, args.ballast)))
        return
    build(args.dir, args.layers, args.width, args.shard_mb)
    shards = sorted(args.dir.glob("*.safetensors"))
    print(f"model: {len(shards)} shards, {sum(s.stat().st_size for s in shards) / 2**20:.0f} MiB bf16, "
          f"{args.quantize}, ballast {args.ballast}M objects", flush=True)
    policies = args.policies.split(",")
    rows = {p: [] for p in policies}
    for _ in range(args.repeat):
        for p in policies:  # interleaved: load drift hits every policy alike
            r = _run_child(args, p)
            rows[p].append(r)
            print(f"  {p:10s} load {r['load_s']:6.2f} s  gc {r['gc_s']:5.2f} s  peak +{r['peak_growth_mb']:5.0f} MB",
                  flush=True)
    base = statistics.median(r["load_s"] for r in rows[policies[0]])
    base_peak = statistics.median(r["peak_growth_mb"] for r in rows[policies[0]])
    for p in policies:
        rs = rows[p]
        load, peak = statistics.median(r["load_s"] for r in rs), statistics.median(r["peak_growth_mb"] for r in rs)
        print(f"{p:10s} load {load:6.2f} s ({load / base:4.2f}x)  gc {statistics.median(r['gc_s'] for r in rs):5.2f} s "
              f"in {rs[0]['collections']:2d}  peak +{peak:6.0f} MB ({peak / base_peak:4.2f}x)  "
              f"unreachable {rs[0]['unreachable']:6d}  objects {rs[0]['objects'] / 1e6:.2f}M  {rs[0]['checksum']}")
    if len({r["checksum"] for rs in rows.values() for r in rs}) != 1:
        raise SystemExit("quantized_load_gc: the policies loaded different weights")


if __name__ == "__main__":
    main()
