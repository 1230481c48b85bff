"""Progress bars in a log (stderr to a file or a pipe: a SLURM log, `nohup ... > log`, CI, kubectl logs): plain
lines at most every PIPELINE_PROGRESS_SECONDS plus each bar's final state, no `\\r` frames, no cursor codes; on a
terminal tqdm draws as before."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tqdm.std

from pipeline import bars
from pty_terminal import pty_terminal

REPO = Path(__file__).resolve().parents[2]
PATCHED = ("__init__", "display", "clear", "close")


class Clock:
    """tqdm's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def log_lines(monkeypatch):
    """`bars.as_log_lines` for one test; tqdm's class as it was afterwards. tqdm's clock is the test's."""
    cls = tqdm.std.tqdm
    for name in PATCHED:
        monkeypatch.setattr(cls, name, vars(cls)[name])
    monkeypatch.setattr(bars._Lines, "seconds", bars._Lines.seconds)
    monkeypatch.setattr(cls, "monitor_interval", 0)  # no monitor thread drawing on its own clock
    clock = Clock()
    monkeypatch.setattr(tqdm.std, "time", clock)
    yield clock
    for name in PATCHED:
        if "_terminal_" + name.strip("_") in vars(cls):
            delattr(cls, "_terminal_" + name.strip("_"))


def _bar_lines(text: str, desc: str) -> list[str]:
    return [line for line in text.split("\n") if line.startswith(desc + ":")]


def test_a_bar_in_a_log_writes_a_line_at_most_every_n_seconds_and_its_final_state(log_lines):
    """10 minutes of a bar updated 10 times a second: 20 lines at 30 s, the last its final state (before: a
    `\\r` frame every 0.1 s, ~6,000 of them)."""
    bars.as_log_lines(30)
    log = io.StringIO()
    bar = tqdm.std.tqdm(total=6000, desc="encode-vae", unit="sample", file=log)
    for i in range(6000):
        log_lines.now = 1000 + (i + 1) / 10
        bar.update()
    bar.close()
    text = log.getvalue()
    assert "\r" not in text and "\x1b" not in text, repr(text[:300])
    lines = _bar_lines(text, "encode-vae")
    assert 18 <= len(lines) <= 21 and len(lines) == text.count("\n"), text
    assert lines[0].startswith("encode-vae:   5% 30") and "sample/s" in lines[0] and "<" in lines[0], lines[0]
    assert lines[-1].startswith("encode-vae: 100% 6000/6000 [10:00<00:00"), lines[-1]


def test_nested_bars_in_a_log_have_no_cursor_codes_and_short_inner_bars_say_nothing(log_lines):
    """evaluate's bars: an outer one over checkpoints, an inner one per checkpoint that a terminal clears
    (leave=False), and lines written between them (tqdm.write). Before: `ESC[A` and `\\r` in the file."""
    bars.as_log_lines(30)
    log = io.StringIO()
    outer = tqdm.std.tqdm(total=4, desc="checkpoints", unit="ckpt", file=log)
    for step in range(4):
        for _ in tqdm.std.tqdm(range(5), desc="generate (base)", unit="image", leave=False, file=log):
            log_lines.now += 1
        tqdm.std.tqdm.write(f"checkpoint {step}: done", file=log)
        outer.update()
    long = tqdm.std.tqdm(range(100), desc="held-out loss", unit="batch", leave=False, file=log)
    for _ in long:
        log_lines.now += 1
    outer.close()
    text = log.getvalue()
    assert "\r" not in text and "\x1b" not in text, repr(text)
    assert _bar_lines(text, "generate (base)") == [] and text.count("checkpoint 3: done\n") == 1, text
    # a cleared bar that lasted long enough to say something ends with its final state
    assert len(_bar_lines(text, "held-out loss")) == 4 and "100/100" in _bar_lines(text, "held-out loss")[-1]
    assert _bar_lines(text, "checkpoints") == [_bar_lines(text, "checkpoints")[-1]] and "4/4" in text, text


def test_the_encode_bar_in_a_log_keeps_its_own_fields(log_lines):
    from stages.encode.progress import SampleProgress

    bars.as_log_lines(0)
    log = io.StringIO()
    with SampleProgress(3, "encode-vae", file=log) as progress:
        for _ in range(3):
            log_lines.now += 1
            progress.sample_read()
        log_lines.now += 1
        progress.encoded(2)
    lines = _bar_lines(log.getvalue(), "encode-vae")
    assert lines[-1].startswith("encode-vae:  17% 0.5/3 samples [00:04<") and lines[-1].endswith("read 3]"), lines


def test_a_bar_on_a_terminal_still_draws_frames(log_lines, monkeypatch):
    """The rule is per stream: a bar on a terminal (a pty here) is tqdm's, `\\r` frames included."""
    with pty_terminal() as terminal:
        monkeypatch.setattr(sys, "stderr", terminal.stream)
        bars.as_log_lines(30)
        bar = tqdm.std.tqdm(total=10, desc="train", unit="step", file=terminal.stream, mininterval=0)
        for _ in range(3):
            log_lines.now += 1
            bar.update()
        bar.close()
        drawn = terminal.drawn()
    assert drawn.count("\r") >= 4 and "train:  30%|" in drawn and "3/10" in drawn, repr(drawn)


