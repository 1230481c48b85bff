"""A node whose view of a shared run folder lags is not refused as "not the same folder on every node": a rank
looks for rank 0's probe file as long as the store looks for what another node wrote (`schemas.view_lag`), on a
fake clock here (no real waits)."""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest

import models.collective as collective
from models.shared_folder import PROBE, check_shared
from schemas import view_lag
from schemas.errors import UserError

TOKEN = 0x1234


@pytest.fixture
def rank1(monkeypatch):
    """Rank 1 of two, the collectives stood in for: the agreed token is TOKEN, an agreement runs its block."""

    @contextmanager
    def together(world, what="", uneven=False):
        yield

    monkeypatch.setattr(collective, "all_max", lambda world, values: [TOKEN])
    monkeypatch.setattr(collective, "together", together)


def _clock(monkeypatch, on_wait) -> list[float]:
    """`time.sleep` on a fake clock: each wait recorded and `on_wait(seconds so far)` called, none slept."""
    waits: list[float] = []

    def sleep(s: float) -> None:
        waits.append(s)
        on_wait(sum(waits))

    monkeypatch.setattr(time, "sleep", sleep)
    return waits


def test_a_probe_that_shows_after_2_5_s_is_seen(tmp_path, rank1, monkeypatch):
    """Before, a rank looked five times over 2 s and refused the run folder of a node lagging 2.5 s."""
    probe = tmp_path / f"{PROBE}{TOKEN:016x}"
    waits = _clock(monkeypatch, lambda now: probe.touch() if now >= 2.5 else None)
    check_shared(tmp_path, 2, 1, "--out", "why")
    assert 2.5 <= sum(waits) < view_lag.VIEW_LAG_SECONDS


def test_a_probe_never_seen_is_refused_after_the_whole_wait_saying_so(tmp_path, rank1, monkeypatch):
    waits = _clock(monkeypatch, lambda now: None)
    with pytest.raises(UserError) as e:
        check_shared(tmp_path, 2, 1, "--out", "why")
    line = str(e.value)
    assert sum(waits) == view_lag.VIEW_LAG_SECONDS
    assert "is not the same folder on every node: rank 1" in line and "(.shared-probe-" in line
    assert f"within {view_lag.VIEW_LAG_SECONDS} s" in line and "rerun" in line and "\n" not in line


def test_a_rank_waiting_for_the_probe_says_so_once(tmp_path, rank1, monkeypatch, capsys):
    """The minute's wait was silent on every rank: one line per rank after the first look fails, not one per look."""
    _clock(monkeypatch, lambda now: None)
    with pytest.raises(UserError):
        check_shared(tmp_path, 2, 1, "--out", "why")
    lines = [line for line in capsys.readouterr().err.splitlines() if "waiting" in line]
    assert len(lines) == 1
    assert lines[0].startswith("rank 1 on ") and f"up to {view_lag.VIEW_LAG_SECONDS} s" in lines[0]
    assert str(tmp_path) in lines[0]


def test_a_probe_seen_at_once_says_nothing(tmp_path, rank1, monkeypatch, capsys):
    (tmp_path / f"{PROBE}{TOKEN:016x}").touch()
    _clock(monkeypatch, lambda now: None)
    check_shared(tmp_path, 2, 1, "--out", "why")
    assert "waiting" not in capsys.readouterr().err
