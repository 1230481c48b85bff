"""A render function for resize-bucket's worker processes that ends its process, as the kernel's out-of-memory
killer or a crash in an image library would, on samples whose caption says "crash the worker"; every other
sample renders as usual. Importable by name from a spawned worker (pytest puts this folder on sys.path, and
spawn passes sys.path on)."""

from __future__ import annotations

import os
import signal

from stages.resize import rendering


def render_item(item, rc, rules):
    rec, key, caption = item
    if caption == "crash the worker":
        os.kill(os.getpid(), signal.SIGKILL)
    return rendering.render(rec, key, caption, rc, rules)


def echo_or_die(item: str) -> str:
    """`item` upper-cased, or the end of this process for "kill"."""
    if item == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    return item.upper()
