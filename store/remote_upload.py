"""One upload that reads the local file once: its CRC32C is computed over the very bytes sent, and a file that no
longer matches its sealed record is refused before anything becomes visible under its name.

Push used to read every file twice (`file_crc` against the record, then s3fs's `put_file`): at 1M samples, the
whole store read twice from disk, and a file damaged between the two reads was sent anyway. Here:
- S3, a file under two parts: read whole (it is held for the PUT anyway), checked, then one conditional PUT
  (`If-None-Match: *`);
- S3, a larger file: a multipart upload fed part by part from one read, `parts_at_once` parts in flight; the
  CRC32C of the parts read is checked before `CompleteMultipartUpload` (conditional too). On a difference, or any
  failure, the upload is aborted: S3 shows a multipart object only once it is completed, so no damaged or partial
  object is ever visible (a killed push leaves an unfinished upload, billed but in no listing, which
  `store gc URL` aborts once it is stale: store/remote_gc.py);
- a conditional write that races another operation on the same key may get S3's `409 ConditionalRequestConflict`
  instead of a 412: AWS's answer is to write again (a PUT is sent again; a multipart upload is aborted and, unless
  the name exists by then - what the 412 would have said -, begun again from the file's first byte), so the 412
  path decides whether someone else wrote it;
- `file://`: store/remote_local.create checks the bytes it copies before the link that makes the object exist;
- any other fsspec back end (gcs, azure, ...): no conditional write nor a hidden upload we can rely on for every
  back end, so the file is checked first (a read), then streamed through the back end's own buffered writer in
  blocks of `part` bytes (a second read, checked again; an object whose bytes differed, or whose upload failed
  part-way - the back end's writer commits on close even then - is removed).
Written here rather than s3fs's `put_file` because that reads the file itself, with no hook for the bytes read.
"""

from __future__ import annotations

import asyncio
import io
import os
import random
import time
from pathlib import Path
from typing import Any

from store.checksum import CHUNK, RunningCrc, file_crc

MAX_PARTS = 10_000  # S3's limit on the parts of one multipart upload
CONFLICT_ATTEMPTS = 5  # conditional writes answered 409 ConditionalRequestConflict, sent again (AWS's advice)


class Mismatch(Exception):
    """The local file is not what its record says (`nbytes` bytes, CRC32C `crc`; crc None: not read, the size
    alone differs). Nothing was made visible."""

    def __init__(self, nbytes: int, crc: str | None) -> None:
        super().__init__(f"{nbytes} bytes, crc32c {crc or 'not read'}")
        self.nbytes, self.crc = nbytes, crc


def check(nbytes: int, crc: str | None, expect: tuple[int, str] | None) -> None:
    if expect is not None and (nbytes, crc) != tuple(expect):
        raise Mismatch(nbytes, crc)


def precondition_failed(e: BaseException) -> bool:
    """S3's 412 Precondition Failed, read from the server's answer that s3fs converted into `e` (a FileExistsError
    for If-None-Match: a conditional create of a name that exists; an OSError for If-Match: the object changed or
    is gone; the same code met on a GET or a multipart completion): botocore's error, kept as the exception's
    cause or context, says "PreconditionFailed" or HTTP status 412. Never the message's text: an error naming a
    path such as `shard-000412.tar` is no 412. The nearest server answer in the chain decides (an error raised
    while handling another request's 412 is not one)."""
    answer = _answer(e)
    return answer is not None and (_error_code(answer) in ("PreconditionFailed", "412") or _http_status(answer) == 412)


def _answer(e: BaseException) -> BaseException | None:
    """The nearest exception in `e`'s chain carrying a server answer (botocore's `response`), None if none does."""
    return next((c for c in _chain(e) if _response(c)), None)


def _chain(e: BaseException):
    """`e` and the exceptions it was raised from or while handling, each once."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _error_code(e: BaseException) -> str | None:
    """botocore's error code (a ClientError's `response`), None for any other exception."""
    error = _response(e).get("Error")
    return error.get("Code") if isinstance(error, dict) else None


def _http_status(e: BaseException) -> int | None:
    meta = _response(e).get("ResponseMetadata")
    return meta.get("HTTPStatusCode") if isinstance(meta, dict) else None


def _response(e: BaseException) -> dict:
    response = getattr(e, "response", None)
    return response if isinstance(response, dict) else {}


def is_conflict(e: BaseException) -> bool:
    """S3's 409 ConditionalRequestConflict: the conditional write raced another operation on the key. s3fs has no
    type for it (an OSError); botocore's error in the chain says "ConditionalRequestConflict" or HTTP status 409,
    read as `precondition_failed` reads a 412: the nearest server answer decides, never the message's text."""
    answer = _answer(e)
    return answer is not None and (_error_code(answer) in ("ConditionalRequestConflict", "409")
                                   or _http_status(answer) == 409)


