"""`store gc` and the damaged versions a repair set aside (`v<N>.damaged/`): removed with a line naming each and the
bytes it frees (its intact shards live on in the repaired version through hard links), with its damage record; a
dry run only says so; kept while a live lease names its number. Before, they stayed for ever (gc skipped them)."""

from __future__ import annotations

import json
import os

from typer.testing import CliRunner

from pipeline.cli import app
from store import Store
from store import format as fmt
from schemas.units import size_text
from store.lease import LEASES_DIR, process_identity
from store_samples import fill


def _cli(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in r.output, r.output
    return r


def _repaired(store: Store):
    """v1 with bytes appended to a shard, repaired: v2 current, v1 set aside as vae/v1.damaged/."""
    fill(store, 6, shard_size_mb=0.004)
    shard = sorted((store.root / "vae" / "v1").glob("*.tar"))[0]
    with open(shard, "ab") as f:
        f.write(os.urandom(700))
    assert _cli("store", "repair", store.root).exit_code == 0
    aside = store.root / "vae" / "v1.damaged"
    assert aside.is_dir() and fmt.damaged_marker(store.root, "vae", 1).is_file()
    return aside


def _freed(folder) -> int:  # the bytes whose last link goes with it
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.stat().st_nlink == 1)


def test_gc_removes_a_damaged_version_set_aside_naming_the_bytes_it_frees(store: Store) -> None:
    aside = _repaired(store)
    freed = _freed(aside)
    linked = [p for p in aside.iterdir() if p.stat().st_nlink > 1]
    assert linked and 0 < freed < sum(p.stat().st_size for p in aside.iterdir())  # intact shards shared with v2
    line = f"vae/v1.damaged (a damaged version a repair set aside; {size_text(freed)}"
    dry = _cli("store", "gc", store.root, "--dry-run")
    assert dry.exit_code == 0 and f"would remove {line} would be freed)" in dry.output, dry.output
    assert aside.is_dir()
    r = _cli("store", "gc", store.root)
    assert r.exit_code == 0 and f"remove {line} freed)" in r.output, r.output
    assert "1 damaged version(s) set aside" in r.output
    assert not aside.exists() and not fmt.damaged_marker(store.root, "vae", 1).exists()
    assert not [p for p in (store.root / "vae").iterdir() if p.name.startswith(".v")]  # no gc-deleting left
    assert _cli("store", "verify", store.root).exit_code == 0
    r2 = Store(store.root).reader("vae")
    assert r2.version == 2 and len(r2.keys()) == 6 and all(r2.get(k) for k in r2.keys())  # every sample intact
    r2.close()
    again = _cli("store", "gc", store.root)
    assert "v1.damaged" not in again.output


def test_a_damaged_version_set_aside_is_kept_while_a_lease_names_its_number(store: Store) -> None:
    """set_aside moves no version a live lease names, so this takes a lease made by hand; gc keeps it as it keeps
    a version a reader holds, and says by whom."""
    aside = _repaired(store)
    (store.root / LEASES_DIR).mkdir(exist_ok=True)
    lease = store.root / LEASES_DIR / "test-reader.json"
    lease.write_text(json.dumps({**process_identity(), "what": "a test reader", "versions": {"vae": [1]}}))
    r = _cli("store", "gc", store.root)
    assert r.exit_code == 0 and "keep vae/v1.damaged: a damaged version set aside, but its number is read by " \
        "a test reader" in r.output, r.output
    assert aside.is_dir() and fmt.damaged_marker(store.root, "vae", 1).is_file()
    lease.unlink()
    assert "remove vae/v1.damaged" in _cli("store", "gc", store.root).output and not aside.exists()


def test_a_gc_during_the_repairs_final_verify_leaves_the_repair_succeeding(store: Store, monkeypatch) -> None:
    """Between the repaired version's commit (the damaged one no longer current) and its set-aside, repair reads
    the new version back in full (minutes at scale): a `store gc` then removes the damaged version, as any version
    nothing current references. The set-aside's rename then met no folder: a FileNotFoundError traceback after a
    repair that had succeeded. The gc is run at that point here, deterministically."""
    from store import gc, repair

    fill(store, 6, shard_size_mb=0.004)
    shard = sorted((store.root / "vae" / "v1").glob("*.tar"))[0]
    with open(shard, "ab") as f:
        f.write(os.urandom(700))
    verify = repair.verify_version

    def gc_first(vdir, *args, **kwargs):
        gc.collect(store.root, echo=lambda line: None)
        return verify(vdir, *args, **kwargs)

    monkeypatch.setattr(repair, "verify_version", gc_first)
    r = _cli("store", "repair", store.root)
    assert r.exit_code == 0 and "repaired as v2" in r.output, r.output
    assert not (store.root / "vae" / "v1").exists() and not (store.root / "vae" / "v1.damaged").exists()
    monkeypatch.setattr(repair, "verify_version", verify)
    assert _cli("store", "verify", store.root).exit_code == 0


class _Killed(Exception):
    pass


def test_a_gc_killed_between_a_folder_and_its_damage_record_leaves_no_stale_record(store: Store, monkeypatch) -> None:
    """gc removes a version's folder, then its records (`v<N>.damaged.json`, `.unchanged`, notes). Killed in between,
    the record outlived its version: a repair's working copy then took v1 for a version repair replaced there
    (`replaced_here`: marked damaged, no v1) and would retire it at the URL, and a later v1 of that number would be
    born damaged. The next gc removes a record no version and no set-aside folder has; a kept version's stays."""
    from store import integrity
    from store.remote_work import replaced_here

    fill(store, 4, tag="a")
    fill(store, 3, tag="b", start=10)  # v2 current: v1 is gc's
    v1, v2 = store.version_dir("vae", 1), store.version_dir("vae", 2)
    integrity.record_damage(v1, problems=["vae/v1/shard-r00-000000.tar: the file is damaged"])  # verify found it
    fmt.unchanged_marker(store.root, "vae", 1).write_text("{}")
    integrity.record_damage(v2, problems=["vae/v2/shard-r00-000000.tar: the file is damaged"])  # a kept version's
    real = fmt.crash_point

    def crash_point(name: str) -> None:
        if name == "gc_mid_delete":  # v1's folder renamed away and partly deleted: a kill here
            raise _Killed(name)
        real(name)

    monkeypatch.setattr(fmt, "crash_point", crash_point)
    try:
        from store.gc import collect

        collect(store.root, echo=lambda line: None)
    except _Killed:
        pass
    monkeypatch.setattr(fmt, "crash_point", real)
    assert not v1.exists() and fmt.damaged_marker(store.root, "vae", 1).exists()
    assert ("vae", 1) in replaced_here(store.root)  # what the kill left: a version repair never replaced

    r = _cli("store", "gc", store.root)
    assert r.exit_code == 0, r.output
    assert "remove vae/v1.damaged.json (the record of a version no longer there" in r.output, r.output
    assert not fmt.damaged_marker(store.root, "vae", 1).exists()
    assert not fmt.unchanged_marker(store.root, "vae", 1).exists()
    assert replaced_here(store.root) == []
    assert not [p for p in (store.root / "vae").iterdir() if p.name.startswith(".v")]  # the leftover finished
    assert fmt.damaged_marker(store.root, "vae", 2).exists()  # a kept version's record stays
