"""The de-duplicating merge of quarantine rows (`quarantine.merged_rows`, every stage's append and a store URL's push
and pull): the column-by-column rule gives the rows the former rules gave (bench/quarantine_merge.py's group_by over
every column, bench/quarantine_append.py's Python tuples), in the same order, and the same sealed file, on values
a joined or hashed key could confuse; and a batch of new rows is handed on as it is, not copied."""

from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from store import quarantine

# values a key joined from several columns, or a hash of them, could take for one another
TRICKY = [None, "", "a", "b", "a|b", "|", "a\x00", "\x00", "\x00a", "a\x1fb", "1", "01", " a", "a ", "ü", "a" * 70]
NAMES = ["key", "source", "stage", "reason", "detail", "time", "table_version", "pictures"]


def _table(rng: random.Random, n: int, names: list[str], values: list[str | None]) -> pa.Table:
    """n rows in 1-3 chunks of random `values` (the rows a stage holds in chunks, a file read by row group)."""
    cuts = sorted(rng.sample(range(n + 1), min(2, n + 1)))
    chunks = [pa.table({c: pa.array([rng.choice(values) for _ in range(k)], pa.string()) for c in names})
              for k in (cuts[0], cuts[-1] - cuts[0], n - cuts[-1])]
    return pa.concat_tables(chunks)


def _file_rows(table: pa.Table) -> tuple[dict, list[dict]]:
    """The seal and the rows of the file `table` is written as."""
    got = pq.read_table(pa.BufferReader(quarantine.to_bytes(table)))
    return dict(got.schema.metadata), got.to_pylist()


def _check_same(old: pa.Table | None, rows: pa.Table) -> None:
    from bench.quarantine_append import old_merged_rows as tuple_rule
    from bench.quarantine_merge import old_merged_rows as group_by_rule

    got, n = quarantine.merged_rows(old, rows)
    want, m = group_by_rule(old, rows)
    assert n == m and got.equals(want)
    assert _file_rows(got) == _file_rows(want)
    if "pictures" not in rows.column_names:  # the tuple rule predates DERIVED: it compares `pictures` too
        want, m = tuple_rule(old, rows)
        assert n == m and got.equals(want)


@pytest.mark.parametrize("values", [TRICKY, TRICKY[:3]], ids=["tricky", "few"])
def test_merge_gives_the_former_rules_rows_on_values_a_joined_key_confuses(values) -> None:
    """Random tables of those values (few values: many duplicates within the new rows and against the file), with
    columns on one side only, against the former rules: the same rows, order and file seal."""
    rng = random.Random(len(values))
    for _ in range(300):
        old = _table(rng, rng.randint(0, 30), rng.sample(NAMES, rng.randint(1, 8)), values) \
            if rng.random() < 0.9 else None
        names = ["key", *rng.sample(NAMES[1:], rng.randint(0, 7))]  # every stage's rows: the key first
        _check_same(old, _table(rng, rng.randint(0, 30), names, values))


def test_merge_renumbering_its_codes_keeps_the_rows(monkeypatch) -> None:
    """The codes renumbered before a fold could overflow int64 (many distinct values in many columns): forced after
    every column here, the same rows."""
    monkeypatch.setattr(quarantine, "_CODE_LIMIT", 2)
    rng = random.Random(7)
    for _ in range(200):
        old = _table(rng, rng.randint(1, 30), NAMES, TRICKY)
        rows = pa.concat_tables([old.slice(rng.randint(0, 10), 10), _table(rng, rng.randint(0, 30), NAMES, TRICKY)])
        _check_same(old, rows.select(rng.sample(NAMES, 8)))


def test_merge_hands_a_batch_of_new_rows_on_uncopied() -> None:
    """Every row new (a source's bad batch, 1M rejects at worst): the merged table holds the rows' own buffers, not
    a copy of them (a take of every row: the rows' size again, at the commit)."""
    rows = pa.table({c: pa.array([f"{c}{i}" for i in range(100)], pa.string()) for c in NAMES})
    old = pa.table({c: pa.array([f"{c}old"], pa.string()) for c in NAMES})
    for before in (None, old):
        merged, added = quarantine.merged_rows(before, rows)
        assert added == 100
        fresh = merged.slice(merged.num_rows - 100)
        for c in NAMES:
            mine = fresh.column(c).chunks[-1].buffers()[2].address
            assert mine == rows.column(c).chunk(0).buffers()[2].address, c
