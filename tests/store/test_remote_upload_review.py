"""Review of store/remote_upload.py and store/remote_download.py (push reads once, pull streams): what a multipart
upload holds, and a body resumed by a Range GET after its object changed. Against the S3 test server."""

from __future__ import annotations

import errno
import os
import tracemalloc

import pytest
from remote_fakes import CheckedFile, CutBody, NoBar

from schemas.errors import UserError
from store import remote as remote_mod
from store import remote_download, remote_upload
from store.checksum import file_crc


class _Counted:
    def __init__(self) -> None:
        self.n = 0

    def update(self, n: int = 1) -> None:
        self.n += n


def test_a_multipart_upload_holds_at_most_the_parts_it_reserved(s3_env, tmp_path, monkeypatch):
    """The budget reserves `PART x PARTS_AT_ONCE` for a big file: what the upload holds must be that, not twice it.
    Measured before every part read and at every part the server receives, over the client's allocations
    (remote_upload.py, botocore, aiohttp; not the in-process test server's): before, botocore wrapped each part's
    bytes in a BytesIO sharing them and aiohttp's `getbuffer()` unshared it - a copy of every part in flight, ~2x
    the reservation (and a round's parts must be freed before the next round is read: ~2 rounds were held once).
    Counted: the blocks of at least a part (a part read, a copy of one); not the small pieces in flight, whose sum
    depends on the thread scheduling and not on the part size (aiohttp's 64 KiB writes: up to 1 MiB of them alive at
    once, seen with sys.setswitchinterval(1e-6); botocore's 1 MiB checksum reads besides: over the 1.5 MiB of slack
    this had)."""
    import moto.s3.models

    part = 2 * 2**20  # S3's smallest is 5 MiB: the test server is told 2 MiB (over botocore's 1 MiB reads)
    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", part)
    monkeypatch.setattr(remote_mod, "PART", part)
    local = tmp_path / "big"
    local.write_bytes(os.urandom(2 * remote_mod.PARTS_AT_ONCE * part))  # two rounds of parts
    remote = remote_mod.open_remote(s3_env.url())
    assert not remote.exists("x/big")  # the client made (and its data files loaded) before the measure
    held = []
    client = [tracemalloc.Filter(True, f)
              for f in (remote_upload.__file__, "*/botocore/*", "*/aiobotocore/*", "*/aiohttp/*", "*/s3fs/*")]
    real_part = moto.s3.models.S3Backend.upload_part

    real_read = remote_upload._read_body

    def measure() -> None:
        held.append(sum(t.size for t in tracemalloc.take_snapshot().filter_traces(client).traces if t.size >= part))

    def upload_part(self, *a, **kw):  # the server has a part: the client holds what it sends
        measure()
        return real_part(self, *a, **kw)

    def read_body(*a):  # a part about to be read: the previous round's must be gone
        measure()
        return real_read(*a)

    monkeypatch.setattr(moto.s3.models.S3Backend, "upload_part", upload_part)
    monkeypatch.setattr(remote_upload, "_read_body", read_body)
    tracemalloc.start(1)  # where each block was allocated: a copy's is in aiohttp, a part read's in remote_upload
    try:
        assert remote.upload(local, "x/big", file_crc(local)[0], NoBar(), local.stat().st_size)
    finally:
        tracemalloc.stop()
    assert len(held) == 2 * remote_mod.PARTS_AT_ONCE + 2 * remote_mod.PARTS_AT_ONCE + 1  # sent; read (and the end)
    reserved = remote_mod.upload_memory(local.stat().st_size)
    # the parts read, each in a buffer of its size (a bytes object's header over it); a copy would be 4 parts more
    assert max(held) <= reserved + 4096, [round(h / 2**20, 2) for h in held]
    assert remote.read("x/big") == local.read_bytes()


