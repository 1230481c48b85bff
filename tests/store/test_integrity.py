"""Damage after the write: verify reports every flipped bit of the metadata files, readers refuse damaged samples
and missing / short shards with one clear error (or report them when asked to skip)."""

from __future__ import annotations

import json
import re
import tarfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from schemas import atomic_write
from schemas.errors import UserError
from store import Store
from store import format as fmt
from store.checksum import SealError, seal, unseal
from store.integrity import DamagedData
from store.verify import verify_store
from damage import flip_bit
from store_samples import fill, key_of, read_only_open


def _problems(root: Path) -> list[str]:
    return verify_store(root, progress=False)


def test_sealed_json_roundtrip_and_every_bit_flip_detected() -> None:
    obj = {"format": "x", "tables": {"vae": {"current": 3}}, "n": [1, 2.5, "é"]}
    data = seal(obj)
    assert unseal(data) == obj
    for pos in range(len(data)):
        for bit in range(8):
            bad = bytearray(data)
            bad[pos] ^= 1 << bit
            with pytest.raises(SealError):
                unseal(bytes(bad))


def test_verify_reports_every_flip_of_store_schema_checksums_and_manifest(store: Store) -> None:
    """store.json, schema.json, checksums.json: every byte; manifest.parquet: every 7th byte (test time); the bit
    flipped is the position mod 8 (every bit of a sealed file: the test above). By design every single-bit flip is caught (CRC32C of each file's exact bytes, see store/verify.py)."""
    fill(store, 2, shard_size_mb=1)
    root, vdir = store.root, store.root / "vae" / "v1"
    assert _problems(root) == []
    targets = [(root / fmt.STORE_JSON, range(len((root / fmt.STORE_JSON).read_bytes())), None)]
    for name, stride in ((fmt.SCHEMA_JSON, 1), (fmt.CHECKSUMS, 1), (fmt.MANIFEST, 7)):
        n = len((vdir / name).read_bytes())
        targets.append((vdir / name, range(0, n, stride), None))
    flips = 0
    for path, positions, bits in targets:
        for pos in positions:
            for bit in (bits if bits is not None else [pos % 8]):
                clean = flip_bit(path, pos, bit)
                try:
                    problems = _problems(root)
                finally:
                    path.write_bytes(clean)
                assert problems, (path.name, pos, bit)
                flips += 1
    assert flips > 2000
    assert _problems(root) == []


def test_verify_reports_each_damaged_shard_byte_kind_and_leftover_temp_files(store: Store) -> None:
    fill(store, 6, shard_size_mb=1)
    vdir = store.root / "vae" / "v1"
    shard = sorted(vdir.glob("*.tar"))[0]
    for pos in (0, 520, len(shard.read_bytes()) - 1):  # tar header, safetensors header, end padding
        clean = flip_bit(shard, pos, 3)
        assert any(shard.name in p and "damaged" in p for p in _problems(store.root)), pos
        shard.write_bytes(clean)
    litter = vdir / ".shard-r00-000000.index.parquet.tmp-123"
    litter.write_bytes(b"x")
    assert any("temp file left by an interrupted write" in p for p in _problems(store.root))
    litter.unlink()
    assert _problems(store.root) == []


def _member_offsets(shard: Path, key: str) -> dict[str, int]:
    with tarfile.open(shard) as tf:
        return {m.name.split(".", 1)[1]: m.offset_data for m in tf.getmembers() if m.name.startswith(key)}


