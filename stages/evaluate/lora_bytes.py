"""A LoRA file's bytes read once per evaluate, not once per check.

`digest`: one chunked pass gives the file's CRC32C and size (checked against the record train sealed beside it)
and its sha256 (the identity the report and the loss array record). Before, the CRC check, the sha256 and (per
evaluated checkpoint) a second sha256 after loading each read the whole file: at 60 checkpoints of 1 GB on a
network disk, minutes per run, and on every rank of a launched `--all-checkpoints`.

`read_for_load`: the file's bytes in memory with their sha256; the loader parses those very bytes
(`models.lora.attach_lora(..., data=)`), so the weights evaluated are the bytes hashed. A file rewritten after
its digest (a training running beside evaluate) is seen by the hash differing, without reading it again.

`known_or_checked`: the sha256 `models.file_hashes` remembers for the file in a cache of checked passes alone
(`CHECKED_CACHE`; same size, mtime, ctime and inode as when a checked pass read it), else a `checked_sha256` pass's
(`FileHashes.sha256(digest=)`). The up-to-date check of `--all-checkpoints` read every checkpoint whole on every
run (100 checkpoints of 0.5 GB: 50 GB read, on every rank of a launch, to say "up to date"); an unchanged one is
now not read. A rewritten one (any write changes its ctime) is read and checked again, and the bytes scored or
pictured are still read and compared with the sha256 (`read_for_load`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import crc32c

CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True)
class Digest:
    sha256: str
    crc32c: str  # 8 hex digits, as store.checksum records them
    nbytes: int


def digest(path: str | Path) -> Digest:
    """CRC32C, sha256 and size of the file in one chunked pass (a GB-sized LoRA is not held in memory)."""
    sha, crc, size = hashlib.sha256(), 0, 0
    with open(path, "rb", buffering=0) as f:
        buf = memoryview(bytearray(CHUNK))
        while n := f.readinto(buf):
            crc = crc32c.crc32c(buf[:n], crc)
            sha.update(buf[:n])
            size += n
    return Digest(sha.hexdigest(), f"{crc:08x}", size)


def checked_sha256(path: str | Path) -> str:
    """The sha256 of `digest`'s pass, with the file checked against the sealed record beside it
    (`store.checksum.check_recorded`: a UserError naming the file when it differs) from the same pass."""
    from store.checksum import check_recorded

    d = digest(path)
    check_recorded(Path(path), measured=(d.crc32c, d.nbytes))
    return d.sha256


def read_for_load(path: str | Path) -> tuple[bytes, str]:
    """(the file's bytes, their sha256): what the loader parses and what it is compared with."""
    with open(path, "rb") as f:
        data = f.read()
    return data, hashlib.sha256(data).hexdigest()


# The sha256s of checked passes alone, apart from `models.file_hashes`' shared cache: one remembered there by a
# hasher that checks nothing (`pipeline compare` hashing the best checkpoint, train its init_lora) passed for a
# checked pass's, and a LoRA damaged since it was sealed was evaluated, its check skipped.
CHECKED_CACHE = "lora-checked-hashes.sqlite"


def checked_hashes():
    """The `models.file_hashes.FileHashes` block of `CHECKED_CACHE`, for `known_or_checked`."""
    from models.file_hashes import FileHashes

    return FileHashes(CHECKED_CACHE)


def known_or_checked(path: str | Path, hashes) -> str:
    """The file's sha256: the one `hashes` (a `checked_hashes` block) remembers for these very bytes, or one
    `checked_sha256` pass, remembered when the file did not change while it was read."""
    return hashes.sha256(path, digest=checked_sha256)


def remembered_sha256(path: str | Path) -> str:
    """The file's sha256 through `models.file_hashes` (read only when changed since it was last hashed; a checked
    pass's counts too): for a file whose bytes are compared with a report's record alone, not evaluated (the best
    EMA's LoRA a report names, the best checkpoint `pipeline compare` names), each read whole on every run before."""
    from models.file_hashes import FileHashes

    with checked_hashes() as checked:
        if (known := checked.cached(path)) is not None:
            return known
    with FileHashes() as hashes:
        return hashes.sha256(path)
