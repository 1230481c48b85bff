"""A rank ending on a failure every rank knows (an agreement's refusal: nothing published in the store) that torchrun's
agent SIGTERMs before it printed its line - another worker of its node exited first, and the agent stops the node's
other workers at once - still ends with that line. Before, the SIGTERM's handler found no published line and the rank
exited 143 silently (a real launch of 2 nodes x 2 workers: node 0's rank 0 said nothing where 3 ranks printed the
refusal; likewise node 0's rank 0 held in its wait for the read marks of a refusal before the group)."""

from __future__ import annotations

import signal

import pytest

from own_collective import own_collective  # noqa: F401  (the fixture)
from test_known_left_together import _as_rank


def _sigterm_lands(monkeypatch):
    """The CLI's SIGTERM handler, its records of its own (the process's signals) left alone: the training loop's
    too (`stages.train.stop.EARLIER`, which the handler appends to where train is imported): left there, a later
    test's in-process training in this worker stopped "by SIGTERM" after its first step (CI)."""
    from pipeline import cli
    from stages.train import stop

    monkeypatch.setattr(cli, "_signalled", [])
    monkeypatch.setattr(cli, "note_signal", lambda signum: None)
    monkeypatch.setattr(stop, "EARLIER", [])
    return lambda *args, **kwargs: cli._terminate(signal.SIGTERM, None)


def test_a_sigterm_while_a_rank_ends_on_an_agreed_failure_ends_it_with_that_line(monkeypatch, capsys,
                                                                                 own_collective):  # noqa: F811
    collective = own_collective
    sigterm = _sigterm_lands(monkeypatch)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    collective.state.run.update(watching=True, world=2)
    landed = []

    def stop_watching() -> None:  # the rank's last store calls: where the agent's SIGTERM lands
        if not landed:
            landed.append(True)
            sigterm()

    collective.state.run["stop_watching"] = stop_watching
    line = "rank 3: refused before the group"
    with pytest.raises(SystemExit) as stopped:
        collective.failure_line(collective.RankFailed(line), line)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert capsys.readouterr().err.splitlines() == [f"error: {line}"]


def test_a_sigterm_in_node_0s_wait_for_the_read_marks_of_a_refusal_ends_the_rank_with_its_line(monkeypatch, capsys,
                                                                                            own_collective):  # noqa: F811,E501
    """Node 0's worker waits until every rank read the texts (its agent's store ends with the node's workers); the
    other worker of its node, done first, exits on the refusal and the agent SIGTERMs this one there."""
    collective = own_collective
    store = _as_rank(monkeypatch, 0, agent_store=True)
    monkeypatch.setattr(collective.before_group, "_count_and_wait", _sigterm_lands(monkeypatch))
    key = f"{collective.store_client._launch_key('before-group')}/the paths/1"
    store.set(f"{key}/1", "no such folder")  # rank 1's refusal, there before rank 0's text
    with pytest.raises(SystemExit) as stopped:
        with collective.together_before_group(2, "the paths"):
            pass
    assert stopped.value.code == 128 + signal.SIGTERM
    assert capsys.readouterr().err.splitlines() == ["error: rank 1: no such folder"]
