"""A `pipeline` process's exit: after the command's own atexit work, one garbage collection that still finalizes
the exit's garbage, then the heap frozen, so the interpreter's finalization does not walk it three more times
(pipeline/exit_gc.py; ~3 s after a model command's last line before)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# `pipeline.cli.main` running a command that leaves a reference cycle with a finalizer (only a collection frees it)
# and registers atexit work of its own, as a lease or the process group's close does. The probe registered before
# main() runs after every callback main() and the command register (atexit: last in, first out).
PROBE = """
import atexit, gc, sys
import typer
import pipeline.cli as cli

atexit.register(lambda: print("after: heap frozen", gc.get_freeze_count() > 0, flush=True))
gc.disable()  # no automatic collection: the cycle waits for the exit
app = typer.Typer()


class Cycle:
    def __del__(self):
        print("cycle finalized", flush=True)


@app.command()
def command():
    c = Cycle()
    c.me = c
    del c
    atexit.register(lambda: print("the command's atexit work", flush=True))


cli.app = app
sys.argv = ["pipeline"]
cli.main()
"""


def test_the_exit_collects_once_after_the_commands_atexit_work_then_freezes():
    proc = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # before: "after: heap frozen False", then the cycle finalized by the first of finalization's collections
    assert proc.stdout.splitlines() == ["the command's atexit work", "cycle finalized", "after: heap frozen True"]