def test_an_error_line_in_a_log_follows_an_open_bars_line_without_a_blank_line(log_lines):
    """A bar writing a log's lines ends each one: an error line then starts without the newline a terminal's
    frame needs before it (a blank line in the log before every error)."""
    from models.collective import report

    bars.as_log_lines(30)
    log = io.StringIO()
    bar = tqdm.std.tqdm(total=10, desc="train", unit="step", file=log)
    try:
        assert not report._bar_mid_line()
        frame = tqdm.std.tqdm(total=10, desc="frames", file=io.StringIO())
        frame.__dict__["_log_lines"] = False  # a bar drawing a terminal's frames, stopped mid-line
        assert report._bar_mid_line()
        frame.close()
    finally:
        bar.close()


def test_a_bad_progress_seconds_is_a_usage_error():
    env = {**os.environ, "PYTHONPATH": str(REPO), bars.SECONDS_ENV: "often"}
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "--help"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "error: PIPELINE_PROGRESS_SECONDS='often' is not a number of seconds; set it to e.g. 30" in proc.stderr


def test_a_bad_progress_seconds_is_refused_on_a_terminal_too(monkeypatch):
    """A bad setting tried on a terminal (where no bar writes lines) is refused there, not first in the batch job
    it was meant for (a SLURM log: the job then failed at its start, after its wait in the queue)."""
    from schemas.errors import UserError

    with pty_terminal() as terminal:
        monkeypatch.setattr(sys, "stderr", terminal.stream)
        monkeypatch.setenv(bars.SECONDS_ENV, "often")
        with pytest.raises(UserError, match="PIPELINE_PROGRESS_SECONDS='often' is not a number of seconds"):
            bars.for_this_stderr()


def _cli_stderr(args: list[str], stderr, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], env=env, stdout=subprocess.DEVNULL,
                          stderr=stderr, timeout=120, cwd=tmp_path)


def test_the_cli_draws_bars_on_a_terminal_and_lines_into_a_file(tmp_path):
    """The same command: on a terminal (a pty with a size) tqdm's frames; into a file one plain line."""
    with pty_terminal() as terminal:
        proc = _cli_stderr(["make-demo-data", str(tmp_path / "a"), "--n", "5"], terminal.stream, tmp_path)
        drawn = terminal.drawn()
    assert proc.returncode == 0 and "\rdemo samples: 100%|" in drawn, repr(drawn)
    with open(tmp_path / "log", "w") as log:
        assert _cli_stderr(["make-demo-data", str(tmp_path / "b"), "--n", "5"], log, tmp_path).returncode == 0
    text = (tmp_path / "log").read_text()
    assert _bar_lines(text, "demo samples") == [text.strip()] and text.startswith("demo samples: 100% 5/5 ["), text


def test_a_bar_in_a_log_says_each_count_once_at_every_redraw(log_lines):
    """PIPELINE_PROGRESS_SECONDS=0 (a line at every redraw): an outer bar redrawn by its inner bars and by lines
    written between them, its count unchanged but its rate moved on, said that count once (before: `outer: 33%
    1/3` twice, the redraws differing only in their rate)."""
    bars.as_log_lines(0)
    log = io.StringIO()
    outer = tqdm.std.tqdm(total=3, desc="outer", unit="ckpt", file=log)
    for step in range(3):
        for _ in tqdm.std.tqdm(range(2), desc="inner", leave=False, file=log):
            log_lines.now += 1
        tqdm.std.tqdm.write(f"checkpoint {step}: done", file=log)
        log_lines.now += 1
        outer.update()
    outer.close()
    counts = [line.split("[")[0].split()[-1] for line in _bar_lines(log.getvalue(), "outer")]
    assert counts == ["0/3", "1/3", "2/3", "3/3"], log.getvalue()


def test_the_encode_bar_in_a_log_says_its_reads_while_its_count_waits(log_lines):
    """encode's count waits for a batch to fill (minutes on a big model) while its postfix counts the samples read:
    a log still gets a line every PIPELINE_PROGRESS_SECONDS with the reads so far."""
    from stages.encode.progress import SampleProgress

    bars.as_log_lines(30)
    log = io.StringIO()
    with SampleProgress(100, "encode-vae", file=log) as progress:
        for _ in range(100):
            log_lines.now += 1
            progress.sample_read()
    lines = _bar_lines(log.getvalue(), "encode-vae")
    assert [line.rsplit(" ", 1)[-1] for line in lines[:3]] == ["30]", "60]", "90]"], lines


def test_a_byte_bar_in_a_log_says_its_figures_in_the_one_size_rule(log_lines):
    """A byte bar's line keeps its own fields (count, total, rate in KiB / MiB / GiB), the drawn bar dropped."""
    from schemas.byte_bar import byte_bar

    bars.as_log_lines(0)
    out = io.StringIO()
    with byte_bar(10 * 2**20, "pull") as bar:
        bar.fp = out
        log_lines.now += 2
        bar.update(10 * 2**20)
    last = _bar_lines(out.getvalue(), "pull")[-1]
    assert last.startswith("pull: 100% 10.0 MiB/10.0 MiB [00:02<00:00, 5.0 MiB/s"), last

