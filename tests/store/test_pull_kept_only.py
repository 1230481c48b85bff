"""A pull of a whole URL copies what the URL's gc keeps (store/remote_gc.py `keep_rule`, the rule gc and push
follow): current versions, what they were made from and versions a live lease names there. A version a newer
current one replaced at the URL is garbage there (its gc removes it), so it is not copied; before, every complete
version was (tens of GB each at 1M samples)."""

from __future__ import annotations

from pathlib import Path

from store import Store
from store import remote_gc, remote_lease
from store.remote import open_remote
from store.remote_pull import pull
from store.remote_push import push
from store_samples import fill, fill_images
from test_push_kept_only import _same_tables


def _pulled(copy: Path, table: str) -> list[int]:
    return sorted(int(p.parent.name[1:]) for p in (copy / table).glob("v*/manifest.parquet"))


def _removed_by_url_gc(url: str) -> set[str]:
    return {v.name for v in remote_gc.plan(open_remote(url)).remove}


def test_a_version_replaced_at_the_url_is_not_pulled(store: Store, tmp_path: Path) -> None:
    url = (tmp_path / "remote").as_uri()
    for i, tag in enumerate("abc"):  # each pushed while current: the URL holds v1, v2 and v3 (current)
        fill(store, 3, tag=tag, start=10 * i)
        push(store.root, url)
    copy = tmp_path / "copy"
    summary = pull(url, copy)
    assert summary.copied == ["vae/v3"] and summary.garbage == ["vae/v1", "vae/v2"], summary
    assert set(summary.garbage) == _removed_by_url_gc(url)  # the very versions the URL's gc removes
    assert [ln for ln in str(summary).splitlines() if ln.startswith("not copied vae/v1: not current")], str(summary)
    assert _pulled(copy, "vae") == [3] and Store(copy, create=False).tables() == {"vae": 3}
    _same_tables(store, copy, "vae", 3)


def test_an_upstream_and_a_leased_version_are_pulled(store: Store, tmp_path: Path) -> None:
    """vae v1 names images v1 (kept, copied although images v3 is current; images v2 is not); a training reading
    vae v1 through the URL (its lease there) while vae v2 is current keeps vae v1, and the pull copies it."""
    url = (tmp_path / "remote").as_uri()
    assert fill_images(store, "a") == 1
    fill(store, 3)  # vae v1, upstream images v1
    push(store.root, url)
    for tag in "bc":
        fill_images(store, tag)
        push(store.root, url)
    fill(store, 4, tag="b", start=10)  # vae v2, current
    push(store.root, url)
    lease = remote_lease.hold(open_remote(url), [("vae", 1)], "a training")
    try:
        copy = tmp_path / "copy"
        summary = pull(url, copy)
        assert summary.garbage == ["images/v2"] and set(summary.garbage) == _removed_by_url_gc(url), summary
    finally:
        lease.release()
    assert _pulled(copy, "images") == [1, 3] and _pulled(copy, "vae") == [1, 2]
    pulled = Store(copy, create=False)
    assert pulled.tables() == {"images": 3, "vae": 2}
    _same_tables(store, copy, "images", int(pulled.reader("vae", 1).schema.lineage.upstream["images"]))
    _same_tables(store, copy, "vae", 1)
    _same_tables(store, copy, "vae", 2)
