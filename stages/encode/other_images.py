"""One line where an encoder reads a current `images` version rendered with other resize settings than its
config's, while the store holds a complete version rendered with exactly the config's: another run's
resize-bucket came between (an Edit run and a Qwen-Image-2.1 run sharing one store, each with its own config).

The encoder still encodes the current version, as every stage reads the current one; the line says which
settings differ (the reference limit, alpha, sizes) and how to encode the config's own version instead. Before,
run stage by stage, the other run's pictures were encoded without a word: a 2.1 config's encode-text on an Edit
run's images encoded only the samples with at most its 2 or 3 references, flattened over white.
"""

from __future__ import annotations

from typing import Any

from tqdm.auto import tqdm

from schemas.config import PipelineConfig

IMAGES = "images"


def say_other_images(job, cfg: PipelineConfig) -> None:
    """The line (rank 0), or nothing: where the current version records its settings and they are the config's,
    or where no other version records the config's."""
    if job.ranks.rank != 0:
        return
    wanted = _compared(config_resize(cfg))
    current = job.images.version
    recorded = _recorded_resize(job.store)
    if recorded.get(current) in (None, wanted):
        return
    same = [v for v, settings in recorded.items() if settings == wanted and v != current]
    if not same:
        return
    from schemas import up_to_date

    differences = up_to_date.changed_settings(recorded[current], wanted, "resize", missing="(default)")
    tqdm.write(f"{job.summary.stage}: the current images v{current} was rendered with other resize settings than "
               f"this config's ({'; '.join(differences)}), images v{max(same)} with this config's: encoding images "
               f"v{current}; to encode v{max(same)} instead, rerun `pipeline run resize-bucket` with this config "
               "first (it renders nothing again where the source is unchanged)")


# Left out of the comparison: how a source's columns are read (resize-bucket records the columns in force, a
# parquet source's detected mask column among them, not the config's), which tells sources apart, not renders.
NOT_COMPARED = ("columns",)


def config_resize(cfg: PipelineConfig) -> dict[str, Any]:
    """The config's resize settings as resize-bucket records them in an `images` version's schema (`resize`)."""
    from schemas.lineage import unhashed_names

    return cfg.resize.model_dump(mode="json", exclude=unhashed_names(cfg.resize) | {"split_by"})


def _compared(settings: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in settings.items() if k not in NOT_COMPARED}


def _recorded_resize(store) -> dict[int, dict[str, Any] | None]:
    """version -> the resize settings a complete `images` version records (None: it records none, or its schema
    does not read)."""
    from schemas.errors import UserError
    from store import format as fmt

    recorded: dict[int, dict[str, Any] | None] = {}
    for v in store.versions(IMAGES):
        if not fmt.is_complete(store.version_dir(IMAGES, v)):
            continue
        try:
            settings = store.checked_schema(IMAGES, v).attrs.get("resize")
        except UserError:  # damaged: stands for nothing
            settings = None
        recorded[v] = _compared(settings) if isinstance(settings, dict) else None
    return recorded
