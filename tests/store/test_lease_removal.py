"""The one remover of local lease files (store/lease.remove_dead, used by `store gc` and the URL cache's eviction):
a reader that refreshes its lease between a remover's judgement (dead: not refreshed for its margin) and the
removal keeps it, and what it names is kept. Before, the file was unlinked by path after the judgement: the
refreshed lease was lost (gc removed its version all the same and its reader stopped; the cache could evict its
version whole while it read). The refresh is injected right after the judgement (`lease.judge` wrapped); ages come
from file mtimes, never from waiting."""

from __future__ import annotations

import os
import time

import pytest

from store import Store
from store import gc, lease
from store.remote_cache import _live_leases
from store_samples import fill

AGED = lease.STALE_SECONDS + 120  # older than every remover's margin


@pytest.fixture
def v1_reader(store: Store, monkeypatch):
    """v1 (not current) read under a lease that every remover judges as another host's (by its refresh age),
    not refreshed for longer than its margin: judged dead, unless refreshed."""
    fill(store, 4, tag="a")  # v1
    fill(store, 4, tag="b", start=10)  # v2 current
    held = lease.hold(store.root, {"vae": 1}, "a reader")
    long_ago = time.time() - AGED
    os.utime(held.path, (long_ago, long_ago))
    monkeypatch.setattr(lease, "host_id", lambda: "another-node-s-kernel")  # the removers run elsewhere
    yield held
    held.release()


def _refreshed_right_after_its_judgement(monkeypatch, held: lease.Lease, refresh) -> list[str]:
    """`refresh` runs once, right after a remover judged `held`'s lease dead: what a reader's heartbeat does then."""
    real, judged = lease.judge, []

    def judge(path, *a, **k):
        found = real(path, *a, **k)
        if path == held.path and not found.live and not judged:
            judged.append(found.why)
            refresh()
        return found

    monkeypatch.setattr(lease, "judge", judge)
    return judged


REFRESHES = {
    # its heartbeat, by its own clock still within the margin: `os.utime` of the file (the same inode)
    "utime": lambda held: held._beat(now=held.path.stat().st_mtime + 1),
    # its heartbeat woken past the margin (`_lost_how`), or an `add`: the file written anew by an atomic rename
    "rewrite": lambda held: held._put(held.path),
}


@pytest.mark.parametrize("how", sorted(REFRESHES))
def test_the_cache_keeps_a_lease_refreshed_between_its_judgement_and_its_removal(store, v1_reader, monkeypatch, how):
    judged = _refreshed_right_after_its_judgement(monkeypatch, v1_reader, lambda: REFRESHES[how](v1_reader))
    live = _live_leases(store.root)
    assert judged and "not refreshed for" in judged[0]  # it was judged dead, then refreshed
    assert [f.path for f in live] == [v1_reader.path] and v1_reader.path.is_file()  # kept: v1 is pinned
    assert [p.name for p in v1_reader.path.parent.iterdir()] == [v1_reader.path.name]  # nothing left aside
    assert v1_reader._beat() is True
    lease.check_held(v1_reader)


def test_a_lease_refreshed_meanwhile_is_put_back_where_hard_links_are_refused(store, v1_reader, monkeypatch):
    def no_hard_links(src, dst, *a, **k):
        raise PermissionError(1, "Operation not permitted")

    _refreshed_right_after_its_judgement(monkeypatch, v1_reader, lambda: REFRESHES["utime"](v1_reader))
    monkeypatch.setattr(os, "link", no_hard_links)
    assert [f.path for f in _live_leases(store.root)] == [v1_reader.path]
    assert [p.name for p in v1_reader.path.parent.iterdir()] == [v1_reader.path.name]
    assert v1_reader._beat() is True


def test_gc_keeps_a_lease_and_its_version_refreshed_between_its_judgement_and_its_removal(store, v1_reader,
                                                                                          monkeypatch):
    judged = _refreshed_right_after_its_judgement(monkeypatch, v1_reader, lambda: REFRESHES["utime"](v1_reader))
    messages: list[str] = []
    p = gc.collect(store.root, echo=messages.append)
    assert judged and not p.remove and not p.dead_leases and ("vae", 1) in p.keep
    assert store.versions("vae") == [1, 2] and v1_reader.path.is_file()
    assert any(m.startswith("keep vae/v1: not current, but read by a reader") for m in messages), messages
    assert v1_reader._beat() is True
    lease.check_held(v1_reader)


def test_a_dead_lease_is_removed_and_what_a_killed_remover_left_aside_once_that_remover_is_gone(store, v1_reader):
    gone = 2**22 + 12345  # above pid_max: no process of this host has it
    folder = v1_reader.path.parent
    left = folder / f"x.json{lease.ASIDE}{gone}-1-n{lease.pid_namespace_id()}-0a1b2c3d"  # a killed remover's
    mid_look = folder / f"y.json{lease.ASIDE}{lease.process_tag()}-0a1b2c3d"  # a live remover's, mid-look
    for p in (left, mid_look):
        p.write_bytes(b"{}")
    found = lease.remove_dead(store.root, lease.leases(store.root))
    assert [(f.path, f.live) for f in found] == [(v1_reader.path, False)]
    assert sorted(p.name for p in folder.iterdir()) == [mid_look.name]
    gc.collect(store.root, echo=lambda m: None)  # nothing names v1 now
    assert store.versions("vae") == [2]


def test_a_reader_refreshing_after_the_removal_finds_its_lease_removed_and_writes_it_again(store, v1_reader):
    """What is left after the rename aside: the reader's refresh finds no file and looks under the store lock
    (`Lease._lost_how`): every version it names intact (no gc removed them), it writes it again."""
    assert _live_leases(store.root) == [] and not v1_reader.path.exists()
    assert v1_reader._beat() is True and v1_reader.path.is_file()
    lease.check_held(v1_reader)
