"""`Store.version_id` hashes a version's manifest once per process (store/store.py `_VERSION_IDS`), keyed by the
manifest file's identity (inode, mtime, size: the read leases' rule; and ctime), so a version gc took and a writer
numbered again, or a manifest rewritten in place with its mtime set back, is never named by the old bytes' id."""

from __future__ import annotations

import os
import time
from collections import Counter

from store import Store
from store import format as fmt
from store.gc import collect
from store.version_notes import note_path, read_note, write_note
from store_samples import fill


def test_reading_every_versions_note_again_and_again_hashes_each_manifest_once(store: Store, monkeypatch) -> None:
    """A resize rerun reads a note of every complete version (stages/resize/pixel_limit.py), and the newest one's
    again (known_tars.py); each read checks the note's version id. Before, each read hashed the manifest again."""
    hashed: Counter[int] = Counter()
    real = fmt.version_id

    def counted(version, manifest):
        hashed[version] += 1
        return real(version, manifest)

    monkeypatch.setattr(fmt, "version_id", counted)
    versions = [fill(store, 3, tag=t, start=10 * i) for i, t in enumerate("abcd")]
    assert versions == [1, 2, 3, 4]
    hashed.clear()  # what the writers hashed is not what is counted
    for v in versions:
        write_note(store, "vae", v, "pixel-limit", 1000 + v)
    for _ in range(3):
        assert [read_note(store, "vae", v, "pixel-limit") for v in versions] == [1001, 1002, 1003, 1004]
    again = Store(store.root)  # another Store of the same folder (each stage opens its own)
    assert [again.version_id("vae", v) for v in versions] == [real(v, fmt.version_dir(store.root, "vae", v)
                                                               / fmt.MANIFEST) for v in versions]
    assert hashed == {1: 1, 2: 1, 3: 1, 4: 1}


def test_a_version_gc_took_and_a_writer_numbered_again_gets_its_own_id_and_not_the_old_ones_note(
        store: Store) -> None:
    """A writer numbers a new version one past the newest folder left, so once gc took v2 the next write is another
    v2, in the same process (`pipeline run all`, a notebook). A cache keyed by the number would name the new v2
    by the old one's id, and a note of the old v2 (put back by a copy) would be trusted for the new rows."""
    assert fill(store, 3, tag="a") == 1
    assert fill(store, 4, tag="b", start=10) == 2
    write_note(store, "vae", 2, "pixel-limit", 2000)
    old_id = store.version_id("vae", 2)
    kept = note_path(store.root, "vae", 2, "pixel-limit").read_bytes()
    store.set_current("vae", 1)
    collect(store.root, echo=lambda _: None)
    assert store.versions("vae") == [1]
    assert fill(store, 6, tag="c", start=20) == 2  # a different v2, by a real writer
    manifest = fmt.version_dir(store.root, "vae", 2) / fmt.MANIFEST
    new_id = fmt.version_id(2, manifest)
    assert new_id != old_id
    assert store.version_id("vae", 2) == new_id
    note_path(store.root, "vae", 2, "pixel-limit").write_bytes(kept)
    assert read_note(store, "vae", 2, "pixel-limit") is None


def test_a_manifest_rewritten_in_place_with_its_size_and_mtime_kept_gets_the_id_of_its_new_bytes(store: Store) -> None:
    """The same inode, size and mtime (set back by `os.utime`, as a copy that keeps times does) over other bytes: the
    id names the bytes it is read from (it decides which notes and "unchanged by fixes" records a version gets, and
    the upstream a downstream lineage names). Before, the cache keyed by (inode, mtime, size) gave the old id."""
    assert fill(store, 3) == 1
    manifest = fmt.version_dir(store.root, "vae", 1) / fmt.MANIFEST
    old_id = store.version_id("vae", 1)
    before = os.stat(manifest)
    with manifest.open("r+b") as f:  # in place: the same inode
        f.seek(before.st_size // 2)
        byte = f.read(1)
        f.seek(before.st_size // 2)
        f.write(bytes([byte[0] ^ 1]))
    while os.stat(manifest).st_ctime_ns == before.st_ctime_ns:  # the write in the commit's clock tick: wait one out
        time.sleep(0.001)
        os.utime(manifest, ns=(before.st_atime_ns, before.st_mtime_ns))
    os.utime(manifest, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(manifest)
    assert fmt.file_identity(after) == fmt.file_identity(before) and after.st_ctime_ns != before.st_ctime_ns
    new_id = fmt.version_id(1, manifest)
    assert new_id != old_id
    assert store.version_id("vae", 1) == Store(store.root).version_id("vae", 1) == new_id
