"""A rerun asks `Store.find_version` and `reuse.reusable_keys` about several lineages (this run's, those before
fixes, earlier spellings): each version's schema.json is read and checked once per Store, not once per lineage."""

from __future__ import annotations

from dataclasses import replace
from shutil import rmtree

from store import Store
from store import format as fmt
from store import integrity
from store.reuse import FEATURE_LINEAGE_ATTR, reusable_keys
from store_samples import key_of, lineage, sample, vae_schema


def _write(store: Store, tag: str, feature: str) -> int:
    s = vae_schema(tag)
    w = store.writer("vae", replace(s, attrs={**s.attrs, FEATURE_LINEAGE_ATTR: feature}), shard_size_mb=0.002)
    for i in range(3):
        one = sample(i)
        w.add(one["key"], tensors=one["tensors"], files=one["files"], meta=one["meta"])
    return w.commit()


def _counting_schema_reads(monkeypatch) -> list[str]:
    reads: list[str] = []
    real = integrity.read_checked

    def counted(vdir, name, *a, **kw):
        if name == fmt.SCHEMA_JSON:
            reads.append(str(vdir))
        return real(vdir, name, *a, **kw)

    monkeypatch.setattr(integrity, "read_checked", counted)
    return reads


def test_each_version_schema_is_read_once_for_several_lineages(store: Store, monkeypatch) -> None:
    _write(store, "a", "feat-a")
    _write(store, "b", "feat-b")
    reads = _counting_schema_reads(monkeypatch)
    assert [store.find_version("vae", lineage(t)) for t in "abcd"] == [1, 2, None, None]
    assert len(reads) == 2  # 8 before: 4 lineages x 2 versions
    found = [reusable_keys(store, "vae", f, "split") for f in ("feat-a", "feat-b", "feat-c", "feat-d")]
    assert [sorted(f) for f in found] == [sorted(key_of(i) for i in range(3))] * 2 + [[], []]
    assert len(reads) == 2  # the same Store: read already (8 more before)


def test_a_version_rewritten_since_is_read_again(store: Store, monkeypatch) -> None:
    """Held by file identity: a version gc removed and a new one of its number written is read again."""
    _write(store, "a", "feat-a")
    assert store.find_version("vae", lineage("a")) == 1
    vdir = store.version_dir("vae", 1)
    other = vdir.parent / "elsewhere"
    _write(Store(other), "b", "feat-b")  # the same number in another store, moved in as a new v1
    rmtree(vdir)
    (other / "vae" / "v1").rename(vdir)
    assert store.find_version("vae", lineage("a")) is None
    assert store.find_version("vae", lineage("b")) == 1


def test_a_schema_rewritten_in_place_with_its_size_and_mtime_kept_is_checked_again(store: Store) -> None:
    """A schema.json whose bytes change in place, keeping its inode, size and mtime (set back: `os.utime`, as
    `cp -p` / `rsync -t` / `tar` do; or a rewrite within the clock's tick): the held schema was trusted (its stat
    matched) and the damage never seen; now its bytes are compared and it is checked again: DamagedData."""
    import os

    import pytest

    from store.integrity import DamagedData

    _write(store, "a", "feat-a")
    assert store.find_version("vae", lineage("a")) == 1
    path = store.version_dir("vae", 1) / fmt.SCHEMA_JSON
    before, data = os.stat(path), path.read_bytes()
    flipped = data.replace(b"feat-a", b"feat-b")
    assert flipped != data and len(flipped) == len(data)
    with open(path, "r+b") as f:  # in place: the same inode
        f.write(flipped)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    with pytest.raises(DamagedData, match="schema.json"):
        store.checked_schema("vae", 1)
