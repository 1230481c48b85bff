"""Progress bars on a terminal that reports no size (0 columns: a pty opened without one, as `ssh -t host cmd`
from a script or `script` without a terminal make): tqdm drew every bar trimmed to nothing."""

from __future__ import annotations

import os
import sys

import tqdm.std

from pipeline.bars import for_this_stderr
from pty_terminal import pty_terminal


def test_a_bar_on_a_terminal_of_zero_columns_shows_its_counts(monkeypatch):
    monkeypatch.setattr(tqdm.std, "_screen_shape_wrapper", tqdm.std._screen_shape_wrapper)  # put back after
    with pty_terminal(columns=None) as terminal:  # a new pty has no size: 0 x 0
        assert os.get_terminal_size(terminal.stream.fileno()).columns == 0
        monkeypatch.setattr(sys, "stderr", terminal.stream)
        for_this_stderr()
        bar = tqdm.std.tqdm(total=10, desc="train", unit="step", file=terminal.stream, dynamic_ncols=True)
        bar.update(3)
        bar.close()
        drawn = terminal.drawn()
    assert "train:  30%" in drawn and "3/10" in drawn and "step/s" in drawn, repr(drawn)


def test_a_terminal_with_a_size_is_left_to_tqdm(monkeypatch):
    monkeypatch.setattr(tqdm.std, "_screen_shape_wrapper", tqdm.std._screen_shape_wrapper)
    before = tqdm.std._screen_shape_wrapper
    with pty_terminal() as terminal:
        monkeypatch.setattr(sys, "stderr", terminal.stream)
        for_this_stderr()
    assert tqdm.std._screen_shape_wrapper is before
