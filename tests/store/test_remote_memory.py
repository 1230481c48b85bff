"""What parallel uploads hold in memory (store/remote.py): s3fs sent a file under 100 MiB in one PUT read whole, and
a larger one in 50 MiB parts, 10 at once, so 16 uploads of big shards held GBs. Now every upload reserves the bytes
it will hold from one budget (big ones wait their turn) and sends big files in small parts, still write-once;
small objects keep the 16-way parallelism. Against the S3 test server; no timing in any assertion
(bench/store_transfer_memory.py measures the memory itself)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from remote_fakes import NoBar
from store import remote as remote_mod
from store import remote_upload
from store.checksum import file_crc


def _file(path: Path, nbytes: int) -> Path:
    path.write_bytes(os.urandom(nbytes))
    return path


def test_uploads_hold_at_most_the_budget_and_big_files_go_in_parts_write_once(s3_env, tmp_path, monkeypatch):
    monkeypatch.setattr(remote_mod, "PART", 5 * 2**20)  # S3's smallest part: a 11 MiB file is 3 parts
    budget = remote_mod.ByteBudget(12 * 2**20)
    monkeypatch.setattr(remote_mod, "uploads_budget", budget)
    remote = remote_mod.open_remote(s3_env.url())
    held_in_put, lock = [0, 0], threading.Lock()  # (now, most) bytes held by uploads inside the S3 upload
    real_create, real_call, part_sizes = remote_upload.s3_create, remote.fs._call_s3, []

    def s3_create(fs, path, local, progress, meta, expect, part, parts_at_once):
        n = remote_mod.upload_memory(os.path.getsize(local))
        with lock:
            held_in_put[0] += n
            held_in_put[1] = max(held_in_put[1], held_in_put[0])
        try:
            assert part == 5 * 2**20 and parts_at_once == remote_mod.PARTS_AT_ONCE
            return real_create(fs, path, local, progress, meta, expect, part, parts_at_once)
        finally:
            with lock:
                held_in_put[0] -= n

    async def call_s3(method, *a, **kw):
        if method == "upload_part":
            with lock:
                part_sizes.append(kw["Body"].getbuffer().nbytes)
        return await real_call(method, *a, **kw)

    monkeypatch.setattr(remote_upload, "s3_create", s3_create)
    monkeypatch.setattr(remote.fs, "_call_s3", call_s3)
    files = [_file(tmp_path / f"f{i}", 4 * 2**20) for i in range(6)] + [_file(tmp_path / "big", 11 * 2**20)]
    for _ in remote_mod.each_at_once(lambda p: remote.upload(p, f"x/{p.name}", file_crc(p)[0], NoBar()), files):
        pass
    assert held_in_put[1] <= 12 * 2**20 and budget.peak <= 12 * 2**20 and budget.held == 0  # 16 at once: 35 MiB
    assert sorted(part_sizes) == [2**20, 5 * 2**20, 5 * 2**20]  # only the big file, in parts
    assert remote_mod.upload_memory(11 * 2**20) == 11 * 2**20  # under 4 parts: held whole (in parts)
    for p in files:
        assert remote.read(f"x/{p.name}") == p.read_bytes()
    # the multipart upload is write-once too: a second writer of the big object is refused, nothing overwritten
    other = _file(tmp_path / "other", 11 * 2**20)
    assert remote.upload(other, "x/big", file_crc(other)[0], NoBar()) is False
    assert remote.read("x/big") == files[-1].read_bytes()


def test_small_objects_still_go_sixteen_at_once(s3_env, tmp_path, monkeypatch):
    """A version's ~20k shard indexes are one round trip each: the budget must not serialise them. Every one of 16
    uploads waits inside the S3 upload until all 16 are there (a barrier: only a serialised upload could fail it)."""
    remote = remote_mod.open_remote(s3_env.url())
    barrier = threading.Barrier(remote_mod.TRANSFERS, timeout=120)
    real_create = remote_upload.s3_create

    def s3_create(*a):
        barrier.wait()  # BrokenBarrierError if fewer than 16 are in flight
        return real_create(*a)

    monkeypatch.setattr(remote_upload, "s3_create", s3_create)
    files = [_file(tmp_path / f"i{i}", 4096) for i in range(remote_mod.TRANSFERS)]
    assert all(remote_mod.each_at_once(lambda p: remote.upload(p, f"y/{p.name}", file_crc(p)[0], NoBar()), files))


def test_a_file_over_ten_thousand_parts_reserves_the_larger_parts_it_is_sent_in():
    """S3 takes at most 10,000 parts: a file over ~156 GiB goes in parts larger than PART, and its reservation
    must count those (it counted PART: a 200 GiB file held 4 x 20.5 MiB while 4 x 16 MiB were reserved). The
    arithmetic alone, no such file written."""
    part, at_once = remote_mod.PART, remote_mod.PARTS_AT_ONCE
    for size in (10_000 * part, 200 * 2**30, 5 * 2**40):
        sent_in = max(part, -(-size // 10_000))  # the smallest part that makes at most 10,000 of them
        assert remote_upload.part_size(size, part) == sent_in and -(-size // sent_in) <= 10_000
        assert remote_mod.upload_memory(size) == at_once * sent_in
    assert remote_mod.upload_memory(200 * 2**30) > at_once * part
