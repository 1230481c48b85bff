"""Checksums of everything the store writes: CRC32C (hardware, ~15 GB/s, package `crc32c`).

CRC32C rather than a faster non-CRC hash because a CRC *guarantees* that any single-bit error, and any burst of
up to 32 flipped bits, changes the checksum; a general hash only makes a miss unlikely. (sha256, which the
manifest also records per shard and sample, stays for external tools; it is ~10x slower to check on read.)

Sealed JSON: a JSON file that carries its own checksum (`store.json`, each version's `checksums.json`, a
checkpoint's `resume.json`). The file is canonical JSON (indent 2, sorted keys) holding
`"checksum": "crc32c:XXXXXXXX"`; the CRC is taken over the file's exact bytes with those 8 hex digits replaced by
zeros. So a flipped bit anywhere else is a single-bit error in the covered bytes (always caught), and a flipped bit
in the digits either makes them differ from the recomputed CRC or stops them being a valid checksum field.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Mapping

import crc32c

from schemas.record_formats import FOLDER_RECORD, FOLDER_RECORDS

CHUNK = 8 * 1024 * 1024
CHECKSUM_KEY = "checksum"
_PREFIX = "crc32c:"
_FIELD_RE = re.compile(rb'"checksum": "crc32c:([0-9a-f]{8})"')
_ZEROS = b"00000000"


class SealError(ValueError):
    """A sealed JSON file whose bytes do not match its checksum (or that has none)."""


def crc_hex(data: bytes | memoryview) -> str:
    return f"{crc32c.crc32c(data):08x}"


def file_crc(path: Path) -> tuple[str, int]:
    """(crc32c hex, size) of a file, read in chunks."""
    value, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(max(1, min(CHUNK, os.fstat(f.fileno()).st_size)))
        mv = memoryview(buf)
        while n := f.readinto(mv):
            value = crc32c.crc32c(mv[:n], value)
            size += n
    return f"{value:08x}", size


class RunningCrc:
    """CRC32C over bytes written in pieces."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: bytes | memoryview) -> None:
        self.value = crc32c.crc32c(data, self.value)

    def hex(self) -> str:
        return f"{self.value:08x}"


# ---------------------------------------------------------------- sealed JSON


