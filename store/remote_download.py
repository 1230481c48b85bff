"""An object's bytes as one streamed GET, in pieces: what a pull holds per transfer is one piece, whatever the
object's size.

s3fs's file object (`fs.open`) fetches in blocks: with its read-ahead cache a transfer held a block of CHUNK (8 MiB)
plus the piece read from it plus the copies in between (~15 MiB a transfer measured; 16 transfers ~240 MiB,
bench/store_transfer_memory.py), and a 256 MB shard cost 32 GETs. Here one GET per object, its body read a piece at
a time (aiohttp pauses the socket while its small buffer is full); a body cut off mid-way (the retryable errors
s3fs retries itself) is resumed with a Range GET from the bytes already received (If-Match its ETag: never another
object's bytes), up to RESUMES times (or the file system's retries, if more), as s3fs's own `get_file` does. Other back ends: their file
object, read a piece at a time.
"""

from __future__ import annotations

from typing import Any, Iterator

from schemas.errors import UserError
from store.checksum import CHUNK
from store.remote_upload import precondition_failed

# a cut body's resumes: each goes on from the bytes received (s3fs's default tries; store/remote.py sets fewer for
# a whole request, whose every try against a silent server waits a read timeout)
RESUMES = 5


def pieces(fs: Any, path: str, piece: int, is_s3: bool, etag: str | None = None) -> Iterator[bytes]:
    """The bytes of object `path`, `piece` bytes at a time (the last piece shorter). `etag` (S3): those of the
    object with that ETag only, from the first byte (a caller remembers what it read by it: store/remote_crcs.py)."""
    if not is_s3:
        with fs.open(path, "rb", block_size=CHUNK) as f:
            while chunk := f.read(piece):
                yield chunk
        return
    from fsspec.asyn import sync
    from s3fs.core import S3_RETRYABLE_ERRORS

    bucket, key, _ = fs.split_path(path)

    async def open_at(offset: int):
        nonlocal etag
        # a resumed body must be of the same object (If-Match: the first response's ETag): one replaced meanwhile
        # (gc removed a dead push's object, another push wrote the name) would splice the bytes of two objects
        kw = {**({"Range": f"bytes={offset}-"} if offset else {}), **({"IfMatch": etag} if etag else {})}
        try:
            resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, **kw)
        except OSError as e:
            if not etag or not precondition_failed(e):
                raise
            raise UserError(f"s3://{bucket}/{key} changed while it was read (another object under its name since "
                            "its first bytes came); rerun to read it again") from None
        etag = etag or resp.get("ETag")
        if offset and not resp.get("ContentRange"):
            # a server (or proxy) that ignores Range sent the whole object again (200, no Content-Range): its first
            # `offset` bytes are those received already; appended, they spliced the object into a damaged copy
            await _skip(resp["Body"], offset)
            return resp["Body"], int(resp.get("ContentLength") or 0)
        return resp["Body"], offset + int(resp.get("ContentLength") or 0)

    (body, size), received, failures = sync(fs.loop, open_at, 0), 0, 0
    try:
        while True:
            try:
                chunk = sync(fs.loop, _fill, body, piece)
            except S3_RETRYABLE_ERRORS:
                failures += 1
                if failures >= max(RESUMES, getattr(fs, "retries", 1)) or received >= size:  # nothing left to ask for
                    raise
                body.close()
                body, _ = sync(fs.loop, open_at, received)
                continue
            if not chunk:
                return
            received += len(chunk)
            yield chunk
    finally:
        body.close()


async def _fill(body: Any, piece: int) -> bytes:
    """The next `piece` bytes of `body` (fewer at its end): one hop into the event loop per piece, not per socket
    read."""
    out = bytearray()
    try:
        while len(out) < piece and (got := await body.read(piece - len(out))):
            out += got
    except Exception as e:  # noqa: BLE001
        if not differs_from_server_checksum(e):
            raise
        # botocore compares the bytes with the server's own checksum at the body's end, once every byte was read:
        # the bytes stand, and the caller's check against the version's sealed checksums.json names the object
        # (pull, verify: damaged; a lazy fetch: read by range instead). A traceback before.
    return bytes(out)


async def _skip(body: Any, n: int) -> None:
    """`n` bytes of `body` read and dropped (a piece at a time: never the whole prefix in memory)."""
    while n > 0 and (got := await body.read(min(n, CHUNK))):
        n -= len(got)


def differs_from_server_checksum(e: BaseException) -> bool:
    """botocore's FlexibleChecksumError: the body read differs from the checksum the server stored with the object
    (damaged on the way, or at rest). By name: botocore is imported only with s3fs."""
    return any(c.__name__ == "FlexibleChecksumError" for c in type(e).__mro__)
