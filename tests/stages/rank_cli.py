"""Run by each of two gloo processes (not a test module itself): `pipeline ARGS...` through the CLI's own entry
point (its signal handlers included); exit status and output are the test's. Several commands joined by `+` run
one after another in the same process (one launch, one set of imports), each after a `=== pipeline ARGS` line
on rank 0's stdout; the first to fail ends the process with its status.

    rank_cli.py ARGS... [+ ARGS...]...
"""

from __future__ import annotations

import itertools
import os
import sys


if __name__ == "__main__":
    from pipeline.cli import main

    args = sys.argv[1:]
    commands = [list(g) for joiner, g in itertools.groupby(args, lambda a: a == "+") if not joiner]
    if len(commands) == 1:
        sys.argv = ["pipeline", *args]
        main()
    else:
        for command in commands:
            if os.environ["RANK"] == "0":
                print("=== pipeline", *command, flush=True)
            sys.argv = ["pipeline", *command]
            try:
                main()
            except SystemExit as e:
                if e.code:
                    raise
