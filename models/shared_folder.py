"""Is a folder that several nodes write together the same folder on every node? A run folder (`--out`: rank 0
writes the checkpoint, every rank adds its RNG file to it, every rank reads it on `--resume`) or a local store that
the encoders' ranks write shards into must be on a file system every node shares. A per-node local disk under the
same path showed up late and badly: at the first checkpoint, hours in, as a missing temp folder on the other nodes,
or, on `--resume`, as ranks that each found another checkpoint (or none) and trained on from different steps. So
it is checked once at the start, by every rank together: rank 0 writes a probe file with a name all ranks agree on
(an all-reduced random number), every rank looks for it, and any rank that does not see it stops every rank with
one line naming itself and its host (models/collective/). A rank looks for the probe as long as the store
looks for what another node wrote (`schemas.view_lag`): a node whose view of a shared folder lags is not refused
for it."""

from __future__ import annotations

import secrets
import socket
import sys
from pathlib import Path

from schemas import view_lag
from schemas.errors import UserError

PROBE = ".shared-probe-"


def check_shared(folder: Path, world: int, rank: int, what: str, why: str) -> None:
    """Every rank of `world` sees the files rank 0 writes into `folder`, else a UserError on every rank. `what`
    names the folder ("--out"), `why` says why it must be shared."""
    if world <= 1:
        return
    from models.collective import all_max, together

    folder = Path(folder)
    (token,) = all_max(world, [secrets.randbits(62) if rank == 0 else 0])
    probe = folder / f"{PROBE}{token:016x}"
    with together(world, f"{what} {folder}: the probe file"):
        if rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
    try:
        with together(world, f"{what} {folder}: the same folder on every node"):
            # a file another NFS client just created may take a while to appear: the store's wait for it
            if rank != 0 and not view_lag.seen_in_time(_saying_so_once(probe, rank)):
                raise UserError(f"{what} {folder} is not the same folder on every node: rank {rank} (host "
                                f"{socket.gethostname()}) does not see the file rank 0 wrote there ({probe.name}) "
                                f"within {view_lag.VIEW_LAG_SECONDS:.0f} s; put it on a file system every node mounts "
                                f"at that path ({why}), or rerun if it is on one (a view that lags longer)")
    finally:
        if rank == 0:
            probe.unlink(missing_ok=True)



def _saying_so_once(probe: Path, rank: int):
    """`probe.exists` as a look that, the first time it fails, prints one line: the wait that follows may last a
    minute (VIEW_LAG_SECONDS), silent on every rank otherwise."""
    said = False

    def look() -> bool:
        nonlocal said
        if probe.exists():
            return True
        if not said:
            said = True
            sys.stderr.write(f"rank {rank} on {socket.gethostname()}: waiting up to {view_lag.VIEW_LAG_SECONDS:.0f} s "
                             f"to see rank 0's probe in {probe.parent} (a shared file system's view can lag)\n")
            sys.stderr.flush()
        return False

    return look
