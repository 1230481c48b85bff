"""The CRC32C of S3 objects that carry none of ours (`x-amz-meta-crc32c`: another tool uploaded them, `aws s3 sync`
of a store), remembered once their bytes were read, by the object's endpoint and URL, ETag and size: a later push
judges them from one HEAD as it judges its own uploads (store/remote.py `recorded_crc`). Before, every push read each
of them back (each present version's manifest at least; every object of a version not yet complete there). The ETag
changes with every write of the object (the MD5 of its bytes, or of its parts'), so one replaced since is read again.
The endpoint (`-o endpoint_url=`, AWS_ENDPOINT_URL; "aws" for AWS's own) is part of the key: the same bucket and key
on two S3-compatible servers (MinIO and AWS) are two objects. An entry of the earlier key (the URL alone) is never
found: that object is read once more.

One JSON line per object, appended to a file beside the stores' caches ($XDG_CACHE_HOME/qwen-edit-pipeline/):
concurrent pushes append without losing each other's lines; a damaged line is skipped. A cache only: when it cannot
be read or written the object is read, as before. Rewritten with the newest KEPT objects once it holds twice that."""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from pathlib import Path

from store import format as fmt

log = logging.getLogger("store")

KEPT = 100_000
_CRC = re.compile(r"[0-9a-f]{8}")
_LOCK = threading.Lock()
# per cache file (tests move $XDG_CACHE_HOME): "ENDPOINT s3://bucket/key" -> (ETag, size, CRC32C), read once per process
_KNOWN: dict[Path, dict[str, tuple[str, int, str]]] = {}


def _path() -> Path:
    from store.remote_cache import default_cache_dir

    return default_cache_dir().parent / "remote-crc32c.jsonl"


def _known() -> tuple[Path, dict[str, tuple[str, int, str]]]:
    path = _path()
    with _LOCK:
        if path not in _KNOWN:
            _KNOWN[path] = _load(path)
        return path, _KNOWN[path]


def _load(path: Path) -> dict[str, tuple[str, int, str]]:
    try:
        lines = path.read_bytes().splitlines()
    except OSError:  # none yet, or unreadable: every object is read, as without the cache
        return {}
    known: dict[str, tuple[str, int, str]] = {}
    for line in lines:
        try:
            obj, etag, size, crc = json.loads(line)
        except (ValueError, TypeError):  # a line cut short by a kill, a damaged disk
            continue
        if isinstance(obj, str) and isinstance(etag, str) and type(size) is int and isinstance(crc, str) \
                and _CRC.fullmatch(crc):
            known.pop(obj, None)  # the last line of an object is its newest: kept last, dropped last
            known[obj] = (etag, size, crc)
    if len(lines) > 2 * KEPT:
        known = dict(list(known.items())[-KEPT:])
        try:
            fmt.atomic_write_bytes(path, b"".join(_line(o, *v) for o, v in known.items()))
        except OSError as e:
            log.debug("remote CRC cache %s not compacted (%s)", path, e)
    return known


def _line(obj: str, etag: str, size: int, crc: str) -> bytes:
    return (json.dumps([obj, etag, size, crc]) + "\n").encode()


def known(obj: str, etag: str, size: int) -> str | None:
    """The CRC32C read from object `obj` ("ENDPOINT s3://bucket/key") when it had this ETag and size, else None."""
    found = _known()[1].get(obj)
    return found[2] if found is not None and found[:2] == (etag, size) else None


def remember(obj: str, etag: str, size: int, crc: str) -> None:
    """Record the CRC32C of `obj`'s bytes, read while it had this ETag and size."""
    path, found = _known()
    with _LOCK:
        found.pop(obj, None)
        found[obj] = (etag, size, crc)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, _line(obj, etag, size, crc))  # one short append: whole, or cut short (skipped on load)
        finally:
            os.close(fd)
    except OSError as e:
        log.debug("remote CRC cache %s not written (%s)", path, e)
