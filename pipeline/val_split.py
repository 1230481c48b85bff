"""`run all`'s check that evaluate, its last stage, will have a 'val' sample to read, made right after the stage
that decides it instead of at evaluate, after the whole training: resize-bucket (each sample's key hash puts it in
'val' with probability resize.val_fraction, so a small source can put none there) and the encoders (they may
quarantine every val sample). The counts come from the store's own readers (`features.open`: the `images`
manifest's split, the text + vae join's dropped report, as evaluate opens it).

Under a launcher rank 0 reads and decides while the other ranks wait (`models.collective.main_alone`): its
refusal stops every rank with the same line, and no rank whose view of the store lags decides otherwise."""

from __future__ import annotations

from schemas.config import PipelineConfig
from schemas.errors import UserError

# the stage after which each check is made, and the stages still to run then (named in the way out)
CHECKED_AFTER = {"resize-bucket": ("encode-text", "encode-vae", "train"), "encode-vae": ("train",)}


def check_val_split(stage: str, cfg: PipelineConfig, store: str) -> None:
    """Refuse (one line) when the 'val' split holds no sample evaluate can read after `stage`; nothing to do
    after a stage that decides nothing about it."""
    if stage not in CHECKED_AFTER:
        return
    from models.collective import main_alone
    from pipeline.launched import launched

    world, _ = launched()
    main_alone(world, f"run all: the 'val' split after {stage}", lambda: _check(stage, cfg, store))


def _check(stage: str, cfg: PipelineConfig, store: str) -> None:
    from features.open import images_in_split, reasons_text, split_report

    in_val, samples, version = images_in_split(store, "val")
    fraction = cfg.resize.val_fraction
    if not in_val:
        _refuse(f"0 of {samples} samples went to the 'val' split that evaluate (its last stage) reads: the hash split "
                f"of each sample's key with resize.val_fraction {fraction} put none of the {samples} there (store "
                f"{store}, images v{version}); raise resize.val_fraction or add samples", stage)
    if stage == "encode-vae":
        rep = split_report(store, ("text", "vae"), "val")
        if not rep["joined"]:
            _refuse(f"{rep['samples']} of {samples} samples went to the 'val' split that evaluate (its last stage) "
                    f"reads, and the encoders left out all {rep['samples']} (none is in both the text and vae "
                    f"tables): {reasons_text(rep)} (rows in {rep['quarantine_file']}); fix those inputs, add samples "
                    "or raise resize.val_fraction", stage)


def _refuse(what_why_fix: str, stage: str) -> None:
    rest = ", ".join(f"`pipeline run {s}`" for s in CHECKED_AFTER[stage])
    raise UserError(f"`pipeline run all` stopped before training: {what_why_fix}, then rerun (`pipeline run all` "
                    f"continues from the finished stages); or train without evaluating: {rest}")
