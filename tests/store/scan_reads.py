"""For the tests of what a scan of a version reads (store repair's, store verify's): the bytes it checksums, and
each kind of damage a version can have."""

from __future__ import annotations

import crc32c
import pytest

from damage import HEADER, flip_bit, sample_byte
from store import Store
from store import format as fmt

#: each kind of damage `damage` makes ("none": none)
DAMAGE = ["none", "sample", "header", "between", "truncated", "deleted", "grown", "index", "manifest", "several"]


class Hashed:
    """Bytes through CRC32C from here to the test's end (`nbytes`): a scan reads a shard's bytes only to checksum
    them (the whole file, a sample's range), by read, pread or its map alike (a map's reads pass no read call, so
    the kernel's rchar would not see them)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.nbytes = 0
        real = crc32c.crc32c

        def counted(data, value=0):
            self.nbytes += memoryview(data).nbytes
            return real(data, value)

        monkeypatch.setattr(crc32c, "crc32c", counted)


def damage(store: Store, kind: str) -> None:
    """One kind of damage (of `DAMAGE`) to the `vae` v1 of a store `store_samples.fill` made (30 samples)."""
    vdir = store.version_dir("vae", 1)
    tars = sorted(vdir.glob("*.tar"))
    with store.reader("vae") as r:
        keys = r.keys()
    if kind == "sample":  # one byte of one sample's tensor
        flip_bit(*sample_byte(store.root, "vae", keys[5]), 1)
    elif kind == "header":  # one sample's tar header
        flip_bit(*sample_byte(store.root, "vae", keys[9], HEADER, 20), 0)
    elif kind == "between":  # the shard's end-of-archive blocks: no sample's bytes, the file's CRC only
        flip_bit(tars[1], tars[1].stat().st_size - 10, 5)
    elif kind == "truncated":
        with open(tars[2], "r+b") as f:
            f.truncate(tars[2].stat().st_size // 2)
    elif kind == "deleted":
        tars[0].unlink()
    elif kind == "grown":  # bytes appended: every sample intact, the shard carried as its recorded bytes
        with open(tars[1], "ab") as f:
            f.write(b"\0" * 1024)
    elif kind == "index":
        index = sorted(vdir.glob("*.index.parquet"))[1]
        flip_bit(index, index.stat().st_size // 2, 3)
    elif kind == "manifest":  # rebuilt from the indexes, and a sample damaged too
        flip_bit(*sample_byte(store.root, "vae", keys[12]), 6)
        flip_bit(vdir / fmt.MANIFEST, (vdir / fmt.MANIFEST).stat().st_size // 2, 3)
    elif kind == "several":
        flip_bit(*sample_byte(store.root, "vae", keys[3]), 1)
        flip_bit(*sample_byte(store.root, "vae", keys[20], "target.png"), 4)
        tars[-1].unlink()
    else:
        assert kind == "none"
