"""encode-text's `prepare` threads (stages/encode/text.py) asked `caption_hopeless` under the tokenizer lock for
every sample; only the tokenizer's first vocabulary read needs it (`stages.encode.intake._longest_token_bytes`).

Four threads each run 2000 samples as `prepare` does: the caption_hopeless step (timed: its wait for the lock
included), then a prompt tokenized under the lock. "before" takes the lock around the step (the old call, spelled
out below), "after" passes the lock in (taken only while the vocabulary is unread). 2-core shared dev machine,
tiny Edit model's tokenizer, two rounds:
  before 4145 / 4698 us per sample in the step | after 5.0 / 7.9 us
The totals (11.6..16.2 s for 8000 samples) do not move measurably here: the tokenizing itself is serialised by the
lock either way; in `prepare` the thread now goes on to its image preprocessing (outside the lock) instead of
waiting.

    python bench/tokenizer_lock.py MODEL    (MODEL: `pipeline make-tiny-model MODEL --variant edit`)
"""

from __future__ import annotations

import argparse
import threading
import time

from models.loading import load_component
from stages.encode.intake import caption_hopeless

CAPTION = "make the sky a deep evening blue and add a small red boat near the shore " * 2
PROMPT = "<|im_start|>system\nDescribe the image.<|im_end|>\n<|im_start|>user\n" + CAPTION * 6


def worker(tokenizer, lock: threading.Lock, mode: str, n: int, out: list[float]) -> None:
    spent = 0.0
    for _ in range(n):
        t = time.perf_counter()
        if mode == "before":
            with lock:
                caption_hopeless("k", CAPTION, tokenizer, lambda least: None)
        else:
            caption_hopeless("k", CAPTION, tokenizer, lambda least: None, lock)
        spent += time.perf_counter() - t
        with lock:
            tokenizer([PROMPT], return_tensors="pt")
    out.append(spent / n)


def main(model: str) -> None:
    tokenizer, lock = load_component(model, "processor").tokenizer, threading.Lock()
    for mode in ("before", "after", "before", "after"):
        out: list[float] = []
        threads = [threading.Thread(target=worker, args=(tokenizer, lock, mode, 2000, out)) for _ in range(4)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(f"{mode}: caption_hopeless step {1e6 * sum(out) / len(out):.1f} us/sample, "
              f"total {time.perf_counter() - t0:.2f} s for 8000 samples")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a model folder (`pipeline make-tiny-model DIR` builds a tiny one)")
    main(parser.parse_args().model)
