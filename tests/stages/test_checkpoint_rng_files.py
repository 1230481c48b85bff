"""Rank 0 seals a checkpoint's resume record after every rank wrote its RNG state into the shared temp folder.
It listed the folder for the files to checksum; on a shared file system (NFS, several nodes) that listing can be
stale and miss another node's `rng-rankNN.safetensors`, which then went into no checksum and was read on resume
unchecked. Now each rank's file is checksummed by name, and one absent is refused naming it. The stale listing is
made deterministic here: the listing leaves rank 1's file out."""

from __future__ import annotations

import pytest

import store.checksum
from schemas.errors import UserError
from stages.train import state as train_state
from store.checksum import file_crc, unseal


def _record() -> train_state.ResumeRecord:
    return train_state.ResumeRecord(step=2, epoch=0, batch_in_epoch=2, config_fingerprint="c", tables={"text": "v1"},
                                    store="/s", model_fingerprint="m", world_size=2)


def test_every_ranks_rng_file_is_checksummed_by_name_not_as_listed(tmp_path, monkeypatch):
    folder = tmp_path / ".step-2.tmp"
    folder.mkdir()
    (folder / "scheduler.json").write_text("{}")  # rank 0's own file
    for rank in (0, 1):
        train_state.save_rng(folder, rank, cuda=False)
    listed = store.checksum.folder_checksums
    monkeypatch.setattr(store.checksum, "folder_checksums", lambda f, skip=(): {
        k: v for k, v in listed(f, skip).items() if k != "rng-rank01.safetensors"})  # a stale listing

    train_state.write_record(folder, _record())
    files = unseal((folder / train_state.RESUME_JSON).read_bytes())["files"]
    assert sorted(files) == ["rng-rank00.safetensors", "rng-rank01.safetensors", "scheduler.json"]
    crc, n = file_crc(folder / "rng-rank01.safetensors")
    assert files["rng-rank01.safetensors"] == {"nbytes": n, "crc32c": crc}
    # so a resume finds rank 1's file damaged, instead of restoring its RNG from it unchecked
    data = bytearray((folder / "rng-rank01.safetensors").read_bytes())
    data[-1] ^= 0x01
    (folder / "rng-rank01.safetensors").write_bytes(bytes(data))
    with pytest.raises(train_state.CheckpointDamaged, match="rng-rank01.safetensors"):
        train_state.check_files(folder, files)

    # absent after the barrier (a node-local --out): refused, naming it, and no record written
    (folder / train_state.RESUME_JSON).unlink()
    (folder / "rng-rank01.safetensors").unlink()
    with pytest.raises(UserError, match=r"rng-rank01\.safetensors \(rank 1's RNG state\) is not there") as e:
        train_state.write_record(folder, _record())
    assert "\n" not in str(e.value)
    assert not (folder / train_state.RESUME_JSON).exists()
