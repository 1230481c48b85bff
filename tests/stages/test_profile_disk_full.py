"""train.profile: a full disk while writing the trace is one line naming the file, the space free and what to do;
no partial trace (nor its temp file) is left."""

from __future__ import annotations

import errno
import json

import pytest
import torch

from fsync_record import fsynced
from schemas.errors import UserError
from stages.train.trackers import StepProfiler


def test_a_full_disk_while_writing_the_trace_is_one_line_and_leaves_no_partial_file(tmp_path):
    prof = StepProfiler(1, tmp_path, 0, torch.device("cpu"))
    torch.ones(4).sum()
    real_export = prof.prof.export_chrome_trace

    def half_then_full(path):  # part of the trace lands, then the disk is full
        with open(path, "w") as f:
            f.write('{"traceEvents": [')
        raise OSError(errno.ENOSPC, "No space left on device")

    prof.prof.export_chrome_trace = half_then_full
    with pytest.raises(UserError) as e:
        prof.step()
    line = str(e.value)
    assert "\n" not in line and "disk full" in line and "trace-rank0.json" in line and "B free" in line
    assert "train.profile=0" in line and "--resume" in line
    assert list((tmp_path / "profile").iterdir()) == []

    prof.prof.export_chrome_trace = real_export  # space freed: the trace is written whole, a real JSON file
    prof._write()
    assert "traceEvents" in json.loads((tmp_path / "profile" / "trace-rank0.json").read_text())


def test_a_written_trace_is_fsynced_and_so_is_its_folder(tmp_path, monkeypatch):
    """The trace is written under this writer's temp name (`temp_of`: another rank's or a killed writer's temp is
    told apart), fsynced, renamed, and the folder fsynced: before, a `.NAME.tmp` no writer owned, renamed
    unsynced (a power loss could leave an empty trace file, or none)."""
    prof = StepProfiler(1, tmp_path, 0, torch.device("cpu"))
    torch.ones(4).sum()
    paths = fsynced(monkeypatch)
    prof.step()
    folder = (tmp_path / "profile").resolve()
    assert len(paths) == 2 and paths[0].startswith(str(folder / ".trace-rank0.json.tmp-")), paths
    assert paths[1] == str(folder)
    assert [p.name for p in folder.iterdir()] == ["trace-rank0.json"]