@pytest.mark.parametrize("kind", ["target", "control_0", "mask_weight", "target.png", "json", "tar-header"])
def test_reader_refuses_a_damaged_byte_of_each_kind(store: Store, kind: str) -> None:
    fill(store, 6, shard_size_mb=1)
    key = key_of(1)  # sample 1: one control, a mask weight, a png
    r = store.reader("vae")
    row = r.manifest.to_pylist()[r.keys().index(key)]
    shard = r.dir / row["shard"]
    tensors = {t["name"]: t for t in row["tensors"]}
    files = {f["name"]: f for f in row["files"]}
    if kind in tensors:
        pos = tensors[kind]["offset"] + tensors[kind]["nbytes"] // 2
    elif kind in files:
        pos = files[kind]["offset"] + 1
    elif kind == "json":
        pos = _member_offsets(shard, key)["json"] + 2
    else:
        pos = row["sample_offset"] + 10  # the first member's tar header (its name)
    r.close()
    flip_bit(shard, pos, 0)
    r = store.reader("vae")
    with pytest.raises(DamagedData) as e:
        r.get(key)
    msg = str(e.value)
    assert "table 'vae' v1" in msg and shard.name in msg and key in msg and "pipeline store repair" in msg
    assert r.damaged(key) is not None
    other = key_of(2)
    assert r.damaged(other) is None and r.get(other)["key"] == other  # the rest reads on
    assert any(key in p for p in _problems(store.root))


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_reader_refuses_missing_or_short_shard_on_open_and_skip_reports(store: Store, damage: str) -> None:
    fill(store, 8, shard_size_mb=0.002)
    vdir = store.root / "vae" / "v1"
    shards = sorted(vdir.glob("*.tar"))
    assert len(shards) >= 2
    if damage == "missing":
        shards[0].unlink()
    else:
        shards[0].write_bytes(shards[0].read_bytes()[:600])  # inside the first sample's safetensors member
    with pytest.raises(DamagedData, match=rf"table 'vae' v1 .*{shards[0].name}.*pipeline store repair"):
        store.reader("vae")
    r = store.reader("vae", on_damaged="skip")
    bad = [k for k in r.keys() if r.damaged(k)]
    in_shard = pq.read_table(vdir / fmt.MANIFEST).to_pylist()
    lost = {x["key"] for x in in_shard if x["shard"] == shards[0].name}
    assert set(bad) == lost
    assert all(r.damaged(k) is None for k in set(r.keys()) - lost)


def test_damaged_store_json_current_is_a_clear_error(store: Store) -> None:
    fill(store, 2)
    path = store.root / fmt.STORE_JSON
    text = path.read_text()
    i = text.index('"current"') + 3
    flip_bit(path, i, 5)  # "current" -> "cuRrent": valid JSON, wrong key
    with pytest.raises(UserError, match="store.json is damaged.*pipeline store repair"):
        Store(store.root, create=False).tables()
    # a format-1 store.json (no checksum) with a damaged table entry: a clear error too, not a KeyError
    path.write_text(json.dumps({"format": fmt.STORE_FORMAT, "format_version": 1, "tables": {"vae": {"curent": 1}}}))
    with pytest.raises(UserError, match="'tables' must map each table"):
        Store(store.root, create=False)


def test_version_without_checksums_json_but_with_checksum_columns_is_refused(store: Store) -> None:
    fill(store, 3)
    (store.root / "vae" / "v1" / fmt.CHECKSUMS).unlink()
    with pytest.raises(DamagedData, match="checksums.json is missing"):
        store.reader("vae")
    assert any("checksums.json" in p for p in _problems(store.root))


def test_commit_removes_leftover_temp_files(store: Store) -> None:
    from store_samples import sample, vae_schema

    w = store.writer("vae", vae_schema())
    s = sample(0)
    w.add(s["key"], tensors=s["tensors"], files=s["files"], meta=s["meta"])
    w.finish_rank()
    (w.dir / ".shard-r00-000000.index.parquet.tmp-999").write_bytes(b"half")
    w.commit()
    assert not [p for p in (store.root / "vae" / "v1").iterdir() if fmt.is_litter(p.name)]
    assert _problems(store.root) == []