def test_a_body_resumed_after_its_object_changed_is_refused_not_spliced(s3_env, tmp_path, monkeypatch):
    """A Range GET resumes a cut body: if the object was replaced in between (gc removed a dead push's object and
    another push wrote the same name), the rest would be of other bytes. The resumed GET must be of the same object
    (If-Match: the first response's ETag) and say so in one line, never return bytes of two objects."""
    first, second = os.urandom(3 * 2**20), os.urandom(3 * 2**20)
    client = s3_env.client()
    client.put_object(Bucket=s3_env.bucket, Key="store/x/o", Body=first)
    remote = remote_mod.open_remote(s3_env.url())
    real_call = remote.fs._call_s3

    async def call_s3(method, *a, **kw):
        if method == "get_object" and "Range" in kw:  # the object replaced before the body is resumed
            client.put_object(Bucket=s3_env.bucket, Key="store/x/o", Body=second)
        out = await real_call(method, *a, **kw)
        if method == "get_object" and "Range" not in kw:
            out["Body"] = CutBody(out["Body"])
        return out

    monkeypatch.setattr(remote.fs, "_call_s3", call_s3)
    got = bytearray()
    with pytest.raises(UserError, match=r"s3://.*/x/o changed while it was read.*rerun"):
        for piece in remote_download.pieces(remote.fs, remote.path("x/o"), remote_mod.READ_PIECE, True):
            got += piece
    assert bytes(got) == first[: len(got)]  # what was received is all of the first object


def test_other_back_ends_remove_an_object_whose_bytes_changed_after_the_check(tmp_path, monkeypatch):
    """memory:// (any back end with neither a conditional write nor a hidden upload): the file is checked, then
    streamed; one that changed between the two reads is written, then removed, and refused. (The push test's damaged
    file is refused by the first read, so it never reached this removal.)"""
    good = os.urandom(3 * 2**16)
    local = tmp_path / "f"
    local.write_bytes(good)
    want = file_crc(local)
    local.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # damaged after the check below has read it intact
    monkeypatch.setattr(remote_upload, "file_crc", lambda path: want)
    url = f"memory://rv3-{tmp_path.name}/store"
    remote = remote_mod.open_remote(url)
    try:
        with pytest.raises(remote_upload.Mismatch):
            remote.upload(local, "x/f", want[0], NoBar(), want[1])
        assert not remote.exists("x/f")
    finally:
        if remote.fs.exists(f"/rv3-{tmp_path.name}"):
            remote.fs.rm(f"/rv3-{tmp_path.name}", recursive=True)


def test_other_back_ends_leave_no_partial_object_when_an_upload_fails_and_a_rerun_sends_it(tmp_path, monkeypatch):
    """fsspec's buffered writer commits what it holds when its `with` block ends, even on an error: a read error
    mid-file (or a lost connection) left a partial object under the name, which a rerun's check-then-write took for
    another push's object ("exists with other content", a gc needed). Now it is removed: the rerun sends the file."""
    monkeypatch.setattr(remote_mod, "PART", 2**16)
    local = tmp_path / "f"
    local.write_bytes(os.urandom(5 * 2**16))
    want = file_crc(local)
    reads = []

    def failing_once(n: int) -> None:  # the local disk fails once, after the first block was sent
        reads.append(n)
        if len(reads) == 2:
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(remote_upload, "open", lambda *a: CheckedFile(open(*a), failing_once), raising=False)
    url = f"memory://rv3-{tmp_path.name}/store"
    remote = remote_mod.open_remote(url)
    try:
        with pytest.raises(OSError, match="Input/output"):
            remote.upload(local, "x/f", want[0], NoBar(), want[1])
        assert not remote.exists("x/f")
        assert remote.upload(local, "x/f", want[0], NoBar(), want[1]) is True
        assert remote.read("x/f") == local.read_bytes()
    finally:
        if remote.fs.exists(f"/rv3-{tmp_path.name}"):
            remote.fs.rm(f"/rv3-{tmp_path.name}", recursive=True)


