"""The `own_collective` fixture: models.collective's per-process state for one test alone (the test process plays
a rank): its before-group store, its watch state and its report lock (models/collective/state.py). The watch thread
(started by the first exchange, or by the test) is stopped at the end, before the state is restored: a watch state
left behind broke later tests of the same worker, and a report lock kept by a watching rank silenced their error
lines."""

from __future__ import annotations

import threading

import pytest


@pytest.fixture
def own_collective(monkeypatch):
    from models import collective
    from models.collective import state

    monkeypatch.setattr(state, "before", state.fresh_before())
    monkeypatch.setattr(state, "run", state.fresh())
    monkeypatch.setattr(state, "report_lock", threading.Lock())
    yield collective
    if (stop := state.run.get("stop_watching")) is not None:
        stop()


def patch_where_used(monkeypatch, name: str, value) -> None:
    """`name` replaced by `value` in every module of models.collective that holds it: the one that defines it and
    each that imports it by name (a patch of the defining module alone misses those), and the package's own name
    where it exports it."""
    import importlib
    import pkgutil

    from models import collective

    modules = [collective] + [importlib.import_module(f"models.collective.{m.name}")
                              for m in pkgutil.iter_modules(collective.__path__)]
    held = [m for m in modules if hasattr(m, name)]
    assert held, f"no module of models.collective holds {name}"
    for module in held:
        monkeypatch.setattr(module, name, value)
