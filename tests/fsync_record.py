"""Which paths a test's code fsyncs (not a test module itself)."""

from __future__ import annotations

import os


def fsynced(monkeypatch) -> list[str]:
    """The paths `os.fsync` is called on from now on (each descriptor's target, as /proc names it), in order."""
    real, paths = os.fsync, []

    def record(fd: int) -> None:
        paths.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    return paths
