"""Per-sample reuse (store/reuse.py) on a format-2 store: carried shards get their checksums recorded in the new
version (verify clean, reader checks them), damage is never carried back while `store repair` runs a stage,
versions marked damaged are never reused, and gc leaves a verifiable store."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

from schemas.lineage import Lineage
from store import Store
from store import format as fmt
from store import repair_context
from store.gc import collect
from store.integrity import DamagedData, read_version_checksums
from store.manifest_files import checked_manifest
from store.reuse import FEATURE_LINEAGE_ATTR, carry_forward, damage_scan, reusable, unchanged_by_fixes
from store.verify import verify_store
from damage import damage_manifest_page, flip_bit, sample_byte
from file_opens import opens
from store_samples import key_of, sample, vae_schema

LINEAGE = "feat-0123456789"


def _schema(tag: str):
    s = vae_schema(tag)
    return replace(s, attrs={**s.attrs, FEATURE_LINEAGE_ATTR: LINEAGE})


def _write(store: Store, tag: str, idx: range) -> int:
    w = store.writer("vae", _schema(tag), shard_size_mb=0.002)
    for i in idx:
        s = sample(i)
        w.add(s["key"], tensors=s["tensors"], files=s["files"], meta=s["meta"])
    return w.commit()


def _carry_all(store: Store, tag: str, keys: list[str]) -> tuple[int, int]:
    """A new version (another table lineage, same feature lineage) holding `keys` carried forward only."""
    w = store.writer("vae", _schema(tag), shard_size_mb=0.002)
    n = 0
    for v, rows in reusable(store, "vae", LINEAGE, keys).items():
        n += carry_forward(w, v, rows)
    return w.commit(), n


def test_carried_shards_are_checksummed_in_the_new_version_and_verify_stays_clean_after_gc(store: Store) -> None:
    _write(store, "a", range(6))
    keys = [key_of(i) for i in range(6)]
    v2, n = _carry_all(store, "b", keys)
    assert (v2, n) == (2, 6)
    v2dir = store.version_dir("vae", 2)
    sums = read_version_checksums(v2dir)
    shards = sorted(p.name for p in v2dir.glob("shard-*.tar"))
    assert shards and all(s in sums for s in shards)
    assert all(os.stat(v2dir / s).st_nlink == 2 for s in shards)  # hard links, not copies
    assert verify_store(store.root, progress=False) == []
    r = store.reader("vae")
    assert r.version == 2 and sorted(r.keys()) == sorted(keys)
    assert all(r.damaged(k) is None for k in keys)
    # the fixes' "none changed" record beside v1 (store/reuse.py) is no problem to verify, and goes with v1
    assert unchanged_by_fixes(store, "vae", 1, "lineage-now", lambda: True)
    assert verify_store(store.root, progress=False) == [] and fmt.unchanged_marker(store.root, "vae", 1).is_file()
    collect(store.root, echo=lambda _: None)
    assert store.versions("vae") == [2] and not fmt.unchanged_marker(store.root, "vae", 1).exists()
    assert verify_store(store.root, progress=False) == []
    assert all(store.reader("vae").damaged(k) is None for k in keys)


def test_damage_in_a_shared_shard_is_found_in_the_new_version_and_not_carried_during_repair(store: Store) -> None:
    _write(store, "a", range(6))
    keys = [key_of(i) for i in range(6)]
    _carry_all(store, "b", keys)
    bad = key_of(1)
    flip_bit(*sample_byte(store.root, "vae", bad, offset=3, version=2), 0)  # the inode both versions share
    # nothing recorded yet: a plain stage run carries by metadata only; under `store repair` each carried sample
    # is checked first
    assert bad in reusable(store, "vae", LINEAGE, [bad]).get(2, None).column("key").to_pylist()
    with repair_context.expecting(Lineage(stage="x", config_hash="y")):
        found = reusable(store, "vae", LINEAGE, keys)
    carried = {k for rows in found.values() for k in rows.column("key").to_pylist()}
    assert carried == set(keys) - {bad}
    assert any(bad in p for p in verify_store(store.root, progress=False))
    with pytest.raises(DamagedData, match="pipeline store repair"):
        store.reader("vae", 2).tensors(bad)
    # verify and the reader recorded the damage: from now on every stage run checks what it carries
    assert fmt.damaged_marker(store.root, "vae", 2).exists() and fmt.damaged_marker(store.root, "vae", 1).exists()
    found = reusable(store, "vae", LINEAGE, keys)
    assert {k for rows in found.values() for k in rows.column("key").to_pylist()} == set(keys) - {bad}


def test_versions_recorded_damaged_or_with_missing_shards_give_only_their_intact_samples(store: Store) -> None:
    _write(store, "a", range(6))
    keys = [key_of(i) for i in range(6)]
    vdir = store.version_dir("vae", 1)
    lost = sorted(vdir.glob("shard-*.tar"))[0]
    lost_keys = {k for k, s in zip(store.reader("vae", on_damaged="skip").keys(),
                                   store.reader("vae", on_damaged="skip").manifest.column("shard").to_pylist())
                 if s == lost.name}
    lost.unlink()
    found = reusable(store, "vae", LINEAGE, keys)
    assert {k for rows in found.values() for k in rows.column("key").to_pylist()} == set(keys) - lost_keys
    fmt.damaged_marker(store.root, "vae", 1).write_text("{}")  # recorded: scanned in full, intact samples reused
    found = reusable(store, "vae", LINEAGE, keys)
    assert {k for rows in found.values() for k in rows.column("key").to_pylist()} == set(keys) - lost_keys
    assert store.find_version("vae", store.reader("vae", on_damaged="skip").schema.lineage) is None  # never up to date


def test_an_older_version_whose_manifest_page_does_not_decode_is_skipped_and_its_samples_recomputed(
        store: Store, tmp_path) -> None:
    """An older version of the wanted lineage whose manifest holds a page that does not decode (its CRC recorded: the
    open finds nothing, reading its rows does) is skipped, as an unreadable version is: its samples are recomputed,
    the damage recorded (the view records it), the run goes on. Before, `reusable` raised DamagedData from the rows'
    read and the encode stopped, at every rerun."""
    _write(store, "a", range(6))
    damage_manifest_page(store.version_dir("vae", 1), "caption", group=0)
    _write(store, "b", range(3, 9))
    keys = [key_of(i) for i in range(9)]
    for _ in ("first", "rerun"):  # the rerun with v1 recorded damaged: every version scanned in full first
        found = reusable(store, "vae", LINEAGE, keys)
        assert list(found) == [2] and sorted(found[2].column("key").to_pylist()) == sorted(keys[3:])
        assert fmt.damaged_marker(store.root, "vae", 1).exists()
    w = store.writer("vae", _schema("c"), shard_size_mb=0.002)  # the stage: carried, and the rest recomputed
    assert carry_forward(w, 2, found[2]) == 6
    for i in range(3):
        s = sample(i)
        w.add(s["key"], tensors=s["tensors"], files=s["files"], meta=s["meta"])
    clean = Store(tmp_path / "clean")
    got, want = store.reader("vae", w.commit()), clean.reader("vae", _write(clean, "c", range(9)))
    assert sorted(got.keys()) == sorted(want.keys()) == sorted(keys)
    for k in keys:
        assert got.meta(k) == want.meta(k) and got.files(k) == want.files(k)
        mine, theirs = got.tensors(k), want.tensors(k)
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[n], theirs[n]) for n in mine)


def test_a_manifest_page_the_full_scan_cannot_decode_is_recorded_and_its_version_not_carried(
        store: Store, monkeypatch) -> None:
    """While every version is scanned in full (`checking_needed`: here another version recorded damaged), a damaged
    page in a row group holding none of the wanted keys passes the rows' read; the scan (repair's, which records
    nothing) fails to read the manifest and rebuilds it: nothing of the version is carried. Before, that damage
    was not recorded: a stage's rerun could call the version up to date, every reader met the page again."""
    monkeypatch.setattr(fmt, "ROW_GROUP_ROWS", 4)
    _write(store, "a", range(12))
    with store.reader("vae", 1) as r:
        first_group = r.view.keys.array.to_pylist()[:4]
    damage_manifest_page(store.version_dir("vae", 1), "caption", group=2)
    _write(store, "b", range(20, 22))
    fmt.damaged_marker(store.root, "vae", 2).write_text("{}")
    assert reusable(store, "vae", LINEAGE, first_group) == {}
    problems = json.loads(fmt.damaged_marker(store.root, "vae", 1).read_text())["problems"]
    assert len(problems) == 1 and problems[0].startswith(f"{store.version_dir('vae', 1) / fmt.MANIFEST} is unreadable")


