"""The encode stages' progress bar: samples, advanced per encoded request, with what has been read so far.

A sample goes through the model as several requests (encode-text: prompt + empty prompt; encode-vae: target +
each control), and requests wait in shape/length groups until a batch fills, so a bar that moved only when a
sample was complete sat at 0% with no rate or ETA until the first batches finished (minutes on a big model).
Here each encoded request moves the bar by its share of its sample (one decimal shown), and the postfix
counts samples read and preprocessed, which moves from the first second.
"""

from __future__ import annotations

import time
from fractions import Fraction

from tqdm import tqdm

BAR_FORMAT = "{l_bar}{bar}| {n:.1f}/{total_fmt} samples [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


class SampleProgress:
    def __init__(self, total: int, desc: str, position: int = 0, file=None) -> None:
        self.bar = tqdm(total=total, desc=desc, unit="sample", position=position, dynamic_ncols=True, leave=True,
                        bar_format=BAR_FORMAT, file=file)
        self.read = 0
        self._done = Fraction(0)

    def sample_read(self) -> None:
        """One sample read and preprocessed (or rejected): shown at once, at most every `mininterval`."""
        self.read += 1
        self.bar.set_postfix_str(f"read {self.read}", refresh=False)
        if time.time() - self.bar.last_print_t >= self.bar.mininterval:
            self.bar.refresh()

    def encoded(self, requests_in_sample: int) -> None:
        """One request of a sample through the model: the bar moves by 1 / the sample's request count (summed
        exactly, so float rounding never takes the bar past its total)."""
        self._add(Fraction(1, requests_in_sample))

    def skipped(self) -> None:
        """A rejected sample counts as done."""
        self._add(Fraction(1))

    def _add(self, share: Fraction) -> None:
        self._done += share
        self.bar.update(float(self._done) - self.bar.n)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> "SampleProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
