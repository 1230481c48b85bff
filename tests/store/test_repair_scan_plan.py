"""`store repair`'s scan of one version (store/repair.py `scan_table`) names the same samples, shards and derived
files as the rule it had before its shard set was built once (bench/repair_scan.py: that rule rebuilt the set of
every sample's shard for each checksums.json entry, O(shards x samples): minutes at 1M samples)."""

from __future__ import annotations

from damage import flip_bit, sample_byte
from store import Store
from store import format as fmt
from store import integrity, repair
from store.checksum import file_crc
from store_samples import fill

INDEX = ".index.parquet"


def _old_derived_damaged(vdir, sums: dict, shard_col: list[str]) -> list[str]:
    """The former rule, verbatim but for its inputs."""
    derived = {n: e for n, e in sums.items() if n not in (fmt.MANIFEST, fmt.SCHEMA_JSON) and n not in set(shard_col)}
    return sorted(n for n, e in derived.items() if not (vdir / n).is_file()
                  or file_crc(vdir / n) != (e["crc32c"], e["nbytes"]))


def test_scan_names_damaged_samples_shards_and_derived_files(store: Store) -> None:
    fill(store, 30)
    vdir = store.version_dir("vae", 1)
    with store.reader("vae") as r:
        keys, shard_col = r.keys(), r.manifest.column("shard").to_pylist()
    shards = sorted(set(shard_col))
    assert len(shards) >= 4
    indexes = sorted(p.name for p in vdir.glob("*" + INDEX))
    bad_key = keys[len(keys) // 2]
    flip_bit(*sample_byte(store.root, "vae", bad_key), 3)  # one sample's tensor bytes
    flip_bit(vdir / indexes[0], (vdir / indexes[0]).stat().st_size // 2, 0)  # an index: derived from the manifest
    (vdir / indexes[-1]).unlink()

    plan = repair.scan_table(store.root, "vae", 1, progress=False)

    sums = integrity.read_version_checksums(vdir)
    bad_shard = shard_col[keys.index(bad_key)]
    assert plan.samples == 30 and plan.unrepairable is None
    assert list(plan.damaged) == [bad_key]
    assert plan.derived_damaged == _old_derived_damaged(vdir, sums, shard_col) == [indexes[0], indexes[-1]]
    assert plan.intact_shards == [s for s in shards if s != bad_shard]
    assert plan.copied == [k for k, s in zip(keys, shard_col) if s == bad_shard and k != bad_key]
    assert plan.needs_repair
