"""A rank ending on a failure every rank knows (an agreement's refusal: nothing published in the store) that torchrun's
agent SIGTERMs before it printed its line - another worker of its node exited first, and the agent stops the node's
other workers at once - still ends with that line. Before, the SIGTERM's handler found no published line and the rank
exited 143 silently (a real launch of 2 nodes x 2 workers: node 0's rank 0 said nothing where 3 ranks printed the
refusal; likewise node 0's rank 0 held in its wait for the read marks of a refusal before the group, and of the
refusals of launch_devices.py and node_settings.py decided through that exchange)."""

from __future__ import annotations

import hashlib
import json
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


def _refused_by_rank_1(monkeypatch, collective, what: str, texts: dict[int, str]) -> None:
    """Rank 0 of 2 under torchrun, on node 0 (its agent's store: this worker waits for the read marks), with rank
    1's text of each exchange of `what` there (`texts`, by exchange): node 0's other worker ends on the refusal of
    the last first, and the agent's SIGTERM lands in this rank's read-mark wait of that exchange."""
    store = _as_rank(monkeypatch, 0, agent_store=True)
    key = f"{collective.store_client._launch_key('before-group')}/{what}"
    for exchange, text in texts.items():
        store.set(f"{key}/{exchange}/1", text)
    sigterm = _sigterm_lands(monkeypatch)

    def read_wait(client, counter: str, *args, _store=store, **kwargs) -> None:  # _store: the test's, kept serving
        if counter == f"{key}/{max(texts)}/read":
            sigterm()

    monkeypatch.setattr(collective.before_group, "_count_and_wait", read_wait)


def _ends_with(capsys, stopped, line: str) -> None:
    assert stopped.value.code == 128 + signal.SIGTERM
    assert capsys.readouterr().err.splitlines() == [f"error: {line}"]


def _view(gpus: int, rank: int = 0, **more) -> dict:
    return {"rank": rank, "local_rank": 0, "gpus": gpus, "host": f"node-{rank}", **more}


def test_a_sigterm_in_the_wait_of_a_refused_device_decision_ends_the_rank_with_its_line(monkeypatch, capsys,
                                                                                      own_collective):  # noqa: F811
    """train.device unset, node 1's rank without a GPU (models/launch_devices.py `agreed_cpu`): the refusal's line
    was formed after that wait, so the SIGTERM there ended node 0's rank with exit 143 and no line."""
    from models import launch_devices

    _refused_by_rank_1(monkeypatch, own_collective, "train.device", {1: json.dumps(_view(0, rank=1))})
    monkeypatch.setattr(launch_devices, "_view", lambda: _view(1))
    with pytest.raises(SystemExit) as stopped:
        launch_devices.agreed_cpu(2, "train.device")
    _ends_with(capsys, stopped, "train.device is unset and rank 1 on node-1 (of 2) has no GPU of its own while the "
               "other ranks do (NCCL and gloo ranks cannot train together): fix the GPU driver there (nvidia-smi), "
               "or set train.device=cpu to train every rank on the CPU")


def test_a_sigterm_in_the_wait_of_a_refused_device_setting_ends_the_rank_with_its_line(monkeypatch, capsys,
                                                                                     own_collective):  # noqa: F811
    """train.device=cuda:0, not there on node 1 (`check_devices`): silent before, likewise."""
    from models import launch_devices, loading

    missing = "train.device is cuda:0, which this machine does not have"
    _refused_by_rank_1(monkeypatch, own_collective, "train.device", {1: json.dumps(_view(0, rank=1, error=missing))})
    monkeypatch.setattr(launch_devices, "_view", lambda: _view(1))
    monkeypatch.setattr(loading, "check_device", lambda device, what: device)  # there on this rank
    with pytest.raises(SystemExit) as stopped:
        launch_devices.check_devices("cuda:0", "train.device", 2)
    _ends_with(capsys, stopped, f"{missing} (on rank 1 on node-1, of 2)")


def test_a_sigterm_in_the_wait_of_a_settings_refusal_ends_the_rank_with_its_line(monkeypatch, capsys,
                                                                               own_collective):  # noqa: F811
    """Node 1 runs with another train.max_steps (pipeline/node_settings.py): the digests differ (exchange 1), then
    the settings themselves name the key (exchange 2), in whose read-mark wait the SIGTERM lands. Silent before."""
    from pipeline import node_settings
    from schemas.config import PipelineConfig

    mine = PipelineConfig()
    theirs = json.dumps({**node_settings.shared_settings(mine), "train.max_steps": "7"})
    _refused_by_rank_1(monkeypatch, own_collective, node_settings.WHAT,
                       {1: hashlib.sha256(theirs.encode()).hexdigest(), 2: theirs})
    with pytest.raises(SystemExit) as stopped:
        node_settings.refuse_differing_settings(2, mine)
    _ends_with(capsys, stopped, "the ranks do not run with the same settings: rank 1's train.max_steps is 7, rank "
               f"0's {mine.train.max_steps} (each node reads --config and --set itself, and the nodes' copies of the "
               "config or their flags differ); use one config and the same flags on every node")
