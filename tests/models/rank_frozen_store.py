"""Run by tests/models/test_frozen_store.py (not a test module itself): a launched rank (the test's environment:
rank 1 of 2) whose launch's store is a port that accepts connections and never answers (its host stopped, SIGSTOP,
or hung), stopped by the test's SIGINT (a Ctrl-C) before its own first exchange: through the CLI's own entry point
(its signal handlers, typer's exit 130, its top-level publish). Prints `ready` once it waits for the signal:
asleep, or, with `exchange`, then at its first exchange (`gather_before_group`: connecting to that store).

    rank_frozen_store.py CONNECT_SECONDS [exchange]
"""

from __future__ import annotations

import sys
import time


def main() -> None:
    from models import collective
    from pipeline.cli import app, main as cli

    # the bound of the publish's connect (10 s): shorter here, so a fixed exit comes in seconds
    collective.timing.CONNECT_SECONDS = float(sys.argv[1])
    exchange = sys.argv[2:] == ["exchange"]

    @app.command("wait-for-ctrl-c")
    def wait_for_ctrl_c() -> None:
        print("ready", flush=True)
        if exchange:
            collective.gather_before_group(2, "the start", "")  # waits for the store's answer until the SIGINT
        time.sleep(600)  # the test's SIGINT ends it

    sys.argv = ["pipeline", "wait-for-ctrl-c"]
    cli()


if __name__ == "__main__":
    main()
