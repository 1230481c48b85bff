"""Is a folder that several nodes write together the same folder on every node? A run folder (`--out`: rank 0
writes the checkpoint, every rank adds its RNG file to it, every rank reads it on `--resume`) or a local store that
the encoders' ranks write shards into must be on a file system every node shares. A per-node local disk under the
same path showed up late and badly: at the first checkpoint, hours in, as a missing temp folder on the other nodes,
or, on `--resume`, as ranks that each found another checkpoint (or none) and trained on from different steps. So
it is checked once at the start, by every rank together: rank 0 writes a probe file with a name all ranks agree on
(an all-reduced random number), every rank looks for it, and any rank that does not see it stops every rank with
one line naming itself and its host (models/collective/)."""

from __future__ import annotations

import secrets
import socket
import time
from pathlib import Path

from schemas.errors import UserError

PROBE = ".shared-probe-"
LOOKS = 5  # a file another NFS client just created may take a moment to appear: look again, briefly


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
            if rank != 0 and not _sees(probe):
                raise UserError(f"{what} {folder} is not the same folder on every node: rank {rank} (host "
                                f"{socket.gethostname()}) does not see the file rank 0 wrote there ({probe.name}); "
                                f"put it on a file system every node mounts at that path ({why})")
    finally:
        if rank == 0:
            probe.unlink(missing_ok=True)


def _sees(probe: Path) -> bool:
    for i in range(LOOKS):
        if probe.exists():
            return True
        if i + 1 < LOOKS:
            time.sleep(0.2 * (i + 1))
    return False
