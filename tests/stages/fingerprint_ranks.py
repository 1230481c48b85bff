"""Run by each of two gloo processes of one node (tests/stages/test_fingerprint_ranks.py, not a test module
itself): the train start's model fingerprint (`stages.train.start.agreed_model_files`) with the files each
rank reads counted, printed as `RESULT same: {json}`; then rank 1 on a copy whose files differ, each rank's line
printed as `RESULT differ: <line>`.

    fingerprint_ranks.py CACHE MODEL OTHER_COPY
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter


def main() -> None:
    cache, model, other = sys.argv[1:4]
    os.environ["XDG_CACHE_HOME"] = cache  # one node's cache, shared by its ranks, empty at first
    import torch.distributed as dist

    import models.file_hashes as file_hashes
    from schemas.errors import UserError
    from schemas.model_files import fingerprint_of
    from stages.train.start import agreed_model_files

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    reads: Counter = Counter()
    real = file_hashes.file_sha256

    def counted(path):
        reads[os.path.relpath(path, model)] += 1
        return real(path)

    file_hashes.file_sha256 = counted
    dist.barrier()  # both ranks hash at once, as on a run's first start
    fingerprint = fingerprint_of(agreed_model_files(2, model))
    print(f"RESULT same: {json.dumps({'fingerprint': fingerprint, 'reads': reads})}", flush=True)
    try:
        agreed_model_files(2, other if rank == 1 else model)
        print("RESULT differ: accepted", flush=True)
    except UserError as e:
        print(f"RESULT differ: {e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
