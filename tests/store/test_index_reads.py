"""Each shard index is read once by the code that needs it whole, counted by the kernel (file_opens.py): on a
shared file system every open is round trips, and a version holds ~20-30k indexes at 1M samples. `store repair`
rebuilding a damaged manifest used to read each index to check it, again to merge it and a third time for the
scan's check of the files the manifest makes redundant; a rank's upload list (`rank_files`) read each three times
(its schema, two columns, its checksum)."""

from __future__ import annotations

from pathlib import Path

from damage import flip_bit
from file_opens import opens
from store import Store
from store import format as fmt
from store import integrity, repair
from store.checksum import file_crc
from store.remote_parts import rank_files
from store_samples import fill

INDEX = ".index.parquet"


def _version(store: Store) -> Path:
    fill(store, 12)
    vdir = store.version_dir("vae", 1)
    assert len(list(vdir.glob("*" + INDEX))) >= 3
    return vdir


def test_repair_rebuilds_a_damaged_manifest_reading_each_index_once(store: Store) -> None:
    vdir = _version(store)
    manifest = vdir / fmt.MANIFEST
    flip_bit(manifest, manifest.stat().st_size // 2, 0)
    with opens(vdir) as n:
        plan = repair.scan(store.root, progress=False)
    t = plan.tables[0]
    assert t.manifest_rebuilt and t.unrepairable is None and not t.damaged and not t.derived_damaged
    assert t.samples == 12
    indexes = sorted(p.name for p in vdir.glob("*" + INDEX))
    assert {i: n[i] for i in indexes} == dict.fromkeys(indexes, 1)

    # still checked against checksums.json before it is used: a damaged index is named, nothing rebuilt from it
    bad = vdir / indexes[1]
    flip_bit(bad, bad.stat().st_size // 2, 0)
    t = repair.scan(store.root, progress=False).tables[0]
    assert t.unrepairable is not None and f"{indexes[1]} is damaged" in t.unrepairable
    assert "cannot be rebuilt from the shard indexes" in t.unrepairable


def test_a_ranks_upload_list_reads_each_index_once(store: Store) -> None:
    vdir = _version(store)
    sums = integrity.read_version_checksums(vdir)
    with opens(vdir) as n:
        files = rank_files(vdir, 0)
    indexes = sorted(p.name for p in vdir.glob("*" + INDEX))
    assert {i: n[i] for i in indexes} == dict.fromkeys(indexes, 1)
    assert not [s for s in files if s.endswith(".tar") and n[s]]  # the shards' sizes and CRCs come from the indexes
    # what the rank lists is what the commit recorded for those files
    assert set(files) == {*indexes, *(i[: -len(INDEX)] + ".tar" for i in indexes), fmt.SCHEMA_JSON}
    assert files == {name: {"nbytes": sums[name]["nbytes"], "crc32c": sums[name]["crc32c"]} for name in files}
    assert files[indexes[0]] == dict(zip(("crc32c", "nbytes"), file_crc(vdir / indexes[0])))
