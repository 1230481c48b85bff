"""Which folders `pipeline demo --workdir DIR` may write into: a new or empty one, or a previous demo's.

The demo writes config.yaml, data/, store/, run/, report/ and tiny-model/ into DIR; into a dataset folder or a
home directory that would mix its files with the user's. A demo workdir carries a marker file, so a rerun
(which skips every stage that is up to date) is recognised; a workdir from before the marker existed is
recognised by its config.yaml pointing at DIR/store.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from schemas.errors import UserError

MARKER = ".pipeline-demo-workdir"


def _is_previous_demo(workdir: Path) -> bool:
    if (workdir / MARKER).is_file():
        return True
    try:
        cfg = yaml.safe_load((workdir / "config.yaml").read_text()) or {}
        return Path(cfg["paths"]["store"]).resolve() == (workdir / "store").resolve()
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return False


def claim_workdir(workdir: Path) -> None:
    """Refuse a non-empty folder that is not a previous demo workdir; otherwise create it and mark it."""
    refuse_other_folder(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / MARKER).write_text("written by `pipeline demo`; a rerun with this --workdir reuses what is here\n")


def refuse_other_folder(workdir: Path) -> None:
    """A UserError when WORKDIR is a file or lies under one, or is a non-empty folder that is not a previous demo
    workdir."""
    from schemas.out_folder import refuse_a_file_on_the_path

    refuse_a_file_on_the_path(workdir, "--workdir ")
    if workdir.is_dir() and any(workdir.iterdir()) and not _is_previous_demo(workdir):
        raise UserError(
            f"--workdir {workdir} is not empty and is not a previous demo workdir: the demo writes config.yaml, "
            "data/, store/, run/, report/ and tiny-model/ there. Pass a new or empty folder (e.g. "
            f"--workdir {workdir / 'demo-workdir'})"
        )


def write_config(effective: Path, text: str) -> Path | None:
    """DIR/config.yaml, the settings this demo runs with. One that holds other settings (edited after the last demo,
    as its summary invites) is kept first, not overwritten unseen; returns where (`_kept_as`)."""
    from store.format import atomic_write_bytes

    try:
        before = effective.read_text()
    except FileNotFoundError:
        before = None
    kept = None
    if before is not None and before != text:
        kept = _kept_as(effective, before)
        if not kept.exists():
            atomic_write_bytes(kept, before.encode())
    atomic_write_bytes(effective, text.encode())
    return kept


def _kept_as(effective: Path, text: str) -> Path:
    """Where an edited config.yaml is kept: DIR/config.previous.yaml, then config.previous.2.yaml, .3, ... (each
    edit kept, none written over: a second edited rerun lost the first edits), or the kept file that holds these
    very settings already."""
    n = 1
    while True:
        kept = effective.with_name("config.previous.yaml" if n == 1 else f"config.previous.{n}.yaml")
        try:
            if kept.read_text() == text:
                return kept
        except FileNotFoundError:
            return kept
        except (OSError, UnicodeDecodeError):  # taken by something else: the next name
            pass
        n += 1
