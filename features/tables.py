"""Which stage writes which table, in pipeline order (the order `store repair` recomputes them in: a table's
producer reads the ones before it)."""

from __future__ import annotations

#: table -> the stage (`pipeline run <stage>`) that writes it
PRODUCER = {"images": "resize-bucket", "text": "encode-text", "vae": "encode-vae"}
#: the tables in the order the stages fill them
TABLE_ORDER = tuple(PRODUCER)
