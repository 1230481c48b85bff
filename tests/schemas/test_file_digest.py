"""The one whole-file hasher gives the digests stored lineages and fingerprints already hold: a path, a str path
and an open file alike, across its read chunks, and version names (`store.format.version_id`) as before."""

from __future__ import annotations

import hashlib

from schemas.file_digest import file_sha256

ABC = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"  # FIPS 180-2's sha256("abc")


def test_a_known_file_has_its_known_digest_by_path_str_and_open_file(tmp_path):
    f = tmp_path / "abc"
    f.write_bytes(b"abc")
    assert file_sha256(f) == file_sha256(str(f)) == ABC
    with open(f, "rb") as fh:
        assert file_sha256(fh) == ABC


def test_a_file_over_many_read_chunks_hashes_as_its_bytes_do(tmp_path):
    data = bytes(range(256)) * 40_000  # ~10 MB: many chunks of file_digest's reads
    (tmp_path / "big").write_bytes(data)
    assert file_sha256(tmp_path / "big") == hashlib.sha256(data).hexdigest()


def test_a_version_name_from_a_path_an_open_file_or_bytes_is_the_same(tmp_path):
    from store import format as fmt

    manifest = tmp_path / "manifest.parquet"
    manifest.write_bytes(b"abc")
    with open(manifest, "rb") as fh:
        assert fmt.version_id(3, manifest) == fmt.version_id(3, fh) == fmt.version_id(3, b"abc") == f"v3-{ABC[:16]}"
