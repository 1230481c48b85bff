"""Ranks of an encoder on several nodes, each node with its own cached copy of a store URL: do they share one
cache (one node, or a shared filesystem: today's way, the cache's commit then pushed back), and which version
number do they all write (their caches may hold different in-progress versions)? Decided by every rank together
(models/collective/: only integers travel)."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Callable, NamedTuple

from schemas.host import host_id
from schemas.table import TableSchema
from models.shared_folder import check_shared
from store import format as fmt
from store.remote_parts import OnRemote, on_remote, serving_schemas, source_url
from store.io_errors import writing
from store.writer import candidate_version, open_version

if TYPE_CHECKING:
    from pathlib import Path

    from stages.encode.job import EncodeJob

_BITS = 62  # a cache's identity, as an integer every rank can all-reduce


class Place(NamedTuple):
    """Where the ranks write. `version`, `url`: the agreed version and the store URL when they write a URL through
    more than one cache; otherwise `version` alone, the one rank 0 opened in the folder every rank shares
    (`_opened_by_rank_0`), or None, None for one process writing a local store (the writer opens its version as
    always). `committed`: a complete version
    of this very schema that the remote holds but not as current (its store.json swap lost, or another writer's
    version made current since): adopted, not written, unless it left damaged inputs out and this run stops on
    them (`_serves`)."""

    version: int | None = None
    url: str | None = None
    committed: int | None = None
    rows: int = 0  # the committed version's samples
    current: int = 0  # the remote's current version that rank 0 saw (0: none): the one adopting `committed` replaces
    refused: int | None = None  # a `committed` one refused, opened in the cache to carry from, never adopted


def writer_place(job: EncodeJob, schema: TableSchema) -> Place:
    """Where the ranks write `schema`'s version (decided by every rank together): see `Place`. A local store is
    checked to be one folder for every node."""
    from models.collective import all_max, spread, together

    world, table = job.ranks.world_size, job.summary.table
    url = source_url(job.store.root)
    if url is None:  # the same answer on every rank: all of them open the same URL, or none
        if world == 1:
            return Place()
        # every rank writes its shards into the store and rank 0 commits them: every node must see it
        check_shared(job.store.root, world, job.ranks.rank, "the store",
                     "each rank writes its shards there and rank 0 commits them; or use a store URL")
        return Place(_opened_by_rank_0(job, want=schema.to_dict()))
    want = schema.to_dict()
    with together(world, f"{job.summary.stage}: the version of table '{table}'"):
        cache = cache_identity(job.store.root)
        with fmt.flock(job.store.root / fmt.STORE_LOCK):
            # only parts this number of ranks wrote: each rank's share of the keys depends on it
            mine = candidate_version(job.store.root, table, want, world)
        remote = on_remote(url, table, want, world, serving_schemas(want, [s.to_dict() for s in job.serving])) \
            if job.ranks.rank == 0 else OnRemote(set())
    # rank 0 alone knows the remote: the others send 0
    committed, rows, current = all_max(world, [remote.committed, remote.rows, remote.current])
    if committed and _serves(job, url, committed):
        return Place(url=url, committed=committed, rows=rows, current=current)
    if committed:  # refused: its samples are carried forward from it, as a local store's rerun carries them
        _open_refused(job, url, committed)
    (high, low), (agreed, _) = spread(world, [cache, mine])
    if high == low:  # one cache: it commits there and pushes back
        return Place(_opened_by_rank_0(job, want, lambda: _own_number(job, want, remote.taken) or None),
                     refused=committed or None)
    while agreed in remote.taken:
        agreed += 1
    (agreed,) = all_max(world, [agreed if job.ranks.rank == 0 else 0])
    return Place(agreed, url, refused=committed or None)


def _opened_by_rank_0(job: EncodeJob, want: dict, number: Callable[[], int | None] = lambda: None) -> int:
    """The version every rank writes into the one folder they share: rank 0 opens it (`open_version`: the
    in-progress one of this schema resumed, else the next number created, or `number()`'s when not None) and the
    others take its number. Each rank picked its own from its listing of the table's folder before: a listing
    that lags on one node (an NFS attribute cache, a version another job committed between the ranks' looks)
    gave another number, and that rank was refused at its writer's open (or wrote a version no one commits).
    Opened, not only chosen, so no other writer of the store takes the number before the ranks' writers open it."""
    from models.collective import all_max, together

    world, table = job.ranks.world_size, job.summary.table
    opened = 0
    with together(world, f"{job.summary.stage}: opening table '{table}'"):
        if job.ranks.rank == 0:
            with writing(f"table '{table}'", job.store.root / table):
                opened, _ = open_version(job.store.root, table, want, number())
    (opened,) = all_max(world, [opened])  # rank 0's: the others send 0
    return opened


def _own_number(job: EncodeJob, want: dict, taken: set[int]) -> int:
    """For one cache (rank 0, which knows the remote's `taken` numbers): 0 when the number its writer opens as
    always (`candidate_version`) is free on the remote, else one past every number the cache and the remote hold.
    The cache opens only the remote's current versions, so its next number could be a complete version of other
    settings there (replaced as current since) or another run's parts: the encode ran to its end and its push was
    refused ("differs between the cache and the remote"; a fresh cache met it again), and its quarantine rows
    named that number, which the remote's version of it would then be judged by (current.left_out_on_remote)."""
    table = job.summary.table
    with fmt.flock(job.store.root / fmt.STORE_LOCK):  # any number of ranks resumes a version of one folder
        own = candidate_version(job.store.root, table, want)
        if own not in taken:
            return 0
        return max([*fmt.list_versions(job.store.root, table), *taken]) + 1


def _serves(job: EncodeJob, url: str, committed: int) -> bool:
    """Whether the remote's complete version `committed` serves this run as it is (stages/encode/current.py: under
    on_damaged=stop, not one that left damaged inputs out), agreed by every rank. Rank 0 reads the remote's
    quarantine rows, and each node's local rank 0 its cache's (a lost swap left a node's rows there alone); what
    each found goes to every rank, and rank 0 alone says why it is refused (each node's look said it: one line
    per node)."""
    from models.collective import gather_texts, together
    from stages.encode.current import left_out_on_remote, say_left_out, serving_version

    rank, stage, table = job.ranks.rank, job.summary.stage, job.summary.table
    keys: list[str] = []  # left out, as this rank's look found them (read under stop only)
    refusing: list[str] = []  # those keys when this rank's look refuses the version

    def left() -> list[str]:
        keys[:] = left_out_on_remote(job.store, url, table, committed, remote_rows=rank == 0)
        return keys

    with together(job.ranks.world_size, f"{stage}: whether table '{table}' v{committed} at {url} left inputs out"):
        if (rank == 0 or job.ranks.local_rank == 0) and \
                serving_version(job.store, stage, table, committed, job.on_damaged, left=left) is None:
            refusing = keys
    looks = [t.split("\n") for t in gather_texts(job.ranks.world_size, _look(refusing))]
    count, shown = max(((int(look[0]), look[1:]) for look in looks), key=lambda found: found[0])  # ties: rank 0's
    # a copy complete in this cache was refused by the look before the model loaded (plan.open_job), which said so
    if count and rank == 0 and not fmt.is_complete(job.store.version_dir(table, committed)):
        say_left_out(stage, table, committed, shown, count)
    return not count


def _look(keys: list[str]) -> str:
    """A rank's left-out `keys` as one text for `gather_texts`: their count, then the first few that fit."""
    from models.collective import MESSAGE_BYTES

    text = str(len(keys))
    for key in keys[:10]:
        if len(f"{text}\n{key}".encode()) > MESSAGE_BYTES:
            break
        text += f"\n{key}"
    return text


def _open_refused(job: EncodeJob, url: str, refused: int) -> None:
    """The remote's complete version `refused` opened in each rank's cache (lazily: its metadata; a carried shard
    is fetched whole when linked, as from a current version opened at the cache's open), so the writer carries
    its samples forward (output.open_writer, store/reuse.reusable) and encodes only those it left out. A cache
    holding no copy (a fresh one, or the node's evicted) encoded every sample again before. Every rank opens
    (one GET of its checksums.json where the cache holds it already), all agreeing."""
    from models.collective import together
    from store.remote_cache import open_beside

    table = job.summary.table
    with together(job.ranks.world_size, f"{job.summary.stage}: opening table '{table}' v{refused} at {url}"):
        open_beside(job.store.root, table, refused)


def cache_identity(root: Path) -> int:
    """One integer per cache folder: equal on two ranks only when they write the same folder. The host is its
    kernel's boot id (schemas/host.py): host names repeat across nodes (`docker --hostname`, cloned VMs), and two
    nodes then taken as one cache had rank 0 commit locally and fail at the end ("ranks [...] have not finished").
    The folder is its device and inode too: containers of one kernel see different folders under one path."""
    st = root.stat()
    here = f"{host_id()}:{st.st_dev}:{st.st_ino}:{root.resolve()}"
    return int.from_bytes(hashlib.sha256(here.encode()).digest()[:8], "big") >> (64 - _BITS)
