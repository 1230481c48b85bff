"""A folder a command creates, refused when a file is there or on its path: one check for the CLI's --out options
and the stages' own output folders (evaluate's report folder, asked by `run all` before its first stage). No
torch, no CLI: stages may import it."""

from __future__ import annotations

from pathlib import Path

from schemas.errors import UserError


def refuse_a_file_on_the_path(out: Path, what: str) -> None:
    """A UserError when OUT (a folder to create) is a file or lies under one. A symbolic link to nothing (a disk
    not mounted) is left to the writer's handler: no mistake on the command line (`user_errors`, exit 1)."""
    for path in (Path(out), *Path(out).parents):
        if path.exists():
            if path.is_dir():
                return
            where = "is a file" if path == Path(out) else f"lies under {path}, which is a file"
            raise UserError(f"{what}{out} {where}: pass a new or empty folder")
