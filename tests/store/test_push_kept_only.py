"""`store push` sends what the pushing store's gc keeps (store/gc.py `keep_rule`, one rule for both): current
versions, what they were made from (lineage `upstream`) and versions a live read lease names. A version a newer
current one replaced is garbage at the URL too (its gc removes it), so it is not uploaded; before, only versions
switched away from (`was_current`) were skipped, and every superseded version - tens of GB at 1M samples - was
sent for the URL's gc to delete."""

from __future__ import annotations

from pathlib import Path

import torch

from store import Store
from store import lease as leases
from store.gc import plan
from store.remote_pull import pull
from store.remote_push import push
from store_samples import fill, fill_images


def _sent(url_root: Path, table: str) -> list[int]:
    return sorted(int(p.parent.name[1:]) for p in (url_root / table).glob("v*/manifest.parquet"))


def _same_tables(store: Store, copy: Path, table: str, version: int) -> None:
    want, got = store.reader(table, version), Store(copy, create=False).reader(table, version)
    assert sorted(got.keys()) == sorted(want.keys())
    for k in want.keys():
        a, b = want.get(k), got.get(k)
        assert a["tensors"].keys() == b["tensors"].keys() and a["files"] == b["files"]
        assert all(torch.equal(a["tensors"][n], b["tensors"][n]) for n in a["tensors"])


def _removed_by_gc(store: Store) -> set[str]:
    return {f"{vdir.parent.name}/{vdir.name}" for vdir in plan(store.root).remove}


def test_a_version_a_newer_current_one_replaced_is_not_uploaded(store: Store, tmp_path: Path) -> None:
    fill(store, 3, tag="a")  # v1
    fill(store, 4, tag="b", start=10)  # v2
    fill(store, 5, tag="c", start=20)  # v3, current
    url = (tmp_path / "remote").as_uri()
    summary = push(store.root, url)
    assert summary.copied == ["vae/v3"] and summary.garbage == ["vae/v1", "vae/v2"], summary
    assert set(summary.garbage) == _removed_by_gc(store)  # the very versions the store's own gc removes
    assert [ln for ln in str(summary).splitlines() if ln.startswith("not sent vae/v1: not current")], str(summary)
    assert _sent(tmp_path / "remote", "vae") == [3]
    copy = tmp_path / "copy"
    pull(url, copy)
    assert Store(copy, create=False).tables() == {"vae": 3}
    _same_tables(store, copy, "vae", 3)


def test_a_version_a_kept_one_was_made_from_is_uploaded(store: Store, tmp_path: Path) -> None:
    """vae v1 names images v1 as its upstream (store_samples.lineage): kept and sent although images v3 is current;
    images v2 (replaced, named by nothing) is not. The pulled copy opens vae and the images version it names."""
    assert fill_images(store, "a") == 1
    fill(store, 3)  # vae v1, upstream images v1
    assert fill_images(store, "b") == 2 and fill_images(store, "c") == 3  # images v3 current
    url = (tmp_path / "remote").as_uri()
    summary = push(store.root, url)
    assert summary.garbage == ["images/v2"] and set(summary.garbage) == _removed_by_gc(store), summary
    assert _sent(tmp_path / "remote", "images") == [1, 3] and _sent(tmp_path / "remote", "vae") == [1]
    copy = tmp_path / "copy"
    pull(url, copy)
    upstream = Store(copy, create=False).reader("vae").schema.lineage.upstream["images"]
    _same_tables(store, copy, "images", int(upstream))
    _same_tables(store, copy, "vae", 1)


def test_a_version_a_live_read_lease_names_is_uploaded(store: Store, tmp_path: Path) -> None:
    """A training still reading vae v1 (its read lease) while v2 is current: gc keeps v1, and push sends it."""
    fill(store, 3, tag="a")
    lease = leases.hold(store.root, {"vae": 1}, "a training")
    try:
        fill(store, 4, tag="b", start=10)  # v2, current
        url = (tmp_path / "remote").as_uri()
        summary = push(store.root, url)
        assert summary.copied == ["vae/v1", "vae/v2"] and not summary.garbage, summary
    finally:
        lease.release()
    assert _sent(tmp_path / "remote", "vae") == [1, 2]
    summary = push(store.root, url)  # the lease gone: v1 there already is checked as before, not skipped
    assert summary.present == ["vae/v1", "vae/v2"] and not summary.garbage, summary
