"""`store gc URL` reads each kept version's metadata once: its schema.json and checksums.json are read for the
closure (the schema checked against the checksums), and the strays' check and each live lease's closure take
them from there. Before: checksums.json was fetched again for the strays (two GETs of what can be megabytes per
version on every gc)."""

from __future__ import annotations

from collections import Counter

from store import Store, remote_gc
from store import format as fmt
from store.remote import Remote, open_remote
from store.remote_push import push
from store_samples import fill


def test_remote_gc_reads_each_kept_versions_metadata_once(s3_env, store: Store, monkeypatch) -> None:
    fill(store, 2)
    url = s3_env.url()
    push(store.root, url)
    reads: Counter[str] = Counter()
    real = Remote.read

    def counted(self, rel, *args, **kwargs):
        reads[rel] += 1
        return real(self, rel, *args, **kwargs)

    monkeypatch.setattr(Remote, "read", counted)
    p = remote_gc.plan(open_remote(url), grace_s=0)
    assert p.keep and not p.remove and not p.strays
    metadata = {rel: n for rel, n in reads.items() if rel.endswith((fmt.CHECKSUMS, fmt.SCHEMA_JSON))}
    assert metadata and all(n == 1 for n in metadata.values()), reads
    assert {f"{t}/v{v}/{fmt.CHECKSUMS}" for t, v in p.keep} <= set(metadata), reads
