"""A store or version written by a newer release - a later format in a record whose bytes are shown intact - is
refused as "written by a newer version of pipeline (format N, this one reads up to M): upgrade", never called
damaged, and `store verify` / `store repair` change nothing in it: a user told "damaged" repairs (rewrites) or
deletes good data. The same number in a record that is damaged stays damage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from schemas.errors import UserError
from store import Store
from store import format as fmt
from store import repair
from store.checksum import crc_hex, seal, unseal
from store.integrity import DamagedData, read_version_checksums
from store.verify import verify_store
from damage import flip_bit
from store_samples import fill

runner = CliRunner()


def newer(found: int, reads: int) -> str:
    return rf"was written by a newer version of pipeline \(format {found}, this one reads up to {reads}\): upgrade"


def files(root: Path) -> dict[str, bytes]:
    """Every file of the store but its locks and leases (a lock file holds its last holder's pid)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)}


def refused_alike(root: Path, found: int, reads: int) -> None:
    """Opening, verifying and repairing the store each refuse it as a newer release's, and none changes a file."""
    before = files(root)
    actions = {"read": lambda: Store(root, create=False).reader("vae"),
               "verify": lambda: verify_store(root, progress=False),
               "repair scan": lambda: repair.scan(root, progress=False)}
    for what, act in actions.items():
        with pytest.raises(UserError, match=newer(found, reads)) as e:
            act()
        assert not isinstance(e.value, DamagedData), what
    for command in (["store", "verify", str(root)], ["store", "repair", str(root)]):
        res = runner.invoke(app, command)
        assert res.exit_code == 1 and "Traceback" not in res.output, res.output
        assert "written by a newer version of pipeline" in res.output and "damaged" not in res.output, res.output
    assert files(root) == before  # no damage marker, no rebuilt store.json, nothing set aside


def test_a_version_whose_checksums_record_is_of_a_newer_format_is_refused_not_repaired(store: Store) -> None:
    """Before: a sealed, intact checksums.json of format 2 was "damaged ... run `pipeline store repair`", and verify
    recorded the version as damaged (v1.damaged.json), so the stage that wrote it would recompute it."""
    fill(store, 4)
    vdir = store.root / "vae" / "v1"
    path = vdir / fmt.CHECKSUMS
    path.write_bytes(seal({**unseal(path.read_bytes()), "format": 2}))
    with pytest.raises(UserError, match=newer(2, 1)):
        read_version_checksums(vdir)
    refused_alike(store.root, 2, 1)
    flip_bit(path, path.stat().st_size // 2, 0)  # the same record damaged: damage, as before
    with pytest.raises(DamagedData, match="is damaged"):
        read_version_checksums(vdir)


def test_a_newer_store_json_is_refused_and_repair_does_not_rebuild_it(store: Store) -> None:
    """Before: a sealed store.json of format version 3 was "use a pipeline release that writes this format", and
    `store repair` took it for damage and rebuilt it in format 2 (the newer release's record lost). An unsealed one
    claiming a later version is damage: every format after 1 seals it."""
    fill(store, 2)
    path = store.root / fmt.STORE_JSON
    rec = unseal(path.read_bytes())
    path.write_bytes(seal({**rec, "format_version": fmt.STORE_FORMAT_VERSION + 1}))
    refused_alike(store.root, fmt.STORE_FORMAT_VERSION + 1, fmt.STORE_FORMAT_VERSION)
    path.write_text(json.dumps({**rec, "format_version": fmt.STORE_FORMAT_VERSION + 1}))
    with pytest.raises(UserError, match="it is damaged: run `pipeline store repair"):
        Store(store.root, create=False)


def test_a_newer_store_json_at_a_url_says_so() -> None:
    """The remote's record, read by push, pull, gc and a cache open (before: "use a pipeline release that writes
    this format")."""
    from store.remote_sync import _parse_record

    record = seal({"format": fmt.STORE_FORMAT, "format_version": fmt.STORE_FORMAT_VERSION + 1, "tables": {}})
    with pytest.raises(UserError, match=f"^s3://b/p/store.json {newer(fmt.STORE_FORMAT_VERSION + 1, 2)}$"):
        _parse_record(record, "s3://b/p")


def test_a_remote_versions_checksums_record_of_a_newer_format_is_not_taken_apart() -> None:
    """Push and pull copy a version by its checksums.json: a newer one's files are not this code's to list (before:
    its entries read as format 1's, "does not list manifest.parquet; the version cannot be checked")."""
    from store.remote_sync import version_files

    record = seal({"format": 2, "objects": {fmt.MANIFEST: {"size": 10, "xxh3": "0"}}})
    with pytest.raises(UserError, match=newer(2, 1)):
        version_files(record, "s3://b/p/vae/v1/checksums.json")


def test_a_newer_schema_json_is_refused_when_its_checksum_holds(store: Store) -> None:
    """A schema.json of schema version 3 that checksums.json records as written: a newer release's version (before:
    verify recorded it as damaged, and named `store repair`). The same number in a schema.json whose bytes differ
    from the record (a flipped bit can make a 2 a 3) stays damage: verify names it and records it."""
    fill(store, 2)
    vdir = store.root / "vae" / "v1"
    schema, sums = vdir / fmt.SCHEMA_JSON, vdir / fmt.CHECKSUMS
    clean = schema.read_bytes()
    raised = json.dumps({**json.loads(clean), "schema_version": 3}).encode()
    rec = unseal(sums.read_bytes())
    rec["files"][fmt.SCHEMA_JSON] = {"nbytes": len(raised), "crc32c": crc_hex(raised)}
    schema.write_bytes(raised)
    sums.write_bytes(seal(rec))
    refused_alike(store.root, 3, 2)

    flipped = bytearray(clean)
    at = clean.index(b'"schema_version": 2') + len(b'"schema_version": ')
    flipped[at] ^= 1  # "2" -> "3"
    schema.write_bytes(bytes(flipped))
    sums.write_bytes(seal({**rec, "files": {**rec["files"], fmt.SCHEMA_JSON: {"nbytes": len(clean),
                                                                             "crc32c": crc_hex(clean)}}}))
    problems = verify_store(store.root, progress=False)
    assert any(fmt.SCHEMA_JSON in p and "damaged" in p for p in problems), problems
    assert fmt.damaged_marker(store.root, "vae", 1).is_file()


def test_a_folder_checksum_record_of_a_newer_format_is_not_called_damaged(tmp_path: Path) -> None:
    """A LoRA's (or checkpoint's) sealed checksums.json of a later format: its entries mean something this code
    does not know. Before: read as format 1's, "is damaged ... the file changed after it was written"."""
    from store.checksum import FOLDER_RECORD, check_recorded, file_crc

    folder = tmp_path / "lora"
    folder.mkdir()
    weights = folder / "pytorch_lora_weights.safetensors"
    weights.write_bytes(b"weights")
    crc, n = file_crc(weights)
    (folder / FOLDER_RECORD).write_bytes(seal({"format": 2, "files": {weights.name: {"size": n, "xxh3": crc}}}))
    before = weights.read_bytes()
    with pytest.raises(UserError, match=newer(2, 1)) as e:
        check_recorded(weights)
    assert "damaged" not in str(e.value) and weights.read_bytes() == before


def test_each_folder_record_is_read_up_to_its_own_format(tmp_path: Path, monkeypatch) -> None:
    """A checkpoint's resume.json and a LoRA's checksums.json each have their own format: a release that reads
    resume.json format 2 (and checksums.json format 1) checks a checkpoint's LoRA against its resume.json format 2.
    Before: both were read against the checksums format, and the LoRA was refused as a newer release's."""
    from schemas.record_formats import FOLDER_RECORDS, RESUME_JSON
    from store.checksum import check_recorded, file_crc

    monkeypatch.setitem(FOLDER_RECORDS, RESUME_JSON, 2)
    weights = tmp_path / "step-000002" / "lora" / "pytorch_lora_weights.safetensors"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"weights")
    crc, n = file_crc(weights)
    (tmp_path / "step-000002" / RESUME_JSON).write_bytes(
        seal({"format": 2, "files": {"lora/" + weights.name: {"nbytes": n, "crc32c": crc}}}))
    check_recorded(weights)  # intact, of a format this release reads
    weights.write_bytes(b"weighTs")
    with pytest.raises(UserError, match="is damaged"):
        check_recorded(weights)


def test_a_newer_version_at_a_url_is_refused_by_verify_pull_and_repair_alike(store: Store, tmp_path: Path) -> None:
    """The remote's copy of a version whose checksums.json a newer release wrote (before: verify named it damaged
    and advised `store repair`, which pulled it and called it unrepairable damage). Nothing on the remote changes."""
    from store.remote_pull import pull
    from store.remote_push import push

    fill(store, 3)
    remote = tmp_path / "remote"
    url = f"file://{remote}"
    push(str(store.root), url)
    path = remote / "vae" / "v1" / fmt.CHECKSUMS
    path.write_bytes(seal({**unseal(path.read_bytes()), "format": 2}))
    before = files(remote)
    with pytest.raises(UserError, match=f"^{url}/vae/v1/checksums.json {newer(2, 1)}$"):
        pull(url, tmp_path / "pulled")
    for command in (["store", "verify", url], ["store", "repair", url, "--cache-dir", str(tmp_path / "cache")]):
        res = runner.invoke(app, command)
        assert res.exit_code == 1 and "Traceback" not in res.output, res.output
        assert f"{url}/vae/v1/checksums.json was written by a newer version" in res.output, res.output
        assert "damaged" not in res.output, res.output
    assert files(remote) == before