def test_format_1_store_stays_readable(store: Store) -> None:
    """A store written before checksums (format 1): no checksums.json, no crc columns, unsealed store.json."""
    fill(store, 3)
    vdir = store.root / "vae" / "v1"
    (vdir / fmt.CHECKSUMS).unlink()
    m = pq.read_table(vdir / fmt.MANIFEST)
    pq.write_table(m.drop_columns(["shard_crc32c", "sample_crc32c"]), vdir / fmt.MANIFEST)
    (store.root / fmt.STORE_JSON).write_text(json.dumps(
        {"format": fmt.STORE_FORMAT, "format_version": 1, "tables": {"vae": {"current": 1}}}))
    r = Store(store.root, create=False).reader("vae")
    assert not r.checksummed and all(r.damaged(k) is None for k in r.keys())
    assert _problems(store.root) == []
    shard = sorted(vdir.glob("*.tar"))[0]
    row = [x for x in m.to_pylist() if x["shard"] == shard.name][0]
    flip_bit(shard, row["tensors"][0]["offset"], 1)
    r = Store(store.root, create=False).reader("vae")
    assert re.search("sha256 mismatch", r.damaged(row["key"]) or "")


# ---------------------------------------------------------------- full disk, read-only store


def _fail_after(monkeypatch, budget: int) -> None:
    """Shard writes fail with ENOSPC once `budget` more bytes have been written (a disk filling up)."""
    import errno

    from store import shard

    real = shard._HashingFile.write
    left = [budget]

    def write(self, b):
        left[0] -= len(b)
        if left[0] < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, b)

    monkeypatch.setattr(shard._HashingFile, "write", write)


def _no_litter(root: Path) -> None:
    left = [p for p in root.rglob("*") if fmt.is_litter(p.name) or p.name.endswith(".tmp")]
    assert not left, left


def test_full_disk_in_a_shard_is_one_error_and_rerun_completes_each_sample_once(store: Store, monkeypatch) -> None:
    from store.io_errors import DiskFullError
    from store_samples import sample, vae_schema

    _fail_after(monkeypatch, 30_000)
    w = store.writer("vae", vae_schema(), shard_size_mb=0.01)
    with pytest.raises(DiskFullError, match=r"disk full while writing a shard of table 'vae' v1 in .*B free"):
        for i in range(12):
            s = sample(i)
            w.add(s["key"], tensors=s["tensors"], files=s["files"], meta=s["meta"])
    w.close()
    _no_litter(store.root)
    monkeypatch.undo()
    w = store.writer("vae", vae_schema(), shard_size_mb=0.01)
    assert w.version == 1 and 0 < len(w.done_keys) < 12
    for i in range(12):
        s = sample(i)
        if s["key"] not in w.done_keys:
            w.add(s["key"], tensors=s["tensors"], files=s["files"], meta=s["meta"])
    w.commit()
    r = store.reader("vae")
    assert sorted(r.keys()) == sorted(key_of(i) for i in range(12))
    assert _problems(store.root) == []


def test_full_disk_writing_the_manifest_leaves_no_temp_file_and_rerun_commits(store: Store, monkeypatch) -> None:
    import errno

    from store.io_errors import DiskFullError
    from store_samples import vae_schema

    from contextlib import contextmanager

    real = atomic_write.atomic_file

    class Full:  # the manifest's temp file: a first write lands, the next one finds the disk full
        def __init__(self, f) -> None:
            self.f, self.writes = f, 0

        def write(self, data) -> int:
            self.writes += 1
            if self.writes > 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

    @contextmanager
    def full_for_manifest(path, *args):
        with real(path, *args) as f:
            yield Full(f) if path.name == fmt.MANIFEST else f

    monkeypatch.setattr(atomic_write, "atomic_file", full_for_manifest)
    with pytest.raises(DiskFullError, match="disk full while writing the manifest of table 'vae' v1"):
        fill(store, 5)
    assert "vae" not in store.tables() and not fmt.is_complete(store.root / "vae" / "v1")
    _no_litter(store.root)
    monkeypatch.undo()
    w = store.writer("vae", vae_schema())
    assert len(w.done_keys) == 5
    w.commit()
    assert len(store.reader("vae")) == 5 and _problems(store.root) == []