def _canonical(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def seal(obj: dict[str, Any]) -> bytes:
    """The bytes of `obj` as sealed JSON (its `checksum` key set here)."""
    body = _canonical({**obj, CHECKSUM_KEY: _PREFIX + _ZEROS.decode()})
    m = _FIELD_RE.search(body)
    assert m is not None and len(_FIELD_RE.findall(body)) == 1
    return body[: m.start(1)] + crc_hex(body).encode() + body[m.end(1) :]


def unseal(data: bytes) -> dict[str, Any]:
    """The object of sealed JSON bytes; SealError when any byte differs from what `seal` wrote."""
    found = list(_FIELD_RE.finditer(data))
    if len(found) != 1:
        raise SealError("no valid checksum field (damaged, or not written by this program)")
    m = found[0]
    zeroed = data[: m.start(1)] + _ZEROS + data[m.end(1) :]
    want, have = m.group(1).decode(), crc_hex(zeroed)
    if want != have:
        raise SealError(f"checksum mismatch (recorded {want}, bytes give {have}): the file is damaged")
    try:
        obj = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:  # only if written by something else
        raise SealError(f"not valid JSON ({e})") from None
    if not isinstance(obj, dict) or obj.get(CHECKSUM_KEY) != _PREFIX + want:
        raise SealError("checksum field is not the file's top-level 'checksum' key")
    del obj[CHECKSUM_KEY]
    return obj


def _legacy_json(data: bytes) -> None:
    """A record without a checksum field parses as a JSON object (one from before checksums); SealError if not."""
    try:
        ok = isinstance(json.loads(data), dict)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SealError(f"no checksum field and no complete JSON object ({e}): cut short or overwritten") from None
    if not ok:
        raise SealError("no checksum field and not a JSON object: overwritten")


def is_sealed(data: bytes) -> bool:
    """Does the file claim a checksum at all (a legacy file has none; a damaged sealed file still has the key)."""
    return b'"checksum": "' in data or b'"crc32c:' in data


# ---------------------------------------------------------------- a folder's files, recorded in sealed JSON
# (a checkpoint's resume.json, the final LoRA's checksums.json: the one way a written folder is checked later)

# the records `check_recorded` reads, each with its own newest format: schemas/record_formats.py


def folder_checksums(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """{relative path: {"nbytes", "crc32c"}} of every file under `folder` but the `skip` names."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name not in skip:
            crc, n = file_crc(p)
            out[p.relative_to(folder).as_posix()] = {"nbytes": n, "crc32c": crc}
    return out


def file_mismatch(folder: Path, name: str, entry: dict[str, Any],
                  measured: tuple[str, int] | None = None) -> str | None:
    """What is wrong with `folder/name` against its recorded entry ("x is missing", "x is damaged (...)"), or None.
    `measured`: the file's (crc32c, size) from a pass that read it already (not read again)."""
    path = folder / name
    if measured is None and not path.is_file():
        return f"{name} is missing"
    crc, n = measured or file_crc(path)
    if (n, crc) != (entry.get("nbytes"), entry.get("crc32c")):
        return (f"{name} is damaged ({n} bytes, crc32c {crc}; recorded {entry.get('nbytes')} bytes, "
                f"crc32c {entry.get('crc32c')})")
    return None


def write_folder_record(folder: Path, extra: dict[str, Any] | None = None) -> None:
    """Seal the sizes and CRC32Cs of `folder`'s files into `folder/checksums.json` (call inside the temp folder,
    before its commit)."""
    (folder / FOLDER_RECORD).write_bytes(seal({**(extra or {}), "files": folder_checksums(folder, (FOLDER_RECORD,))}))


def check_recorded(path: Path, records: Mapping[str, int] = FOLDER_RECORDS, levels: int = 2,
                   measured: tuple[str, int] | None = None) -> None:
    """Check one file against the sealed record of the folder holding it (its own folder's `checksums.json`, or
    up to `levels` folders up: a checkpoint's `resume.json` covers `lora/<file>`); a UserError when it differs.
    A file no record names (written elsewhere) passes: there is nothing to check it against. `measured`: its
    (crc32c, size) taken by the caller's own read (evaluate hashes a LoRA in the same pass), not read again."""
    from schemas.errors import UserError
    from schemas.newer import refuse_newer

    for folder, rel in _covering_folders(Path(path).resolve(), levels):  # the bytes read: a link's target's
        for name, reads_up_to in records.items():
            record = folder / name
            if not record.is_file():
                continue
            try:
                data = record.read_bytes()
                if not is_sealed(data):  # a record from before checksums (plain JSON): nothing to check against
                    # ...but one that is no JSON at all was cut short before its checksum field, not written
                    # before checksums: it passed as such, and the file it covers went unchecked
                    _legacy_json(data)
                    continue
                obj = unseal(data)
            except (OSError, SealError) as e:
                raise UserError(f"{path}: its checksum record {record} is damaged ({e}); the file cannot be "
                                "trusted: use an intact copy or rerun the command that wrote it") from None
            # intact, but its `files` may mean something else now: a newer release's, not a damaged file
            refuse_newer(str(record), obj, reads_up_to, intact=True)
            files = obj.get("files") or {}
            if rel in files:
                problem = file_mismatch(folder, rel, files[rel], measured)
                if problem:
                    raise UserError(f"{folder}: {problem}, checked against {record}; the file changed after it "
                                    "was written: use an intact copy or rerun the command that wrote it")
                return


def _covering_folders(path: Path, levels: int) -> list[tuple[Path, str]]:
    """(folder, PATH relative to it) for PATH's folder and up to `levels` - 1 above, from its resolved folder (the
    file's own name kept, not followed: the entry a rename replaces). Walked up by name, a relative PATH stopped
    at "." (`Path(".").parent`): a checkpoint's `lora/<file>` named from inside `lora/` missed its `resume.json`,
    and `../x` from a sealed folder was looked up in it (a ValueError traceback)."""
    entry = Path(path).parent.resolve() / Path(path).name
    return [(folder, entry.relative_to(folder).as_posix()) for folder in entry.parents[:levels]]


def recorded_by(path: Path, records: Mapping[str, int] = FOLDER_RECORDS, levels: int = 2) -> Path | None:
    """The sealed record that names `path` among the files it covers (as `check_recorded` finds it: its own
    folder's, or up to `levels` folders up), or None: a file some command wrote and sealed (a run's final LoRA,
    a checkpoint's), which replacing would leave its record naming other bytes. A record that cannot be read
    tells nothing (None)."""
    for folder, rel in _covering_folders(path, levels):  # the name a rename over PATH replaces, not a link's target
        for name in records:
            record = folder / name
            if not record.is_file():
                continue
            try:
                files = unseal(record.read_bytes()).get("files") or {}
            except (OSError, SealError):
                continue
            if isinstance(files, dict) and rel in files:
                return record
    return None
