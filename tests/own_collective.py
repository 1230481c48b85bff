"""The `own_collective` fixture: models.collective's per-process state for one test alone (the test process plays
a rank): its before-group store, its watch state and its report lock. The watch thread (started by the first
exchange, or by the test) is stopped at the end, before the state is restored: a watch state left behind broke
later tests of the same worker, and a report lock kept by a watching rank silenced their error lines."""

from __future__ import annotations

import threading

import pytest


@pytest.fixture
def own_collective(monkeypatch):
    from models import collective

    monkeypatch.setattr(collective, "_before", {"store": None, "hosted": False, "count": {}})
    monkeypatch.setattr(collective, "_state", {"watching": False, "published": False})
    monkeypatch.setattr(collective, "_report_lock", threading.Lock())
    yield collective
    if (stop := collective._state.get("stop_watching")) is not None:
        stop()
