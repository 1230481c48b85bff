"""Ranks of an encoder on several nodes, each node with its own cached copy of a store URL: do they share one
cache (one node, or a shared filesystem: today's way, the cache's commit then pushed back), and which version
number do they all write (their caches may hold different in-progress versions)? Decided by every rank together
(models/collective.py: only integers travel)."""

from __future__ import annotations

import hashlib
import socket
from typing import TYPE_CHECKING

from schemas.table import TableSchema
from models.shared_folder import check_shared
from store import format as fmt
from store.remote_parts import source_url, taken_on_remote
from store.writer import candidate_version

if TYPE_CHECKING:
    from stages.encode.job import EncodeJob

_BITS = 62  # a cache's identity, as an integer every rank can all-reduce


def writer_place(job: EncodeJob, schema: TableSchema) -> tuple[int | None, str | None]:
    """(the agreed version, the store URL) when the ranks write a store URL through more than one cache; (None,
    None) otherwise: one process, a local store (checked to be one folder for every node), or one cache for all
    (the writer opens its version as always)."""
    from models.collective import all_max, spread, together

    world, table = job.ranks.world_size, job.summary.table
    url = source_url(job.store.root)
    if world <= 1:
        return None, None
    if url is None:  # the same answer on every rank: all of them open the same URL, or none
        # a local store: every rank writes its shards into it and rank 0 commits them, so every node must see it
        check_shared(job.store.root, world, job.ranks.rank, "the store",
                     "each rank writes its shards there and rank 0 commits them; or use a store URL")
        return None, None
    want = schema.to_dict()
    with together(world, f"{job.summary.stage}: the version of table '{table}'"):
        here = f"{socket.gethostname()}:{job.store.root.resolve()}"
        cache = int.from_bytes(hashlib.sha256(here.encode()).digest()[:8], "big") >> (64 - _BITS)
        with fmt.flock(job.store.root / fmt.STORE_LOCK):
            # only parts this number of ranks wrote: each rank's share of the keys depends on it
            mine = candidate_version(job.store.root, table, want, world)
        taken = taken_on_remote(url, table, want, world) if job.ranks.rank == 0 else set()
    (high, low), (agreed, _) = spread(world, [cache, mine])
    if high == low:
        return None, None
    while agreed in taken:  # rank 0 alone knows the remote: the others send 0
        agreed += 1
    (agreed,) = all_max(world, [agreed if job.ranks.rank == 0 else 0])
    return agreed, url
