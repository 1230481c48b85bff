"""The CLI's list of the signals that stopped the process (`pipeline.cli._signalled`) belongs to one run of its entry
point, as the signal record does: the training loop reads it (stages/train/stop.py `_recorded_by_cli`: a Ctrl-C lost
in a finalizer during the imports), so an earlier in-process run's SIGTERM (a test's `main()`, a notebook) left there
stopped the next run's training at its first step."""

from __future__ import annotations

import os
import signal


def test_a_second_run_in_the_process_starts_with_no_signal_of_the_first(monkeypatch) -> None:
    import pipeline.cli as cli
    from schemas import interruptible
    from stages.train import stop

    seen: list[list[int]] = []

    def command() -> None:
        seen.append(stop._recorded_by_cli())
        raise SystemExit(0)

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(cli, "app", command)
    monkeypatch.setattr(cli, "_signalled", [signal.SIGTERM])  # the earlier run's stop
    monkeypatch.setattr(interruptible, "_received", {"fd": None, "seen": set(), "write": None})
    monkeypatch.setattr(cli.exit_gc, "collect_once_at_exit", lambda: None)
    try:
        try:
            cli.main()
        except SystemExit as e:
            assert e.code == 0
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(-1)
        for end in ("fd", "write"):
            if interruptible._received.get(end) is not None:
                os.close(interruptible._received[end])
    assert seen == [[]], "the earlier run's SIGTERM reached this run's training"
