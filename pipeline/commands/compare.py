"""`pipeline compare REPORT_OR_RUN... --out DIR`: several runs' held-out loss curves and best checkpoints on one
page (DIR/index.html) and in one table (DIR/curves.csv); runs on different held-out sets are refused."""

from __future__ import annotations

from pathlib import Path

import typer

from pipeline.commands.common import JsonOpt, emit, json_mode, usage_error, user_errors
from pipeline.launched import one_process


def command(
    inputs: list[str] = typer.Argument(..., help="Report folders (with losses.zarr) or run folders holding one."),
    out: Path = typer.Option(..., "--out", help="Folder for index.html and curves.csv."),
    as_json: bool = JsonOpt,
) -> None:
    one_process("compare")  # every rank would write the same page and table
    if len(inputs) < 2:  # a usage mistake (exit 2), like a missing argument; write_compare refuses it too
        usage_error("INPUTS: pass at least two reports or runs")
    from stages.evaluate.compare import given_twice, write_compare

    # `R R` or `R ./R/`: judged on the paths alone (the lookup of their loss groups finds R and R/losses.zarr)
    if twice := given_twice(inputs, [Path(p).resolve() for p in inputs]):
        usage_error(f"INPUTS: {twice}")

    with user_errors(), json_mode(as_json):
        result = write_compare(inputs, out)
    emit(result, as_json)
