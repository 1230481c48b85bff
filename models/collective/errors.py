"""The errors every rank agrees on: `RankFailed` (another rank's failure, or this one's, the same line on every
rank), whether an error is known to every rank already (`agreed`, `_mark`), and the one-line text an error travels
as (`_message`, `_first_line`)."""

from __future__ import annotations

from schemas.errors import UserError


class RankFailed(UserError):
    """Another rank (or this one) failed a step all ranks take together; the message is that rank's error."""


def _message(error: BaseException, what: str) -> str:
    if isinstance(error, UserError):
        text = str(error)
    else:
        text = f"{what or 'a step'} failed: {type(error).__name__}: {error}"
    return " ".join(text.splitlines()) or type(error).__name__


def agreed(error: BaseException | None) -> bool:
    """Whether every rank already knows of this error (it came out of `together` or `share_failure`, or
    `failure_line` published it)."""
    return isinstance(error, RankFailed) or getattr(error, "agreed_by_all_ranks", False)


def _mark(error: BaseException) -> BaseException:
    try:
        error.agreed_by_all_ranks = True  # type: ignore[attr-defined]
    except AttributeError:  # an exception type with __slots__: it is then reported as any other
        pass
    return error


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