def backoff(attempt: int) -> None:
    time.sleep(min(2.0, 0.05 * 2**attempt) * (0.5 + random.random()))  # jittered: two racers do not meet again


def part_size(size: int, part: int) -> int:
    """The part size a file of `size` bytes is sent in: `part`, or larger where `part` would make more than
    S3's 10,000 parts (a file over ~156 GiB at 16 MiB parts)."""
    return max(part, -(-size // MAX_PARTS))


def s3_create(fs: Any, path: str, local: Path, progress: Any, meta: dict[str, Any], expect: tuple[int, str] | None,
              part: int, parts_at_once: int) -> bool:
    """Create object `path` from `local` unless it exists (False then, nothing written); `expect` (nbytes, crc):
    refused with `Mismatch` when the bytes read are not those, nothing visible."""
    bucket, key, _ = fs.split_path(path)
    _rewind_on_every_try(fs, bucket)
    with open(local, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if expect is not None and size != expect[0]:
            raise Mismatch(size, None)
        if size < 2 * part:
            crc = RunningCrc()
            data = _read_body(f, size, crc)
            n = data.getbuffer().nbytes if data is not None else 0
            check(n, crc.hex(), expect)
            for attempt in range(CONFLICT_ATTEMPTS):
                if data is not None:
                    data.seek(0)
                try:
                    fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data if data is not None else b"",
                               IfNoneMatch="*", **meta)
                    break
                except Exception as e:  # noqa: BLE001  the conditional PUT lost: the object exists
                    if precondition_failed(e):
                        return False
                    if not is_conflict(e) or attempt == CONFLICT_ATTEMPTS - 1:
                        raise
                    backoff(attempt)
            progress.update(n)
            return True
        sent = _Sent(progress)
        for attempt in range(CONFLICT_ATTEMPTS):
            if attempt:
                f.seek(0)  # begun again: every part sent again
            created = _multipart(fs, bucket, key, f, sent, meta, part_size(size, part), parts_at_once, expect,
                                 last=attempt == CONFLICT_ATTEMPTS - 1)
            if created is not None:
                return created
            if object_there(fs, bucket, key):  # the racing writer created it: what the 412 would have said
                return False
            backoff(attempt)
    return True  # not reached: the last attempt raises on a conflict


class _Sent:
    """A progress bar fed by upload attempts: bytes sent again after a conflict are not counted twice."""

    def __init__(self, progress: Any) -> None:
        self.progress, self.counted, self.now = progress, 0, 0

    def restart(self) -> None:
        self.now = 0

    def update(self, n: int) -> None:
        self.now += n
        if self.now > self.counted:
            self.progress.update(self.now - self.counted)
            self.counted = self.now


def _rewind_body(params: dict[str, Any], **_: Any) -> None:
    """botocore's hook at the start of every API call: the request's body from its first byte (ours always start
    there). s3fs's own loop of tries (store/remote.S3FS_TRIES, after botocore's AWS_MAX_ATTEMPTS: a server throttling
    with 503 SlowDown, a connection lost once the body was sent) calls again with the same BytesIO, which the try
    before had read to its end: botocore took its length from there, 0, and the server created an empty object (or
    an empty last part, a truncated object) counted as sent; the commit's look refused it as another store's."""
    body = params.get("Body")
    if hasattr(body, "seek"):
        body.seek(0)


def _rewind_on_every_try(fs: Any, bucket: str) -> None:
    """`_rewind_body` on the client s3fs sends this bucket's requests with (once per client: `unique_id`)."""
    from fsspec.asyn import sync

    async def client() -> Any:
        await fs.set_session()
        return await fs.get_s3(bucket)

    events = sync(fs.loop, client).meta.events
    for operation in ("PutObject", "UploadPart"):
        events.register(f"before-parameter-build.s3.{operation}", _rewind_body, unique_id=f"rewind-{operation}")


def object_there(fs: Any, bucket: str, key: str) -> bool:
    """Is there an object `key` (one HEAD; s3fs's `exists` also lists `key` as a folder when there is none)?"""
    try:
        fs.call_s3("head_object", Bucket=bucket, Key=key)
    except FileNotFoundError:
        return False
    return True


def _multipart(fs: Any, bucket: str, key: str, f, sent: _Sent, meta: dict[str, Any], part: int, parts_at_once: int,
               expect: tuple[int, str] | None, last: bool) -> bool | None:
    """One multipart upload of the file from its first byte: True (created), False (the name exists), None (a
    409 conflict at the completion, the upload aborted; AWS: begin another; `last`: raised instead)."""
    sent.restart()
    upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key, **meta)["UploadId"]
    try:
        parts = _send_parts(fs, bucket, key, upload, f, sent, part, parts_at_once, expect)
        try:
            fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload,
                       MultipartUpload={"Parts": parts}, IfNoneMatch="*")
        except Exception as e:  # noqa: BLE001
            if not precondition_failed(e) and (last or not is_conflict(e)):
                raise
            _abort(fs, bucket, key, upload)
            return False if precondition_failed(e) else None
    except BaseException:
        _abort(fs, bucket, key, upload)
        raise
    return True


