"""`python failing_disk_run.py FMT SRC STORE`: resize-bucket of SRC into STORE in its own process while a disk fault
keeps part of the source unread (the faults of test_resize_read_errors.py / test_resize_parquet_read_errors.py),
for tests that SIGKILL it (STORE_CRASH_AT) and resume it while the disk still fails. Prints the summary."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from _pytest.monkeypatch import MonkeyPatch  # noqa: E402


def failing_disk(m: MonkeyPatch, fmt: str, src: Path) -> Path:
    """The fault of `fmt`'s source (made by the tests' `_tars` / `_source`) on `m`; the file it hits."""
    import pyarrow.parquet as pq

    from stages.resize import parquet_source
    from tests.stages.test_resize_parquet_read_errors import _bad_sector
    from tests.stages.test_resize_read_errors import _data_offset, _failing_tar

    if fmt == "tars":
        victim = src / "shard-1.tar"
        _failing_tar(m, victim, _data_offset(victim, "s1_1.control.png") + 10)
        return victim
    m.setattr(parquet_source, "BATCH_ROWS", 3)  # = the row groups: the fault in group 1 is met at row 3
    victim = src / "part-1.parquet"
    _bad_sector(m, victim, pq.read_metadata(victim).row_group(1).column(0).data_page_offset + 100)
    return victim


if __name__ == "__main__":
    from pipeline.config import load_config
    from stages.resize import stage
    from tests.stages.test_resize_rerun_reads import SMALL

    fmt, src, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    failing_disk(MonkeyPatch(), fmt, src)
    # one shard: its commit (the kill tests' after_shard_commit) comes after the quarantine rows are written
    print(stage.run(load_config(None, {**SMALL, "resize.shard_size_mb": 1024}), src, out))
