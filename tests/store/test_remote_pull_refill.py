"""A pulled copy whose files were deleted or cut short since (a user's rm, a full disk, a killed copy): the next
`store pull` finds them by one stat each against the version's checksums.json, fetches exactly those again (to
`schemas.temp_files.temp_of`'s name, renamed into place) and clears the damage readers recorded for them; damage it
did not repair (a sample's bytes changed in a shard of the right size) stays recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas.errors import UserError
from store import Store
from store import format as fmt
from store import remote as remote_mod
from store.integrity import DamagedData
from store.remote_pull import pull
from store.remote_push import push
from store.verify import verify_store
from store_samples import fill

from test_remote_sync import files_of


def _downloads(monkeypatch) -> list[str]:
    fetched: list[str] = []
    real = remote_mod.Remote.download

    def counting(self, rel, local, progress):
        fetched.append(rel)
        return real(self, rel, local, progress)

    monkeypatch.setattr(remote_mod.Remote, "download", counting)
    return fetched


def _pulled(s3_env, store: Store, tmp_path: Path) -> tuple[Path, Path, list[str]]:
    fill(store, 24)  # several shards
    push(store.root, s3_env.url())
    dst = tmp_path / "pulled"
    pull(s3_env.url(), dst)
    vdir = fmt.version_dir(dst, "vae", 1)
    shards = sorted(p.name for p in vdir.glob("shard-*.tar"))
    assert len(shards) >= 4
    return dst, vdir, shards


def test_pull_refetches_exactly_the_deleted_and_truncated_files_and_clears_their_damage(
        s3_env, store: Store, tmp_path: Path, monkeypatch) -> None:
    dst, vdir, shards = _pulled(s3_env, store, tmp_path)
    (vdir / shards[0]).unlink()  # deleted by a user
    with open(vdir / shards[1], "r+b") as f:  # cut short (a full disk, a killed copy)
        f.truncate(100)
    index = fmt.index_name(shards[2])
    (vdir / index).unlink()
    flipped = vdir / shards[3]  # the same size, one byte changed: no stat finds it, the reader's CRC32C does
    data = bytearray(flipped.read_bytes())
    data[600] ^= 0xFF
    flipped.write_bytes(bytes(data))

    reader = Store(dst).reader("vae", on_damaged="skip")  # the open's size check records the lost shards
    lost = {shards[0], shards[1]}
    damaged_keys = [k for k in reader.keys() if reader.view.samples.shard_of(reader.view.keys.index(k)) in lost]
    flipped_key = None
    for k in reader.keys():  # the reader refuses the changed sample on its first read (recorded)
        try:
            reader.tensors(k)
        except DamagedData:
            if reader.view.samples.shard_of(reader.view.keys.index(k)) == shards[3]:
                flipped_key = k
    reader.close()
    marker = fmt.damaged_marker(dst, "vae", 1)
    before = json.loads(marker.read_text())
    assert set(before["shards"]) == lost and flipped_key in before["damaged"]
    assert damaged_keys and set(damaged_keys) <= set(before["damaged"])

    fetched = _downloads(monkeypatch)
    summary = pull(s3_env.url(), dst)
    # exactly the three files, nothing else fetched again
    assert sorted(fetched) == sorted(f"vae/v1/{n}" for n in (shards[0], shards[1], index))
    assert summary.objects_sent == 3 and summary.present == ["vae/v1"]
    assert not [p for p in vdir.iterdir() if fmt.is_litter(p.name) or p.name.endswith(".part")]
    for n in (shards[0], shards[1], index):
        assert (vdir / n).read_bytes() == (fmt.version_dir(store.root, "vae", 1) / n).read_bytes()
    # the repaired shards' damage is gone; the changed sample (not repaired: its shard has the right size) stays
    after = json.loads(marker.read_text())
    assert after["shards"] == {} and set(after["damaged"]) == {flipped_key}
    assert not set(damaged_keys) & set(after["damaged"])

    # once the changed shard is restored too, the pull clears the last entry and the copy verifies clean
    flipped.unlink()
    pull(s3_env.url(), dst)
    assert not marker.exists()
    assert verify_store(dst) == []
    assert files_of(dst) == files_of(store.root)
    with Store(dst).reader("vae") as r:  # on_damaged="stop": opens, reads every sample
        for k in r.keys():
            r.tensors(k)


def test_a_refill_cut_off_leaves_no_partial_file_under_the_name(s3_env, store: Store, tmp_path: Path,
                                                                monkeypatch) -> None:
    dst, vdir, shards = _pulled(s3_env, store, tmp_path)
    want = (vdir / shards[0]).stat().st_size
    with open(vdir / shards[0], "r+b") as f:
        f.truncate(50)

    def cut(self, rel, local, progress):  # some bytes written to the temp name, then the connection drops
        Path(local).write_bytes(b"x" * 10)
        raise ConnectionResetError("connection reset by peer")

    with monkeypatch.context() as m:
        m.setattr(remote_mod.Remote, "download", cut)
        with pytest.raises((UserError, ConnectionResetError)):
            pull(s3_env.url(), dst)
    assert (vdir / shards[0]).stat().st_size == 50  # the damaged file as it was, never the partial bytes
    assert not [p for p in vdir.iterdir() if fmt.is_litter(p.name)]
    with pytest.raises(DamagedData, match="truncated"):  # and a reader refuses it, naming it
        Store(dst).reader("vae")
    pull(s3_env.url(), dst)
    assert (vdir / shards[0]).stat().st_size == want and verify_store(dst) == []


def test_a_copy_without_its_manifest_is_completed(s3_env, store: Store, tmp_path: Path) -> None:
    """The manifest deleted: the copy's own checksums.json is the remote's, so it is this version, damaged -
    completed (before: refused as another store's version under the same number)."""
    dst, vdir, _ = _pulled(s3_env, store, tmp_path)
    (vdir / fmt.MANIFEST).unlink()
    pull(s3_env.url(), dst)
    assert verify_store(dst) == [] and files_of(dst) == files_of(store.root)
