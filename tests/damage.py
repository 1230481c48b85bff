"""Damage for the integrity tests: one flipped bit in a file, or in a given byte of a stored sample, locally or on
the S3 test server; a manifest page damaged with its CRC recorded."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, NamedTuple

import pyarrow.parquet as pq

from store import Store
from store import format as fmt
from store.checksum import file_crc, seal, unseal

HEADER = "<header>"  # `member` naming the sample's tar header (its first bytes) rather than a tensor or file


def flip_bit(path: Path, pos: int, bit: int) -> bytes:
    """Flip bit `bit` of byte `pos` of the file; returns the file's clean bytes."""
    clean = path.read_bytes()
    bad = bytearray(clean)
    bad[pos] ^= 1 << bit
    path.write_bytes(bytes(bad))
    return clean


def sample_byte(root: Path, table: str, key: str, member: str | None = None, offset: int | None = None,
                version: int | None = None) -> tuple[Path, int]:
    """(shard, position) of a byte of sample `key`: `offset` bytes into its tensor or file `member` (None: its
    first tensor; HEADER: its tar header), by default the member's middle byte."""
    r = Store(root, create=False).reader(table, version)
    row = r.manifest.to_pylist()[r.keys().index(key)]
    shard = r.dir / row["shard"]
    r.close()
    if member == HEADER:
        return shard, row["sample_offset"] + (offset or 0)
    entries = row["tensors"] + row["files"]
    entry = entries[0] if member is None else next(x for x in entries if x["name"] == member)
    return shard, entry["offset"] + (entry["nbytes"] // 2 if offset is None else offset)


def damage_manifest_page(vdir: Path, column: str, group: int) -> None:
    """The page header of `column`'s first page in row group `group` of the version's manifest overwritten, and the
    damaged bytes' CRC recorded, as a writer that damaged them before checksumming would: only decoding that page
    finds it. `column` is a leaf's path (a nested column has several leaves: the Arrow schema's index is not one)."""
    md = pq.ParquetFile(vdir / fmt.MANIFEST).metadata
    leaf = [md.schema.column(i).path for i in range(md.num_columns)].index(column)
    chunk = md.row_group(group).column(leaf)
    page = chunk.dictionary_page_offset or chunk.data_page_offset
    data = bytearray((vdir / fmt.MANIFEST).read_bytes())
    data[page:page + 8] = b"\xff" * 8
    (vdir / fmt.MANIFEST).write_bytes(bytes(data))
    record = unseal((vdir / fmt.CHECKSUMS).read_bytes())
    record["files"][fmt.MANIFEST]["crc32c"] = file_crc(vdir / fmt.MANIFEST)[0]
    (vdir / fmt.CHECKSUMS).write_bytes(seal(record))


def key_at(root: Path, table: str, index: int) -> str:
    """The `index`-th key of the table in key order."""
    r = Store(root, create=False).reader(table)
    key = sorted(r.keys())[index]
    r.close()
    return key


class ServerDamage(NamedTuple):
    url: str  # the store URL the local store was pushed to
    keys: list[str]  # its images table's keys
    key: str  # the sample damaged on the server
    repair: Callable[[], None]  # puts the shard's clean bytes back


def damaged_on_server(s3_env, root: Path, prefix: str) -> ServerDamage:
    """The store at `root` pushed to `s3_env.url(prefix)`, then one bit of its second sample's target.png flipped in
    the remote's images shard (read by range there, each range checked)."""
    from store.remote_push import push

    url, client, bucket = s3_env.url(prefix), s3_env.client(), s3_env.bucket
    push(root, url)
    with Store(root).reader("images") as r:
        keys = r.keys()
    key = sorted(keys)[1]
    shard, pos = sample_byte(root, "images", key, "target.png")
    rel = f"{prefix}/images/v1/{shard.name}"
    clean = client.get_object(Bucket=bucket, Key=rel)["Body"].read()
    bad = bytearray(clean)
    bad[pos] ^= 1 << 4
    client.put_object(Bucket=bucket, Key=rel, Body=bytes(bad))
    return ServerDamage(url, keys, key, lambda: client.put_object(Bucket=bucket, Key=rel, Body=clean))


def lose_current(s3_env, prefix: str, table: str) -> None:
    """The remote's store.json without `table`: its version complete there, not current (a swap lost)."""
    client, key = s3_env.client(), f"{prefix}/store.json"
    record = unseal(client.get_object(Bucket=s3_env.bucket, Key=key)["Body"].read())
    del record["tables"][table]
    client.put_object(Bucket=s3_env.bucket, Key=key, Body=seal(record))
