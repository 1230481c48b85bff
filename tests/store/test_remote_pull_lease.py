"""`pipeline store pull URL DIR` copies every complete version - hours and terabytes at a million samples - and a
`store gc URL` elsewhere meanwhile removed the versions no longer current from under it: the pull stopped at the
first object gone ("disappeared meanwhile?; rerun"), and its rerun no longer found that version at all. Now the pull
holds a read lease on the versions it copies, as every other reader of a URL does (store/remote_lease.py), till it
ends. Against the S3 test server."""

from __future__ import annotations

from pathlib import Path

from store_samples import fill, push_every_version

from store import Store
from store import format as fmt
from store import remote_pull
from store.remote_gc import collect
from store.remote_pull import pull
from store.remote_push import push


def test_a_gc_during_a_pull_keeps_the_versions_it_copies(s3_env, store: Store, tmp_path: Path, monkeypatch):
    fill(store, 4)  # v1, current at the URL when the pull lists it
    url = s3_env.url()
    push_every_version(store, url)
    fill(store, 4, tag="b")  # v2, made current at the URL while the pull copies v1: v1 is what a gc removes then
    collected = []
    real = remote_pull.fetch_checked

    def fetch_checked(remote, f, path, *a, **kw):
        if f.rel.startswith("vae/v1/") and not collected:  # the pull is copying v1: a push and a gc elsewhere
            collected.append(None)
            push(store.root, url)
            collected[0] = collect(url, grace_s=0, echo=lambda line: None)
        return real(remote, f, path, *a, **kw)

    monkeypatch.setattr(remote_pull, "fetch_checked", fetch_checked)
    summary = pull(url, tmp_path / "pulled")
    assert summary.copied == ["vae/v1"] and collected[0].remove == []
    assert fmt.list_versions(tmp_path / "pulled", "vae") == [1]
    monkeypatch.setattr(remote_pull, "fetch_checked", real)
    assert [v.name for v in collect(url, grace_s=0, echo=lambda line: None).remove] == ["vae/v1"]  # released
