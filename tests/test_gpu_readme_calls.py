"""The device calls written out in bench/gpu/README.md are pasted as they are into a 10-minute GPU lease: every
one must fit the tool's 2,000-character command, name only proof.py stages, train configurations and
correctness parts that exist, and run gpu-tier files that exist. Checked here so that a renamed configuration or
a typo costs a test run, not a device call."""

from __future__ import annotations

import re
import shlex
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "bench" / "gpu" / "README.md"
COMMAND_LIMIT = 2000  # characters in one device `run` command


def _calls() -> list[str]:
    """Every one-line bash block that installs the carried wheels: a device call."""
    blocks = re.findall(r"```bash\n(.*?)\n\s*```", README.read_text(), re.S)
    return [b.strip() for b in blocks if "--target /tmp/site" in b]


def _commands(call: str, program: str) -> list[list[str]]:
    """The argument lists that follow `program` in the call's `;`/`|`/`&&`-separated commands."""
    found = []
    for part in re.split(r";|\|\|?|&&", call):
        words = shlex.split(part)
        if program in words:
            found.append(words[words.index(program) + 1:])
    return found


def _option(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_every_call_fits_and_names_what_proof_py_knows():
    sys.path.insert(0, str(REPO))
    from bench.gpu.fullsize import CONFIGS
    from bench.gpu.proof import CORRECTNESS_PARTS, STAGES

    calls = _calls()
    assert len(calls) >= 8, "bench/gpu/README.md: the common setup, calls 1-4 and A, B, E (C and D are 3 and 4)"
    for call in calls:
        assert "\n" not in call and len(call) <= COMMAND_LIMIT, call[:200]
        for args in _commands(call, "bench/gpu/proof.py"):
            assert _option(args, "--stage") in (*STAGES, "all"), args
            for name in (_option(args, "--configs") or "").split(",") if "--configs" in args else []:
                assert name in CONFIGS, f"{name!r} is no configuration of bench/gpu/fullsize.py"
            for part in (_option(args, "--parts") or "").split(",") if "--parts" in args else []:
                assert part in CORRECTNESS_PARTS, part


def test_the_gpu_tier_runs_files_that_exist_and_ends_its_log_with_the_counts():
    """pyproject's addopts hold -q already: a second -q (-qq) drops pytest's last line, the one that says how
    many tests passed, failed and skipped, from the log a call brings back."""
    addopts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    runs = [args for call in _calls() for args in _commands(call, "pytest")]
    assert runs, "no gpu-tier run among the calls"
    for args in runs:
        assert [a for a in args if a.startswith("tests/")], args
        for path in (a for a in args if a.startswith("tests/")):
            assert (REPO / path).exists(), path
        assert not ("-q" in addopts.split() and "-q" in args), args
