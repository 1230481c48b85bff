"""`run all`'s check of a Qwen-Image-2.1 model's reference area (`resize.control_vae_area`) against its VLM
processor's limits (`models.qwen21_predict.reference_area_refusal`), made only for a run that has references: the
processor would resize every one and encode-text quarantine them all, but a dataset without references never
shows the VLM one (before, a text-only 2.1 dataset was refused for an area it never uses).

Before resize-bucket the settings tell (resize.max_controls 0: none kept; resize.min_controls >= 1: every sample
kept has one), or a folder source's listing (a control folder's file for a target); any other source (tar shards,
a JSONL manifest, parquet) tells only once read: its `images` table is asked right after resize-bucket, before the
encoders (its `num_controls` column)."""

from __future__ import annotations

from pathlib import Path

from schemas.config import PipelineConfig
from schemas.errors import UserError


def check_before_resize(cfg: PipelineConfig, model: str, source: str | None) -> None:
    """Refuse (one line) an area the processor resizes when the settings or the folder listing tell the run has
    references; when they tell it only after resize-bucket, `check_after_resize` asks the table."""
    from models.qwen21_predict import reference_area_refusal

    refusal = reference_area_refusal(cfg.resize.control_vae_area, model)
    if refusal is not None and _references_told(cfg, source):
        raise UserError(refusal)


def check_after_resize(stage: str, cfg: PipelineConfig, model: str, store: str) -> None:
    """After resize-bucket: refuse such an area when the `images` table holds a sample with references (rank 0
    reads the processor and the table, the other ranks wait and stop with its line: `models.collective.main_alone`;
    a rank reading the processor itself could fail alone where the others wait)."""
    from models.loading import model_variant

    if stage != "resize-bucket" or model_variant(model) != "qwen-image-2.1":
        return
    # the settings told before resize-bucket (`check_before_resize` refused there): no rank asks the processor or
    # the table, and every rank skips alike, the config being the same on each. A folder listing's answer is
    # rank 0's alone (`_check_settings` runs on rank 0), so that case still asks the table, together
    if _told_by_settings(cfg) is not None:
        return
    from models.collective import main_alone
    from pipeline.launched import launched

    main_alone(launched()[0], "run all: the references' area", lambda: _check_table(cfg, model, store))


def _check_table(cfg: PipelineConfig, model: str, store: str) -> None:
    from models.qwen21_predict import reference_area_refusal

    refusal = reference_area_refusal(cfg.resize.control_vae_area, model)
    if refusal is not None and _samples_with_references(store):
        raise UserError(refusal)


def _references_told(cfg: PipelineConfig, source: str | None) -> bool | None:
    """Whether the run has references, where the settings or a folder source's listing tell before resize-bucket
    reads the source; None where only the source's samples tell."""
    told = _told_by_settings(cfg)
    if told is not None:
        return told
    if source is None:  # (resize-bucket refuses it)
        return None
    root = Path(source)
    if not (root / "target").is_dir():  # not a folder source (`stages.resize.sources.detect_format`'s rule)
        return None
    from stages.resize.folder_source import folder_layout

    layout = folder_layout(root)  # a listing, no file read
    return any(stem in layout.targets for by_stem in layout.controls.values() for stem in by_stem)


def _told_by_settings(cfg: PipelineConfig) -> bool | None:
    """Whether the run has references, where the resize settings alone tell; None where they do not."""
    if cfg.resize.max_controls == 0:  # resize-bucket quarantines every sample with one
        return False
    if cfg.resize.min_controls >= 1:  # ... and every sample without one
        return True
    return None


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