def test_atomic_write_removes_its_temp_file_on_enospc(tmp_path: Path, monkeypatch) -> None:
    import errno
    import os

    real_fsync = os.fsync

    def fsync(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError):
        fmt.atomic_write_bytes(tmp_path / "x.json", b"{}")
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert list(tmp_path.iterdir()) == []


def test_read_only_store_is_one_line(store: Store, monkeypatch) -> None:
    """A store on a read-only mount: the first write (the writer's lock file) fails with EROFS (simulated: the
    tests run as root, whom file modes do not stop)."""
    import os

    from store_samples import vae_schema

    fill(store, 2)
    monkeypatch.setattr(os, "open", read_only_open(os.open))
    with pytest.raises(UserError, match=r"cannot write table 'vae': .*\.write-r00\.lock is not writable"):
        store.writer("vae", vae_schema("b"))


def test_two_nodes_ranks_of_one_pid_probe_a_shared_folder_at_once(tmp_path, monkeypatch) -> None:
    """`check_writable` of the folder every rank of a launch across nodes writes to (an encode's table): two
    nodes' ranks may have the same pid, and a probe named by the pid alone met the other's still there (O_EXCL):
    FileExistsError, a traceback, where the folder was writable."""
    import os
    import socket

    from store.io_errors import check_writable

    monkeypatch.setattr(socket, "gethostname", lambda: "node-b")
    monkeypatch.setattr(os, "unlink", lambda path: None)  # node b's probe still there when node a probes
    check_writable(tmp_path, "table 'vae'")
    monkeypatch.undo()
    monkeypatch.setattr(socket, "gethostname", lambda: "node-a")
    check_writable(tmp_path, "table 'vae'")
    assert len(list(tmp_path.iterdir())) == 1  # node a's removed, node b's left by the patch


def test_a_probe_a_killed_process_of_the_same_pid_left_is_overwritten(tmp_path, monkeypatch) -> None:
    """A process killed between its probe's create and unlink left it; a later process of the same host, pid
    (reused) and thread probes the folder: it is writable, so no error (before: O_EXCL, FileExistsError)."""
    import os

    from store.io_errors import check_writable

    monkeypatch.setattr(os, "unlink", lambda path: None)  # the killed one's probe left behind
    check_writable(tmp_path, "table 'vae'")
    monkeypatch.undo()
    check_writable(tmp_path, "table 'vae'")
    assert list(tmp_path.iterdir()) == []


def test_not_writable_errors_become_one_line() -> None:
    import errno

    from store.io_errors import describe

    err = describe(OSError(errno.EROFS, "Read-only file system", "/s/vae/.write-r00.lock"), "table 'vae'", Path("/s"))
    assert err is not None and "cannot write table 'vae': /s/vae/.write-r00.lock is not writable" in str(err)
    assert describe(ValueError("x"), "a", Path("/")) is None


def test_every_bit_flip_of_store_json_is_refused_on_open(store: Store) -> None:
    fill(store, 2)
    path = store.root / fmt.STORE_JSON
    clean = path.read_bytes()
    for pos in range(len(clean)):
        for bit in range(8):
            flip_bit(path, pos, bit)
            with pytest.raises(UserError):
                fmt.read_store_record(store.root)
            path.write_bytes(clean)
    assert Store(store.root, create=False).tables() == {"vae": 1}


def test_repair_dry_run_names_what_it_cannot_repair(store: Store) -> None:
    from typer.testing import CliRunner

    from pipeline.cli import app

    fill(store, 3)
    (store.root / "vae" / "v1" / fmt.CHECKSUMS).unlink()
    res = CliRunner().invoke(app, ["store", "repair", str(store.root), "--dry-run"])
    assert res.exit_code == 0 and "vae v1: CANNOT REPAIR: checksums.json is missing" in res.output
    res = CliRunner().invoke(app, ["store", "repair", str(store.root)])
    assert res.exit_code == 1 and "not repaired: vae v1: checksums.json is missing" in res.output


