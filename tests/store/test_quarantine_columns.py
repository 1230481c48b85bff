"""STORE/quarantine.parquet read for a few columns (`quarantine.read(root, columns)`): the checks every rank runs at
its start (train's and evaluate's dropped report, encode's left-out samples) compare keys, stages, reasons and table
versions, and the file holds every stage's rejects with their long `source` and `detail` texts (~1M rows: ~200 MB
parsed, ~2/3 of it those two, in each of 64 ranks). The rows are the full read's, a damaged file still refused."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from schemas.errors import UserError
from store import Store
from store import format as fmt
from store import quarantine

ROWS = [{"key": f"{i:032x}", "source": f"shards/part-{i}.tar:{i}.jpg", "stage": "encode-vae" if i % 2 else
         "encode-text", "reason": "damaged-input", "detail": "read failed at byte " + "7" * i,
         "table_version": f"vae/v{1 + i % 3}"} for i in range(7)]


def _columns_decoded(monkeypatch) -> list[list[str] | None]:
    """The columns every parquet read of quarantine.parquet decodes from now on (None: all of them)."""
    seen: list[list[str] | None] = []
    real_table, real_read = pq.read_table, pq.ParquetFile.read

    def read_table(source, *a, columns=None, **kw):
        if str(source).endswith(fmt.QUARANTINE):
            seen.append(None if columns is None else list(columns))
        return real_table(source, *a, columns=columns, **kw)

    def read(self, columns=None, *a, **kw):
        seen.append(None if columns is None else list(columns))
        return real_read(self, columns, *a, **kw)

    monkeypatch.setattr(pq, "read_table", read_table)
    monkeypatch.setattr(pq.ParquetFile, "read", read)
    return seen


def test_a_few_columns_are_the_full_reads_rows_and_only_those_are_decoded(tmp_path: Path, monkeypatch) -> None:
    st = Store(tmp_path / "s")
    assert st.add_quarantine(ROWS) == len(ROWS)
    whole = st.quarantine()
    seen = _columns_decoded(monkeypatch)
    got = st.quarantine(["key", "reason", "table_version", "samples"])  # `samples`: a column this file lacks
    assert got.column_names == ["key", "reason", "table_version"]
    assert got.to_pylist() == whole.select(["key", "reason", "table_version"]).to_pylist()
    assert seen == [["key", "reason", "table_version"]]
    assert Store(tmp_path / "none").quarantine(["key", "table_version"]).column_names == ["key"]  # no file: no rows


def test_a_damaged_file_is_refused_when_a_few_columns_are_read(tmp_path: Path) -> None:
    st = Store(tmp_path / "s")
    st.add_quarantine(ROWS)
    (st.root / fmt.QUARANTINE).write_bytes((st.root / fmt.QUARANTINE).read_bytes()[:-20])
    with pytest.raises(UserError, match="quarantine.parquet is damaged"):
        st.quarantine(["key", "reason"])
    fmt.atomic_write_parquet(st.root / fmt.QUARANTINE, quarantine.empty().drop_columns(["reason"]))
    with pytest.raises(UserError, match=r"missing columns \['reason'\]"):
        st.quarantine(["key"])


def test_encodes_left_out_samples_read_keys_reasons_and_versions_only(tmp_path: Path, monkeypatch) -> None:
    """Every encode rank asks which damaged inputs a version left out (stages/encode/current.py `left_out`): the
    keys quarantined for it that it does not hold, without decoding the file's source and detail texts."""
    from stages.encode.current import left_out
    from store_samples import fill, key_of

    st = Store(tmp_path / "s")
    assert fill(st, 3) == 1  # vae v1 holds samples 0..2
    held = {**ROWS[0], "key": key_of(1), "table_version": "vae/v1"}  # quarantined by a failed run, then committed
    st.add_quarantine([*ROWS, held])
    seen = _columns_decoded(monkeypatch)
    assert left_out(st, "vae", 1) == [ROWS[0]["key"], ROWS[3]["key"], ROWS[6]["key"]]
    assert seen and all(c is not None and not {"source", "detail"} & set(c) for c in seen)


def test_a_rerun_after_the_upgrade_that_added_pictures_records_a_rejected_sample_once(tmp_path: Path) -> None:
    """resize-bucket's keyed rows gained `pictures` (a function of the key): the same reject recorded again by a
    rerun after the upgrade is the same row, not a second one `store inspect` counts (2 inputs for 1)."""
    root = Store(tmp_path / "st").root
    row = {"key": "ab" * 16, "source": "src/m.jsonl:3", "stage": "resize-bucket", "reason": "too-small",
           "detail": "8x8"}
    assert quarantine.add_rows(root, [row]) == 1  # as the release before recorded it
    assert quarantine.add_rows(root, [{**row, "pictures": "cd" * 16}]) == 0
    assert quarantine.add_rows(root, [{**row, "key": "ef" * 16, "pictures": "cd" * 16}]) == 1  # another sample
    assert quarantine.samples_by_reason(quarantine.read(root)) == {"too-small": 2}
