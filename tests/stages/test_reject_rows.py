"""A resize-bucket run's quarantine rows held as text columns until its commit (stages/resize/reject_rows.py): the
rows a commit appends are those the former list of dicts appended - columns, their order, values, row order -
across chunk boundaries, with details changed and rows taken back before and after their chunk became columns."""

from __future__ import annotations

import pytest

from schemas import UserError
from stages.resize import reject_rows
from stages.resize.reject_rows import RejectRows
from store import Store


def _row(i: int) -> dict:
    row = {"key": f"k{i}" if i % 3 else None, "source": f"/data/target/{i}.png", "stage": "resize-bucket",
           "reason": "unreadable-image" if i % 2 else "duplicate", "detail": f"detail {i}"}
    if i % 5 == 0:
        row["pictures"] = f"p{i}"
    if i == 7:  # one column met first in a later chunk than `pictures`
        row["samples"] = 3
    return row


@pytest.mark.parametrize("chunk", [4, 1000])
def test_the_rows_appended_are_those_a_list_of_dicts_appended(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(reject_rows, "CHUNK", chunk)
    rows, held = RejectRows(), []
    for i in range(23):
        held.append((i, rows.add(_row(i))))
    dicts = [_row(i) for i in range(23)]
    for i in (2, 21):  # in a chunk already columns (chunk 4) and one still dicts
        rows.set_detail(held[i][1], f"changed {i}")
        dicts[i]["detail"] = f"changed {i}"
    for i in (0, 9, 22):
        rows.drop(held[i][1])
    dicts = [d for i, d in enumerate(dicts) if i not in (0, 9, 22)]
    assert len(rows) == 20 and {k: v for k, v in rows.first().items() if v is not None} == dicts[0]
    old, new = Store(tmp_path / "old"), Store(tmp_path / "new")
    old.add_quarantine(dicts)
    new.add_quarantine_table(rows.table())
    strip = [c for c in old.quarantine().column_names if c != "time"]
    assert new.quarantine().column_names == old.quarantine().column_names
    assert new.quarantine().select(strip).to_pylist() == old.quarantine().select(strip).to_pylist()


def test_rows_added_after_a_read_keep_their_numbers(monkeypatch):
    monkeypatch.setattr(reject_rows, "CHUNK", 4)
    rows = RejectRows()
    for i in range(6):
        rows.add(_row(i))
    rows.table()  # the last 2 rows become a short chunk
    n = rows.add(_row(6))
    rows.drop(0)
    rows.set_detail(5, "changed")
    assert n == 6 and rows.first()["source"] == "/data/target/1.png"
    assert [r["detail"] for r in rows.table().to_pylist()] == [f"detail {i}" for i in (1, 2, 3, 4)] + \
        ["changed", "detail 6"]


def test_a_row_without_a_source_is_refused_as_add_rows_refuses_it(tmp_path):
    rows = RejectRows()
    rows.add({**_row(1), "source": ""})
    with pytest.raises(UserError, match="quarantine row 0 lacks \\['source'\\]"):
        Store(tmp_path / "s").add_quarantine_table(rows.table())


def test_a_run_holds_its_rejected_rows_in_far_less_than_a_dict_each():
    """~715 B a row as dicts (1M bad samples: ~700 MB until the commit); compressed columns ~40 B, plus the last
    chunk's dicts (bench/resize_reject_memory.py)."""
    import gc
    import tracemalloc

    import pyarrow as pa

    from schemas.errors import Rejected
    from stages.resize.intake import Intake
    from stages.resize.sources import SourceSample
    from stages.resize.summary import ResizeSummary

    intake, n = Intake(ResizeSummary(version=1)), 5 * reject_rows.CHUNK
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0] + pa.total_allocated_bytes()
        for i in range(n):
            path = f"/data/edits/batch_{i // 1000:04d}/target/pair_{i:07d}.png"
            intake.reject(SourceSample(name=str(i), source=path, target=b"x"), Rejected(
                "unreadable-image", f"target ({path}): not a readable image", key=f"{i:032x}"))
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] + pa.total_allocated_bytes() - before
    finally:
        tracemalloc.stop()
    assert held / n < 200, f"{held / n:.0f} B a row"
    assert len(intake.rejects) == n and intake.rejects.first()["source"].endswith("pair_0000000.png")
