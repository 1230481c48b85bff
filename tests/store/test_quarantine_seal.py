"""STORE/quarantine.parquet is sealed (`quarantine.SEAL`: a crc32c of each column's values in its parquet key-value
metadata) like every other store file: a flipped byte that changes what is read - a recorded reason in a data page,
a column's name in the footer - is refused in one line naming the file and `store repair`, and `store verify` names
it. Before, `unreadable-image` read back as `unseadable-image` and verify said ok. A file written before the seal
still reads."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from schemas.errors import UserError
from store import Store
from store import format as fmt
from store import quarantine

ROWS = [{"key": f"{i:032x}", "source": f"in/{i}.png", "stage": "resize-bucket", "reason": "unreadable-image",
         "detail": "cannot identify image file", "samples": "3" if i % 2 else None} for i in range(6)]


def _cli(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in r.output, r.output
    return r


def _flipped(data: bytes, offset: int, mask: int) -> bytes:
    out = bytearray(data)
    out[offset] ^= mask
    return bytes(out)


def test_a_flipped_byte_in_a_recorded_reason_is_refused_and_named_by_verify(store: Store) -> None:
    assert store.add_quarantine(ROWS) == len(ROWS)
    path = store.root / fmt.QUARANTINE
    data = path.read_bytes()
    at = data.index(b"unreadable-image")  # in the dictionary page: the one copy every row's reason reads
    path.write_bytes(_flipped(data, at + 3, ord("r") ^ ord("s")))  # unreadable -> unseadable
    with pytest.raises(UserError, match=r"quarantine.parquet is damaged \(column 'reason' has crc32c .*store repair"):
        store.quarantine()
    with pytest.raises(UserError, match="quarantine.parquet is damaged"):
        store.quarantine(["key", "reason"])  # the read every rank's start makes checks its columns too
    r = _cli("store", "verify", store.root)
    assert r.exit_code == 1 and "quarantine.parquet: column 'reason'" in r.output, r.output
    r = _cli("store", "repair", store.root)
    assert r.exit_code == 0 and "set aside" in r.output, r.output
    assert _cli("store", "verify", store.root).exit_code == 0


def test_a_flipped_byte_in_a_column_name_is_refused(store: Store) -> None:
    """The names live in the footer, which parquet's page CRCs do not cover: `samples` read back renamed counted
    each 3-input row as one."""
    store.add_quarantine(ROWS)
    path = store.root / fmt.QUARANTINE
    data = path.read_bytes()
    hits = [i for i in range(len(data)) if data.startswith(b"samples", i)]
    assert hits
    for at in hits:
        path.write_bytes(_flipped(data, at + 4, ord("p") ^ ord("P")))
        try:
            got = store.quarantine()
        except UserError as e:
            assert "quarantine.parquet is damaged" in str(e)
            continue
        assert got.equals(quarantine.read(_intact(store, data))), at  # read as written, or refused


def _intact(store: Store, data: bytes) -> Path:
    root = store.root.parent / "intact"
    root.mkdir(exist_ok=True)
    (root / fmt.QUARANTINE).write_bytes(data)
    return root


def test_a_file_written_before_the_seal_still_reads_and_its_next_append_seals_it(store: Store) -> None:
    table = pa.table({c: pa.array([r.get(c) for r in ROWS], pa.string()) for c in ROWS[0]})
    pq.write_table(table, store.root / fmt.QUARANTINE)
    assert store.quarantine().equals(table)
    assert _cli("store", "verify", store.root).exit_code == 0
    assert store.add_quarantine([{**ROWS[0], "key": "k"}]) == 1
    assert quarantine.SEAL in pq.read_metadata(store.root / fmt.QUARANTINE).metadata
    assert store.quarantine().num_rows == len(ROWS) + 1


def test_the_seal_is_the_same_however_a_column_is_laid_out() -> None:
    """Written from an append's table, read back as one chunk or sliced, with nulls: one crc."""
    col = pa.chunked_array([pa.array(["a", None, "bc"]), pa.array(["", None])])
    big = pa.chunked_array([pa.array(["x", "a", None, "bc", "", None], pa.large_string()).slice(1)])
    assert quarantine._column_crc(col) == quarantine._column_crc(big)
    other = pa.chunked_array([pa.array(["a", "", "bc", "", None])])  # a null is not an empty text
    assert quarantine._column_crc(col) != quarantine._column_crc(other)


def test_a_store_urls_copy_is_sealed_and_a_flipped_byte_there_refused(s3_env, store: Store, tmp_path: Path) -> None:
    """Push writes the URL's quarantine.parquet through the same writer (a compare-and-swap of its bytes), and pull
    reads it through the same reader."""
    from store.remote import open_remote
    from store.remote_pull import pull
    from store.remote_push import push
    from store_samples import fill

    fill(store, 2)
    store.add_quarantine(ROWS)
    push(store.root, s3_env.url())
    remote = open_remote(s3_env.url())
    data = remote.read(fmt.QUARANTINE)
    assert quarantine.SEAL in pq.read_metadata(pa.BufferReader(data)).metadata
    at = data.index(b"unreadable-image")
    remote.write(fmt.QUARANTINE, _flipped(data, at + 3, ord("r") ^ ord("s")))
    with pytest.raises(UserError, match=r"quarantine.parquet is damaged \(column 'reason' has crc32c"):
        pull(s3_env.url(), tmp_path / "pulled")


def test_rows_an_older_release_appended_to_a_sealed_file_read_and_the_sealed_ones_are_still_checked(
        store: Store) -> None:
    """A release before the seal appends by reading the table (its key-value metadata, the seal, comes along),
    adding rows and writing it back: the stale seal made the whole file read as damaged. The rows the seal counts
    are checked, those after it read as a file written before the seal does."""
    store.add_quarantine(ROWS[:4])
    path = store.root / fmt.QUARANTINE
    older = pq.read_table(path)  # as the older release's append reads it, metadata kept
    added = pa.table({c: pa.array([r.get(c) for r in ROWS[4:]], pa.string()) for c in older.column_names})
    fmt.atomic_write_parquet(path, pa.concat_tables([older, added], promote_options="permissive"))
    assert store.quarantine().num_rows == len(ROWS)
    assert _cli("store", "verify", store.root).exit_code == 0
    data = path.read_bytes()
    at = data.index(b"unreadable-image")
    path.write_bytes(_flipped(data, at + 3, ord("r") ^ ord("s")))  # the sealed rows' reason, damaged
    with pytest.raises(UserError, match=r"quarantine.parquet is damaged \(column 'reason'"):
        store.quarantine()
