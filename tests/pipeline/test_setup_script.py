"""scripts/setup.sh runs pip only when pyproject.toml or the pins changed (a stamp inside .venv), and tells
the user how to get `pipeline` in a new shell. Checked on a copy with a stand-in .venv whose `python` only
logs what it is asked to do, so no real install happens."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _setup(root: Path) -> str:
    # Only the stand-in python can be reached: any other python/pip on PATH refuses, so nothing is installed.
    guard = root / "guard-bin"
    guard.mkdir(exist_ok=True)
    for name in ("python", "python3", "python3.11", "pip", "pip3"):
        (guard / name).write_text("#!/bin/sh\necho 'real python reached' >&2\nexit 99\n")
        (guard / name).chmod(0o755)
    env = {"PATH": f"{guard}:/usr/bin:/bin", "HOME": str(root)}
    proc = subprocess.run(["bash", str(root / "scripts" / "setup.sh")], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0 and "real python reached" not in proc.stderr, proc.stderr
    return proc.stdout


def test_setup_skips_pip_when_nothing_changed(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    bin_ = tmp_path / ".venv" / "bin"
    bin_.mkdir(parents=True)
    log = tmp_path / "python-calls.log"
    (bin_ / "python").write_text(f'#!/usr/bin/env bash\necho "$*" >> {log}\n')
    (bin_ / "python").chmod(0o755)
    (bin_ / "activate").write_text(f'export PATH="{bin_}:$PATH"\n')  # what a real activate does that matters here
    (bin_ / "pipeline").write_text("#!/bin/sh\n")
    (bin_ / "pipeline").chmod(0o755)

    out = _setup(tmp_path)  # no stamp yet: pip runs (pinned torch, then the package)
    calls = log.read_text()
    assert "pip install -q torch==2.14.1 torchvision==0.29.1" in calls and "pip install -q -e .[test]" in calls
    assert "run `. .venv/bin/activate`" in out and "to get the `pipeline` command" in out

    log.unlink()
    out = _setup(tmp_path)  # nothing changed: no pip at all
    assert "pip skipped" in out and not log.exists()

    with (tmp_path / "pyproject.toml").open("a") as f:
        f.write("\n# a changed dependency list\n")
    _setup(tmp_path)
    assert "pip install -q -e .[test]" in log.read_text()


def test_a_failed_pip_install_stops_setup_and_writes_no_stamp(tmp_path):
    """`pip install ... | grep -v ... || true` made a failed install succeed: setup went on, wrote its stamp, and
    every later run skipped pip on a .venv missing the package."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    bin_ = tmp_path / ".venv" / "bin"
    bin_.mkdir(parents=True)
    # pip fails on the package install (no network, a conflict), as pip does: a message on stderr, exit 1
    (bin_ / "python").write_text('#!/usr/bin/env bash\ncase "$*" in *"-e .[test]"*) '
                                 'echo "ERROR: No matching distribution found for diffusers" >&2; exit 1;; esac\n')
    (bin_ / "python").chmod(0o755)
    (bin_ / "activate").write_text(f'export PATH="{bin_}:$PATH"\n')
    guard = tmp_path / "guard-bin"
    guard.mkdir()
    env = {"PATH": f"{guard}:/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", str(tmp_path / "scripts" / "setup.sh")], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "No matching distribution found for diffusers" in proc.stdout + proc.stderr
    assert not (tmp_path / ".venv" / ".pipeline-setup-stamp").exists() and "setup: done" not in proc.stdout
