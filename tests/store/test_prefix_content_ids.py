"""`JoinedTables.content_ids(first)` (evaluate's `max_loss_samples`) reads the first rows' content columns from their
row groups alone, and names them as reading every column whole did (the ids recorded in loss arrays still match)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from store.join import JoinedTables
from store_samples import joined_over_manifests

ROWS, GROUP = 2000, 256


def _manifest(table: str, odd_crc_at: int | None) -> bytes:
    rng = np.random.default_rng(1 if table == "text" else 2)
    crcs = [f"{int(v):08x}" for v in rng.integers(0, 2**32, ROWS)]
    if odd_crc_at is not None:  # one value the writer would not write: the crc column is hashed as strings
        crcs[odd_crc_at] = crcs[odd_crc_at].upper() + "0"
    cols = {
        "key": pa.array([f"{i:032x}" for i in range(ROWS)]),
        "shard": pa.array(["shard-r00-000000.tar"] * ROWS),
        "sample_offset": pa.array(np.arange(ROWS, dtype=np.int64) * 512),
        "sample_nbytes": pa.array(np.full(ROWS, 512, np.int64)),
        "sample_sha256": pa.array([rng.bytes(32).hex() for _ in range(ROWS)]),
        "sample_crc32c": pa.array(crcs),
        "split": pa.array(np.where(np.arange(ROWS) % 7 == 3, "val", "train")),
    }
    if table == "vae":
        cols["img_shapes"] = pa.array([[[1, int(a), int(a)], [1, int(b), int(b)]] for a, b in rng.integers(4, 64, (ROWS, 2))])
    else:
        cols["length"] = pa.array(rng.integers(8, 512, ROWS))
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table(cols), sink, row_group_size=GROUP)
    return sink.getvalue().to_pybytes()


def _whole_columns_parsed(j: JoinedTables) -> JoinedTables:
    """The join with every content column parsed whole first: the ids as they were computed before."""
    for r in j.readers.values():
        for name in ("sample_sha256", "img_shapes", "length"):
            if r.view.has_column(name):
                r.view.column(name)
        r.view.samples.crcs()
    return j


@pytest.mark.parametrize("odd_crc_at", [None, ROWS - 5])
@pytest.mark.parametrize("first", [1, 40, 300])
def test_first_rows_ids_equal_the_whole_column_reads(odd_crc_at, first):
    data = {t: _manifest(t, odd_crc_at) for t in ("text", "vae")}
    for split in ("val", "train"):
        expected = _whole_columns_parsed(joined_over_manifests(data, split)).content_ids(first)
        assert joined_over_manifests(data, split).content_ids(first) == expected
    assert joined_over_manifests(data, "val").content_ids(40) != joined_over_manifests(data, "val").content_ids(41)
    other = {**data, "vae": _manifest("vae", 3)}  # a crc inside the first rows differs (as strings)
    assert joined_over_manifests(other, "val").content_ids(40)["vae"] != joined_over_manifests(data, "val").content_ids(40)["vae"]


def test_first_rows_read_their_row_groups_alone(monkeypatch):
    """256 samples of a 1M-row split parsed every content column whole (~170 MB RSS at 900k rows): only the groups
    holding the rows are decoded now (the crc column is looked over a group at a time, none kept)."""
    data = {t: _manifest(t, None) for t in ("text", "vae")}
    j = joined_over_manifests(data, "val")
    groups: dict[str, set[int]] = {}
    real = pq.ParquetFile.read_row_group

    def counted(self, i, columns=None, **kw):
        for c in columns or ["*"]:
            groups.setdefault(c, set()).add(i)
        return real(self, i, columns=columns, **kw)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counted)
    j.content_ids(30)  # the first 30 val rows lie in row group 0 (rows < 256)
    for name in ("sample_sha256", "img_shapes", "length"):
        assert groups[name] == {0}, name
    for r in j.readers.values():
        assert "sample_sha256" not in r.view.parsed and r.view.samples._crc_u32 is False  # nothing kept


def test_a_parsed_columns_groups_are_its_values():
    """`ManifestView.column_groups` of a column parsed already yields its one array (before: `.chunks` of an Array,
    an AttributeError) and, unparsed, the same values a group at a time."""
    view = next(iter(joined_over_manifests({t: _manifest(t, None) for t in ("text", "vae")}).readers.values())).view
    unparsed = pa.concat_arrays(list(view.column_groups("sample_crc32c")))
    assert "sample_crc32c" not in view.parsed
    parsed = view.column("sample_crc32c")
    assert pa.concat_arrays(list(view.column_groups("sample_crc32c"))).equals(parsed) and unparsed.equals(parsed)
