"""How every tqdm progress bar of a `pipeline` command draws, set once where the CLI starts (`for_this_stderr`).

On a terminal tqdm draws as it does. Into a log (stderr to a file or a pipe: a SLURM job's log, `nohup ... > log`,
a CI log, `kubectl logs`) a bar is a plain line - count, rate, ETA - at most every PIPELINE_PROGRESS_SECONDS
(default 30) plus its final state, with no `\\r` frames (tqdm redraws every 0.1 s: ~25 MB of frames to encode a
million samples) and no cursor-movement codes (nested bars' `ESC[A`), so less, grep and tail read it. A bar that
leaves nothing on a terminal (`leave=False`) and ended before its first line says nothing at all.
"""

from __future__ import annotations

import os
import sys

from schemas.errors import UserError

SECONDS_ENV = "PIPELINE_PROGRESS_SECONDS"
DEFAULT_SECONDS = 30.0


def for_this_stderr() -> None:
    """Set the bars up for what stderr is: a terminal without a size, a log, or a terminal (nothing to do). A bad
    PIPELINE_PROGRESS_SECONDS is refused on a terminal too: tried there, not first in the batch job it is for."""
    seconds = line_seconds()
    try:
        columns = os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError, AttributeError):  # no terminal (a pipe, a file, a closed or replaced stderr)
        as_log_lines(seconds)
        return
    if columns <= 0:
        bars_on_a_terminal_without_size()


def line_seconds() -> float:
    """The least time between two lines of one bar in a log: PIPELINE_PROGRESS_SECONDS, else 30."""
    raw = os.environ.get(SECONDS_ENV, "").strip()
    if not raw:
        return DEFAULT_SECONDS
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise UserError(f"{SECONDS_ENV}={raw!r} is not a number of seconds; set it to e.g. 30 (0: a line at every "
                        f"redraw), or unset it for the default {DEFAULT_SECONDS:.0f}")
    return seconds


def bars_on_a_terminal_without_size() -> None:
    """A terminal that reports 0 columns (a pty opened with no size: `ssh -t host cmd` from a script, `script`
    without a terminal, some CI runners) made tqdm trim every progress bar to nothing (it draws in columns - 1,
    here -1): such a size is taken as unknown, as on a pipe (a short bar with its counts, rate and ETA)."""
    import tqdm.std

    measure = tqdm.std._screen_shape_wrapper

    def known_sizes_only():
        shape = measure()

        def sizes(fp):
            cols, rows = shape(fp)
            return (cols if cols is not None and cols > 0 else None, rows if rows is not None and rows > 0 else None)

        return sizes

    tqdm.std._screen_shape_wrapper = known_sizes_only


def as_log_lines(seconds: float) -> None:
    """Every tqdm bar (tqdm.auto's and tqdm's are tqdm.std's subclasses) that writes to something other than a
    terminal writes log lines, one at most every `seconds`. Again in the same process: the new `seconds`."""
    import tqdm.std

    bar = tqdm.std.tqdm
    _Lines.seconds = seconds
    if "_terminal_display" in vars(bar):
        return
    bar._terminal_init, bar._terminal_display = bar.__init__, bar.display
    bar._terminal_clear, bar._terminal_close = bar.clear, bar.close
    bar.__init__, bar.display, bar.clear, bar.close = _init, _display, _clear, _close


class _Lines:
    seconds = DEFAULT_SECONDS


def _to_log(bar) -> bool:
    """Whether this bar writes log lines: its stream is not a terminal (decided once, at its first draw)."""
    known = bar.__dict__.get("_log_lines")
    if known is None:
        try:
            known = not bar.fp.isatty()
        except (AttributeError, ValueError, OSError):  # a stream without isatty, a closed one
            known = True
        bar.__dict__["_log_lines"] = known
    return known


def _init(bar, *args, **kwargs) -> None:
    bar._terminal_init(*args, **kwargs)
    if not bar.disable and _to_log(bar):
        # tqdm's own clock wakes no more often than a line may come (its 0.1 s redraw, its 10 s monitor)
        bar.mininterval = max(bar.mininterval, _Lines.seconds)
        bar.maxinterval = max(bar.maxinterval, _Lines.seconds)


def _display(bar, msg=None, pos=None):
    if not _to_log(bar):
        return bar._terminal_display(msg, pos)
    if msg == "":  # a clear: a log keeps its lines
        return False
    now = bar._time()
    last = bar.__dict__.get("_log_line_t")
    if last is None and _Lines.seconds > 0:  # its first draw (its start) is no line, unless each change is one
        bar._log_line_t = now
        return False
    if last is not None and now - last < _Lines.seconds:
        return False
    said = _said(bar)
    if said == bar.__dict__.get("_log_said"):  # a redraw (a tqdm.write, a nested bar's) whose rate moved on alone
        return False
    bar._log_line_t, bar._log_said = now, said
    _write(bar, msg or _line(bar))
    return True


def _said(bar) -> tuple:
    """What a bar's line says apart from its clock (elapsed, rate, ETA): its count, total, description and
    postfix (encode's `read N`, which moves while the count waits for a batch to fill)."""
    return bar.n, bar.total, bar.desc, bar.postfix


def _clear(bar, nolock=False) -> None:
    if not _to_log(bar):
        bar._terminal_clear(nolock)


def _close(bar) -> None:
    """A log's last line of the bar: its final state where a terminal keeps the bar (leave) or where it said
    something already, unless its last line has that count; the bookkeeping as tqdm's own close."""
    if getattr(bar, "disable", True) or not _to_log(bar):
        return bar._terminal_close()
    keep = abs(bar.pos) == 0 if bar.leave is None else bar.leave
    said = bar.__dict__.get("_log_said")
    last = None
    if (keep or said is not None) and (said is None or said[0] != bar.n):
        bar._ema_dt = lambda: None  # the whole run's rate, as tqdm's own last frame
        last = _line(bar)
    bar.disable = True
    bar._decr_instances(bar)
    if last:
        with bar._lock:
            _write(bar, last)


def _line(bar) -> str:
    """The bar as one plain line: `desc:  50% 5/10 [00:05<00:05, 1.00step/s, postfix]`, no drawn bar."""
    fields = dict(bar.format_dict)
    form = fields.get("bar_format")
    if form:  # its own fields kept, the drawn bar dropped
        fields.update(ncols=None, bar_format=form.replace("{l_bar}{bar}|", "{desc}: {percentage:3.0f}%")
                      .replace("{bar}", ""))
    else:
        fields.update(ncols=0)  # tqdm's own form without the bar
    return bar.format_meter(**fields).strip()


def _write(bar, line: str) -> None:
    try:
        bar.fp.write(line + "\n")
        getattr(bar.fp, "flush", lambda: None)()
    except ValueError:  # a stream closed under the bar (interpreter exit): nothing to say it on
        pass
