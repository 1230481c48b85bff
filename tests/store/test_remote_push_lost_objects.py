"""A push sends again the objects of a version already at the URL that its listing lacks (deleted behind the tool's
back: readers there are told to push that version again). A local store's were resent; a cache's version, marked a
copy of the URL's once pushed (store/remote_cache.py `push_back`), was skipped whole: the cache's next push said it
was there and left the URL broken, though the cache held the lost bytes. Now what it holds intact is sent again,
from the listing the push makes anyway (no request more)."""

from __future__ import annotations

from pathlib import Path

from store import Store
from store import format as fmt
from store.remote import Remote
from store.remote_cache import local_store, push_back
from store.remote_pull import pull
from store.remote_push import push
from store_samples import fill, fill_images


def test_a_cache_push_sends_again_what_the_url_lost_of_a_version_it_pushed(s3_env, tmp_path: Path,
                                                                            monkeypatch) -> None:
    url = s3_env.url("lost")
    src = Store(tmp_path / "src")
    fill(src, 4, tag="a")
    push(src.root, url)  # vae v1
    root = local_store(url, ["vae"], tmp_path / "cache", lease=False)
    assert fill_images(Store(root), "a") == 1  # committed in the cache, pushed: a copy of the URL's from now on
    assert push_back(url, root).copied == ["images/v1"]
    vdir = fmt.version_dir(root, "images", 1)
    lost = sorted(p.name for p in vdir.iterdir() if fmt.shard_of(p.name) is not None)[0]
    s3_env.client().delete_object(Bucket=s3_env.bucket, Key=f"lost/images/v1/{lost}")

    fill(Store(root), 3, tag="b", start=10)  # the next stage's work: vae v2, pushed back
    summary = push_back(url, root)
    assert summary.copied == ["vae/v2"] and "images/v1" in summary.present, summary
    copy = tmp_path / "copy"
    pull(url, copy, tables=["images"])  # refused ("... is missing ... push that version again") before
    assert (fmt.version_dir(copy, "images", 1) / lost).read_bytes() == (vdir / lost).read_bytes()

    # nothing lost: the cache's versions cost the push no request (the marker and range counts are no objects)
    asked: list[str] = []
    real = Remote.recorded_crc
    monkeypatch.setattr(Remote, "recorded_crc", lambda self, rel: asked.append(rel) or real(self, rel))
    fill(Store(root), 2, tag="c", start=20)
    assert push_back(url, root).copied == ["vae/v3"]
    assert not [rel for rel in asked if not rel.startswith("vae/v3/")], asked
