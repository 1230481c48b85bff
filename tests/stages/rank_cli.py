"""Run by each of two gloo processes (not a test module itself): `pipeline ARGS...` through the CLI's own entry
point (its signal handlers included); exit status and output are the test's.

    rank_cli.py ARGS...
"""

from __future__ import annotations

import sys


if __name__ == "__main__":
    from pipeline.cli import main

    sys.argv = ["pipeline", *sys.argv[1:]]
    main()
