"""A schema-v1 store written by hand (pyarrow + tarfile + stdlib only, following docs/store-format.md) is read
with derived img_shapes and a hint, then migrated to v2: hard links, verify, idempotent, kill-safe at every step.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import random
import shutil
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from pipeline.cli import app
from store import Store

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]

# (key, target h, w in pixels, control h, w or None)
SAMPLES = [("k%02d" % i, 64 + 32 * (i % 3), 96 - 16 * (i % 2), (128, 64) if i % 2 else None) for i in range(7)]


def bf16_bits(n: int, seed: int) -> bytes:
    """n raw bf16 values (finite: the exponent never all ones), little-endian."""
    rng = random.Random(seed)
    return b"".join(struct.pack("<H", (rng.randrange(2) << 15) | (rng.randrange(1, 0xFF) << 7) | rng.randrange(128))
                    for _ in range(n))


def safetensors_bytes(name: str, shape: list[int], data: bytes) -> bytes:
    header = json.dumps({name: {"dtype": "BF16", "shape": shape, "data_offsets": [0, len(data)]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data


def write_v1_store(root: Path, shards: int = 2) -> None:
    vdir = root / "vae" / "v1"
    vdir.mkdir(parents=True)
    (root / "store.json").write_text(json.dumps(
        {"format": "qwen-edit-feature-store", "format_version": 1, "tables": {"vae": {"current": 1}}}))
    (vdir / "schema.json").write_text(json.dumps({
        "table": "vae", "schema_version": 1,
        "fields": [{"name": "target", "kind": "tensor", "dtype": "bfloat16", "rank": 4, "optional": False}],
        "lineage": {"stage": "encode-vae", "config_hash": "old", "model_fingerprint": "m", "upstream": {"images": 1},
                    "code_version": "0.0.9"},
        "attrs": {},
    }))
    rows = []
    per_shard = -(-len(SAMPLES) // shards)
    for s in range(shards):
        name = f"shard-r00-{s:06d}.tar"
        chunk = SAMPLES[s * per_shard : (s + 1) * per_shard]
        placed = []
        with tarfile.open(vdir / name, "w", format=tarfile.USTAR_FORMAT) as tar:
            for key, h, w, ctrl in chunk:
                shape = [4, 1, h // 8, w // 8]
                data = bf16_bits(4 * (h // 8) * (w // 8), seed=h * w + len(placed))
                meta = {"height": h, "width": w, "control_height": ctrl[0] if ctrl else None,
                        "control_width": ctrl[1] if ctrl else None, "split": "train"}
                members = [(f"{key}.safetensors", safetensors_bytes("target", shape, data)),
                           (f"{key}.json", json.dumps(meta).encode())]
                start = tar.offset  # USTAR: each member = one 512-byte header, then its data padded to 512
                for mname, blob in members:
                    info = tarfile.TarInfo(mname)
                    info.size = len(blob)
                    tar.addfile(info, io.BytesIO(blob))
                hlen = struct.unpack("<Q", members[0][1][:8])[0]
                placed.append((key, meta, start, tar.offset, {
                    "name": "target", "offset": start + 512 + 8 + hlen, "nbytes": len(data),
                    "dtype": "bfloat16", "shape": shape}))
        raw = (vdir / name).read_bytes()
        for key, meta, start, end, tensor in placed:
            rows.append({"key": key, "shard": name, "shard_sha256": hashlib.sha256(raw).hexdigest(),
                         "shard_nbytes": len(raw), "sample_offset": start, "sample_nbytes": end - start,
                         "sample_sha256": hashlib.sha256(raw[start:end]).hexdigest(), "tensors": [tensor],
                         "files": [], **meta})
    rows.sort(key=lambda r: r["key"])
    pq.write_table(pa.Table.from_pylist(rows), vdir / "manifest.parquet")


@pytest.fixture
def v1_store(tmp_path: Path) -> Path:
    root = tmp_path / "v1store"
    write_v1_store(root)
    return root


def test_reader_derives_img_shapes_for_v1_with_a_hint(v1_store: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="store"):
        r = Store(v1_store).reader("vae")
    hints = [rec.getMessage() for rec in caplog.records]
    assert len(hints) == 1 and "pipeline migrate v1-to-v2" in hints[0]
    for key, h, w, ctrl in SAMPLES:
        want = [(1, h // 16, w // 16)] + ([(1, ctrl[0] // 16, ctrl[1] // 16)] if ctrl else [])
        assert r.img_shapes(key) == want and r.meta(key)["img_shapes"] == [list(s) for s in want]
        t = r.tensors(key)["target"]
        assert t.dtype == torch.bfloat16 and t.shape == (4, 1, h // 8, w // 8)
    assert runner.invoke(app, ["store", "verify", str(v1_store)]).exit_code == 0


def test_migrate_links_verifies_switches_and_is_idempotent(v1_store: Path) -> None:
    before = {k: Store(v1_store).reader("vae").tensors(k)["target"].clone() for k, *_ in SAMPLES}
    dry = runner.invoke(app, ["migrate", "v1-to-v2", str(v1_store), "--dry-run"])
    assert dry.exit_code == 0 and "v1 (schema v1) -> v2 (schema v2)" in dry.output and "dry run" in dry.output
    assert Store(v1_store).tables() == {"vae": 1}
    res = runner.invoke(app, ["migrate", "v1-to-v2", str(v1_store)])
    assert res.exit_code == 0, res.output
    st = Store(v1_store)
    assert st.tables() == {"vae": 2}
    r = st.reader("vae")
    assert r.schema.schema_version == 2 and r.schema.attrs["migrated_from"] == 1
    for old in (v1_store / "vae" / "v1").glob("*.tar"):  # same inode: tensors not copied
        assert os.stat(old).st_ino == os.stat(v1_store / "vae" / "v2" / old.name).st_ino
    for key, h, w, ctrl in SAMPLES:
        want = [[1, h // 16, w // 16]] + ([[1, ctrl[0] // 16, ctrl[1] // 16]] if ctrl else [])
        assert r.manifest.column("img_shapes")[r.keys().index(key)].as_py() == want
        assert torch.equal(r.tensors(key)["target"].view(torch.int16), before[key].view(torch.int16))
    assert r.schema.lineage == st.reader("vae", version=1).schema.lineage
    # inspect's counts recorded for the migrated version (v1, handwritten, has none): the buckets the v1 height /
    # width columns give, now from img_shapes
    from store.inspect import describe
    from store.integrity import read_version_record

    assert read_version_record(v1_store / "vae" / "v2")["counts"]["samples"] == len(SAMPLES)
    v1, v2 = describe(v1_store)["tables"]["vae"]["versions"]
    assert {k: v2[k] for k in ("samples", "shards", "bytes", "buckets")} == \
        {k: v1[k] for k in ("samples", "shards", "bytes", "buckets")}
    again = runner.invoke(app, ["migrate", "v1-to-v2", str(v1_store)])
    assert again.exit_code == 0 and "nothing to do" in again.output
    assert runner.invoke(app, ["store", "verify", str(v1_store)]).exit_code == 0


KILL_SCRIPT = "import sys; from store.migrate import migrate_v1_to_v2; migrate_v1_to_v2(__import__('pathlib').Path(sys.argv[1]))"


@pytest.mark.parametrize("point", ["migrate_after_links", "migrate_before_rename", "migrate_after_rename",
                                   "migrate_before_switch", "migrate_after_switch"])
def test_kill_during_migration_leaves_a_valid_store(tmp_path: Path, point: str) -> None:
    root = tmp_path / "s"
    write_v1_store(root)
    env = {**os.environ, "STORE_CRASH_AT": point}
    res = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(root)], env=env, cwd=REPO, capture_output=True)
    assert res.returncode == -9, res.stderr.decode()
    check = runner.invoke(app, ["store", "verify", str(root)])
    assert check.exit_code == 0, check.output
    current = Store(root).tables()["vae"]
    assert current == (2 if point == "migrate_after_switch" else 1)
    assert len(Store(root).reader("vae")) == len(SAMPLES)
    res = runner.invoke(app, ["migrate", "v1-to-v2", str(root)])
    assert res.exit_code == 0, res.output
    assert Store(root).tables() == {"vae": 2} and not list((root / "vae").glob("*.migrating"))
    assert sorted(p.name for p in (root / "vae").iterdir() if not p.name.startswith(".")) == ["v1", "v2"]
    assert runner.invoke(app, ["store", "verify", str(root)]).exit_code == 0
    shutil.rmtree(root)


def test_a_finished_migration_whose_schema_fails_its_checksum_is_built_again(v1_store: Path) -> None:
    """A migration killed after its version was renamed into place (store.json still names v1), then a bit of
    that version's schema.json flipped that still parses. Read unchecked, it was taken as the finished migration
    and refused by its verify on every rerun ("failed verification"); checked, it is recorded as damaged and the
    migration is built again."""
    from damage import flip_bit
    from store import format as fmt

    assert runner.invoke(app, ["migrate", "v1-to-v2", str(v1_store)]).exit_code == 0
    Store(v1_store).set_current("vae", 1)  # as a kill at migrate_before_switch leaves it
    path = v1_store / "vae" / "v2" / fmt.SCHEMA_JSON
    flip_bit(path, path.read_bytes().index(b'"old"') + 3, 0)  # config_hash "old" -> "ole"
    res = runner.invoke(app, ["migrate", "v1-to-v2", str(v1_store)])
    assert res.exit_code == 0, res.output
    assert Store(v1_store).tables() == {"vae": 3} and fmt.damaged_marker(v1_store, "vae", 2).is_file()
    assert Store(v1_store).reader("vae").schema.lineage.config_hash == "old"


def test_a_current_version_whose_schema_version_was_flipped_to_1_is_not_migrated(v1_store: Path) -> None:
    """A current schema-v2 version whose schema.json reads "schema_version": 1 after one damaged byte: read
    unchecked, the plan migrated it (a new version vouching for the damaged schema's other bytes); checked, it is
    skipped (its stage's rerun writes a new version), and a dry run records nothing."""
    from store import format as fmt

    assert runner.invoke(app, ["migrate", "v1-to-v2", str(v1_store)]).exit_code == 0
    path = v1_store / "vae" / "v2" / fmt.SCHEMA_JSON
    data = path.read_bytes()
    path.write_bytes(data.replace(b'"schema_version": 2', b'"schema_version": 1'))
    assert path.read_bytes() != data
    dry = runner.invoke(app, ["migrate", "v1-to-v2", str(v1_store), "--dry-run"])
    assert dry.exit_code == 0 and "nothing to do" in dry.output, dry.output
    assert not fmt.damaged_marker(v1_store, "vae", 2).exists()
    res = runner.invoke(app, ["migrate", "v1-to-v2", str(v1_store)])
    assert res.exit_code == 0 and "nothing to do" in res.output, res.output
    assert Store(v1_store).tables() == {"vae": 2} and fmt.damaged_marker(v1_store, "vae", 2).is_file()
