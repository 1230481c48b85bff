"""README.md's "What the demo does" block is the output `pipeline demo` prints now: the same lines in the same
order (floats and times, which vary by machine, and the workdir path aside; counts of samples, buckets, steps,
epochs and quarantined files are the demo's own and must match)."""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from pipeline.cli import app

README = Path(__file__).resolve().parents[2] / "README.md"
EPOCH = re.compile(r"^epoch \d+: padding efficiency")


def normalised(lines: list[str], workdir: str) -> list[str]:
    out = []
    for line in lines:
        line = line.replace(workdir, "WORKDIR")
        line = re.sub(r"\d+\.\d+", "F", line)  # losses, rates, seconds, MB
        line = re.sub(r"^(time\s+)\d+ s$", r"\1N s", line)
        if line.strip():
            out.append(line.rstrip())
    return out


def readme_block() -> tuple[list[str], str]:
    text = README.read_text()
    section = text[text.index("## What the demo does"):]
    block = section[section.index("```text\n") + 8:]
    lines = block[:block.index("```")].splitlines()
    workdir = re.search(r"to (\S+)/tiny-model$", lines[1]).group(1)
    # the README shortens the per-epoch lines to the first one and a note
    return [line for line in lines if not line.startswith("…")], workdir


def test_readme_demo_output_is_what_the_demo_prints(tmp_path):
    shown, shown_workdir = readme_block()
    work = tmp_path / "demo-workdir"
    result = CliRunner().invoke(app, ["demo", "--workdir", str(work)])
    assert result.exit_code == 0, result.output
    printed = result.stdout.splitlines()
    epochs = [line for line in printed if EPOCH.match(line)]
    assert len(epochs) == 12, "README: 'one such line per epoch, 12 in all'"
    printed = [line for line in printed if not EPOCH.match(line) or line == epochs[0]]
    assert normalised(shown, shown_workdir) == normalised(printed, str(work))
