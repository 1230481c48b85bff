"""The end of an encode job: this rank's last shard and quarantine rows, rank 0's commit (all ranks agreeing on
both, models/collective/), the check of a version that replaces a damaged one; or giving up without commit."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from stages.encode.intake import check_damaged_total, flush_quarantine
from stages.encode.output import rank_shard_sizes
from stages.encode.summary import Summary, over_ranks
from store.writer_commit import EmptyVersion

if TYPE_CHECKING:
    from stages.encode.job import EncodeJob


def finish(job: EncodeJob) -> Summary:
    """Quarantine rows, this rank's last shard, rank 0 commits (manifest last). Both parts are agreed on by
    all ranks (models/collective/; they are the barriers too): a rank that fails (a full disk, its
    damaged-input threshold, in `failed` for a failure in its loop) stops every rank with its one line."""
    from models.collective import together

    if job.summary.up_to_date:  # completed by another process meanwhile, or its lost swap redone (open_writer)
        push_node_rows(job)
        job.summary.seconds = time.perf_counter() - job.started
        return job.summary
    assert job.writer is not None
    world, stage = job.ranks.world_size, job.summary.stage
    # uneven: the ranks end their shares far apart (a share of the samples new since the last encode, a slower
    # node), and the uploads of a store URL's parts too: they wait for each other through the launcher's store, not
    # in the agreement's collective, whose timeout (NCCL's: 10 minutes) ended the ranks that were done first
    with together(world, f"{stage}: this rank's last shard", uneven=True):
        flush_quarantine(job)
        job.writer.finish_rank(rejected=job.summary.quarantined)
        job.summary.loop_seconds = time.perf_counter() - job.loop_started
        job.summary.bytes_written = sum(
            size - job.shard_sizes_before.get(name, 0) for name, size in rank_shard_sizes(job).items()
        )
        job.images.stop_check_ahead()
    check_damaged_total(job)  # every rank past the barrier above: the same sums, the same verdict
    if job.writer.remote_url is not None:  # each node's rows merge after the commit: refused before it, not after
        from store.remote_parts import check_node_quarantine

        with together(world, f"{stage}: the remote quarantine.parquet"):
            if job.ranks.local_rank == 0:
                check_node_quarantine(job.writer)
    empty = None
    # uneven: rank 0 commits alone (every rank's indexes merged or fetched, a repaired version read back in full)
    with together(world, f"{stage}: the commit of table '{job.summary.table}'", uneven=True):
        if job.ranks.rank == 0:
            empty = _commit(job)
        else:
            job.writer.close()
    _drop_if_empty(job, empty)
    if job.writer.remote_url is not None:  # committed on the remote by rank 0 (store/remote_parts.py)
        from store.remote_parts import drop_local_version

        drop_local_version(job.writer)
        job.summary.committed_to = job.writer.remote_url
        push_node_rows(job, job.writer.remote_url)
    job.summary.seconds = time.perf_counter() - job.started
    if job.lease is not None:
        job.lease.release()
    return over_ranks(job.summary, world)  # every rank's counts and damaged samples: one line says it all


def _commit(job: EncodeJob) -> EmptyVersion | None:
    """Rank 0's commit. A version found empty (every input rejected: its folder and a store URL's parts removed) is
    returned, not raised: every node removes its own part of it first (`_drop_if_empty`)."""
    try:
        job.summary.version = job.writer.commit(allow_empty=False)
    except EmptyVersion as e:
        return e
    job.summary.newer_current = job.writer.newer_current  # a store URL: another writer's stays current
    if job.repairing is not None:
        _verify_repaired(job)
    return None


def _drop_if_empty(job: EncodeJob, empty: EmptyVersion | None) -> None:
    """After the commit, every rank learns whether rank 0 found the version empty (`empty`, on rank 0); if so,
    each node's cached folder of it goes (several caches of a store URL: rank 0's commit removed its own and the
    remote's parts), and every rank stops with rank 0's line, all ranks agreeing. Before, only rank 0's node
    removed its folder; the others kept theirs (rank-done files, schema.json) of a version no longer anywhere."""
    from models.collective import all_max, together

    world = job.ranks.world_size
    (found,) = all_max(world, [int(empty is not None)])
    if not found:
        return
    with together(world, f"{job.summary.stage}: this node's cached folder of the empty table "
                         f"'{job.summary.table}' v{job.writer.version}"):
        if job.writer.remote_url is not None:
            from store.remote_parts import drop_local_version

            drop_local_version(job.writer)  # gone already on rank 0's node: nothing there
        if empty is not None:
            raise empty


def push_node_rows(job: EncodeJob, url: str | None = None) -> None:
    """A store URL: each node's rejected samples (its cache's quarantine.parquet, shared by its ranks) merged into
    the remote's by its local rank 0, all ranks agreeing (a failed merge is every rank's one line). After a commit
    on several caches (no push back), and whenever the table is up to date: a merge that failed after the commit
    left that node's rows only in its cache, and the rerun, finding the table up to date, pushed rank 0's cache
    alone. A merge that adds nothing writes nothing. `url`: the writer's (else the one the cache copies)."""
    from models.collective import together
    from store.remote_parts import push_node_quarantine, source_url

    url = url or source_url(job.store.root)
    if url is None:
        return
    with together(job.ranks.world_size, f"{job.summary.stage}: this node's quarantine rows to {url}"):
        if job.ranks.local_rank == 0:
            push_node_quarantine(job.store.root, url, job.summary.table)


def _verify_repaired(job: EncodeJob) -> None:
    """The version that replaces one recorded as damaged is read back in full (as `store verify`)."""
    from tqdm.auto import tqdm

    from store.repair import replace_damaged

    done = replace_damaged(job.store, job.summary.table, job.summary.version, job.repairing, "recomputed")
    job.summary.repaired_from = job.repairing
    tqdm.write(f"{job.summary.stage}: {done}")


def close(job: EncodeJob) -> None:
    """Give up the writer lock without committing (on error; a rerun resumes from committed shards); close
    the `images` reader and release its lease (idempotent: also the end of a finished or up-to-date job)."""
    job.images.close()
    if job.writer is not None:
        job.writer.close()
    if job.lease is not None:
        job.lease.release()


def failed(job: EncodeJob, error: BaseException) -> None:
    """This rank failed in its own part of the work (its loop): the other ranks learn it at their next
    agreement (`finish`) instead of waiting for this rank there (models/collective/)."""
    from models.collective import share_failure

    share_failure(job.ranks.world_size, error, job.summary.stage)