def test_a_conditional_write_answered_409_conflict_is_sent_again_and_the_412_decides(s3_env, tmp_path,
                                                                                    monkeypatch):
    """S3 answers a conditional write that races another operation on its key with 409 ConditionalRequestConflict
    (not 412), and AWS says: write again - a multipart upload begun again. Before, the 409 failed the push ("answered:
    ..."). Now: sent again, and the 412 (or, after a multipart conflict, the name existing) decides whether another
    writer made it: False, its object untouched; no unfinished upload is left billed. store.json's compare-and-swap
    reads again after a jittered wait. Every conditional write below is answered 409 once, through a proxy in front
    of the test server."""
    import moto.s3.models
    from fault_proxy import FaultProxy

    part = 2**20  # S3's smallest is 5 MiB: the test server is told 1 MiB
    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", part)
    monkeypatch.setattr(remote_mod, "PART", part)
    client, prefix = s3_env.client(), f"/{s3_env.bucket}/"
    racers: dict[str, bytes] = {}  # key -> the bytes another writer puts there while ours is answered 409
    answered: set[str] = set()

    def fault(method: str, path: str) -> str | None:
        where, _, query = path.partition("?")
        key = where[len(prefix):]
        conditional = (method == "PUT" and not query) or (method == "POST" and "uploadId=" in query)
        if not conditional or key in answered:
            return None
        answered.add(key)
        if key in racers:
            client.put_object(Bucket=s3_env.bucket, Key=key, Body=racers[key])
        return "conflict"

    proxy = FaultProxy(s3_env.endpoint, fault)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        remote = remote_mod.open_remote(s3_env.url())
        for name, nbytes in (("small", part), ("big", 3 * part)):  # one PUT; a multipart upload of 3 parts
            ours, theirs = tmp_path / name, os.urandom(nbytes)
            ours.write_bytes(os.urandom(nbytes))
            crc = file_crc(ours)
            bar = _Counted()
            assert remote.upload(ours, f"x/{name}", crc[0], bar, crc[1]) is True  # sent again: created
            assert bar.n == nbytes  # the bytes sent again after the conflict not counted twice
            assert remote.read(f"x/{name}") == ours.read_bytes()
            racers[f"store/x/{name}-raced"] = theirs
            assert remote.upload(ours, f"x/{name}-raced", crc[0], NoBar(), crc[1]) is False  # the other's
            assert remote.read(f"x/{name}-raced") == theirs
        waits: list[int] = []  # a 409 means a write still in flight: read again at once and it meets it again
        real_backoff = remote_upload.backoff
        monkeypatch.setattr(remote_upload, "backoff", lambda attempt: (waits.append(attempt), real_backoff(attempt)))
        remote.swap("x/record", lambda old: (old or b"") + b"+1")
        assert remote.read("x/record") == b"+1" and waits == [0]
    finally:
        proxy.stop()
    assert sorted(answered) == [f"store/x/{n}" for n in ("big", "big-raced", "record", "small", "small-raced")]
    assert [how for how, *_ in proxy.faults] == ["conflict"] * 5
    assert client.list_multipart_uploads(Bucket=s3_env.bucket).get("Uploads", []) == []


