"""`pipeline store verify` finds a flipped byte anywhere; `pipeline store inspect` reports the store."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from store import Store, integrity
from store.verify import verify_store
from store_samples import fill

runner = CliRunner()


def verify(root: Path):
    return runner.invoke(app, ["store", "verify", str(root)])


def test_clean_store_verifies(store: Store) -> None:
    fill(store, 8)
    res = verify(store.root)
    assert res.exit_code == 0 and "ok:" in res.output


def test_flipped_byte_anywhere_in_a_shard_is_found(store: Store) -> None:
    fill(store, 8, shard_size_mb=0.02)
    shard = sorted((store.root / "vae" / "v1").glob("*.tar"))[0]
    clean = shard.read_bytes()
    # header block, safetensors header, tensor bytes, file bytes, tail padding: every position is covered.
    for pos in [0, 100, 600, 1100, len(clean) // 3, len(clean) // 2, len(clean) - 1]:
        bad = bytearray(clean)
        bad[pos] ^= 0x10
        shard.write_bytes(bytes(bad))
        res = verify(store.root)
        assert res.exit_code == 1, pos
        lines = [ln for ln in res.output.splitlines() if shard.name in ln]
        assert any("crc32c" in ln and "damaged" in ln for ln in lines), (pos, res.output)
    shard.write_bytes(clean)
    assert verify(store.root).exit_code == 0


def test_manifest_problems_one_line_each(store: Store) -> None:
    fill(store, 12)
    mpath = store.root / "vae" / "v1" / "manifest.parquet"
    m = pq.read_table(mpath)
    keys = m.column("key").to_pylist()
    keys[1] = keys[0]  # duplicate key
    rows = m.to_pylist()
    rows[2]["tensors"][0]["offset"] += 8  # row pointing at the wrong bytes
    rows[3]["img_shapes"] = [[1, 0, 4]]  # invalid img_shapes
    for r, k in zip(rows, keys):
        r["key"] = k
    pq.write_table(m.from_pylist(rows, schema=m.schema), mpath)
    untouched = set(m.column("shard").to_pylist()) - {r["shard"] for r in rows[:4]}
    (store.root / "vae" / "v1" / sorted(untouched)[0]).unlink()
    res = verify(store.root)
    assert res.exit_code == 1
    out = res.output
    assert "duplicate key" in out
    assert "disagree with the safetensors header" in out
    assert "img_shapes entry must be 3 positive ints" in out
    assert "shard file missing" in out


def test_inspect_text_and_json(store: Store) -> None:
    fill(store, 10)
    fill(store, 4, tag="b")
    store.add_quarantine([{"source": "x.png", "stage": "resize-bucket", "reason": "truncated image"}])
    res = runner.invoke(app, ["store", "inspect", str(store.root)])
    assert res.exit_code == 0
    assert "vae: current v2" in res.output and "10 samples" in res.output and "buckets:" in res.output
    assert "lineage: stage encode-vae, config cfg-b" in res.output
    info = json.loads(runner.invoke(app, ["store", "inspect", str(store.root), "--json"]).output)
    v1, v2 = info["tables"]["vae"]["versions"]
    assert (v1["samples"], v2["samples"], info["tables"]["vae"]["current"]) == (10, 4, 2)
    assert v1["bytes"] == sum(p.stat().st_size for p in (store.root / "vae" / "v1").glob("*.tar"))
    assert v1["splits"] == {"val": 2, "train": 8} and sum(v1["buckets"].values()) == 10
    assert v1["lineage"]["config_hash"] == "cfg-a"
    assert info["quarantine"] == {"rows": 1, "samples": 1, "by_reason": {"truncated image": 1}}


def test_cli_on_missing_store_is_one_red_line(tmp_path: Path) -> None:
    res = runner.invoke(app, ["store", "inspect", str(tmp_path / "none")])
    assert res.exit_code == 1 and "no store at" in res.output


def test_verify_of_a_missing_store_says_what_to_do(tmp_path: Path) -> None:
    """`store verify nostore` named the missing store.json and stopped there; `store inspect` says what to do."""
    res = verify(tmp_path / "nostore")
    lines = res.output.strip().splitlines()
    assert res.exit_code == 1 and len(lines) == 1, res.output
    assert f"no store at {tmp_path / 'nostore'}" in lines[0] and "check the path, or run a stage first" in lines[0]


def test_verify_never_crashes_on_a_flipped_manifest_byte(store: Store) -> None:
    """A deterministic sample of single-bit flips spread over every region of a small manifest.parquet (header,
    column chunks of strings and lists, footer, magic): each is reported as problem lines, never an exception
    (the campaign saw a UnicodeDecodeError traceback for 24 of ~124k flips)."""
    from damage import flip_bit
    from store import format as fmt
    from store.verify import verify_store

    fill(store, 4, shard_size_mb=1)
    path = store.root / "vae" / "v1" / "manifest.parquet"
    marker = fmt.damaged_marker(store.root, "vae", 1)
    clean = path.read_bytes()
    positions = sorted(set(range(0, len(clean), 23)) | set(range(len(clean) - 16, len(clean))))
    for pos in positions:
        flip_bit(path, pos, pos % 8)
        problems = verify_store(store.root, progress=False)  # raises nothing
        assert problems and all(isinstance(p, str) and "\n" not in p for p in problems), pos
        path.write_bytes(clean)
        marker.unlink(missing_ok=True)
    flip_bit(path, len(clean) // 2, 5)  # and once through the CLI: lines, exit 1, no traceback
    res = verify(store.root)
    assert res.exit_code == 1 and res.exception is None or isinstance(res.exception, SystemExit)
    assert "Traceback" not in res.output and "manifest.parquet" in res.output


def test_the_checksum_pass_has_a_bar_in_bytes(store: Store, capsys) -> None:
    """verify reads every byte of a version twice: once for each file's CRC32C, once per sample. The first pass
    (minutes for a 100 GB table) had no bar; it has one in bytes, with the version's total (so a rate and an
    ETA), and none with progress off."""
    from schemas.units import size_text
    from store import integrity
    from store.verify import verify_store

    fill(store, 8)
    total = sum(e["nbytes"] for e in integrity.read_version_checksums(store.root / "vae" / "v1").values())
    capsys.readouterr()
    assert verify_store(store.root) == []
    err = capsys.readouterr().err.replace("\r", "\n")
    last = [ln for ln in err.splitlines() if ln.startswith("checksum vae/v1: 100%")][-1]
    size = size_text(total)  # the summaries' own units (schemas/byte_bar.py)
    assert f"{size}/{size}" in last and "iB/s" in last, err
    assert verify_store(store.root, progress=False) == []
    assert "checksum" not in capsys.readouterr().err


@pytest.mark.parametrize("rows_per_pass", [200_000, 7])
def test_each_shard_is_checked_against_exactly_its_manifest_rows(store: Store, tmp_path: Path, monkeypatch,
                                                                 rows_per_pass: int) -> None:
    """verify's rows per shard (read a group of shards at a time, runs found on codes: store/verify_manifest.py)
    are the manifest's rows of that shard, in manifest order, the columns its checks read, keys checked first:
    duplicate and invalid keys named, rows of no shard (null) one group, an empty manifest no shard. Whether the
    manifest is read in one group or in many (`ROWS_PER_PASS` rows)."""
    import shutil

    import pyarrow as pa

    from store import verify_manifest
    from store.verify_manifest import checked_columns, read_manifest_pass

    monkeypatch.setattr(verify_manifest, "ROWS_PER_PASS", rows_per_pass)
    fill(store, 40, shard_size_mb=0.03)
    vdir = store.version_dir("vae", 1)
    m = pq.read_table(vdir / "manifest.parquet")
    keys, shards = m.column("key").to_pylist(), m.column("shard").to_pylist()
    assert 3 < len(set(shards)) < 40
    cases = {"dups": m.set_column(0, "key", pa.array([keys[0]] * 3 + ["a.b"] + keys[4:], pa.string())),
             "nulls": m.set_column(1, "shard", pa.array([None if i % 7 == 0 else s for i, s in enumerate(shards)])),
             "empty": m.slice(0, 0)}
    for name, t in cases.items():
        d = tmp_path / name
        shutil.copytree(vdir, d)
        (d / "checksums.json").unlink()
        pq.write_table(t, d / "manifest.parquet", row_group_size=9)  # several batches, as a large manifest
        problems, by_shard = read_manifest_pass(d, "vae/v1", None)
        rows = t.select(checked_columns(t.column_names)).to_pylist()
        want: dict[str, list] = {}
        for r in rows:
            want.setdefault(str(r["shard"]), []).append(r)
        assert {s: by_shard[s].rows.to_pylist() for s in by_shard} == want, name
        assert list(by_shard) == sorted(want), name
        named = [p for p in problems if "key" in p]
        assert named == (["vae/v1: duplicate key " + keys[0]] * 2 + ["vae/v1: invalid key 'a.b'"] if name == "dups"
                         else []), name


def test_verify_holds_a_group_of_shards_rows_at_a_time(store: Store, monkeypatch) -> None:
    """`store verify` held the whole manifest parsed (every column, then taken in shard order: ~2.6 GB at 1M
    samples). It now holds the rows of at most two groups of `ROWS_PER_PASS` rows (one shard at least), and only
    the columns its checks read (no caption or split), and still names damage in every group."""
    from store import verify_manifest
    from store.verify_manifest import read_manifest_pass

    monkeypatch.setattr(verify_manifest, "ROWS_PER_PASS", 6)
    fill(store, 40, shard_size_mb=0.004)
    vdir = store.version_dir("vae", 1)
    _, by_shard = read_manifest_pass(vdir, "vae/v1", integrity.read_version_checksums(vdir))
    m = pq.read_table(vdir / "manifest.parquet")
    biggest = max(Counter(m.column("shard").to_pylist()).values())
    assert by_shard.passes >= 3
    held_most = 0
    for shard in by_shard:
        part = by_shard[shard]
        assert "caption" not in part.rows.column_names and "split" not in part.rows.column_names
        held_most = max(held_most, sum(len(p) for g in by_shard._held.values() for p in g.values()))
    assert 0 < held_most <= 2 * max(6, biggest)
    # damage in the first and the last group is found, one line each
    first, last = sorted(by_shard)[0], sorted(by_shard)[-1]
    rows = m.to_pylist()
    hit = {}
    for r in rows:
        if r["shard"] in (first, last) and r["shard"] not in hit:
            r["tensors"][0]["offset"] += 8
            hit[r["shard"]] = r["key"]
    pq.write_table(m.from_pylist(rows, schema=m.schema), vdir / "manifest.parquet")
    (vdir / "checksums.json").unlink()
    problems = verify_store(store.root, progress=False)
    for shard, key in hit.items():
        assert any(shard in p and key in p and "disagree with the safetensors header" in p for p in problems), \
            (shard, problems)


@pytest.mark.parametrize("damage", [b"{garbage", b"", b"\xff\xfe"])
def test_a_store_json_that_is_no_json_names_the_repair_that_rebuilds_it(store: Store, damage: bytes) -> None:
    """A store.json cut or overwritten into no JSON at all was one line without what to do (a seal that fails
    names `pipeline store repair`, which rebuilds the record); every command that opens the store says it now."""
    fill(store, 3)
    (store.root / "store.json").write_bytes(damage)
    for command in ("inspect", "gc"):
        res = runner.invoke(app, ["store", command, str(store.root)])
        assert res.exit_code == 1 and f"run `pipeline store repair {store.root}`" in res.output, res.output
    assert runner.invoke(app, ["store", "repair", str(store.root)]).exit_code == 0
    assert verify(store.root).exit_code == 0
