"""Errors a user can act on: the CLI prints them as one line (what, which file, what to do), no traceback."""


class UserError(Exception):
    pass


class Rejected(Exception):
    """A sample that goes to the quarantine instead of its table: `reason` is a short category, `detail` says
    what and where. Raised or returned by a stage's per-sample work; the run goes on."""

    def __init__(self, reason: str, detail: str = "", key: str | None = None) -> None:
        super().__init__(reason, detail, key)  # all init args in .args: picklable back from a worker process
        self.reason, self.detail, self.key = reason, detail, key

    def __str__(self) -> str:
        return self.detail or self.reason


_SECRET_NAME = None  # compiled on first use


def without_secrets(word: str) -> str:
    """`word` (a command-line item: `secret=...`, `--option=token=...`, `client_kwargs={aws_secret_access_key: ...}`)
    with the value after a secret-looking name (secret, token, password, credential, key) replaced by `***`: a
    credential given on the command line goes into no message, lease record or log. Other items are kept whole."""
    import re

    global _SECRET_NAME
    if _SECRET_NAME is None:
        _SECRET_NAME = re.compile(r"(secret|token|passw|credential|(?<![a-z])key(?![a-z]))[^=:]*[=:]", re.I)
    m = _SECRET_NAME.search(word)
    return word if m is None else word[: m.end()] + "***"
