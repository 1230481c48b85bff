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


def test_a_multipart_upload_holds_at_most_the_parts_it_reserved(s3_env, tmp_path, monkeypatch):
    """The budget reserves `PART x PARTS_AT_ONCE` for a big file: the parts read for one round must be freed before
    the next round is read (the file bytes alive, allocated by remote_upload.py, are measured at every part sent)."""
    import moto.s3.models

    part = 2**20  # S3's smallest is 5 MiB: the test server is told 1 MiB (a quarter of the bytes traced)
    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", part)
    monkeypatch.setattr(remote_mod, "PART", part)
    local = tmp_path / "big"
    local.write_bytes(os.urandom(2 * remote_mod.PARTS_AT_ONCE * part))  # two rounds of parts
    remote = remote_mod.open_remote(s3_env.url())
    held, ours = [], tracemalloc.Filter(True, remote_upload.__file__, all_frames=True)

    def alive(n: int) -> None:  # what remote_upload holds before each read of the file
        held.append(sum(s.size for s in tracemalloc.take_snapshot().filter_traces([ours]).statistics("filename")))

    monkeypatch.setattr(remote_upload, "open", lambda *a: CheckedFile(open(*a), alive), raising=False)
    tracemalloc.start(2)  # the read, in the test class, and its caller in remote_upload.py
    try:
        assert remote.upload(local, "x/big", file_crc(local)[0], NoBar(), local.stat().st_size)
    finally:
        tracemalloc.stop()
    assert len(held) > 2 * remote_mod.PARTS_AT_ONCE
    # a round's parts freed before the next is read: one part's slack (two rounds held would be 3 parts more)
    assert max(held) <= remote_mod.upload_memory(local.stat().st_size) + part, [h / 2**20 for h in held]
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