def test_shard_cut_short_after_open_is_a_clear_error(store: Store) -> None:
    """A shard truncated while a reader has it open (disk trouble, a stray tool) gives DamagedData naming the
    sample, not a crash (a map of a file cut short kills the process with SIGBUS on access)."""
    fill(store, 8, shard_size_mb=0.05)
    r = store.reader("vae")
    shards = r.manifest.column("shard").to_pylist()
    offsets = r.manifest.column("sample_offset").to_pylist()
    rows = sorted((i for i, s in enumerate(shards) if s == shards[0]), key=lambda i: offsets[i])
    assert len(rows) >= 2
    first, last = r.keys()[rows[0]], r.keys()[rows[-1]]
    r.tensors(first)  # the shard is open now
    path = r.dir / shards[0]
    with open(path, "r+b") as f:
        f.truncate(offsets[rows[-1]] + 100)
    with pytest.raises(DamagedData, match=rf"sample {last} in {shards[0]} is damaged \(the shard ends .* before"):
        r.tensors(last)


def test_damage_records_from_concurrent_readers_are_all_kept(store: Store) -> None:
    """Readers on several ranks record damage into one marker at once: the read-merge-write is locked, so no
    finding is lost (unlocked, concurrent rewrites dropped each other's samples)."""
    import threading

    from store import integrity

    fill(store, 4)
    vdir = store.version_dir("vae", 1)

    def record(t: int) -> None:
        for i in range(25):
            integrity.record_damage(vdir, {f"k{t}-{i}": "crc32c mismatch"})

    threads = [threading.Thread(target=record, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    marker = json.loads(fmt.damaged_marker(store.root, "vae", 1).read_text())
    assert len(marker["damaged"]) == 6 * 25


def test_damage_records_from_concurrent_processes_are_all_kept(store: Store) -> None:
    """Ranks are processes, each with its own cache of the marker (`integrity._recorded`): recording at once, each
    its own samples and the same shared ones, none drops another's (the merge under the lock reads the file)."""
    import os
    import subprocess
    import sys

    fill(store, 4)
    vdir = store.version_dir("vae", 1)
    code = ("import sys; from pathlib import Path; from store import integrity\n"
            "vdir, t = Path(sys.argv[1]), sys.argv[2]\n"
            "for i in range(20):\n"
            "    integrity.record_damage(vdir, {f'k{t}-{i}': 'crc32c mismatch', f'shared-{i}': 'crc32c mismatch'})\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(vdir), str(t)], env=env) for t in range(4)]
    assert [p.wait(timeout=300) for p in procs] == [0] * 4
    marker = json.loads(fmt.damaged_marker(store.root, "vae", 1).read_text())
    assert set(marker["damaged"]) == {f"k{t}-{i}" for t in range(4) for i in range(20)} | {f"shared-{i}" for i in range(20)}


def test_a_repeat_finding_takes_no_lock_and_rewrites_nothing(store: Store, monkeypatch, caplog) -> None:
    """Every rank of a validation meets the same damaged samples, a resumed or next-epoch read meets them again:
    a finding already recorded (another rank's wording of it too) leaves the marker as it is and takes no lock,
    so a store mounted read-only after the damage was recorded warns only for what is new (each repeat took the
    lock: a warning line per damaged sample read there, and one locked re-read of the whole marker each)."""
    import errno

    from store import integrity

    fill(store, 4)
    vdir = store.version_dir("vae", 1)
    integrity.record_damage(vdir, {"k1": "crc32c mismatch", "k2": "crc32c mismatch"}, {"s.tar": "shard s.tar is missing"},
                            ["manifest.parquet is damaged"])
    marker = fmt.damaged_marker(store.root, "vae", 1)
    stamp = (marker.stat().st_ino, marker.stat().st_mtime_ns, marker.read_bytes())

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(fmt, "flock", read_only)
    with caplog.at_level("WARNING", logger="store"):
        integrity.record_damage(vdir, {"k1": "crc32c mismatch"})
        integrity.record_damage(vdir, {"k2": "the shard ends before it (another rank's node)"})
        integrity.record_damage(vdir, shards={"s.tar": "shard s.tar is missing"}, problems=["manifest.parquet is damaged"])
    assert caplog.text == ""
    assert (marker.stat().st_ino, marker.stat().st_mtime_ns, marker.read_bytes()) == stamp
    with caplog.at_level("WARNING", logger="store"):
        integrity.record_damage(vdir, {"k1": "crc32c mismatch", "k3": "crc32c mismatch"})  # k3 is new
    assert "could not record the damage found in" in caplog.text and "Read-only file system" in caplog.text


def test_a_lost_shard_is_recorded_with_all_its_samples_in_one_write_on_open(store: Store, monkeypatch) -> None:
    """The reader that finds a shard missing on open records its samples with it (one write), so reading them
    later adds nothing: one at a time, a lost shard of thousands of samples cost one locked, fsync'd rewrite of
    the whole marker per sample (quadratic bytes; bench/damage_record.py)."""
    fill(store, 8, shard_size_mb=0.002)
    vdir = store.root / "vae" / "v1"
    lost_shard = sorted(vdir.glob("*.tar"))[0]
    lost_shard.unlink()
    rows = pq.read_table(vdir / fmt.MANIFEST).to_pylist()
    lost = {x["key"] for x in rows if x["shard"] == lost_shard.name}
    writes: list[Path] = []
    real = fmt.atomic_write_json
    monkeypatch.setattr(fmt, "atomic_write_json", lambda path, obj: (writes.append(path), real(path, obj)))
    r = store.reader("vae", on_damaged="skip")
    marker = json.loads(fmt.damaged_marker(store.root, "vae", 1).read_text())
    assert set(marker["damaged"]) == lost and set(marker["shards"]) == {lost_shard.name}
    assert len(writes) == 1
    for key in sorted(lost):
        with pytest.raises(DamagedData, match=f"sample {key} in {lost_shard.name} is damaged"):
            r.tensors(key)
    assert len(writes) == 1 and json.loads(fmt.damaged_marker(store.root, "vae", 1).read_text()) == marker


def test_a_damage_record_that_cannot_be_written_is_reported(store: Store, monkeypatch, caplog) -> None:
    import errno

    from store import integrity

    fill(store, 4)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fmt, "atomic_write_json", full)
    with caplog.at_level("WARNING", logger="store"):
        integrity.record_damage(store.version_dir("vae", 1), {"k": "crc32c mismatch"})
    assert "could not record the damage found in" in caplog.text and "No space left on device" in caplog.text


def test_repair_records_its_damage_under_the_lock_readers_take(store: Store, monkeypatch) -> None:
    """`store repair` marks the version it replaces while a training on the same store may record damage in the
    same marker: repair waits for the damage lock and merges, so neither drops the other's findings (it used to
    overwrite the marker unlocked: a reader's earlier record was lost, and a reader mid-merge then wrote its own
    stale merge over repair's). The reader here holds the lock mid-merge when repair comes to record."""
    import threading

    from damage import sample_byte
    from store import integrity, repair

    fill(store, 4)
    vdir = store.version_dir("vae", 1)
    flip_bit(*sample_byte(store.root, "vae", key_of(2)), 0)
    integrity.record_damage(vdir, problems=["found earlier by a reader"])
    plan = repair.scan(store.root, progress=False)
    assert set(plan.tables[0].damaged) == {key_of(2)}

    at_lock = threading.Event()
    real_flock = fmt.flock

    def flock(path, *a, **k):
        if Path(path).name == integrity.DAMAGE_LOCK and threading.current_thread() is not threading.main_thread():
            at_lock.set()  # repair is about to wait for the reader's lock
        return real_flock(path, *a, **k)

    monkeypatch.setattr(fmt, "flock", flock)
    marker = fmt.damaged_marker(store.root, "vae", 1)
    failed: list[str] = []
    with real_flock(store.root / integrity.DAMAGE_LOCK):  # the reader's read-merge-write, as record_damage does it
        seen = integrity._recorded(marker, fresh=True)
        # the recompute does nothing here: the marker is what this test is about
        worker = threading.Thread(target=lambda: failed.extend(repair.apply(plan, lambda t, s: None, echo=lambda m: None)))
        worker.start()
        while not at_lock.is_set() and worker.is_alive():
            at_lock.wait(0.05)
        fmt.atomic_write_json(marker, integrity._merged(seen, 1, None, {"s.tar": "shard s.tar is missing"}, None))
    worker.join()
    rec = json.loads(marker.read_text())
    assert set(rec["damaged"]) == {key_of(2)}  # repair's
    assert rec["shards"] == {"s.tar": "shard s.tar is missing"} and rec["problems"] == ["found earlier by a reader"]
    assert failed and "did not complete" in failed[0]


def test_repair_that_cannot_write_the_damage_marker_says_so_in_one_line(store: Store, monkeypatch) -> None:
    """The marker is what keeps the damaged version from being reused: repair stops when it cannot be written, with
    the line every full-disk write gives (not an OSError traceback), and the version is left as it was."""
    import errno

    from damage import sample_byte
    from store import integrity, repair

    fill(store, 4)
    flip_bit(*sample_byte(store.root, "vae", key_of(2)), 0)
    plan = repair.scan(store.root, progress=False)

    def full(path, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(integrity.fmt, "atomic_write_json", full)
    failed = repair.apply(plan, lambda t, s: None, echo=lambda m: None)  # before: an OSError traceback
    assert len(failed) == 1 and re.match(r"vae v1: disk full while writing the damage marker of table 'vae' v1",
                                         failed[0])
    assert not fmt.damaged_marker(store.root, "vae", 1).exists()


def test_a_full_disk_line_gives_small_sizes_in_kib(tmp_path: Path, monkeypatch) -> None:
    """On a nearly full disk the manifest's need (two copies of a 15 kB file) read "about 0.0 MB needed" and the
    space left "0.0 MB free": a figure of nothing. Below 0.1 MiB the line counts KiB."""
    import errno
    import shutil
    from collections import namedtuple

    from store.io_errors import describe

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(300_000, 272_000, 28_000))
    line = str(describe(OSError(errno.ENOSPC, "No space left on device"), "the manifest", tmp_path, need=30_000))
    assert "(27 KiB free, about 29 KiB needed)" in line, line
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(2**30, 0, 500 * 2**20))
    line = str(describe(OSError(errno.ENOSPC, "No space left on device"), "the manifest", tmp_path, need=3 * 2**20))
    assert "(500.0 MiB free, about 3.0 MiB needed)" in line, line


def test_a_file_size_limit_is_one_line_and_the_rerun_completes(tmp_path: Path) -> None:
    """A write past the largest file allowed (EFBIG: `ulimit -f`, FAT32's 4 GiB) was a traceback ending in
    "OSError: [Errno 27] File too large"; now one line saying so and what to do, and the rerun completes."""
    import os
    import resource
    import subprocess
    import sys

    from pipeline.demo_data import make_demo_data

    make_demo_data(tmp_path / "data", n=12, fmt="folder", max_controls=1, seed=3)
    repo = Path(__file__).resolve().parents[2]
    args = [sys.executable, "-m", "pipeline.cli", "run", "resize-bucket", "--source", str(tmp_path / "data"),
            "--store", str(tmp_path / "store"), "--area", "9216"]
    env = {**os.environ, "PYTHONPATH": str(repo)}

    def limited() -> None:  # files of at most 40 kB: the first shard passes it
        resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, resource.RLIM_INFINITY))

    res = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, preexec_fn=limited)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "error: file too large while writing a shard of table 'images' v1" in res.stderr, res.stderr[-3000:]
    res = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not verify_store(tmp_path / "store")
