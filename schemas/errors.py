"""Errors a user can act on: the CLI prints them as one line (what, which file, what to do), no traceback."""


class UserError(Exception):
    pass