@pytest.mark.parametrize(("code", "condition", "failed"), [
    ("PreconditionFailed", "If-None-Match", True),  # a conditional create of a name that exists: FileExistsError
    ("PreconditionFailed", "If-Match", True),  # a rewrite or a resumed GET of an object changed since
    ("ConditionalRequestConflict", "", False),  # 409: write again, not "someone else wrote it"
    ("AccessDenied", "", False),
])
def test_every_412_s3fs_reports_is_one_answer(code, condition, failed):
    """The one reading of a 412 (push's create, the update loop, a lease's rewrite, a resumed download), over the
    exceptions s3fs makes of the server's answer."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    answer = {"Error": {"Code": code, "Message": f"{code} (test)", **({"Condition": condition} if condition else {})}}
    e = translate_boto_error(ClientError(answer, "PutObject"))
    assert remote_upload.precondition_failed(e) is failed
    assert remote_upload.is_conflict(e) is (code == "ConditionalRequestConflict")


@pytest.mark.parametrize("e", [
    FileNotFoundError(2, "No such file or directory", "b/vae/v3/shard-000412.tar"),
    OSError(errno.EIO, "b/vae/v3/shard-000412.tar: read 412 bytes of 1000"),
    FileExistsError(17, "File exists", "/tmp/store/.lease-412"),
    OSError(errno.EINVAL, "Precondition Failed"),  # a message alone, no server answer behind it
], ids=["path", "count", "local-exists", "text-only"])
def test_an_error_that_only_names_412_is_no_precondition_failure(e):
    """Before, any error text containing "412" read as S3's 412: a missing shard-000412.tar was taken for an
    object changed by another writer (a lease "removed", a download "changed while it was read")."""
    assert remote_upload.precondition_failed(e) is False


def test_every_412_the_server_answers_reads_as_one(s3_env):
    """Real answers of the S3 server, through s3fs: a conditional create of a name that exists, a rewrite and a
    read of an object changed since its ETag was taken; and a HEAD's bare 412 (no body: code "412")."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    remote = remote_mod.open_remote(s3_env.url())
    fs, path = remote.fs, remote.path("x/shard-000412.tar")
    bucket, key, _ = fs.split_path(path)
    fs.pipe_file(path, b"one")
    seen = []
    for call in (lambda: fs.call_s3("put_object", Bucket=bucket, Key=key, Body=b"two", IfNoneMatch="*"),
                 lambda: fs.pipe_file(path, b"two", IfMatch='"0"'),
                 lambda: fs.call_s3("get_object", Bucket=bucket, Key=key, IfMatch='"0"')):
        with pytest.raises(OSError) as raised:
            call()
        seen.append(remote_upload.precondition_failed(raised.value))
    assert seen == [True, True, True]
    head = ClientError({"Error": {"Code": "412", "Message": "Precondition Failed"},
                        "ResponseMetadata": {"HTTPStatusCode": 412}}, "HeadObject")
    assert remote_upload.precondition_failed(translate_boto_error(head)) is True
    with pytest.raises(FileNotFoundError) as missing:
        fs.cat_file(remote.path("x/shard-000413.tar"))
    assert remote_upload.precondition_failed(missing.value) is False


@pytest.mark.parametrize("e", [
    OSError(errno.EIO, "ConditionalRequestConflict"),  # a message alone, no server answer behind it
    FileNotFoundError(2, "No such file or directory", "b/x/conditionalrequestconflict-409.tar"),
], ids=["text-only", "path"])
def test_an_error_that_only_names_409_is_no_conflict(e):
    """Before, any error text naming ConditionalRequestConflict read as S3's 409 (and was written again)."""
    assert remote_upload.is_conflict(e) is False


def _raised_from(answer):
    """What s3fs raises for a server answer it has no type for: an OSError raised from botocore's ClientError."""
    try:
        try:
            raise answer
        except Exception as cause:
            raise OSError(errno.EIO, "upload failed") from cause
    except OSError as e:
        return e


def test_every_409_the_server_answers_reads_as_a_conflict():
    """botocore's answer in the chain decides: code ConditionalRequestConflict, or a bare HTTP 409 (no body); a
    412 or a 403 is not one."""
    from botocore.exceptions import ClientError

    def answer(code, status):
        return ClientError({"Error": {"Code": code, "Message": "(test)"},
                            "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

    assert remote_upload.is_conflict(_raised_from(answer("ConditionalRequestConflict", 409))) is True
    assert remote_upload.is_conflict(_raised_from(answer("409", 409))) is True
    assert remote_upload.is_conflict(answer("ConditionalRequestConflict", 409)) is True
    assert remote_upload.is_conflict(_raised_from(answer("PreconditionFailed", 412))) is False
    assert remote_upload.is_conflict(_raised_from(answer("AccessDenied", 403))) is False
