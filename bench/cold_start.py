"""Cold start of each `pipeline` command: a fresh process from launch to exit, an old revision vs this checkout.

The old revision is unpacked with `git archive` into a temp folder (nothing in the repository changes); both run
with the same interpreter, each with its own tree first on PYTHONPATH, from a neutral folder, interleaved old/new
--repeat times; the medians of wall and CPU (user + sys: steadier than wall on a loaded machine) and old/new
ratios are printed. The fixtures (a tiny model, 8 demo samples through resize-bucket, encode-text, encode-vae)
are built once with this checkout, in --work (kept, reused when given again) or a temp folder.

2-core shared machine with a CI run on it (load 4-6), old = ea60028 (before the store imported torch lazily),
median of 3, wall / CPU: --help 0.41 / 0.45 s (1.0x, already free of the model stack); store inspect 2.95 ->
0.67 s (4.4x; CPU 3.6x); store verify 2.40 -> 0.73 s (3.3x); store gc --dry-run 1.98 -> 0.45 s (4.4x); plan
(tiny model) 14.1 / 16.3 s, CPU 8.6 / 8.4 s (1.0x: it builds the model on the meta device, so it imports diffusers,
and diffusers imports bitsandbytes whenever it is installed - ~0.7 s CPU of the 8.5, see docs/architecture.md).
Same machine (load 3-4), old = 1013687 (before an error line and a model folder's configs were read without
torch), median of 3, wall: store inspect (no store) 1.49 -> 0.37 s (4.0x), plan (no model) 1.51 -> 0.39 s (3.9x);
peak RSS (/usr/bin/time) of the first 687 -> 95 MB; the others as before.

    python bench/cold_start.py OLD_REV [--repeat 3] [--work /tmp/cold]
"""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from pathlib import Path

from old_vs_new import REPO, bench_args, bench_folders, env_for, interleaved_medians, old_tree  # bench/ is on sys.path: this script's folder


def commands(work: Path) -> dict[str, list[str]]:
    store, model, nowhere = str(work / "store"), str(work / "model"), str(work / "nowhere")
    return {
        "--help": ["--help"],
        "store inspect": ["store", "inspect", store],
        "store verify": ["store", "verify", store],
        "store gc --dry-run": ["store", "gc", store, "--dry-run"],
        "plan (tiny model)": ["plan", "--model", model],
        # a mistyped path: the command's one error line (exit 1) is all it does
        "store inspect (no store)": ["store", "inspect", nowhere],
        "plan (no model)": ["plan", "--model", nowhere],
    }


def run(tree: Path, words: list[str], cwd: Path) -> tuple[float, float]:
    """(wall, CPU) seconds of one `python -m pipeline.cli WORDS` from `tree` (exit 1 with one error line where
    WORDS name a path that is not there)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", *words], env=env_for(tree), cwd=cwd,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    expected = 1 if any(w.endswith("nowhere") for w in words) else 0
    if proc.returncode != expected or (expected and not proc.stderr.startswith("error: ")):
        raise SystemExit(f"{tree}: pipeline {' '.join(words)} failed:\n{proc.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def build_fixtures(work: Path) -> None:
    if (work / "store" / "vae").is_dir():
        return
    steps = [["make-tiny-model", str(work / "model"), "--variant", "edit-plus"],
             ["make-demo-data", str(work / "data"), "--n", "8"],
             ["run", "resize-bucket", "--source", str(work / "data"), "--store", str(work / "store"), "--area", "65536"],
             ["run", "encode-text", "--store", str(work / "store"), "--model", str(work / "model")],
             ["run", "encode-vae", "--store", str(work / "store"), "--model", str(work / "model")]]
    for words in steps:
        print("fixture: pipeline", " ".join(words[:2]), flush=True)
        run(REPO, words, work)


def main() -> None:
    args = bench_args(__doc__, repeat=3, work_holds="them")
    with bench_folders(args, "cold-start-") as (tmp, work):
        build_fixtures(work)
        old = old_tree(args.old, tmp)
        print(f"== cold start, old {args.old} vs this checkout, median of {args.repeat} (interleaved)")
        print(f"{'command':26s} {'old wall':>9s} {'new wall':>9s} {'ratio':>6s}   {'old cpu':>8s} {'new cpu':>8s} {'ratio':>6s}")
        for name, words in commands(work).items():
            (ow, oc), (nw, nc) = interleaved_medians(args.repeat, lambda: run(old, words, work),
                                                     lambda: run(REPO, words, work))
            print(f"{name:26s} {ow:8.2f}s {nw:8.2f}s {ow / nw:5.1f}x   {oc:7.2f}s {nc:7.2f}s {oc / nc:5.1f}x", flush=True)


if __name__ == "__main__":
    main()