def test_the_full_scan_records_the_manifest_it_cannot_decode_from_its_own_read(store: Store, monkeypatch) -> None:
    """The scan's own manifest error is recorded: the manifest (hundreds of MB at 1M rows) is not opened and decoded
    a second time for it, and the line is the one a reader's view records on meeting that page (one line, not
    two, when a reader finds it later)."""
    monkeypatch.setattr(fmt, "ROW_GROUP_ROWS", 4)
    _write(store, "a", range(12))
    vdir = store.version_dir("vae", 1)
    damage_manifest_page(vdir, "caption", group=2)
    with opens(vdir) as counts:
        plan = damage_scan(store, "vae", 1)
    assert plan.manifest_rebuilt and counts[fmt.MANIFEST] == 1
    with pytest.raises(DamagedData) as e:
        checked_manifest(vdir)
    assert json.loads(fmt.damaged_marker(store.root, "vae", 1).read_text())["problems"] == [str(e.value)]


def test_a_manifest_page_reusable_keys_cannot_decode_is_recorded_and_nothing_reused(store: Store) -> None:
    """`reusable_keys` (which of a version's values a resize carries) skipped a manifest whose page does not decode
    without recording it, as a reader's view records it: the version stayed up to date for the stage's rerun."""
    from store.reuse import reusable_keys

    _write(store, "a", range(6))
    damage_manifest_page(store.version_dir("vae", 1), "split", group=0)
    assert reusable_keys(store, "vae", LINEAGE, "split") == {}
    assert fmt.damaged_marker(store.root, "vae", 1).exists()


