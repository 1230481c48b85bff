"""A published failure's end (models/collective/counting.py `_known_by_all`): every rank counts itself among those that
know the line and waits until all have; the store's host (rank 0 of a plain env:// launch) then ends the store
with its process. Before, it ended as soon as it saw every rank counted, while another rank still polled to see the
same: that rank's poll met a reset connection, and torch's client printed a C++ warning and stack after its last
line (CI: `test_a_failure_published_through_a_store_hiccup_still_stops_every_rank_with_its_line`). Now a rank that
saw all counted says so and calls the store no more; the host waits for those words. Rank-by-rank, in-process,
against a real TCPStore this test serves."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from datetime import timedelta

import torch.distributed as dist

from own_collective import own_collective  # noqa: F401  (the fixture)
from test_launch_devices import TIMEOUT, _env


def _as_rank(monkeypatch, rank: int, agent_store: bool = False) -> dist.TCPStore:
    """Rank `rank` of 2 (one a node under `agent_store`: the store, this test's, is node 0's agent's)."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    for name, value in _env(rank, store.port, agent_store=agent_store).items():
        monkeypatch.setenv(name, value)
    return store


def test_the_host_ends_only_once_every_rank_saw_all_counted(monkeypatch, own_collective) -> None:  # noqa: F811
    collective = own_collective
    store = _as_rank(monkeypatch, 0)  # rank 0 hosts the store
    key = collective.store_client._failure_key()
    store.set(f"{key}/known/1", "1")  # rank 1 counted itself and polls to see rank 0 counted
    returned = threading.Event()
    client = collective.store_client._store_client()
    host = threading.Thread(target=lambda: (collective.counting._known_by_all(client, key, 2), returned.set()),
                            daemon=True)
    host.start()
    # the host counts itself first (a loaded machine took over 2 s to get there: a fixed 2 s look failed), then
    # must still wait for rank 1's words; the look below can only miss a host that went on, never fail one that waits
    store.wait([f"{key}/known/0"], timedelta(seconds=TIMEOUT))
    assert not returned.wait(1.0), "the host went on (ending the store) before rank 1 saw every rank counted"
    store.set(f"{key}/known/left/1", "1")  # rank 1 saw it and calls the store no more
    assert returned.wait(TIMEOUT)


def test_under_torchrun_node_0s_worker_ends_only_once_every_rank_saw_all_counted(monkeypatch,
                                                                                 own_collective) -> None:  # noqa: F811
    """Under torchrun node 0's agent serves the store and ends it once its worker exits: that worker waits as a
    store's own host does. Before, it counted, saw rank 1 counted and exited at once: rank 1 (node 1, the
    publisher of a refusal) one poll behind met a reset connection, and torch's client printed a C++ warning and
    stack before its error line (CI: test_start_one_node, node 1's --out holding other files)."""
    collective = own_collective
    store = _as_rank(monkeypatch, 0, agent_store=True)
    key = collective.store_client._failure_key()
    store.set(f"{key}/known/1", "1")  # rank 1 published, counted itself and polls to see rank 0 counted
    returned = threading.Event()
    client = collective.store_client._store_client()
    rank0 = threading.Thread(target=lambda: (collective.counting._known_by_all(client, key, 2), returned.set()),
                             daemon=True)
    rank0.start()
    store.wait([f"{key}/known/0", f"{key}/known/left/0"], timedelta(seconds=TIMEOUT))  # its word for node 0's others
    assert not returned.wait(1.0), "node 0's worker went on (its exit ends the agent's store) before rank 1 saw it"
    store.set(f"{key}/known/left/1", "1")
    assert returned.wait(TIMEOUT)


def test_under_torchrun_another_nodes_rank_neither_waits_for_words_nor_polls_for_reads(monkeypatch,
                                                                                      own_collective) -> None:  # noqa: F811,E501
    """Node 1's rank does not end the store: it says its word and returns; before a group it counts its read and
    goes on, where it polled for node 0's read mark (a poll in flight when node 0's worker exited printed the
    C++ warning). A clock of the test's own: no pause taken."""
    collective = own_collective
    store = _as_rank(monkeypatch, 1, agent_store=True)
    key = collective.store_client._failure_key()
    store.set(f"{key}/known/0", "1")
    now, pauses = [0.0], []

    def pause(seconds: float) -> None:
        pauses.append(now[0])
        now[0] += seconds

    monkeypatch.setattr(collective.counting, "time", SimpleNamespace(monotonic=lambda: now[0], sleep=pause))
    collective.counting._known_by_all(collective.store_client._store_client(), key, 2)
    assert store.check([f"{key}/known/1", f"{key}/known/left/1"]) and pauses == []
    texts = f"{collective.store_client._launch_key('before-group')}/the paths/1"
    store.set(f"{texts}/0", "")  # rank 0's outcome, read before its read mark
    assert collective.gather_before_group(2, "the paths", "") == ["", ""]
    assert store.check([f"{texts}/read/1"]) and pauses == [], "rank 1 polled for node 0's read mark"


def test_a_rank_that_saw_all_counted_says_so_and_returns(monkeypatch, own_collective) -> None:  # noqa: F811
    collective = own_collective
    store = _as_rank(monkeypatch, 1)
    key = collective.store_client._failure_key()
    store.set(f"{key}/known/0", "1")  # the host counted
    collective.counting._known_by_all(collective.store_client._store_client(), key, 2)
    assert store.check([f"{key}/known/1", f"{key}/known/left/1"])


def test_a_rank_ending_on_the_line_stops_its_watch_thread_first(monkeypatch, own_collective) -> None:  # noqa: F811
    """Its watch thread polled on until the process ended: a poll in flight when the host ended the store printed
    the same warning (rank 1 of that CI run had published the failure itself)."""
    collective = own_collective
    store = _as_rank(monkeypatch, 1)
    collective.watch_failures(2)
    watcher = next(t for t in threading.enumerate() if t.name == "rank-failure-watch")
    key = collective.store_client._failure_key()
    store.set(f"{key}/known/0", "1")
    collective.counting._known_by_all(collective.store_client._store_client(), key, 2)
    assert not watcher.is_alive()


def test_the_host_waits_for_the_words_of_ranks_counted_at_the_end_of_its_wait(monkeypatch, own_collective) -> None:  # noqa: F811,E501
    """The host's wait for the others' words had the deadline of its wait for the counts before it: a last rank
    counted near that deadline left the host one look (the words not written yet) before it ended the store under
    ranks still polling. A clock of the test's own: rank 2 counts 9.95 s into the host's 10 s wait, and ranks 1
    and 2 say they stopped polling at its third pause, past the 10 s."""
    collective = own_collective
    store = _as_rank(monkeypatch, 0)  # rank 0 hosts the store
    key = collective.store_client._failure_key()
    client = collective.store_client._store_client()
    store.set(f"{key}/known/1", "1")  # rank 1 counted itself and polls to see all counted
    now, pauses = [0.0], []

    def pause(_seconds: float) -> None:
        pauses.append(now[0])
        if len(pauses) == 1:  # rank 2 counts at the end of the host's wait
            now[0] = collective.timing.HOST_WAIT_SECONDS - 0.05
            store.set(f"{key}/known/2", "1")
        else:
            now[0] += 0.1
        if len(pauses) == 3:  # ranks 1 and 2 saw all counted: they call the store no more
            store.set(f"{key}/known/left/1", "1")
            store.set(f"{key}/known/left/2", "1")

    monkeypatch.setattr(collective.counting, "time", SimpleNamespace(monotonic=lambda: now[0], sleep=pause))
    collective.counting._known_by_all(client, key, 3)
    assert store.check([f"{key}/known/left/1", f"{key}/known/left/2"]), \
        f"the host ended the store at {now[0]:.2f} s before every rank said it stopped polling"


def test_a_rank_whose_wait_ran_out_says_so_too(monkeypatch, own_collective) -> None:  # noqa: F811
    """Rank 2 never counted (killed): rank 1 stops polling at its bound and says so, or a host that saw rank 2
    count later would wait its whole bound for rank 1's word. The test's own clock: 0.1 s a pause."""
    collective = own_collective
    store = _as_rank(monkeypatch, 1)
    key = collective.store_client._failure_key()
    client = collective.store_client._store_client()
    store.set(f"{key}/known/0", "1")  # the host counted
    now = [0.0]
    monkeypatch.setattr(collective.counting, "time", SimpleNamespace(monotonic=lambda: now[0],
                                                            sleep=lambda _s: now.__setitem__(0, now[0] + 0.1)))
    collective.counting._known_by_all(client, key, 3)
    assert now[0] >= collective.timing.HOST_WAIT_SECONDS and store.check([f"{key}/known/left/1"])


def test_under_an_agent_store_each_rank_waits_until_all_read_a_before_group_decision(monkeypatch,
                                                                                       own_collective) -> None:  # noqa: F811
    """Under torchrun the store is an agent's, which ends once its node's worker exits: a refusal decided before the
    group (`together_before_group`) ended rank 0 as soon as it had read the texts, and node 1's rank, one poll
    behind, met a reset connection and ended on "the launch's store ... went away meanwhile" instead of the line
    (CI: test_settings_one_node's run all refusing node 1's report folder). Each rank now counts itself as having
    read and waits (at most HOST_WAIT_SECONDS) until every rank has, as a store's own host does."""
    collective = own_collective
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    for name, value in _env(0, store.port, agent_store=True).items():  # rank 0; the store is "the agent's"
        monkeypatch.setenv(name, value)
    key = f"{collective.store_client._launch_key('before-group')}/the paths/1"
    store.set(f"{key}/1", "rank 1's refusal")
    returned = threading.Event()
    rank0 = threading.Thread(target=lambda: (collective.gather_before_group(2, "the paths", ""), returned.set()),
                             daemon=True)
    rank0.start()
    store.wait([f"{key}/read/0"], timedelta(seconds=TIMEOUT))  # rank 0 read the texts
    assert not returned.wait(1.0), "rank 0 went on (its exit ends the agent's store) before rank 1 read the texts"
    store.set(f"{key}/read/1", "1")
    assert returned.wait(TIMEOUT)
