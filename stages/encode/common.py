"""What the encode stages (encode-text, encode-vae) share, in one import: ranks, settings hash, the job (lineage,
up to date, resumable writer with this rank's share of the `images` keys, quarantine, commit), batching, the
summary.

A stage reads top to bottom as: `open_job` (lineage, up to date?) -> load its one model component ->
`job.open_writer(schema)` (keys still to do) -> loop over `batches_by_shape(prefetched(...))` -> `job.finish()`.

Where each part lives: `ranks.py` (processes and devices), `settings.py` (features hash, overrides, precision),
`summary.py`, `plan.py` (`open_job`), `job.py` (`EncodeJob`), `output.py` (writer, carry forward), `intake.py`
(checked reads, quarantine), `commit.py` (finish, close), `batching.py` (prefetch, shape-grouped batches, halved
on out-of-memory).
"""

from __future__ import annotations

from features.pictures import open_png
from stages.encode.batching import MemoryBoundForward, batches_by_shape, prefetched
from stages.encode.intake import (caption_hopeless, control_count_rejection, nonfinite_rejection,
                                  placeholder_rejection)
from stages.encode.job import EncodeJob
from stages.encode.plan import IMAGES_TABLE, open_job
from stages.encode.ranks import Ranks, current_ranks, rank_device
from stages.encode.settings import (config_hash, earlier_config_hashes, placed, resolve_precision,
                                    serving_config_hashes, settings_record, with_overrides)
from stages.encode.summary import DAMAGED_INPUT, Summary

__all__ = [
    "DAMAGED_INPUT", "IMAGES_TABLE", "EncodeJob", "MemoryBoundForward", "Ranks", "Summary", "batches_by_shape",
    "caption_hopeless",
    "config_hash",
    "control_count_rejection", "current_ranks", "earlier_config_hashes", "nonfinite_rejection", "open_job", "open_png",
    "placed",
    "prefetched", "placeholder_rejection", "rank_device", "resolve_precision", "serving_config_hashes",
    "settings_record", "with_overrides",
]
