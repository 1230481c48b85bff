"""A rank ending on a failure every rank knows (an agreement's refusal: nothing published in the store) that torchrun's
agent SIGTERMs before it printed its line - another worker of its node exited first, and the agent stops the node's
other workers at once - still ends with that line. Before, the SIGTERM's handler found no published line and the rank
exited 143 silently (a real launch of 2 nodes x 2 workers: node 0's rank 0 said nothing where 3 ranks printed the
refusal)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from own_collective import own_collective  # noqa: E402,F401  (the fixture)


def test_a_sigterm_while_a_rank_ends_on_an_agreed_failure_ends_it_with_that_line(monkeypatch, capsys,
                                                                                 own_collective):  # noqa: F811
    collective = own_collective
    from pipeline import cli

    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cli, "_signalled", [])
    monkeypatch.setattr(cli, "note_signal", lambda signum: None)
    collective.state.run.update(watching=True, world=2)
    landed = []

    def stop_watching() -> None:  # the rank's last store calls: where the agent's SIGTERM lands
        if not landed:
            landed.append(True)
            cli._terminate(signal.SIGTERM, None)

    collective.state.run["stop_watching"] = stop_watching
    line = "rank 3: refused before the group"
    with pytest.raises(SystemExit) as stopped:
        collective.failure_line(collective.RankFailed(line), line)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert capsys.readouterr().err.splitlines() == [f"error: {line}"]
