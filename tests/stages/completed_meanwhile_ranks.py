"""Run by each of two gloo processes (tests/stages/test_encode_integrity.py, not a test module itself): an
encode-vae whose table another launch completed while this one loaded its model, seen by rank 0 but not yet by
rank 1 (the other launch's commit landed between their looks). Prints `RESULT summary: <version> <up_to_date>`.

    completed_meanwhile_ranks.py STORE MODEL
"""

from __future__ import annotations

import os
import sys

from pipeline.config import load_config
from schemas.errors import UserError
from store import Store


def main() -> None:
    store, model = sys.argv[1], sys.argv[2]
    from stages.encode import vae as encode_vae

    real, looks = Store.find_version, []

    def racing_look(self, table, lineage, serving=()):
        looks.append(table)
        if table != "vae" or (len(looks) > 1 and os.environ["RANK"] == "0"):
            return real(self, table, lineage, serving)
        return None  # the up-to-date check (both ranks) and rank 1's second look: before the other commit

    Store.find_version = racing_look
    try:
        s = encode_vae.run(load_config(None, {"encode_vae.dtype": "float32", "encode_vae.device": "cpu"}),
                           store, model)
        print(f"RESULT summary: {s.version} {s.up_to_date}", flush=True)
    except UserError as e:
        print(f"RESULT summary: error {e}", flush=True)


if __name__ == "__main__":
    main()
