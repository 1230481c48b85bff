"""The revivals' bookkeeping (stages/resize/intake.py `Intake.take_back`, `kept_instead`, `settle_revivals`):
the rows and pairs they let go are dropped in one pass at the end (the rows when read: reject_rows.py) (a list search per revived copy made 1M
samples' revivals quadratic: bench/revival_bookkeeping.py); the quarantine rows, their order and the summary's
duplicate pairs are those the removals one by one left."""

from __future__ import annotations

from schemas.errors import Rejected
from stages.resize.sources import SourceSample
from stages.resize.intake import Intake
from stages.resize.summary import ResizeSummary


def _dup(intake: Intake, key: str, source: str) -> tuple[SourceSample, int]:
    rec = SourceSample(name=key, source=source)
    return rec, intake.reject(rec, Rejected("duplicate", "same content", key=key))


def test_revived_copies_leave_the_rows_and_pairs_a_removal_each_left():
    intake = Intake(ResizeSummary(version=1))
    intake.first_source.update({"a": "a1", "b": "b1", "c": "c1"})
    intake.reject(SourceSample(name="x", source="x1"), Rejected("bad-caption", "empty", key=None))
    a2, a3 = _dup(intake, "a", "a2"), _dup(intake, "a", "a3")
    _dup(intake, "c", "c2")  # a plain duplicate of a kept sample: stays
    b2, b3, b4 = _dup(intake, "b", "b2"), _dup(intake, "b", "b3"), _dup(intake, "b", "b4")
    # round 1: a2 kept instead of a1 (a3 its duplicate); b2 taken back and rejected itself
    intake.take_back("a", *a2)
    intake.kept_instead("a", a2[0], [a3])
    intake.take_back("b", *b2)
    intake.reject(b2[0], Rejected("bad-mask", "damaged mask", key="b"))
    # round 2: b3 kept instead (b4 its duplicate)
    intake.take_back("b", *b3)
    intake.kept_instead("b", b3[0], [b4])
    intake.settle_revivals()
    rows = intake.rejects.table().to_pylist()
    assert [(r["source"], r["reason"]) for r in rows] == [
        ("x1", "bad-caption"), ("a3", "duplicate"), ("c2", "duplicate"), ("b4", "duplicate"), ("b2", "bad-mask")]
    detail = {r["source"]: r["detail"] for r in rows if r["reason"] == "duplicate"}
    assert detail["a3"].endswith("as a2") and detail["b4"].endswith("as b3") and detail["c2"] == "same content"
    assert intake.summary.duplicates == [("c1", "c2"), ("a2", "a3"), ("b3", "b4")]
    assert intake.summary.quarantined == {"bad-caption": 1, "duplicate": 3, "bad-mask": 1}
    assert not intake.pairs_gone  # settled: a second settle changes nothing
    intake.settle_revivals()
    assert len(intake.rejects) == 5 and len(intake.summary.duplicates) == 3


def test_a_source_of_many_duplicates_lists_the_first_pairs_and_counts_them_all():
    """A pair each (~140 B) was ~140 MB for 1M duplicates: the summary names 5 and counts the rest; a revival's
    pair past the listed ones leaves the count."""
    intake = Intake(ResizeSummary(version=1, quarantine_file="q.parquet"))
    for i in range(1000):
        intake.first_source[f"k{i}"] = f"first{i}"
    copies = [_dup(intake, f"k{i}", f"copy{i}") for i in range(1000)]
    intake.take_back("k999", *copies[999])  # rendered after all: its pair goes, though not listed
    intake.take_back("k0", *copies[0])  # a listed one
    intake.settle_revivals()
    s = intake.summary
    assert len(s.duplicates) <= 100 and s.duplicates[:2] == [("first1", "copy1"), ("first2", "copy2")]
    assert s.duplicate_pairs == 998 == s.quarantined["duplicate"]
    lines = [line for line in str(s).splitlines() if line.startswith("duplicate:")]
    assert lines[0] == "duplicate: kept first1, dropped copy1 (same target, controls and caption)" and len(lines) == 6
    assert lines[-1].startswith("duplicate: 993 more pairs")
