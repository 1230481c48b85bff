"""Recovery gaps of issue 22 point 6 on the store: a shard with bytes appended (every sample intact) is repaired,
`store gc --dry-run` works on a read-only store, and a killed write's `.store.json.tmp-*` in the store root (and
a table's `.v<N>.*.json.tmp-*`) is reported by verify and removed by repair."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from store import Store
from store_samples import fill, read_only_open


def _cli(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in r.output, r.output
    return r


def test_a_shard_with_bytes_appended_is_repaired_with_every_sample(store: Store) -> None:
    fill(store, 6, shard_size_mb=0.004)
    before = {k: store.reader("vae").get(k)["tensors"] for k in store.reader("vae").keys()}
    shard = sorted((store.root / "vae" / "v1").glob("*.tar"))[0]
    with open(shard, "ab") as f:
        f.write(os.urandom(700))
    assert _cli("store", "verify", store.root).exit_code == 1
    r = _cli("store", "repair", store.root)
    assert r.exit_code == 0 and "bytes appended" in r.output, r.output
    # the new version is read back in full, as long as `store verify`: with verify's bars (none before)
    assert "checksum vae/v2: 100%" in r.output and "verify vae/v2: 100%" in r.output, r.output
    assert _cli("store", "verify", store.root).exit_code == 0
    st = Store(store.root, create=False)
    reader = st.reader("vae")
    assert reader.version == 2 and sorted(reader.keys()) == sorted(before)
    for k, tensors in before.items():
        got = reader.get(k)["tensors"]
        assert all((got[n] == t).all() for n, t in tensors.items())
    reader.close()


def test_gc_dry_run_on_a_read_only_store(store: Store, monkeypatch) -> None:
    fill(store, 2)
    fill(store, 2, tag="b")  # v2 current: v1 would be removed
    monkeypatch.setattr(os, "open", read_only_open(os.open))
    r = _cli("store", "gc", store.root, "--dry-run")
    assert r.exit_code == 0 and "would remove vae/v1" in r.output, r.output


def test_gc_on_a_read_only_store_names_the_stores_lock(store: Store, monkeypatch) -> None:
    """Before: "cannot write output: ST/.store.lock is not writable", output being the CLI's generic word; now the
    store's lock file, the store read-only here, and what to do. Nothing removed."""
    fill(store, 2)
    fill(store, 2, tag="b")
    monkeypatch.setattr(os, "open", read_only_open(os.open))
    r = _cli("store", "gc", store.root)
    lock = store.root / ".store.lock"
    assert r.exit_code == 1 and r.output == (
        f"error: cannot take the store's lock file {lock}: the store {store.root} is read-only here (Read-only file "
        "system), and this command changes it; run it where the store is writable (a read-write mount, an account "
        "that may write its files)\n"), r.output
    assert (store.root / "vae" / "v1").is_dir()


@pytest.mark.parametrize("name", [".store.json.tmp-999999999", "vae/.v1.unchanged.json.tmp-999999999",
                                  "vae/.v1.damaged.json.tmp-999999999"])
def test_a_temp_file_left_by_a_kill_is_reported_and_removed(store: Store, name: str) -> None:
    """store.json's, and a table's records beside its versions (the fix scan's "unchanged" answer, the damage
    marker): before, only the store root's were reported and removed."""
    fill(store, 2)
    litter = store.root / name  # no such process
    litter.write_text("{")
    r = _cli("store", "verify", store.root)
    assert r.exit_code == 1 and f"{name}: temp file left by an interrupted write" in r.output, r.output
    r = _cli("store", "repair", store.root)
    assert r.exit_code == 0 and not litter.exists(), r.output
    assert _cli("store", "verify", store.root).exit_code == 0


def test_verify_ends_with_what_to_do_for_current_and_for_old_versions(store: Store) -> None:
    """repair recomputes current versions only: damage in a version no longer current (an old version sharing a
    repaired shard by hard link) stays, and verify then fails after a successful repair. Its last line says
    which command deals with what."""
    fill(store, 2)
    fill(store, 2, tag="b")  # v2 current, v1 old
    for version in ("v1", "v2"):
        with open(sorted((store.root / "vae" / version).glob("*.tar"))[0], "ab") as f:
            f.write(os.urandom(700))
    r = _cli("store", "verify", store.root)
    last = r.output.strip().splitlines()[-1]
    assert r.exit_code == 1 and last.split(": ", 1)[0].endswith(" problem(s)"), last
    assert f"`pipeline store repair {store.root}` recomputes what is damaged" in last
    assert f"vae/v1 is not current: `pipeline store gc {store.root}` removes" in last
    assert _cli("store", "repair", store.root).exit_code == 0
    r = _cli("store", "verify", store.root)
    last = r.output.strip().splitlines()[-1]
    assert r.exit_code == 1 and "pipeline store repair" not in last and "vae/v1 is not current" in last, last
    assert _cli("store", "gc", store.root).exit_code == 0
    assert _cli("store", "verify", store.root).exit_code == 0


