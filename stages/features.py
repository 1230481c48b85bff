"""The one way a stage opens the encoded features (`text` + `vae` of a split): with the reading settings of its
own config section - `on_damaged`, `max_damaged_fraction`, `max_dropped_fraction`, `max_open_shards` - on every
path that reads them (train, its validator, its up-to-date check, evaluate), never with defaults of its own."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from store.join import JoinedTables, open_features


class ReadingSettings(Protocol):
    """What `train` and `evaluate` declare (schemas/config.py) for reading store features."""

    on_damaged: str
    max_damaged_fraction: float
    max_dropped_fraction: float
    max_open_shards: int


def open_configured(settings: ReadingSettings, section: str, store: str | Path, model: str,
                    split: str) -> JoinedTables:
    """`store.join.open_features` of `split` as `settings` (the config section named `section`) say."""
    from models.loading import model_fingerprint

    return open_features(store, model, model_fingerprint(model), split, settings.max_dropped_fraction,
                         settings.max_open_shards, on_damaged=settings.on_damaged,
                         max_damaged_fraction=settings.max_damaged_fraction, section=section)
