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