def test_a_damaged_quarantine_file_is_set_aside_by_repair(store: Store) -> None:
    """Before: verify said "run store repair", repair said "nothing to repair: intact", and every later append of
    a rejected input (an encode's finish) ended in pyarrow's traceback, so an encode that rejected a sample could
    never commit."""
    import pytest

    from schemas.errors import UserError

    fill(store, 2)
    row = {"key": "k1", "source": "a.png", "stage": "encode-vae", "reason": "unreadable"}
    store.add_quarantine([row])
    path = store.root / "quarantine.parquet"
    data = bytearray(path.read_bytes())
    data[-8] ^= 0xFF  # a flipped byte in the footer's length: pyarrow cannot read the file (a flip at a layout
    # offset, the middle of the file, may land on a statistic, harmless since the seal: quarantine.SEAL)
    path.write_bytes(bytes(data))
    r = _cli("store", "verify", store.root)
    assert r.exit_code == 1 and "quarantine.parquet" in r.output, r.output
    with pytest.raises(UserError, match="quarantine.parquet is damaged.*store repair"):
        store.add_quarantine([{**row, "key": "k2"}])
    r = _cli("store", "repair", store.root)
    assert r.exit_code == 0 and "set aside" in r.output and "nothing to repair" not in r.output, r.output
    assert (store.root / "quarantine.parquet.damaged").read_bytes() == bytes(data)  # kept for inspection
    assert _cli("store", "verify", store.root).exit_code == 0
    assert store.add_quarantine([{**row, "key": "k2"}]) == 1
    assert store.quarantine().column("key").to_pylist() == ["k2"]


def test_a_temp_file_another_host_may_still_write_is_named_so_and_removed_once_a_day_old(store: Store) -> None:
    """A temp of another host's or container's writer (or of this host before a reboot: a new boot id) is left by
    repair until untouched for a day (`schemas/temp_files.py`): verify said "`store repair` removes it", repair
    then said "nothing to repair: ... intact" and verify failed alike on every rerun. Verify now says whose it may
    be and when repair removes it; a day later repair does."""
    import time

    fill(store, 2)
    litter = store.root / ".store.json.tmp-999999999-h0123456789ab-n1"  # not this host's
    litter.write_text("{")
    r = _cli("store", "verify", store.root)
    assert r.exit_code == 1, r.output
    (line,) = [ln for ln in r.output.splitlines() if litter.name in ln]
    assert "another host or container" in line and "untouched for a day" in line, line
    assert _cli("store", "repair", store.root).exit_code == 0 and litter.exists()
    old = time.time() - 25 * 3600
    os.utime(litter, (old, old))
    r = _cli("store", "verify", store.root)
    (line,) = [ln for ln in r.output.splitlines() if litter.name in ln]
    assert line.endswith("temp file left by an interrupted write (`pipeline store repair` removes it)"), line
    assert _cli("store", "repair", store.root).exit_code == 0 and not litter.exists()
    assert _cli("store", "verify", store.root).exit_code == 0


def test_a_trimmed_shard_has_its_bytes_fsynced_before_the_repaired_version_counts_it(store: Store,
                                                                                     monkeypatch) -> None:
    """The repair writes the recorded bytes of a shard with bytes appended as a new file, then links it into the
    new version, whose folder fsync makes only names durable: that file's bytes are fsynced before the rank's
    done file (a power loss kept a committed shard of zeros in the repaired version)."""
    from store import format as fmt

    fill(store, 6, shard_size_mb=0.004)
    shard = sorted((store.root / "vae" / "v1").glob("*.tar"))[0]
    with open(shard, "ab") as f:
        f.write(os.urandom(700))
    events: list[str] = []
    fsync, atomic_write_bytes = os.fsync, fmt.atomic_write_bytes

    def record_fsync(fd):
        events.append("fsync " + os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    def record_write(path, *args, **kwargs):
        events.append(path.name)
        atomic_write_bytes(path, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", record_fsync)
    monkeypatch.setattr(fmt, "atomic_write_bytes", record_write)
    assert _cli("store", "repair", store.root).exit_code == 0
    done = events.index(fmt.rank_done_name(0))
    assert f"fsync {store.root / 'vae' / '.trim-v1' / shard.name}" in events[:done], events[:done]


def test_verify_names_model_and_config_only_where_repair_recomputes(store: Store) -> None:
    """Damage repair mends without recomputing a sample (a shard index, counts sealed that are not the manifest's,
    a temp file): the advice says no --model / --config is needed, and repair without them mends it. A damaged
    sample: the advice asks for them (before: always)."""
    from store.checksum import seal
    from store.integrity import read_version_record

    fill(store, 6)
    vdir = store.root / "vae" / "v1"
    index = sorted(vdir.glob("*.index.parquet"))[0]
    data = bytearray(index.read_bytes())
    data[len(data) // 2] ^= 0x01
    index.write_bytes(bytes(data))
    record = read_version_record(vdir)
    record["counts"]["samples"] += 1
    (vdir / "checksums.json").write_bytes(seal(record))
    (store.root / ".store.json.tmp-999999999").write_text("{")
    r = _cli("store", "verify", store.root)
    last = r.output.strip().splitlines()[-1]
    assert r.exit_code == 1 and last.startswith("3 problem(s): "), r.output
    assert f"`pipeline store repair {store.root}` rewrites what is damaged (no sample recomputed: no --model / " \
           "--config needed)" in last, last
    r = _cli("store", "repair", store.root)  # no --model, no --config: as advised
    assert r.exit_code == 0 and "v1 repaired as v2 (0 recomputed" in r.output, r.output
    assert _cli("store", "verify", store.root).exit_code == 0

    shard = sorted((store.root / "vae" / "v2").glob("*.tar"))[0]
    data = bytearray(shard.read_bytes())
    data[700] ^= 0x10  # inside the first sample's bytes
    shard.write_bytes(bytes(data))
    last = _cli("store", "verify", store.root).output.strip().splitlines()[-1]
    assert f"`pipeline store repair {store.root}` recomputes what is damaged (with the --model / --config" in last, last
