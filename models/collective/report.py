"""The lines a launched rank prints itself: its one failure line (`report_once`, whoever prints it first), the line of
a failure it could not tell the others (`_untold_warning`), and whether a progress bar left stderr mid-line
(`_bar_mid_line`)."""

from __future__ import annotations

import os
import sys
import threading

from models.collective import state


def report_once(message: str) -> bool:
    """Print `error: MESSAGE` to stderr (red on a terminal, as the CLI's lines) unless this process already
    reported a failure; whether it printed. Every failure line of a launched rank comes here - its main thread's
    (the CLI's handlers: pipeline/commands/common.py `report_error`), its watch thread's, a signal's - because two
    of them may print at once: where every rank met the same failure, a rank's watch thread read the line another
    rank published while its main thread printed its own, the same (the user saw it twice). While watching, the
    lock is kept: the process ends after its report, and a second reporter stays silent. In one process it is
    released: nothing else reports there, and another command may follow in the same process (tests)."""
    if not state.report_lock.acquire(blocking=False):
        return False
    try:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        text = ("\n" if _bar_mid_line() else "") + f"error: {message}"
        try:
            red = sys.stderr.isatty()
        except (OSError, ValueError):
            red = False
        sys.stderr.write((f"\x1b[31m{text}\x1b[0m" if red else text) + "\n")
        sys.stderr.flush()
    finally:
        if not state.run["watching"]:
            state.report_lock.release()
    return True


def _bar_mid_line() -> bool:
    """Whether a progress bar may have left stderr mid-line, so a line printed now must start with a newline: a
    bar still open (this rank's main thread is stuck in its loop), or one another thread is closing (tqdm drops a
    bar from its open ones before it writes its last state and newline: the clean CI run's one failure, rank 0's
    line glued to its bar's text). Not merely tqdm imported (every rank imports it with the libraries): a rank
    that drew no bar printed a blank line before the error."""
    tq = sys.modules.get("tqdm.std")
    if tq is None:
        return False
    # open bars (tqdm keeps no disabled bar there), but for those writing a log's whole lines (pipeline/bars.py
    # marks them `_log_lines`): before them a newline left a blank line in the log before each error line
    if any(not vars(bar).get("_log_lines") for bar in list(getattr(tq.tqdm, "_instances", ()))):
        return True
    closing, me = tq.tqdm.close.__code__, threading.get_ident()
    for ident, frame in sys._current_frames().items():  # the closing bar is on another thread's stack
        while ident != me and frame is not None:
            if frame.f_code is closing:
                return True
            frame = frame.f_back
    return False


def _untold_warning(silent: str) -> None:
    """The line of a rank whose failure or stop could not be published: the store's host accepts connections but
    does not answer (stopped, hung; `silent`: `StoreSilent`'s text), so the ranks waiting for this one learn nothing
    from it."""
    sys.stderr.write(("\n" if _bar_mid_line() else "") + f"rank {os.environ.get('RANK', '?')} could not tell the other "
                     f"ranks: {silent}; they stop at their own timeout\n")
    sys.stderr.flush()
