"""`JoinedTables.stand_in`: a table's content id hashes a column in place of its samples' checksums only where every
joined row holds a value there (never the id of the checksums); a row without one names the table as before."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from store_samples import joined_over_manifests

ROWS = 40


def _manifest(table: str, crc_seed: int, latents: list | None = None) -> bytes:
    rng = np.random.default_rng(crc_seed)
    cols = {
        "key": pa.array([f"{i:032x}" for i in range(ROWS)]),
        "shard": pa.array(["shard-r00-000000.tar"] * ROWS),
        "sample_offset": pa.array(np.arange(ROWS, dtype=np.int64) * 512),
        "sample_nbytes": pa.array(np.full(ROWS, 512, np.int64)),
        "sample_sha256": pa.array([rng.bytes(32).hex() for _ in range(ROWS)]),
        "sample_crc32c": pa.array([f"{int(v):08x}" for v in rng.integers(0, 2**32, ROWS)]),
        "split": pa.array(["train"] * ROWS),
    }
    if table == "vae":
        cols["img_shapes"] = pa.array([[[1, 4, 4]]] * ROWS)
        if latents is not None:
            cols["latents_sha256"] = pa.array(latents, pa.string())
    else:
        cols["length"] = pa.array(np.full(ROWS, 8))
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table(cols), sink)
    return sink.getvalue().to_pybytes()


def _ids(vae: bytes, stand_in: bool) -> dict:
    j = joined_over_manifests({"text": _manifest("text", 1), "vae": vae})
    if stand_in:
        j.stand_in("vae", "latents_sha256")
    return j.content_ids()


def test_the_stand_in_names_the_table_only_where_every_row_holds_it():
    latents = [f"{i:064x}" for i in range(ROWS)]
    a, b = _manifest("vae", 2, latents), _manifest("vae", 3, latents)  # other sample bytes, the same latents
    assert _ids(a, True) == _ids(b, True)
    assert _ids(a, False) != _ids(b, False)
    assert _ids(a, True)["vae"] != _ids(a, False)["vae"] and _ids(a, True)["text"] == _ids(a, False)["text"]
    assert _ids(_manifest("vae", 2, [*latents[:-1], "f" * 64]), True) != _ids(a, True)  # other latents
    gap = _manifest("vae", 2, [*latents[:-1], None])  # a row carried from before the column: the checksums
    assert _ids(gap, True) == _ids(gap, False) == _ids(_manifest("vae", 2), True)
