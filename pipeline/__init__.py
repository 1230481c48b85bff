"""The `pipeline` command (pipeline/cli.py) and what its commands share."""

import os
import sys


def _drop_the_folder_dash_m_put_first() -> None:
    """`python -m pipeline.cli` (or `-m pipeline`) puts the current folder first on sys.path, before the project:
    run from a folder holding a `store/` (a store's own folder), `models/`, `stages/`, `schemas/` or `features/`,
    that folder was imported in place of the project's package (`ImportError: cannot import name 'Store' from
    'store' (./store/__init__.py)`, a traceback). The `pipeline` script has its own bin folder there instead, and
    no folder of the user's; `-m` is made the same by dropping that entry, unless the folder is the project's
    root (whose packages these are). Python sets sys.argv[0] to "-m" only while it imports the module's package."""
    if sys.argv[:1] != ["-m"] or not sys.path or sys.path[0] != os.getcwd():
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.realpath(sys.path[0]) != os.path.realpath(root):
        del sys.path[0]


_drop_the_folder_dash_m_put_first()
