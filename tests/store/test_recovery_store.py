"""Recovery gaps of issue 22 point 6 on the store: a shard with bytes appended (every sample intact) is repaired,
`store gc --dry-run` works on a read-only store, and a killed write's `.store.json.tmp-*` in the store root is
reported by verify and removed by repair."""

from __future__ import annotations

import os

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


def test_a_store_json_temp_file_left_by_a_kill_is_reported_and_removed(store: Store) -> None:
    fill(store, 2)
    litter = store.root / ".store.json.tmp-999999999"  # no such process
    litter.write_text("{")
    r = _cli("store", "verify", store.root)
    assert r.exit_code == 1 and litter.name in r.output
    r = _cli("store", "repair", store.root)
    assert r.exit_code == 0 and not litter.exists(), r.output
    assert _cli("store", "verify", store.root).exit_code == 0