def test_per_sample_reuse_goes_through_the_one_rule(store: Store, monkeypatch) -> None:
    """Carrying samples forward is a reuse decision too: with `schemas.up_to_date` saying "stale" nothing is
    carried (a path comparing lineages by itself would still carry)."""
    from schemas import up_to_date

    _write(store, "a", range(3))
    keys = [key_of(i) for i in range(3)]
    assert sum(t.num_rows for t in reusable(store, "vae", LINEAGE, keys).values()) == 3
    monkeypatch.setattr(up_to_date, "is_current", lambda recorded, present: False)
    assert reusable(store, "vae", LINEAGE, keys) == {}


def test_a_version_note_is_read_back_for_its_version_only_and_goes_with_it(store: Store) -> None:
    """store/version_notes.py: a caller's record beside a version, tied to its manifest bytes: a version rebuilt
    under the same number (another manifest) does not inherit it; verify ignores it; gc removes it."""
    from store.version_notes import note_path, read_note, write_note

    _write(store, "a", range(3))
    write_note(store, "vae", 1, "source-tars", {"tars": {"a.tar": ["0" * 64, 3]}})
    assert read_note(store, "vae", 1, "source-tars") == {"tars": {"a.tar": ["0" * 64, 3]}}
    assert read_note(store, "vae", 1, "other") is None
    assert verify_store(store.root, progress=False) == []
    note = note_path(store.root, "vae", 1, "source-tars")
    kept = note.read_bytes()
    rebuilt = Store(store.root.parent / "rebuilt")
    _write(rebuilt, "a", range(4))  # v1 again, other rows
    note_path(rebuilt.root, "vae", 1, "source-tars").write_bytes(kept)
    assert read_note(rebuilt, "vae", 1, "source-tars") is None
    note.write_text("{not json")
    assert read_note(store, "vae", 1, "source-tars") is None
    _write(store, "b", range(2))
    collect(store.root, echo=lambda _: None)
    assert store.versions("vae") == [2] and not note.exists()


def test_a_schema_json_flipped_to_the_wanted_lineage_is_not_reused_by_reusable_keys(store: Store) -> None:
    """`reusable_keys` (which of a version's values a resize carries) read schema.json unchecked: a flipped byte
    that still parses and names the wanted feature lineage reused the rows of another lineage. Checked now, the
    version is skipped (recorded as damaged, as a reader records it)."""
    from store.reuse import reusable_keys

    _write(store, "a", range(6))
    path = store.version_dir("vae", 1) / fmt.SCHEMA_JSON
    data = path.read_bytes()
    assert data.count(LINEAGE.encode()) == 1
    path.write_bytes(data.replace(LINEAGE.encode(), LINEAGE[:-1].encode() + b"8"))
    assert reusable_keys(store, "vae", LINEAGE[:-1] + "8", "split") == {}
    assert fmt.damaged_marker(store.root, "vae", 1).exists()
    assert reusable_keys(store, "vae", LINEAGE, "split") == {}  # the damaged version is not reused either
