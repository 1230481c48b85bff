"""Manifests are written in row groups of `fmt.ROW_GROUP_ROWS` rows (pyarrow's default put up to 1M rows in one
group, whose columns every streamed read decoded whole), and the streamed readers read only the groups holding the
rows they want: `rows_at` (`meta_of`, `files_of`) and verify's passes. A manifest written before, in one group,
reads the same rows; damage in a later group is still refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from store import Store
from store import format as fmt
from store.checksum import file_crc, seal, unseal
from damage import damage_manifest_page
from store.verify import verify_store
from store_samples import fill, sample

N = 30
GROUP = 4  # rows a group in the tests' grouped manifests: 8 groups of 30 rows


def _filled(root: Path, monkeypatch, group_rows: int) -> Store:
    monkeypatch.setattr(fmt, "ROW_GROUP_ROWS", group_rows)
    store = Store(root)
    fill(store, N)
    return store


def _groups(vdir: Path) -> list[int]:
    md = pq.ParquetFile(vdir / fmt.MANIFEST).metadata
    return [md.row_group(g).num_rows for g in range(md.num_row_groups)]


def test_a_commit_writes_the_manifest_in_row_groups_of_bounded_rows(tmp_path: Path, monkeypatch) -> None:
    store = _filled(tmp_path / "s", monkeypatch, GROUP)
    assert _groups(store.version_dir("vae", 1)) == [GROUP] * (N // GROUP) + [N % GROUP]


def test_rows_at_meta_of_files_of_read_the_same_rows_from_the_groups_holding_them(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    """The same keys read through a manifest of many groups and through one of a single group (as written before:
    pyarrow's default of up to 1M rows a group) give the same values, those `meta` / `files` read; the grouped one
    reads only the groups holding the wanted rows."""
    asked: list[list[int] | None] = []
    real = pq.ParquetFile.iter_batches

    def iter_batches(self, *a, **kw):
        asked.append(kw.get("row_groups"))
        return real(self, *a, **kw)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", iter_batches)
    keys = [sample(i)["key"] for i in (29, 3, 17, 3)]
    got = {}
    for group_rows in (1 << 20, GROUP):
        store = _filled(tmp_path / f"g{group_rows}", monkeypatch, group_rows)
        assert len(_groups(store.version_dir("vae", 1))) == (1 if group_rows > N else 8)
        asked.clear()
        with store.reader("vae") as r:
            meta = r.meta_of(keys, ["caption", "img_shapes", "split"])
            files = r.files_of(keys)
            rows = sorted({r.view.keys.index(k) for k in keys})
            located = r.view.rows_at(rows, ["shard", "sample_offset", "tensors"])
            assert meta == {k: {c: r.meta(k)[c] for c in ("caption", "img_shapes", "split")} for k in keys}
            assert files == {k: r.files(k) for k in keys}
            assert located == {i: {c: r.view.manifest.column(c)[i].as_py() for c in ("shard", "sample_offset",
                                                                                    "tensors")} for i in rows}
        got[group_rows] = (meta, files, {r.view.keys.array[i].as_py(): v for i, v in located.items()})
        if group_rows == GROUP:
            holding = sorted({i // GROUP for i in rows})
            assert len(holding) < 8
            assert sorted(g for groups in asked for g in groups) == sorted(holding * 3)  # meta_of, files_of, rows_at
    assert got[1 << 20] == got[GROUP]
    assert got[GROUP][0][sample(17)["key"]]["caption"] == "caption 17"


def _reads(monkeypatch, wider_than: int = 0) -> list[int]:
    """Rows of every table the manifest readers decode from now on (`wider_than`: of those with more columns: a
    reader parses the one column it keeps, e.g. its keys, a group at a time too)."""
    decoded: list[int] = []
    for name in ("read", "read_row_group", "read_row_groups"):
        real = getattr(pq.ParquetFile, name)

        def spy(self, *a, _real=real, **kw):
            t = _real(self, *a, **kw)
            if t.num_columns > wider_than:
                decoded.append(t.num_rows)
            return t

        monkeypatch.setattr(pq.ParquetFile, name, spy)
    return decoded


def test_verify_decodes_a_group_of_a_column_at_a_time_and_refuses_damage_in_a_later_group(
        tmp_path: Path, monkeypatch) -> None:
    """verify's passes decode one row group of one column at a time (a column decoded whole before: ~100 MB at 1M
    samples); every group of every column is still decoded, so a damaged page in a later group is refused, in one
    printable line, as recorded (pyarrow's message quotes the damaged byte it met, \\x0f here: before, the line and
    the damage record held it as a control character)."""
    from store import integrity
    from store.verify_manifest import read_manifest_pass

    store = _filled(tmp_path / "s", monkeypatch, GROUP)
    vdir = store.version_dir("vae", 1)
    decoded = _reads(monkeypatch)
    problems, by_shard = read_manifest_pass(vdir, "vae/v1", integrity.read_version_checksums(vdir))
    assert problems == []
    walked = {s: by_shard[s].rows.to_pylist() for s in by_shard}
    assert decoded and max(decoded) <= GROUP
    assert sum(len(rows) for rows in walked.values()) == N
    assert verify_store(store.root, progress=False) == []

    damage_manifest_page(vdir, "caption", group=6)  # a caption page in the 7th of 8 groups
    problems = verify_store(store.root, progress=False)
    assert any("vae/v1/manifest.parquet: undecodable (OSError: " in p for p in problems), problems
    assert all(p.isprintable() for p in problems), problems
    assert json.loads(fmt.damaged_marker(store.root, "vae", 1).read_text())["problems"] == problems


def test_verify_names_a_manifest_that_is_no_parquet_with_the_readers_line(tmp_path: Path, monkeypatch) -> None:
    """A manifest whose bytes are no parquet (their CRC recorded: only opening it finds it) is one problem line, the
    store's line for it nested, as a reader's open says it (`ManifestGroups`, which verify's open goes through)."""
    from store.integrity import DamagedData

    store = _filled(tmp_path / "s", monkeypatch, GROUP)
    vdir = store.version_dir("vae", 1)
    (vdir / fmt.MANIFEST).write_bytes(b"PAR1 no footer\x0f\n here PAR1")
    record = unseal((vdir / fmt.CHECKSUMS).read_bytes())
    record["files"][fmt.MANIFEST] = dict(zip(("crc32c", "nbytes"), file_crc(vdir / fmt.MANIFEST)))
    (vdir / fmt.CHECKSUMS).write_bytes(seal(record))
    with pytest.raises(DamagedData) as e:
        store.reader("vae")
    assert verify_store(store.root, progress=False) == [f"vae/v1/manifest.parquet: unreadable ({e.value})"]
    assert str(e.value).startswith(f"{vdir / fmt.MANIFEST} is unreadable (") and str(e.value).isprintable()


@pytest.mark.parametrize("group_rows", [1 << 20, GROUP])
def test_verify_reads_a_manifest_of_one_group_or_many(tmp_path: Path, monkeypatch, group_rows: int) -> None:
    store = _filled(tmp_path / "s", monkeypatch, group_rows)
    assert verify_store(store.root, progress=False) == []


def test_reusable_reads_only_the_groups_holding_the_wanted_keys_and_finds_the_same_rows(tmp_path: Path,
                                                                                       monkeypatch) -> None:
    """An encode rank's search for rows to carry (store/reuse.py `reusable`) decodes only the row groups holding its
    keys, never the whole manifest (every column of it: ~500 MB at 1M samples, in every rank), and finds the rows the
    whole manifest holds for them, every column, in manifest order; a one-group manifest gives the same rows."""
    from dataclasses import replace

    from store.reuse import FEATURE_LINEAGE_ATTR, reusable
    from store_samples import vae_schema

    def filled(root: Path, group_rows: int) -> Store:
        monkeypatch.setattr(fmt, "ROW_GROUP_ROWS", group_rows)
        store = Store(root)
        s = vae_schema()
        w = store.writer("vae", replace(s, attrs={**s.attrs, FEATURE_LINEAGE_ATTR: "feat"}), shard_size_mb=0.004)
        for i in range(N):
            x = sample(i)
            w.add(x["key"], tensors=x["tensors"], files=x["files"], meta=x["meta"])
        w.commit()
        return store

    keys = [sample(i)["key"] for i in (29, 3, 17, 3)] + ["0" * 32]  # a repeat, and a key no version holds
    got = {}
    for group_rows in (1 << 20, GROUP):
        store = filled(tmp_path / f"g{group_rows}", group_rows)
        with store.reader("vae") as r:
            whole = r.view.manifest
            rows = sorted({r.view.keys.index(k) for k in keys[:4]})
        decoded = _reads(monkeypatch, wider_than=1)
        (found,) = reusable(store, "vae", "feat", keys).values()
        assert found.to_pylist() == whole.take(rows).to_pylist()
        assert found.schema == whole.schema
        if group_rows == GROUP:
            assert decoded and max(decoded) <= GROUP
            assert len(decoded) == len({i // GROUP for i in rows}) < N // GROUP
        got[group_rows] = found.to_pylist()
        monkeypatch.undo()
    assert got[1 << 20] == got[GROUP]


def test_a_parsed_column_read_group_by_group_is_the_whole_columns_narrowed_to_the_type_every_group_fits(
        tmp_path: Path) -> None:
    """A reader parses a column a row group at a time (`read_column`: less of the pool kept after a 1M-row parse),
    each group narrowed on its own: a group whose values need a wider type than another's makes the whole column that
    type, as the cast of the whole column did (a chunk of int16 beside one of int32 is no column)."""
    from store.arrow_columns import NARROWER, narrowed
    from store.manifest_files import read_column

    shapes = [[[1, 8, 8]], [[1, 40_000, 2]], [[1, 4, 4], [1, 2, 2]], None, [[1, 3, 5]]]  # 40,000: not an int16
    table = pa.table({"img_shapes": pa.array(shapes, pa.list_(pa.list_(pa.int64()))),
                      "shard": pa.array(["b.tar", "a.tar", "b.tar", "c.tar", "a.tar"])})
    for rows in (2, 1 << 20):  # groups of 2 rows (3 groups: the wide value in the first), and one group
        data = tmp_path / f"m{rows}.parquet"
        pq.write_table(table, data, row_group_size=rows)
        got = read_column(tmp_path, data.read_bytes(), "img_shapes", narrow=NARROWER["img_shapes"]).combine_chunks()
        whole = narrowed(pq.read_table(data).column("img_shapes").combine_chunks(), NARROWER["img_shapes"])
        assert got.type == whole.type == pa.list_(pa.list_(pa.int32()))
        assert got.to_pylist() == whole.to_pylist() == shapes
        names = read_column(tmp_path, data.read_bytes(), "shard", dictionary=True).combine_chunks()
        assert pa.types.is_dictionary(names.type) and names.to_pylist() == table.column("shard").to_pylist()
    small = pa.table({"img_shapes": pa.array([[[1, 8, 8]], [[1, 2, 4]]], pa.list_(pa.list_(pa.int64())))})
    pq.write_table(small, tmp_path / "small.parquet", row_group_size=1)
    got = read_column(tmp_path, (tmp_path / "small.parquet").read_bytes(), "img_shapes", narrow=NARROWER["img_shapes"])
    assert got.type == pa.list_(pa.list_(pa.int16())) and got.to_pylist() == [[[1, 8, 8]], [[1, 2, 4]]]


def test_a_damaged_page_is_refused_by_each_row_reader_with_the_same_line_naming_the_manifest(
        tmp_path: Path, monkeypatch) -> None:
    """A caption page of one row group damaged (its bytes' CRC recorded: opening finds nothing): every read of the
    view that decodes it (`rows_at` / `meta_of`, `table_at`, `column_at`, `column_groups`, a parsed column) refuses it
    with the same line, naming the manifest and what to run; rows of the other groups still read. pyarrow's message
    carries newlines and the damaged byte it met (a control character): before, the error held them as they were."""
    from store.integrity import DamagedData

    store = _filled(tmp_path / "s", monkeypatch, GROUP)
    vdir = store.version_dir("vae", 1)
    damage_manifest_page(vdir, "caption", group=6)  # rows 24-27
    rows = np.array([24, 26], np.int64)
    with store.reader("vae") as r:
        view = r.view
        caption_of = {sample(i)["key"]: sample(i)["meta"]["caption"] for i in range(N)}
        assert view.rows_at([1, 29], ["caption"]) == {i: {"caption": caption_of[view.keys.array[i].as_py()]}
                                                      for i in (1, 29)}
        readers = {"rows_at": lambda: view.rows_at([25], ["caption"]),
                   "meta_of": lambda: r.meta_of([view.keys.array[25].as_py()], ["caption"]),
                   "table_at": lambda: view.table_at(rows, ["caption"]),
                   "table_at every column": lambda: view.table_at(rows),
                   "column_at": lambda: view.column_at("caption", rows[::-1].copy()),
                   "column_groups": lambda: list(view.column_groups("caption"))}
        said = {}
        for name, read in readers.items():
            with pytest.raises(DamagedData) as e:
                read()
            said[name] = str(e.value)
    with Store(store.root).reader("vae") as r:  # a fresh view: nothing parsed yet
        with pytest.raises(DamagedData) as e:
            r.view.column("caption")
        said["column"] = str(e.value)
    line = said["rows_at"]
    assert all(s == line for s in said.values()), said
    assert line.startswith(f"{vdir / fmt.MANIFEST} is unreadable (OSError: ") and "pipeline store repair" in line
    assert line.isprintable(), line  # one line, no control characters


def test_crcs_at_reads_each_group_of_the_crc_column_once(tmp_path: Path, monkeypatch) -> None:
    """`crcs_at`'s first call tells whether every sample_crc32c is 8 hex digits a row group at a time and takes the
    rows' numbers from those same groups: each group decoded once (before, the groups holding the rows were decoded
    again: 8 + 3 here), the numbers those of the whole column."""
    store = _filled(tmp_path / "s", monkeypatch, GROUP)
    rows = np.array([29, 1, 5, 1], np.int64)  # groups 7, 0, 1; a repeat; not in order
    with store.reader("vae") as r:
        decoded = _reads(monkeypatch)
        got = r.view.samples.crcs_at(rows)
        monkeypatch.undo()
        assert decoded == [GROUP] * 7 + [N % GROUP]
        assert got is not None and got.dtype == np.uint32
        assert got.tolist() == r.view.samples.crcs()[rows].tolist()
        assert [f"{int(c):08x}" for c in got] == [r.view.manifest.column("sample_crc32c")[int(i)].as_py()
                                                   for i in rows]


_VIEW_READS = {"rows_at": lambda r: r.view.rows_at([25], ["caption"]),
               "meta_of": lambda r: r.meta_of([r.view.keys.array[25].as_py()], ["caption"]),
               "table_at": lambda r: r.view.table_at(np.array([24, 26], np.int64), ["caption"]),
               "column_groups": lambda r: list(r.view.column_groups("caption")),
               "column": lambda r: r.view.column("caption"),
               "manifest": lambda r: r.view.manifest}


@pytest.mark.parametrize("read", sorted(_VIEW_READS))
def test_a_damaged_page_met_through_the_view_is_recorded_so_a_rerun_does_not_call_the_version_up_to_date(
        tmp_path: Path, monkeypatch, read: str) -> None:
    """A page damaged before its bytes were checksummed passes the open's check; the read through the view that
    decodes it records the damage (`v<N>.damaged.json`), as the open records a checksum mismatch: the stage's rerun
    then finds no version up to date (`find_version`) and writes a new one. Before, nothing was recorded: the rerun
    called the version up to date and every reader met the page again."""
    from store.integrity import DamagedData
    from store_samples import lineage

    store = _filled(tmp_path / "s", monkeypatch, GROUP)
    vdir = store.version_dir("vae", 1)
    damage_manifest_page(vdir, "caption", group=6)  # rows 24-27
    assert store.find_version("vae", lineage()) == 1  # the open's checks find nothing
    with store.reader("vae") as r:
        with pytest.raises(DamagedData) as e:
            _VIEW_READS[read](r)
    marker = fmt.damaged_marker(store.root, "vae", 1)
    assert marker.is_file(), "not recorded"
    assert json.loads(marker.read_text())["problems"] == [str(e.value)]
    assert Store(store.root).find_version("vae", lineage()) is None


def test_running_out_of_memory_while_decoding_the_manifest_is_not_called_damage(tmp_path: Path, monkeypatch) -> None:
    """A decode that runs out of memory says so (MemoryError: pyarrow's ArrowMemoryError is one), never "unreadable;
    run store repair", and records nothing: the bytes are intact, and a recorded version would be recomputed."""
    store = _filled(tmp_path / "s", monkeypatch, GROUP)
    with store.reader("vae") as r:
        def out_of_memory(self, *a, **kw):
            raise pa.ArrowMemoryError("malloc of size 1073741824 failed")

        monkeypatch.setattr(pq.ParquetFile, "read_row_group", out_of_memory)
        with pytest.raises(MemoryError):
            r.view.table_at(np.array([1, 2], np.int64), ["caption"])
    assert not fmt.damaged_marker(store.root, "vae", 1).exists()


@pytest.mark.parametrize("how", ["checksum", "page"])
def test_the_images_split_read_records_damage_as_a_reader_does_and_a_one_off_read_writes_nothing(
        tmp_path: Path, how: str) -> None:
    """The `images` keys and splits read for a split (features/open.py: `images_in_split`, the dropped report) record
    a damaged manifest, a checksum mismatch or a page that does not decode, through `checked_manifest` /
    `checked_groups` (record=True), as a reader's open does: resize-bucket's rerun must not call it up to date. The
    same read without it (inspect, migrate) writes nothing."""
    from features.open import images_in_split
    from store.integrity import DamagedData
    from store.manifest_files import checked_groups, checked_manifest
    from store_samples import fill_images

    store = Store(tmp_path / "s")
    fill_images(store, "t")
    vdir = store.version_dir("images", 1)
    if how == "page":
        damage_manifest_page(vdir, "key", group=0)
    else:
        data = bytearray((vdir / fmt.MANIFEST).read_bytes())
        data[len(data) // 2] ^= 1
        (vdir / fmt.MANIFEST).write_bytes(bytes(data))
    marker = fmt.damaged_marker(store.root, "images", 1)
    for read in (lambda: list(checked_groups(vdir, ["key", "split"])), lambda: checked_manifest(vdir, ["key"])):
        with pytest.raises(DamagedData):
            read()
    assert not marker.exists()
    with pytest.raises(DamagedData) as e:
        images_in_split(store.root, "train")
    assert json.loads(marker.read_text())["problems"] == [str(e.value)]
    marker.unlink()
    with pytest.raises(DamagedData) as e:
        list(checked_groups(vdir, ["key", "split"], record=True))
    assert json.loads(marker.read_text())["problems"] == [str(e.value)]
