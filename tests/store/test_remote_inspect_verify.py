"""`pipeline store inspect|verify s3://...` against the S3 test server: inspect says what a local inspect of the same
store says (from the metadata alone: no shard is fetched); verify streams every object of every version once, writes
nothing to the cache, and names a damaged object (and its damaged sample) on the remote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from store import Store
from store.remote_push import push
from store_samples import fill, push_every_version

runner = CliRunner()


def _two_versions(store: Store) -> Store:
    fill(store, 10, tag="a")
    fill(store, 6, tag="b", start=20)
    return store


def test_inspect_of_a_url_matches_the_local_store_and_fetches_no_shard(s3_env, store: Store, monkeypatch) -> None:
    from store import remote as remote_mod

    _two_versions(store)
    push_every_version(store, s3_env.url())
    read: list[str] = []
    real_read = remote_mod.Remote.read
    monkeypatch.setattr(remote_mod.Remote, "read",
                        lambda self, rel, small=False: read.append(rel) or real_read(self, rel, small))
    monkeypatch.setattr(remote_mod.Remote, "download", lambda *a: pytest.fail("inspect downloaded a file"))
    remote = runner.invoke(app, ["store", "inspect", s3_env.url(), "--json"])
    assert remote.exit_code == 0, remote.output
    local = runner.invoke(app, ["store", "inspect", str(store.root), "--json"])
    assert local.exit_code == 0, local.output
    a, b = json.loads(remote.stdout), json.loads(local.stdout)  # the bar on stderr
    # the manifests fetched (tens of MB each at a million samples): a bar in bytes, its total the listed sizes
    assert f"inspect {s3_env.url()}: metadata: 100%" in remote.stderr and "B/s" in remote.stderr, remote.stderr
    assert a.pop("store") == s3_env.url() and b.pop("store") == str(store.root)
    assert a == b and [v["samples"] for v in a["tables"]["vae"]["versions"]] == [10, 6]
    assert read and not any(r.endswith(".tar") for r in read)

    text = runner.invoke(app, ["store", "inspect", s3_env.url()])
    assert text.exit_code == 0 and "vae" in text.output


def _fetched(monkeypatch) -> list[tuple[str, int]]:
    """(object, bytes) of every read the code under test makes of a Remote, from now on."""
    from store import remote as remote_mod

    out: list[tuple[str, int]] = []
    real_read = remote_mod.Remote.read

    def read(self, rel, small=False):
        data = real_read(self, rel, small)
        out.append((rel, len(data)))
        return data

    monkeypatch.setattr(remote_mod.Remote, "read", read)
    monkeypatch.setattr(remote_mod.Remote, "download", lambda *a: pytest.fail("inspect downloaded a file"))
    return out


def test_inspect_of_a_url_fetches_no_manifest_whose_counts_are_recorded(s3_env, store: Store, monkeypatch) -> None:
    """A version whose checksums.json records its counts: its manifest (~140 MB at a million samples) is not fetched,
    only its listed size compared with the sealed one (a cut-short manifest is named); a version sealed before the
    record has its manifest fetched and counted, the same numbers either way."""
    from store.checksum import seal
    from store.integrity import read_version_record

    _two_versions(store)
    old = store.version_dir("vae", 1)  # as committed before counts were recorded (pushed so)
    record = read_version_record(old)
    del record["counts"]
    (old / "checksums.json").write_bytes(seal(record))
    push_every_version(store, s3_env.url())
    local = json.loads(runner.invoke(app, ["store", "inspect", str(store.root), "--json"]).stdout)
    fetched = _fetched(monkeypatch)
    res = runner.invoke(app, ["store", "inspect", s3_env.url(), "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    assert got.pop("store") == s3_env.url() and local.pop("store") == str(store.root)
    assert got == local and [v["samples"] for v in got["tables"]["vae"]["versions"]] == [10, 6]
    names = [rel for rel, _ in fetched]
    assert "vae/v1/manifest.parquet" in names and "vae/v2/manifest.parquet" not in names, names
    assert "vae/v2/checksums.json" in names and "vae/v2/schema.json" in names
    assert f"inspect {s3_env.url()}: metadata: 100%" in res.stderr, res.stderr  # the bar's total what was fetched

    # a manifest cut short on the server: that version marked damaged, the object named by its URL, the other
    # version still described (as a local inspect does with a damaged manifest)
    client = s3_env.client()
    key = "store/vae/v2/manifest.parquet"
    data = client.get_object(Bucket=s3_env.bucket, Key=key)["Body"].read()
    client.put_object(Bucket=s3_env.bucket, Key=key, Body=data[:-100])
    res = runner.invoke(app, ["store", "inspect", s3_env.url()])
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    assert f"* v2: damaged: {s3_env.url()}/vae/v2/manifest.parquet is damaged ({len(data) - 100} bytes listed, " \
        f"{len(data)} sealed)" in res.output, res.output
    assert "  v1: schema v" in res.output and "10 samples" in res.output, res.output
    res = runner.invoke(app, ["store", "inspect", s3_env.url(), "--json"])
    versions = json.loads(res.stdout)["tables"]["vae"]["versions"]
    assert versions[0] == local["tables"]["vae"]["versions"][0] and "damaged" in versions[1], versions


def test_inspect_of_a_url_marks_each_damaged_version_and_describes_the_rest(s3_env, store: Store) -> None:
    """A flipped bit in a fetched manifest (a version without recorded counts), in a schema.json, in a
    checksums.json's seal: each version named damaged with its object, as a local inspect names it; none stops the
    report."""
    from store.checksum import seal
    from store.integrity import read_version_record

    fill(store, 10, tag="a")
    fill(store, 6, tag="b", start=20)
    fill(store, 4, tag="c", start=40)
    fill(store, 3, tag="d", start=60)
    old = store.version_dir("vae", 1)  # its manifest fetched and counted
    record = read_version_record(old)
    del record["counts"]
    (old / "checksums.json").write_bytes(seal(record))
    push_every_version(store, s3_env.url())
    _flip(s3_env, "store/vae/v1/manifest.parquet")
    _flip(s3_env, "store/vae/v2/schema.json")
    _flip(s3_env, "store/vae/v3/checksums.json")
    res = runner.invoke(app, ["store", "inspect", s3_env.url(), "--json"])
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    versions = json.loads(res.stdout)["tables"]["vae"]["versions"]
    for v, name in zip(versions, ("manifest.parquet", "schema.json", "checksums.json")):
        assert v.get("damaged", "").startswith(f"{s3_env.url()}/vae/v{v['version']}/{name} is damaged ("), versions
    assert versions[3]["samples"] == 3 and "damaged" not in versions[3], versions


def _flip(s3_env, key: str, at: int | None = None) -> None:
    client = s3_env.client()
    data = bytearray(client.get_object(Bucket=s3_env.bucket, Key=key)["Body"].read())
    data[len(data) // 2 if at is None else at] ^= 0x01
    client.put_object(Bucket=s3_env.bucket, Key=key, Body=bytes(data))


def test_verify_of_a_url_streams_every_object_and_caches_nothing(s3_env, store: Store, tmp_path: Path,
                                                                   monkeypatch) -> None:
    from store import remote_cache
    from store import remote as remote_mod

    _two_versions(store)
    push_every_version(store, s3_env.url())
    # verify reads where the store lies: no cache, no download to a file (1M samples would be terabytes on disk)
    monkeypatch.setattr(remote_cache, "local_store", lambda *a, **k: pytest.fail("verify opened the cache"))
    monkeypatch.setattr(remote_mod.Remote, "download", lambda *a: pytest.fail("verify downloaded a file"))
    cache = tmp_path / "cache"
    res = runner.invoke(app, ["store", "verify", s3_env.url(), "--cache-dir", str(cache)])
    assert res.exit_code == 0, res.output
    assert f"ok: {s3_env.url()} verified" in res.output
    assert not cache.exists()

    # a flipped byte in a shard of v1 (not current) and in a shard index of v2 on the server: both named, the
    # shard's damaged sample by its key, exit 1, still nothing written under the cache
    client = s3_env.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=s3_env.bucket)["Contents"]]
    shard = next(k for k in keys if k.startswith("store/vae/v1/") and k.endswith(".tar"))
    index = next(k for k in keys if k.startswith("store/vae/v2/") and k.endswith(".index.parquet"))
    _flip(s3_env, shard)
    _flip(s3_env, index)
    client.put_object(Bucket=s3_env.bucket, Key="store/vae/v2/stray.bin", Body=b"x")
    res = runner.invoke(app, ["store", "verify", s3_env.url(), "--cache-dir", str(cache)])
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    rel_shard, rel_index = shard.split("/", 1)[1], index.split("/", 1)[1]
    assert any(rel_shard in ln and "the file is damaged" in ln for ln in lines), res.output
    assert any(rel_shard in ln and "key " in ln and "sample bytes are damaged" in ln for ln in lines), res.output
    assert any(rel_index in ln and "the file is damaged" in ln for ln in lines), res.output
    assert any("vae/v2/stray.bin: not listed in checksums.json" in ln for ln in lines), res.output
    assert "store gc" in lines[-1] and "store repair" in lines[-1]  # v1 is old, v2 current
    assert not cache.exists()


def test_inspect_and_verify_of_an_empty_prefix_are_one_line(s3_env, tmp_path: Path) -> None:
    for args in (["inspect", s3_env.url("nothing")],
                 ["verify", s3_env.url("nothing"), "--cache-dir", str(tmp_path / "c")]):
        res = runner.invoke(app, ["store", *args])
        assert res.exit_code == 1 and "Traceback" not in res.output
        assert f"no store at {s3_env.url('nothing')}" in res.output


@pytest.mark.parametrize("rows_per_pass", [200_000, 3])
def test_verify_of_a_file_url_streams_it_too(store: Store, tmp_path: Path, monkeypatch, rows_per_pass: int) -> None:
    """A `file://` URL (a shared file system) goes the same way: each file read once where it lies, each shard's
    manifest rows checked against its bytes, also when the manifest is read a few shards' rows at a time (its
    threads asking for shards of two groups at once: store/verify_manifest.py)."""
    from store import verify_manifest

    monkeypatch.setattr(verify_manifest, "ROWS_PER_PASS", rows_per_pass)
    fill(store, 10)
    url = f"file://{tmp_path / 'remote'}"
    push(store.root, url)
    res = runner.invoke(app, ["store", "verify", url])
    assert res.exit_code == 0 and f"ok: {url} verified" in res.output, res.output
    shard = sorted((tmp_path / "remote" / "vae" / "v1").glob("*.tar"))[-1]
    data = bytearray(shard.read_bytes())
    data[-1024 - 3] ^= 0x10  # inside the last sample's bytes (before the tar's two zero end blocks)
    shard.write_bytes(bytes(data))
    res = runner.invoke(app, ["store", "verify", url])
    assert res.exit_code == 1 and f"vae/v1/{shard.name}: crc32c" in res.output, res.output
    shard.write_bytes(bytes(data[:700]) + bytes([data[700] ^ 0x10]) + bytes(data[701:]))  # the first sample's bytes
    res = runner.invoke(app, ["store", "verify", url])
    assert res.exit_code == 1 and f"vae/v1/{shard.name}: key " in res.output, res.output


def test_verify_of_a_url_counts_bytes_in_1024s_as_the_local_one(store: Store, tmp_path: Path, monkeypatch) -> None:
    """Every byte bar of `store verify URL` is the package's byte bar (schemas/byte_bar.py: KiB / MiB, as the local
    verify's): before, the URL's counted in 1000s, so the same version showed other figures on the two."""
    import tqdm

    from schemas.byte_bar import BAR_FORMAT
    from store.remote_verify import verify_url

    fill(store, 10)
    url = f"file://{tmp_path / 'remote'}"
    push(store.root, url)
    formats = []
    real = tqdm.tqdm.__init__

    def record(self, *a, **kw):
        if kw.get("unit") == "B":
            formats.append(kw.get("bar_format"))
        real(self, *a, **kw)

    monkeypatch.setattr(tqdm.tqdm, "__init__", record)
    assert verify_url(url, progress=True)[0] == []
    assert formats and set(formats) == {BAR_FORMAT}, formats


def test_verify_that_loses_the_server_says_so_in_one_line_not_as_damage(s3_env, store: Store, monkeypatch) -> None:
    """The connection is lost while verify streams the objects: one line naming the URL and what to do (exit 1), not
    a problem line per object nor advice to repair a store nothing is known to be wrong with."""
    from store import remote_verify

    fill(store, 12, shard_size_mb=0.02)
    push(store.root, s3_env.url())
    real, calls = remote_verify.RemoteObjects._stream, []

    def reset_after_two(self, *args):
        calls.append(args[0])
        if len(calls) > 2:  # as botocore reports a reset connection once its retries are spent
            raise ConnectionResetError("connection reset by peer")
        return real(self, *args)

    monkeypatch.setattr(remote_verify.RemoteObjects, "_stream", reset_after_two)
    res = runner.invoke(app, ["store", "verify", s3_env.url()])
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    lines = [ln for ln in res.output.replace("\r", "\n").splitlines() if ln.strip() and "verify vae" not in ln]
    assert len(lines) == 1 and f"lost the connection to {s3_env.url()}" in lines[0], res.output
    assert "store repair" not in res.output


def test_counts_that_are_not_the_manifests_at_a_url_are_repaired_as_verify_advises(s3_env, store: Store,
                                                                                    tmp_path: Path) -> None:
    """A version pushed with counts its manifest does not have (a writer's bug): verify URL names them and advises
    `store repair URL`, which writes the version again (nothing recomputed); then verify passes. The rerun advised
    before found the version up to date, so verify failed on every run."""
    from store.checksum import seal
    from store.integrity import read_version_record

    fill(store, 10, tag="a")
    vdir = store.version_dir("vae", 1)
    record = read_version_record(vdir)
    record["counts"]["samples"] = 93
    (vdir / "checksums.json").write_bytes(seal(record))
    url = s3_env.url()
    push(store.root, url)
    res = runner.invoke(app, ["store", "verify", url])
    assert res.exit_code == 1 and "samples 93 recorded, 10 counted" in res.output, res.output
    assert f"run `pipeline store repair {url}`" in res.output and "rerun" not in res.output, res.output
    res = runner.invoke(app, ["store", "repair", url, "--cache-dir", str(tmp_path / "work")])
    assert res.exit_code == 0 and "vae: v1 repaired as v2 (0 recomputed" in res.output, res.output
    res = runner.invoke(app, ["store", "verify", url])
    assert res.exit_code == 0, res.output
    info = json.loads(runner.invoke(app, ["store", "inspect", url, "--json"]).stdout)
    assert info["tables"]["vae"]["current"] == 2 and [v["samples"] for v in info["tables"]["vae"]["versions"]] == [10]


def test_inspects_bar_of_a_url_ends_at_its_total_when_a_damaged_version_is_skipped(s3_env, store: Store,
                                                                                  monkeypatch) -> None:
    """v2's checksums.json seal broken: its schema.json and manifest are never fetched. Before, the bar's total
    still counted them and it stopped below 100 %; now the total is what was fetched (as for a manifest whose
    counts are recorded, left at the URL), and the bar ends there."""
    from store import remote_view

    _two_versions(store)
    push_every_version(store, s3_env.url())
    _flip(s3_env, "store/vae/v2/checksums.json")
    bars = []
    real = remote_view.byte_bar
    monkeypatch.setattr(remote_view, "byte_bar", lambda *a, **kw: bars.append(real(*a, **kw)) or bars[-1])
    res = runner.invoke(app, ["store", "inspect", s3_env.url(), "--json"])
    assert res.exit_code == 0 and "damaged" in json.loads(res.stdout)["tables"]["vae"]["versions"][1], res.output
    fetched = sum((store.version_dir("vae", v) / name).stat().st_size
                  for v, name in ((1, "checksums.json"), (1, "schema.json"), (2, "checksums.json")))
    [bar] = bars
    assert (bar.n, bar.total) == (fetched, fetched)


def test_inspect_of_a_url_marks_a_version_whose_object_was_deleted_and_describes_the_rest(s3_env,
                                                                                       store: Store) -> None:
    """An object a version's checksums.json lists, deleted behind the tool's back (a schema.json; a checksums.json
    while its manifest is there): that version named damaged with the object's line, the others described, as a
    local inspect does with a missing file. Before, the one lost object stopped the whole report."""
    fill(store, 10, tag="a")
    fill(store, 6, tag="b", start=20)
    fill(store, 4, tag="c", start=40)
    push_every_version(store, s3_env.url())
    client = s3_env.client()
    client.delete_object(Bucket=s3_env.bucket, Key="store/vae/v1/schema.json")
    client.delete_object(Bucket=s3_env.bucket, Key="store/vae/v2/checksums.json")
    res = runner.invoke(app, ["store", "inspect", s3_env.url(), "--json"])
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    versions = json.loads(res.stdout)["tables"]["vae"]["versions"]
    assert versions[0].get("damaged", "").startswith(f"{s3_env.url()}/vae/v1/schema.json is missing"), versions
    assert versions[1].get("damaged", "").startswith(f"{s3_env.url()}/vae/v2/checksums.json is missing"), versions
    assert versions[2]["samples"] == 4 and "damaged" not in versions[2], versions
