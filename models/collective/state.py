"""What this process's collective modules share, per run: the watch state (`run`: whether it watches, whether it
published a failure, its watch thread and its stop, what it found of the launch's store), the before-group exchange's
store and counts (`before`), the report lock (`report_lock`, replaced by `new_run`), and each thread's own finding of
a silent store (`found`). Read through this module (`state.run`), never bound by name elsewhere: a new run (or a
test's own state) replaces them here."""

from __future__ import annotations

import threading


def fresh() -> dict:
    return {"watching": False, "published": False}


def fresh_before() -> dict:
    return {"store": None, "hosted": False, "count": {}}


run: dict = fresh()
before: dict = fresh_before()
report_lock = threading.Lock()
# `silent`: the line of this thread's last store call (`_outcome`) where it went unanswered, else None
found = threading.local()
