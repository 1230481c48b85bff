"""The exit of a `pipeline` command that imports the model stack: an old revision vs this checkout, same run.

"exit" is the wall time from the command's last line of output (PYTHONUNBUFFERED, so a line arrives when printed)
to the process's end: atexit's callbacks and the interpreter's finalization. Before pipeline/exit_gc.py that was
three full garbage collections over the ~550k objects torch, torch._inductor, diffusers, transformers and peft
leave; now one, in the last atexit callback, and the finalization's skip the frozen heap. Also the whole command's
wall and CPU (user + sys, steadier than wall on a loaded machine). The old revision is unpacked with `git archive`
(bench/old_vs_new.py); both run with the same interpreter from a neutral folder, interleaved old/new
--repeat times; medians and old/new ratios are printed. The tiny model is built once with this checkout.

2-core shared machine, other helpers' tests running, old = 28e4be3, median of 5, `plan --model TINY`: exit 1.61 ->
0.51 s (3.1x; load ~1.5), 1.65 -> 0.50 s (3.3x; load ~4); whole command wall 8.2 -> 7.1 s, CPU 8.2 -> 7.1 s (1.2x).
A script importing only torch, diffusers, transformers and peft (load ~4), from its last statement to the process's
end: 3.2 s, 0.86 s with exit_gc's collect + freeze, 0.44 s with gc.freeze() alone (no collection at all: not done,
the exit's garbage would not be finalized); os._exit ~0.1 s.

    python bench/exit_time.py OLD_REV [--repeat 5] [--work /tmp/exit]
"""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from pathlib import Path

from old_vs_new import REPO, bench_args, bench_folders, env_for, interleaved_medians, old_tree  # bench/ is on sys.path: this script's folder


def commands(work: Path) -> dict[str, list[str]]:
    return {"plan (tiny model)": ["plan", "--model", str(work / "model")]}


def run(tree: Path, words: list[str], cwd: Path) -> tuple[float, float, float]:
    """(exit, wall, CPU) seconds of one `python -m pipeline.cli WORDS` from `tree`."""
    env = {**env_for(tree), "PYTHONUNBUFFERED": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = last = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", *words], env=env, cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = []
    for line in proc.stdout:
        last = time.perf_counter()
        output.append(line)
    proc.wait()
    end = time.perf_counter()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: pipeline {' '.join(words)} failed:\n{''.join(output)[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return end - last, end - start, cpu


def main() -> None:
    args = bench_args(__doc__, repeat=5, work_holds="the tiny model")
    with bench_folders(args, "exit-time-") as (tmp, work):
        if not (work / "model" / "model_index.json").is_file():
            run(REPO, ["make-tiny-model", str(work / "model"), "--variant", "edit-plus"], work)
        old = old_tree(args.old, tmp)
        print(f"== exit time, old {args.old} vs this checkout, median of {args.repeat} (interleaved)")
        print(f"{'command':18s} {'old exit':>9s} {'new exit':>9s} {'ratio':>6s}   {'old wall':>9s} {'new wall':>9s}"
              f"   {'old cpu':>8s} {'new cpu':>8s} {'ratio':>6s}")
        for name, words in commands(work).items():
            (oe, ow, oc), (ne, nw, nc) = interleaved_medians(args.repeat, lambda: run(old, words, work),
                                                             lambda: run(REPO, words, work))
            print(f"{name:18s} {oe:8.2f}s {ne:8.2f}s {oe / ne:5.1f}x   {ow:8.2f}s {nw:8.2f}s   {oc:7.2f}s {nc:7.2f}s "
                  f"{oc / nc:5.1f}x", flush=True)


if __name__ == "__main__":
    main()
