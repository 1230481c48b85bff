"""The one wait for a shared file system's lagging view: a file or folder another node made a moment ago may not
show on this node yet (NFS caches a folder's attributes up to acdirmax, 60 s by default). Every look for what
another node wrote waits by it: the store writer's open and commit (store/writer_open.py, store/writer_commit.py),
the check that a run folder or store is the same folder on every node (models/shared_folder.py).

In schemas/ so models/, which may import nothing but schemas, waits as long as the store does: a node lagging
more than a shorter wait had its run folder refused as "not the same folder on every node"."""

from __future__ import annotations

import time
from typing import Callable

# Seconds between looks: waiting a minute once costs nothing next to a refused open, commit or run (a rerun)
VIEW_LAG_WAITS_S = (1, 2, 4, 8, 15, 30)
VIEW_LAG_SECONDS = sum(VIEW_LAG_WAITS_S)


def seen_in_time(look: Callable[[], bool]) -> bool:
    """Whether `look()` holds, at once or after one of the waits of VIEW_LAG_WAITS_S (VIEW_LAG_SECONDS in all)."""
    for wait in (*VIEW_LAG_WAITS_S, None):
        if look():
            return True
        if wait is not None:
            time.sleep(wait)
    return False