def _send_parts(fs: Any, bucket: str, key: str, upload: str, f, progress: Any, part: int, parts_at_once: int,
                expect: tuple[int, str] | None) -> list[dict[str, Any]]:
    """Every part, `parts_at_once` at a time (one read of the file, the CRC32C over it); checked against `expect`
    before the caller completes the upload."""
    from fsspec.asyn import sync

    crc, sent, parts = RunningCrc(), 0, []
    while True:
        chunks = []
        while len(chunks) < parts_at_once and (chunk := _read_body(f, part, crc)) is not None:
            chunks.append(chunk)
        if not chunks:
            break

        async def send(chunks=chunks, first=len(parts) + 1):
            # every part's request ends before a failure is raised: a part still in flight at the abort may be
            # stored after it, and billed
            return await asyncio.gather(*(fs._call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload,
                                                      PartNumber=first + i, Body=c) for i, c in enumerate(chunks)),
                                        return_exceptions=True)

        done = sync(fs.loop, send)
        if failed := next((e for e in done if isinstance(e, BaseException)), None):
            raise failed
        for i, out in enumerate(done):
            parts.append({"PartNumber": len(parts) + 1, "ETag": out["ETag"]})
            n = chunks[i].getbuffer().nbytes
            progress.update(n)
            sent += n
        # emptied, not just unnamed: `send`'s default still holds this list until the next round has been read,
        # which held ~2 rounds of parts while the budget reserved one (tests/store/test_remote_upload_review.py)
        chunks.clear()
    check(sent, crc.hex(), expect)
    return parts


def _read_body(f, n: int, crc: RunningCrc) -> io.BytesIO | None:
    """Up to `n` bytes of `f` (None at its end), read straight into the buffer the request sends, their CRC32C
    added to `crc`. Not bytes: botocore wraps a bytes body in a BytesIO that shares it, and aiohttp's
    `getbuffer()` then unshares it - a copy of every part in flight, which held ~2x the bytes the budget reserved
    (tests/store/test_remote_upload_review.py). A BytesIO that owns its buffer is sent as it is."""
    body = io.BytesIO()
    if n <= 0:
        return None
    body.seek(n - 1)
    body.write(b"\0")  # allocated once at its full size
    got = 0
    with body.getbuffer() as view:
        while got < n and (k := f.readinto(view[got:])):
            got += k
        crc.update(view[:got])
    if not got:
        return None
    body.truncate(got)
    body.seek(0)
    return body


def _abort(fs: Any, bucket: str, key: str, upload: str) -> None:
    try:
        fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)
    except Exception:  # noqa: BLE001  best effort: `store gc URL` aborts what is left once it is stale
        pass


def generic_create(fs: Any, path: str, local: Path, progress: Any, expect: tuple[int, str] | None,
                   part: int) -> bool:
    """Any other fsspec back end: a check then a write (no conditional write to rely on), the file checked before
    (`expect`) and streamed in blocks of `part` bytes through the back end's writer, its CRC32C computed again over
    the bytes sent; an object whose bytes differed (the file changed between the reads), or a partial one (an
    error mid-file: fsspec's writer commits on close all the same), is removed."""
    if fs.exists(path):
        return False
    if expect is not None:
        crc, n = file_crc(local)
        check(n, crc, expect)
    crc, n, opened = RunningCrc(), 0, False
    try:
        with open(local, "rb") as src, fs.open(path, "wb", block_size=part) as dst:
            opened = True
            while chunk := src.read(min(part, CHUNK)):
                dst.write(chunk)
                crc.update(chunk)
                n += len(chunk)
                progress.update(len(chunk))
        check(n, crc.hex(), expect)
    except BaseException:
        # fsspec's writer commits what it holds when its `with` ends, even on an error: a partial object a rerun
        # would take for another push's (tests/store/test_remote_upload_review.py)
        if not opened:
            raise
        try:
            fs.rm(path)
        except Exception:  # noqa: BLE001  never committed (or gone): nothing to remove
            pass
        raise
    return True
