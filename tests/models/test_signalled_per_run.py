"""The CLI's list of the signals that stopped the process (`pipeline.cli._signalled`) belongs to one run of its entry
point, as the signal record does: the training loop reads it (stages/train/stop.py `_recorded_by_cli`: a Ctrl-C lost
in a finalizer during the imports), so an earlier in-process run's SIGTERM (a test's `main()`, a notebook) left there
stopped the next run's training at its first step."""

from __future__ import annotations

import signal

import pytest

from test_second_run import _main_running


def test_a_second_run_in_the_process_starts_with_no_signal_of_the_first(monkeypatch) -> None:
    from stages.train import stop

    seen: list[list[int]] = []

    def command() -> None:
        seen.append(stop._recorded_by_cli())
        raise SystemExit(0)

    with pytest.raises(SystemExit) as e:
        _main_running(monkeypatch, command, signalled=(signal.SIGTERM,))  # the earlier run's stop
    assert e.value.code == 0
    assert seen == [[]], "the earlier run's SIGTERM reached this run's training"
