"""What a resumed resize-bucket already holds, by source: {source: key} of every sample in the committed shards of
the unfinished version it resumes (their indexes' `key` and `source` columns).

The writer resumes only a version of the same lineage, whose source listing hash covers the source's bytes (or,
at URLs, its shards' metadata): a sample found under the same source name has the same bytes, so its key, and the
readers (sources.py) skip reading it (a tar at a URL is still streamed: only the member bytes are not kept) and the
stage skips hashing it. Without this a resumed run re-read and re-hashed every finished sample to find its key."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from store.writer_open import index_paths


def resumed_sources(vdir: Path) -> dict[str, str]:
    """{source: key} of the committed shards in `vdir` (the writer read the same indexes' keys: they are readable)."""
    done: dict[str, str] = {}
    for p in index_paths(vdir):
        t = pq.read_table(p, columns=["key", "source"])
        done.update(zip(t.column("source").to_pylist(), t.column("key").to_pylist()))
    return done
