"""`store repair`'s scan of one version (store/repair.py `scan_table`) names the same samples, shards and derived
files as the rules it had before:
- before its shard set was built once (bench/repair_scan.py: that rule rebuilt the set of every sample's shard for
  each checksums.json entry, O(shards x samples): minutes at 1M samples);
- before a shard whose whole file matched its checksums.json entry was trusted whole: every sample of every shard
  was read and checksummed again after the whole-file pass (every byte of the version read twice: hours of I/O at
  1M samples of latents). That rule is the scan with no shard trusted whole (`_as_written` empty), compared here
  on each kind of damage."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from damage import flip_bit, sample_byte
from store import Store
from store import format as fmt
from store import integrity, repair
from store.checksum import file_crc
from scan_reads import DAMAGE, Hashed, damage
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


# ---------------------------------------------------------------- each shard's bytes read once


def _version_bytes(vdir: Path) -> tuple[int, int]:
    """(the shard files' bytes, what the scan checksums of the other files) of a version: each once, and
    checksums.json once more (its seal, checked again by the scan's reader: a few kB, ~4 MB at 1M samples)."""
    files = [p for p in vdir.iterdir() if p.is_file()]
    tars = sum(p.stat().st_size for p in files if p.name.endswith(".tar"))
    return tars, sum(p.stat().st_size for p in files) - tars + (vdir / fmt.CHECKSUMS).stat().st_size


def _sample_bytes(store: Store, shard: str) -> int:
    with store.reader("vae", on_damaged="skip") as r:
        m = r.manifest
    return sum(n for s, n in zip(m.column("shard").to_pylist(), m.column("sample_nbytes").to_pylist()) if s == shard)


def test_an_intact_store_is_read_once(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    fill(store, 30)
    vdir = store.version_dir("vae", 1)
    tars, others = _version_bytes(vdir)
    hashed = Hashed(monkeypatch)

    plan = repair.scan_table(store.root, "vae", 1, progress=False)

    assert not plan.needs_repair and plan.samples == 30
    assert hashed.nbytes == tars + others  # before: every sample's bytes a second time (+124 kB here)


def test_only_the_damaged_shards_samples_are_read_again(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    fill(store, 30)
    vdir = store.version_dir("vae", 1)
    with store.reader("vae") as r:
        key = r.keys()[7]
    path, pos = sample_byte(store.root, "vae", key)
    flip_bit(path, pos, 2)
    tars, others = _version_bytes(vdir)
    again = _sample_bytes(store, path.name)
    hashed = Hashed(monkeypatch)

    plan = repair.scan_table(store.root, "vae", 1, progress=False)

    assert list(plan.damaged) == [key] and path.name not in plan.intact_shards
    assert hashed.nbytes == tars + others + again


# ---------------------------------------------------------------- the same plan as every sample read again


@pytest.mark.parametrize("kind", DAMAGE)
def test_the_plan_is_the_one_every_sample_read_gives(store: Store, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    fill(store, 30)
    damage(store, kind)

    plan = dataclasses.asdict(repair.scan_table(store.root, "vae", 1, progress=False))
    with monkeypatch.context() as m:
        m.setattr(repair, "_as_written", lambda manifest, sums: set())  # no shard trusted whole: the rule before
        before = dataclasses.asdict(repair.scan_table(store.root, "vae", 1, progress=False))

    assert plan == before
    assert (kind == "none") != repair.scan_table(store.root, "vae", 1, progress=False).needs_repair


# ---------------------------------------------------------------- a shard two versions share (one inode)


def test_a_shard_carried_by_hard_link_damaged_later_is_damaged_in_both_versions(store: Store) -> None:
    """v2 carries v1's shards by hard link, their rows (`shard_crc32c` included) copied: one file, two versions.
    Damage to it after the carry fails the whole-file CRC in both, so neither trusts the shard whole: each scan and
    verify reads its samples and names the damaged one."""
    from store.manifest import rows_by_shard
    from store.verify import verify_version
    from store_samples import vae_schema

    fill(store, 30)
    v1 = store.version_dir("vae", 1)
    with store.reader("vae") as r:
        keys, manifest = r.keys(), r.manifest
    w = store.writer("vae", vae_schema("a"))
    for shard, rows in rows_by_shard(manifest).items():
        w.add_linked_shard(v1 / shard, rows)
    assert w.commit() == 2
    v2 = store.version_dir("vae", 2)
    assert not verify_version(v1, "vae/v1", progress=False) and not verify_version(v2, "vae/v2", progress=False)
    path, pos = sample_byte(store.root, "vae", keys[11], version=1)
    assert (v2 / path.name).stat().st_ino == path.stat().st_ino
    flip_bit(path, pos, 3)

    for version, vdir in ((1, v1), (2, v2)):
        assert list(repair.scan_table(store.root, "vae", version, progress=False).damaged) == [keys[11]]
        problems = verify_version(vdir, f"vae/v{version}", progress=False)
        assert any(f"key {keys[11]}: sample bytes are damaged" in p for p in problems), problems
