"""Stages on a store at a URL (`paths.store: s3://bucket/prefix`), for `run all` and `pipeline demo`.

Each stage runs on the store's local cached copy (store/remote_cache.py): the versions it reads are pulled first,
every file checked against its version's checksums, and the table it writes is pulled too when the remote has one
(so an up-to-date table is recognised and a killed stage resumes). A stage that writes a table pushes it back as
soon as it has committed (push's guarantees: write-once objects, manifest last, store.json by compare-and-swap),
so the remote holds every table a local run would, and a killed `run all` loses nothing that was pushed.
The same code path as `pipeline run <stage> --store URL`; one node (the cache is per node).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from features.tables import PRODUCER

#: the tables each stage reads (its own output table is added, optional)
READS: dict[str, tuple[str, ...]] = {
    "resize-bucket": (),
    "encode-text": ("images",),
    "encode-vae": ("images",),
    "train": ("text", "vae"),
    "evaluate": ("images", "text", "vae"),
}
WRITES = {stage: table for table, stage in PRODUCER.items()}


@dataclass(frozen=True)
class StoreAccess:
    """Where the stages find the store: `store` itself when it is a folder, else its cached copy."""

    store: str
    cache_dir: Path | None = None
    cache_gb: float | None = None

    @contextmanager
    def for_stage(self, stage: str, log: Callable[[str], None] = print) -> Iterator[str]:
        """The local store folder `stage` works on; its table pushed back when the stage returns."""
        from store.remote import is_url

        if not is_url(self.store):
            yield self.store
            return
        from store.remote_cache import local_store, push_back

        written = WRITES.get(stage)
        tables = [*READS[stage], *([written] if written else [])]
        optional = (written,) if written else ()
        local = local_store(self.store, tables, self.cache_dir, self.cache_gb, optional=optional)
        yield str(local)
        if written:
            log(str(push_back(self.store, local)))

    def local(self, tables: list[str]) -> Path:
        """The local folder holding `tables`' current versions (pulled when the store is a URL)."""
        from store.remote_cache import local_store

        return local_store(self.store, tables, self.cache_dir, self.cache_gb)


def named_by_url(summary, store: str):
    """A stage summary's `store` (its up-to-date line says `pipeline store verify STORE` checks the bytes) is the
    folder the stage worked on, for a URL its cached copy: name the URL the user passed instead."""
    from store.remote import is_url

    if is_url(store) and hasattr(summary, "store"):
        summary.store = store
    return summary
