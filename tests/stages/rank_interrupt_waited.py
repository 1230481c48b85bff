"""Run by each of two gloo processes (tests/stages/test_rank_interrupt_waited.py, not a test module itself): rank W
waits for the other at an arrival (models/collective/arrive.py `arrive_together`, as every rank waits for rank 0's
checkpoint write), and the other is stopped by a Ctrl-C (SIGINT) outside any `fails_alone` / `together` block once
W's arrival is in the launch's store (so W surely waits for it: no sleep racing). Through the CLI's own entry point
(its signal handlers, typer's exit 130, its top-level handler); exit status and output are the test's.

    rank_interrupt_waited.py W
"""

from __future__ import annotations

import os
import signal
import sys
import time

RANK = int(os.environ["RANK"])


def main() -> None:
    waiting = int(sys.argv[1])
    from models import collective
    from pipeline.cli import app, main as cli
    from pipeline.commands.common import user_errors

    @app.command("wait-for-peer")
    def wait_for_peer() -> None:
        with user_errors():  # as every command: a rank's failure is its one line
            _wait_for_peer()

    def _wait_for_peer() -> None:
        # both ranks up and watching, as after a run's first decision (rank 0 serves the store from here on)
        collective.gather_before_group(2, "the start", "")
        if RANK == waiting:
            collective.arrive_together(2, "rank 0's checkpoint")  # the other never comes
            return
        store_client = collective.store_client
        client, key = store_client._store_client(), f"{store_client._launch_key('arrived')}/1/{waiting}"
        while not client.check([key]):  # the waiting rank has arrived: it waits for this one
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)  # the CLI's handler raises KeyboardInterrupt here, as on a Ctrl-C
        time.sleep(600)  # not reached

    sys.argv = ["pipeline", "wait-for-peer"]
    cli()


if __name__ == "__main__":
    main()
