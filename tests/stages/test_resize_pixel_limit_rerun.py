"""A resize-bucket rerun under a lowered resize.max_image_pixels quarantines the samples over it that it would
otherwise carry forward undecoded (stages/resize/pixel_limit.py), as a fresh run does: the same rows, the same
quarantine rows and reason text; the other samples are carried without reading their images. Raised again, the
sample comes back, and nothing else is read."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from pipeline.config import load_config
from pipeline.demo_data import make_demo_data
from stages.resize import stage
from stages.resize.summary import ResizeSummary
from store import Store

from tests.stages.test_resize_rerun_reads import SMALL, Reads, _rows

BIG = 300 * 300


def _quarantine(st: Store) -> list[tuple]:
    q = st.quarantine()
    if q is None:
        return []
    return sorted(zip(*(q.column(c).to_pylist() for c in ("source", "reason", "key", "detail"))))


def _same_as_fresh(tmp_path: Path, out: Path, src: Path, over: dict, rerun: ResizeSummary) -> None:
    fresh = tmp_path / f"fresh{len(list(tmp_path.glob('fresh*')))}"
    made = stage.run(load_config(None, {**SMALL, **over}), src, fresh)
    assert _rows(Store(out)) == _rows(Store(fresh))
    assert rerun.quarantined == made.quarantined
    # the same rows, reason and detail text (the quarantine file keeps every run's rows: the fresh one's are in it)
    assert set(_quarantine(Store(fresh))) <= set(_quarantine(Store(out)))


def _folder(tmp_path: Path, controls: int) -> tuple[Path, Path]:
    """Demo samples (small) with one 300x300 target, or with a 300x300 first control."""
    src = tmp_path / "src"
    make_demo_data(src, n=6, fmt="folder", max_controls=controls, seed=5)
    big = src / ("control" if controls else "target") / "sample_0002.png"
    assert big.exists()
    Image.new("RGB", (300, 300), (30, 120, 200)).save(big)
    return src, big


def test_a_lowered_pixel_limit_quarantines_a_carried_target_as_a_fresh_run(tmp_path: Path, monkeypatch) -> None:
    src, big = _folder(tmp_path, controls=0)
    out = tmp_path / "store"
    first = stage.run(load_config(None, SMALL), src, out)
    assert first.written == 6

    reads = Reads(monkeypatch)
    lowered = stage.run(load_config(None, {**SMALL, "resize.max_image_pixels": BIG - 1}), src, out)
    assert dict(lowered.quarantined) == {"image-too-large": 1}  # before the fix: 0, the big sample carried
    assert (lowered.written, lowered.reused) == (0, 5)
    assert set(reads.images) == {"target/sample_0002.png"}  # the others carried unread, by their recorded size
    monkeypatch.undo()
    assert str(big) not in {m["source"] for _, m in _rows(Store(out)).values()}
    _same_as_fresh(tmp_path, out, src, {"resize.max_image_pixels": BIG - 1}, lowered)

    reads = Reads(monkeypatch)
    raised = stage.run(load_config(None, {**SMALL, "resize.max_image_pixels": BIG}), src, out)
    assert (raised.written, raised.reused, sum(raised.quarantined.values())) == (0, 6, 0)  # back, from v1's rows
    # only the sample v2 quarantined is read (as any quarantined sample is), and carried from v1, not rendered
    assert dict(reads.images) == {"target/sample_0002.png": 1}
    monkeypatch.undo()
    _same_as_fresh(tmp_path, out, src, {"resize.max_image_pixels": BIG}, raised)


def test_a_lowered_pixel_limit_quarantines_a_carried_control_as_a_fresh_run(tmp_path: Path, monkeypatch) -> None:
    """A control's size is not recorded: the samples with controls are read (headers checked), not rendered."""
    src, big = _folder(tmp_path, controls=1)
    out = tmp_path / "store"
    stage.run(load_config(None, SMALL), src, out)
    lowered = stage.run(load_config(None, {**SMALL, "resize.max_image_pixels": BIG - 1}), src, out)
    assert dict(lowered.quarantined) == {"image-too-large": 1}
    assert lowered.written == 0 and lowered.reused == 5
    _same_as_fresh(tmp_path, out, src, {"resize.max_image_pixels": BIG - 1}, lowered)

    reads = Reads(monkeypatch)  # v2 records that its rows are within the lowered limit: nothing read again
    again = stage.run(load_config(None, {**SMALL, "resize.max_image_pixels": BIG - 1, "resize.val_fraction": 0.5}),
                      src, out)
    assert again.reused == 5 and again.written == 0
    assert set(reads.images) == {"target/sample_0002.png", "control/sample_0002.png"}  # the quarantined one alone


@pytest.mark.parametrize("fmt", ["webdataset", "jsonl", "parquet"])
def test_every_source_format_quarantines_carried_samples_over_a_lowered_limit(tmp_path: Path, fmt: str) -> None:
    """Demo samples with and without controls (sides 48..320): the limit lowered under the largest target."""
    src, out = tmp_path / "src", tmp_path / "store"
    make_demo_data(src, n=12, fmt=fmt, max_controls=1, seed=7)
    first = stage.run(load_config(None, SMALL), src, out)
    areas = sorted(m["source_size"][0] * m["source_size"][1] for _, m in _rows(Store(out)).values())
    over = {"resize.max_image_pixels": areas[-1] - 1}
    lowered = stage.run(load_config(None, {**SMALL, **over}), src, out)
    assert lowered.quarantined["image-too-large"] >= 1 and lowered.written == 0
    _same_as_fresh(tmp_path, out, src, over, lowered)
    raised = stage.run(load_config(None, SMALL), src, out)
    assert raised.written == 0 and raised.reused == first.written
    _same_as_fresh(tmp_path, out, src, {}, raised)


@pytest.mark.parametrize("fmt", ["folder", "jsonl"])
def test_a_lowered_file_size_limit_quarantines_a_carried_sample_as_a_fresh_run(tmp_path: Path, fmt: str) -> None:
    """resize.max_file_bytes: a folder/JSONL sample is carried only while its files' size is within it (checked
    by stat before the recorded key is trusted, known_sources.py), so the same holds for it (a guard, no fix)."""
    src, out = tmp_path / "src", tmp_path / "store"
    make_demo_data(src, n=8, fmt=fmt, max_controls=1, seed=9)
    stage.run(load_config(None, SMALL), src, out)
    largest = max(p.stat().st_size for p in src.rglob("*.png"))
    over = {"resize.max_file_bytes": largest - 1}
    lowered = stage.run(load_config(None, {**SMALL, **over}), src, out)
    assert lowered.quarantined["file-too-large"] >= 1 and lowered.written == 0
    _same_as_fresh(tmp_path, out, src, over, lowered)
