"""`store verify` reads a shard's samples again only when the shard fails its whole-file CRC32C: one that matches
the CRC its writer took holds the very bytes its samples' CRCs were taken of. The checks of the manifest against
the bytes (tar members named after the key, files and tensors at their recorded offsets, safetensors headers)
still run, on the headers alone. Before, every sample was read and checksummed again after the whole-file pass."""

from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest

from scan_reads import DAMAGE, Hashed, damage
from store import Store
from store import format as fmt
from store import verify
from store_samples import fill


def test_an_intact_version_is_read_once(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    fill(store, 30)
    vdir = store.version_dir("vae", 1)
    files = sum(p.stat().st_size for p in vdir.iterdir() if p.is_file())
    hashed = Hashed(monkeypatch)

    assert verify.verify_version(vdir, "vae/v1", progress=False) == []

    # every file once, schema.json once more (the manifest pass checks it before parsing it: 1 kB)
    assert hashed.nbytes == files + (vdir / fmt.SCHEMA_JSON).stat().st_size  # before: + every sample's bytes


@pytest.mark.parametrize("kind", DAMAGE)
def test_the_problems_are_those_every_sample_read_gives(store: Store, monkeypatch: pytest.MonkeyPatch,
                                                       kind: str) -> None:
    fill(store, 30)
    damage(store, kind)
    vdir = store.version_dir("vae", 1)

    found = verify.verify_version(vdir, "vae/v1", progress=False)
    with monkeypatch.context() as m:
        m.setattr(verify, "_as_written", lambda rows, entry: False)  # every sample read again: the rule before
        before = verify.verify_version(vdir, "vae/v1", progress=False)

    assert found == before
    assert (kind == "none") == (found == [])


def test_a_manifest_that_disagrees_with_intact_shards_is_found(store: Store) -> None:
    """The shards match their CRCs; the manifest (its own bytes damaged) points a tensor at other bytes and names a
    file at the wrong offset: found from the headers alone."""
    fill(store, 12)
    vdir = store.version_dir("vae", 1)
    m = pq.read_table(vdir / fmt.MANIFEST)
    rows = m.to_pylist()
    rows[2]["tensors"][0]["offset"] += 8
    rows[5]["files"][0]["offset"] += 512
    pq.write_table(m.from_pylist(rows, schema=m.schema), vdir / fmt.MANIFEST)

    problems = verify.verify_version(vdir, "vae/v1", progress=False)

    assert not any(".tar: crc32c" in p or "sample bytes are damaged" in p for p in problems)
    assert any(rows[2]["key"] in p and "disagree with the safetensors header" in p for p in problems), problems
    assert any(rows[5]["key"] in p and "not at its recorded offset/size" in p for p in problems), problems


def test_each_shard_is_checked_right_after_its_checksum(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard's headers are read while its bytes are still in the page cache: right after its whole-file CRC, not
    in a second pass after every file of the version (TBs at 1M samples: every header then a cold read)."""
    fill(store, 30)
    vdir = store.version_dir("vae", 1)
    events: list[tuple[str, str]] = []
    crc, check = verify.file_crc, verify._check_shard

    def logged_crc(path):
        events.append(("crc", path.name))
        return crc(path)

    def logged_check(path, *args, **kwargs):
        events.append(("headers", path.name))
        return check(path, *args, **kwargs)

    monkeypatch.setattr(verify, "file_crc", logged_crc)
    monkeypatch.setattr(verify, "_check_shard", logged_check)

    assert verify.verify_version(vdir, "vae/v1", progress=False) == []

    shards = sorted(p.name for p in vdir.glob("shard-*.tar"))
    assert len(shards) > 2
    for s in shards:
        at = events.index(("crc", s))
        assert events[at + 1] == ("headers", s), events[at : at + 3]  # before: every file's CRC first


def test_a_samples_headers_are_read_at_once(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The headers an intact shard's rows are checked against (each member's tar header, the safetensors member's
    length and JSON header) lie within a few kB of a small sample: one read of the shard a sample, where each
    header read on its own was 5 (3 members), a round trip each on a network file system."""
    n = 30
    fill(store, n)
    vdir = store.version_dir("vae", 1)
    reads: list[int] = []
    pread = os.pread

    def counted(fd: int, size: int, at: int) -> bytes:
        reads.append(size)
        return pread(fd, size, at)

    monkeypatch.setattr(os, "pread", counted)

    assert verify.verify_version(vdir, "vae/v1", progress=False) == []
    assert len(reads) == n, f"{len(reads)} reads of the shards for {n} samples' headers"


def test_headers_past_a_read_are_read_again(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sample larger than one read (its tensors' bytes between its first headers and the members after them):
    the headers beyond it are still read, and a damaged one found."""
    fill(store, 12)
    monkeypatch.setattr(verify, "HEADER_READ", 600)  # the test's samples: ~1-4 kB
    vdir = store.version_dir("vae", 1)
    assert verify.verify_version(vdir, "vae/v1", progress=False) == []
    m = pq.read_table(vdir / fmt.MANIFEST)
    rows = m.to_pylist()
    rows[4]["files"][0]["offset"] += 512  # its last member's
    pq.write_table(m.from_pylist(rows, schema=m.schema), vdir / fmt.MANIFEST)
    problems = verify.verify_version(vdir, "vae/v1", progress=False)
    assert any(rows[4]["key"] in p and "not at its recorded offset/size" in p for p in problems), problems
