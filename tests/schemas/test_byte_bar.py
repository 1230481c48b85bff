"""schemas/byte_bar.py: the package's one bar over bytes."""

from __future__ import annotations

import io

import tqdm.auto

from schemas.byte_bar import byte_bar


def test_a_byte_bar_is_tqdm_auto_s_and_counts_in_powers_of_1024(monkeypatch):
    """tqdm.auto's bar, as every other bar of the package (a Jupyter user gets its widget; plain tqdm printed text
    lines into the notebook), its figures in powers of 1024 under tqdm's letters."""
    made = []
    real = tqdm.auto.tqdm
    monkeypatch.setattr(tqdm.auto, "tqdm", lambda *a, **kw: made.append(kw) or real(*a, file=io.StringIO(), **kw))
    with byte_bar(3 * 1024**3, "push") as bar:
        bar.update(1536 * 1024)
        assert "1.50M/3.00G" in str(bar)
    assert len(made) == 1
