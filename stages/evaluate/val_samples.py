"""The val samples one process evaluates: the first `max_loss_samples` intact ones, kept as outlines."""

from __future__ import annotations

from pathlib import Path

from features.damaged import read_intact
from features.open import open_configured
from models.sample import from_features
from schemas.config import EvaluateConfig


def read_val_samples(cfg: EvaluateConfig, store: str | Path, model: str):
    """(the val split's joined tables, `val_share.Share` of its first `max_loss_samples` intact samples, all when
    unset). Each is read once to find the intact ones and kept as an outline (key, img_shapes, mask): the loss
    passes read the features again batch by batch (`val_share.reader`), so what is held does not grow with the
    count (10k val samples x several MB each, held in full before)."""
    from models.loading import model_files
    from stages.evaluate.val_share import Share, loss_sample_count, outline

    tables = open_configured(cfg, "evaluate", store, model, model_files(model), "val")
    n = loss_sample_count(cfg, tables)
    tables.check_ahead(lambda: iter(range(len(tables))))  # the bytes checked by a thread just ahead of the reads
    try:  # evaluate.on_damaged=skip: a damaged one left out where it is read, the next one read instead
        read = read_intact(tables, n, lambda i: (i, outline(from_features(*tables.features_at(i)))),
                           "read val samples")
    finally:
        tables.stop_check_ahead()
    return tables, Share([s for _, s in read], list(range(len(read))), [i for i, _ in read])
