"""schemas/byte_bar.py: the package's one bar over bytes."""

from __future__ import annotations

import io

import tqdm.auto

from schemas.byte_bar import byte_bar


def test_a_byte_bar_is_tqdm_auto_s_and_says_its_figures_in_the_one_size_rule():
    """tqdm.auto's bar, as every other bar of the package (a Jupyter user gets its widget; plain tqdm printed text
    lines into the notebook). Its count, total and rate in `size_text`'s binary units: tqdm's own scaling said
    `1.50M/3.00G` in powers of 1024 and the rate `MB/s` in powers of 1000, beside summaries in kB / MB."""
    with byte_bar(3 * 1024**3, "push") as bar:
        assert isinstance(bar, tqdm.auto.tqdm)
        bar.fp = io.StringIO()
        bar.update(1536 * 1024)
        bar.start_t -= 1.0  # a second in: a rate of 1.5 MiB/s
        shown = str(bar)
    assert "| 1.5 MiB/3072.0 MiB [" in shown and "MiB/s]" in shown and "MB" not in shown, shown

