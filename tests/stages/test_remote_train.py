"""A store pushed to the S3 test server and pulled back trains exactly as the original (same LoRA, bit for bit)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.lora import read_lora
from pipeline.config import load_config
from stages.train.recipe import run
from store.remote_pull import pull
from store.remote_push import push
from train_store import make_train_store, mixed_specs

CFG = {"train.device": "cpu", "train.batch_size": 2, "train.learning_rate": 2e-3, "train.lora.rank": 4,
       "train.max_steps": 3, "train.warmup_steps": 1}


def test_pulled_store_trains_the_same_lora(s3_env, tiny_edit_model, tmp_path: Path) -> None:
    local = tmp_path / "store"
    make_train_store(local, tiny_edit_model, mixed_specs(6, 2, masks=True))
    push(local, s3_env.url("features"))
    pulled = tmp_path / "pulled"
    summary = pull(s3_env.url("features"), pulled)
    assert sorted(summary.copied) == ["text/v1", "vae/v1"]

    cfg = load_config(None, CFG)
    run(cfg, local, tiny_edit_model, tmp_path / "run-local")
    run(cfg, pulled, tiny_edit_model, tmp_path / "run-pulled")
    a, b = read_lora(tmp_path / "run-local" / "lora")[0], read_lora(tmp_path / "run-pulled" / "lora")[0]
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_train_reads_a_store_url_through_a_cache_smaller_than_the_store(s3_env, tiny_edit_model,
                                                                       tmp_path: Path) -> None:
    """The cache holds the versions' metadata and a few shards; the training reads every shard, evicting the least
    recently used ones as it goes, stays under the limit and trains the LoRA the local store trains."""
    from typer.testing import CliRunner

    from pipeline.cli import app
    from schemas.errors import UserError
    from store import format as fmt
    from store.remote_cache import local_store
    from store.remote_shards import fetch_stats

    local = tmp_path / "store"
    make_train_store(local, tiny_edit_model, mixed_specs(6, 2, masks=True), shard_size_mb=0.004)
    push(local, s3_env.url("features"))
    shards = [p.stat().st_size for p in local.rglob("*") if fmt.SHARD_RE.fullmatch(p.name)]
    cache = tmp_path / "cache"
    local_store(s3_env.url("features"), ["text", "vae"], cache)  # metadata only
    metadata = _bytes(cache)
    limit = metadata + 3 * max(shards) + 4096  # room for three shards (and the run's read lease)
    assert len(shards) > 3 and metadata + sum(shards) > limit
    args = ["run", "train", "--model", tiny_edit_model, "--device", "cpu", "--batch-size", "2", "--max-steps", "3",
            "-s", "train.learning_rate=2e-3", "-s", "train.lora.rank=4", "-s", "train.warmup_steps=1"]
    fetched = fetch_stats()["shards"]
    res = CliRunner().invoke(app, [*args, "--store", s3_env.url("features"), "--out", str(tmp_path / "run-url"),
                                   "--cache-dir", str(cache), "--cache-gb", str(limit / 1e9)])
    assert res.exit_code == 0, res.output
    assert _bytes(cache) <= limit
    cached_now = [p for p in cache.rglob("*") if fmt.SHARD_RE.fullmatch(p.name)]
    assert fetch_stats()["shards"] - fetched > len(cached_now)  # shards were fetched whole and evicted meanwhile
    res = CliRunner().invoke(app, [*args, "--store", str(local), "--out", str(tmp_path / "run-local")])
    assert res.exit_code == 0, res.output
    a, b = read_lora(tmp_path / "run-local" / "lora")[0], read_lora(tmp_path / "run-url" / "lora")[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # a second store URL whose metadata does not fit beside the first's: the versions nobody uses are evicted
    (cached,) = [p for p in cache.iterdir() if p.is_dir()]
    push(local, s3_env.url("other"))
    other = local_store(s3_env.url("other"), ["text", "vae"], cache, limit_gb=metadata * 1.5 / 1e9)
    assert Store_versions(other) == {"text": [1], "vae": [1]}  # in use: kept
    left = Store_versions(cached)
    assert left["text"] == [] or left["vae"] == []  # the older store's versions went first
    assert _bytes(cache) <= metadata * 1.5
    # the first one is opened again (checked) when used next
    assert Store_versions(local_store(s3_env.url("features"), ["vae"], cache, limit_gb=10))["vae"] == [1]
    # the metadata of the versions in use cannot fit: one line naming the cache and the limit
    with pytest.raises(UserError, match="over its limit"):
        local_store(s3_env.url("features"), ["text", "vae"], cache, limit_gb=metadata * 0.5 / 1e9)


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def Store_versions(root: Path) -> dict[str, list[int]]:
    from store import format as fmt

    return {t: fmt.list_versions(root, t) for t in ("text", "vae")}


def test_a_full_cache_disk_is_one_line_and_shows_nothing(s3_env, tiny_edit_model, tmp_path: Path, monkeypatch) -> None:
    """On open (a version's metadata): one line, no partial file, naming --cache-gb (before, only "free space and
    rerun": without a limit the rerun fills the disk at the same point). On a read (a shard fetched whole): the
    samples are read by byte range instead (tests/store/test_remote_cache_leftovers.py), no partial file left."""
    import errno

    from schemas.errors import UserError
    from store import Store
    from store import remote_shards
    from store.remote_cache import local_store

    local = tmp_path / "store"
    make_train_store(local, tiny_edit_model, mixed_specs(4))
    push(local, s3_env.url("full"))
    import itertools

    from store.remote import Remote

    real_fetch, real_download = remote_shards._download, Remote.download  # a shard's fetch / a metadata object's
    calls = itertools.count()  # next() is atomic: metadata objects are fetched several at a time

    def disk_fills_up(rel, part):
        if next(calls) == 2 or rel.endswith(".tar"):
            part.write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(remote_shards, "_download",
                        lambda remote, rel, part: disk_fills_up(rel, part) or real_fetch(remote, rel, part))
    monkeypatch.setattr(Remote, "download", lambda self, rel, part, progress: disk_fills_up(rel, part)
                        or real_download(self, rel, part, progress))
    cache = tmp_path / "cache"
    with pytest.raises(UserError, match="disk full while writing the store cache in " + str(cache)) as full:
        local_store(s3_env.url("full"), ["text", "vae"], cache)
    assert "or limit the cache below its disk's free space with --cache-gb G" in str(full.value), full.value
    assert not list(cache.rglob("*.part"))  # no partial file left
    (root,) = [p for p in cache.iterdir() if p.is_dir()]
    assert Store_versions(root) == {"text": [], "vae": []}
    assert Store_versions(local_store(s3_env.url("full"), ["text", "vae"], cache)) == {"text": [1], "vae": [1]}
    with Store(root, create=False).reader("vae") as r:  # a scan: its whole fetch meets the full disk
        read = sum(1 for k in r.keys() if r.tensors(k))
    assert read == 4  # every sample read by byte range (each checked), the run goes on
    assert not [p for p in root.rglob("*")
                if remote_shards.FETCH_TAG in p.name and not p.name.endswith(remote_shards.RANGED)]
    assert not [p for p in root.rglob("*.tar")]
