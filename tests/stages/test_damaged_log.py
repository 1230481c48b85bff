"""RUN/damaged_samples.jsonl (train.on_damaged=skip): appended, not rewritten; a killed writer loses no record it
finished and its torn last line is cut off; a full disk is one line naming the file and the space free."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from schemas.errors import UserError
from stages.train import damaged_log, guard

WRITER = """
import sys
from pathlib import Path
from stages.train import guard
run_dir = Path(sys.argv[1])
i = 0
while True:  # one damaged sample per batch, each printed once its record is written
    guard.record_skipped(run_dir, {f"s{i:06d}": f"crc mismatch in shard {i} " + "x" * 200})
    print(f"s{i:06d}", flush=True)
    i += 1
"""


def _bytes_written() -> int:
    """This process's bytes passed to write(2) so far (the kernel's count: whatever the writer's code)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("no wchar in /proc/self/io")


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux's /proc/self/io")
def test_recording_writes_each_sample_once_not_the_whole_list_again(tmp_path):
    """300 damaged batches: the bytes written stay about the list's size (a rewrite per batch wrote ~150x it)."""
    before = _bytes_written()
    for i in range(300):
        guard.record_skipped(tmp_path, {f"sample-{i:05d}": f"table 'vae' v1: crc mismatch of sample {i}"})
    written = _bytes_written() - before
    size = (tmp_path / guard.DAMAGED_REPORT).stat().st_size
    assert written < 2 * size, (written, size)
    listed = damaged_log.read(tmp_path)
    assert list(listed) == [f"sample-{i:05d}" for i in range(300)]
    assert listed["sample-00007"] == "table 'vae' v1: crc mismatch of sample 7"


def test_a_killed_writer_loses_no_record_and_a_torn_line_is_cut_off(tmp_path):
    """SIGKILL while recording: every sample the writer had finished is read back; a torn last line (a kill in
    the middle of a write) is skipped by readers and cut off by the next writer, whose records all read back."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    done = [proc.stdout.readline().strip() for _ in range(50)]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    listed = damaged_log.read(tmp_path)
    assert set(done) <= set(listed) and len(listed) >= 50

    path = tmp_path / damaged_log.NAME
    with open(path, "ab") as f:  # what a kill in the middle of one write leaves
        f.write(b'{"sample": "torn", "problem": "crc mis')
    assert damaged_log.read(tmp_path) == listed
    guard.record_skipped(tmp_path, {"after": "crc mismatch", "after2": "truncated shard"})
    again = damaged_log.read(tmp_path)
    assert again == {**listed, "after": "crc mismatch", "after2": "truncated shard"}
    assert path.read_bytes().endswith(b'"truncated shard"}\n') and b"torn" not in path.read_bytes()


def test_a_resume_reads_the_list_back_and_appends_only_new_samples(tmp_path):
    from stages.train.damaged import DamageTally

    class Tables:
        keys = ["a", "b", "c"]

    DamageTally(tmp_path, 0, 1).record(Tables, {0: "crc a", 1: "crc b"}, step=1)
    size = (tmp_path / damaged_log.NAME).stat().st_size
    resumed = DamageTally(tmp_path, 0, 1)  # a resume meets a and b again, then c
    resumed.record(Tables, {0: "crc a", 1: "crc b"}, step=5)
    assert (tmp_path / damaged_log.NAME).stat().st_size == size
    resumed.record(Tables, {2: "crc c"}, step=6)
    assert damaged_log.read(tmp_path) == {"a": "crc a", "b": "crc b", "c": "crc c"}


def test_a_run_folder_of_the_earlier_json_list_goes_on(tmp_path):
    (tmp_path / "damaged_samples.json").write_text('{"skipped": 1, "samples": {"old": "crc old"}}')
    guard.record_skipped(tmp_path, {"new": "crc new"})
    assert damaged_log.read(tmp_path) == {"old": "crc old", "new": "crc new"}


def test_a_full_disk_is_one_line_naming_the_file_and_the_list_is_left_whole(tmp_path, monkeypatch):
    guard.record_skipped(tmp_path, {"a": "crc a"})
    before = (tmp_path / damaged_log.NAME).read_bytes()
    real_write = os.write

    def half_then_full(fd, data):  # part of the line lands, then the disk is full
        real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(damaged_log.os, "write", half_then_full)
    with pytest.raises(UserError) as e:
        guard.record_skipped(tmp_path, {"b": "crc b"})
    line = str(e.value)
    assert "\n" not in line and "disk full" in line and damaged_log.NAME in line and str(tmp_path) in line
    assert "B free" in line and "--resume" in line
    assert (tmp_path / damaged_log.NAME).read_bytes() == before


def test_a_sample_two_ranks_meet_in_different_epochs_is_listed_and_named_once(tmp_path, capsys):
    """Each rank remembered only what the list held at its start and what it listed itself: a damaged sample rank 0
    met in epoch 0 and rank 1 in epoch 1 (another shuffle) was appended and named twice. Now a rank reads what the
    others listed since it last looked (each byte once) before it lists a sample; a sample new to the run still is."""
    from types import SimpleNamespace

    from stages.train.damaged import DamageTally

    tables = SimpleNamespace(keys=["k0", "k1", "k2", "k3"])
    rank0, rank1 = DamageTally(tmp_path, 0, 2), DamageTally(tmp_path, 1, 2)
    rank0.record(tables, {2: "crc mismatch"}, 3)  # epoch 0
    rank1.record(tables, {2: "crc mismatch"}, 9)  # epoch 1: the same sample
    rank1.record(tables, {1: "truncated shard", 2: "crc mismatch"}, 10)
    lines = damaged_log.path_of(tmp_path).read_text().splitlines()
    assert [json.loads(line)["sample"] for line in lines] == ["k2", "k1"]
    said = [line for line in capsys.readouterr().out.splitlines() if "left out damaged sample" in line]
    assert said == [f"rank 0: optimizer step 3: left out damaged sample(s) k2 (train.on_damaged=skip; listed in "
                    f"{damaged_log.path_of(tmp_path)})",
                    f"rank 1: optimizer step 10: left out damaged sample(s) k1 (train.on_damaged=skip; listed in "
                    f"{damaged_log.path_of(tmp_path)})"]
    assert damaged_log.read(tmp_path, up_to=3) == {"k2": "crc mismatch"}  # listed at the step that first met it
