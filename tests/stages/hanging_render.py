"""A render function for resize-bucket's worker processes that never returns on the sample whose caption is the
environment's HANG_CAPTION, as a worker stuck on a file would; every other sample renders as usual. Importable
by name from a spawned worker (the parent puts this folder on sys.path, and spawn passes sys.path on)."""

from __future__ import annotations

import os
import time

from stages.resize import rendering


def render_item(item, rc, rules):
    rec, key, caption = item
    while caption == os.environ.get("HANG_CAPTION"):
        time.sleep(1)
    return rendering.render(rec, key, caption, rc, rules)
