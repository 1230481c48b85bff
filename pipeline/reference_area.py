"""`run all`'s check of a Qwen-Image-2.1 model's reference area (`resize.control_vae_area`) against its VLM
processor's limits (`models.qwen21_predict.check_reference_area`), made only for a run that has references: the
processor would resize every one and encode-text quarantine them all, but a dataset without references never
shows the VLM one (before, a text-only 2.1 dataset was refused for an area it never uses).

Before resize-bucket the settings tell (resize.max_controls 0: none kept; resize.min_controls >= 1: every sample
kept has one), or a folder source's listing (a control folder's file for a target); any other source (tar shards,
a JSONL manifest, parquet) tells only once read: its `images` table is asked right after resize-bucket, before the
encoders (its `num_controls` column)."""

from __future__ import annotations

from pathlib import Path

from schemas.config import PipelineConfig


def check_before_resize(cfg: PipelineConfig, model: str, source: str) -> None:
    """Refuse (one line) an area the processor resizes when the settings or the folder listing tell the run has
    references; when they tell it only after resize-bucket, `check_after_resize` asks the table."""
    if _area_kept(cfg, model) or not _references_told(cfg, source):
        return
    from models.qwen21_predict import check_reference_area

    check_reference_area(cfg.resize.control_vae_area, model)


def check_after_resize(stage: str, cfg: PipelineConfig, model: str, store: str) -> None:
    """After resize-bucket: refuse such an area when the `images` table holds a sample with references (rank 0
    reads, the other ranks wait and stop with its line: `models.collective.main_alone`)."""
    from models.loading import model_variant

    if stage != "resize-bucket" or model_variant(model) != "qwen-image-2.1" or _area_kept(cfg, model):
        return
    from models.collective import main_alone
    from pipeline.launched import launched

    main_alone(launched()[0], "run all: the references' area", lambda: _check_table(cfg, model, store))


def _check_table(cfg: PipelineConfig, model: str, store: str) -> None:
    if _samples_with_references(store):
        from models.qwen21_predict import check_reference_area

        check_reference_area(cfg.resize.control_vae_area, model)


def _area_kept(cfg: PipelineConfig, model: str) -> bool:
    from models.qwen21_predict import vlm_pixel_limits

    low, high = vlm_pixel_limits(model)
    return low <= cfg.resize.control_vae_area <= high


def _references_told(cfg: PipelineConfig, source: str) -> bool | None:
    """Whether the run has references, where the settings or a folder source's listing tell before resize-bucket
    reads the source; None where only the source's samples tell."""
    if cfg.resize.max_controls == 0:  # resize-bucket quarantines every sample with one
        return False
    if cfg.resize.min_controls >= 1:  # ... and every sample without one
        return True
    root = Path(source)
    if not (root / "target").is_dir():  # not a folder source (`stages.resize.sources.detect_format`'s rule)
        return None
    from stages.resize.sources import folder_layout

    layout = folder_layout(root)  # a listing, no file read
    return any(stem in layout.targets for by_stem in layout.controls.values() for stem in by_stem)


def _samples_with_references(store: str) -> int:
    """How many samples of the store's current `images` version have references (its manifest's column)."""
    import pyarrow.compute as pc

    from store.manifest_files import checked_manifest
    from store.store import Store

    st = Store(store, create=False)
    m = checked_manifest(st.version_dir("images", st.tables()["images"]), ["num_controls"])
    if "num_controls" not in m.column_names:  # a version written before the column: no references recorded
        return 0
    return int(pc.sum(pc.greater(pc.fill_null(m.column("num_controls"), 0), 0)).as_py() or 0)
