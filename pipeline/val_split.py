"""`run all`'s check that evaluate, its last stage, will have 'val' samples it accepts, made right after each stage
that decides them instead of at evaluate, after the whole training: resize-bucket (each sample's key hash puts it in
'val' with probability resize.val_fraction, so a small source can put none there; its quarantine can take the ones
it would have put there), encode-text and encode-vae (they may quarantine every val sample, or more of them than
evaluate.max_dropped_fraction: evaluate's own rule, `features.open.dropped_beyond`). The counts come from the
store's own readers (`features.open`: the `images` manifest's split, the quarantine, the images + text and
text + vae joins' dropped reports).

Under a launcher rank 0 reads and decides while the other ranks wait (`models.collective.main_alone`): its
refusal stops every rank with the same line, and no rank whose view of the store lags decides otherwise."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from schemas.config import PipelineConfig
from schemas.errors import UserError
from schemas.units import count_text
from store import format as fmt

# the stage after which each check is made, and the stages still to run then (named in the way out)
CHECKED_AFTER = {"resize-bucket": ("encode-text", "encode-vae", "train"), "encode-text": ("encode-vae", "train"),
                 "encode-vae": ("train",)}
# after each encoder: the join that holds the val samples left for evaluate, what holds them, who left the rest out
JOINED_AFTER = {"encode-text": (("images", "text"), "the text table", "encode-text"),
                "encode-vae": (("text", "vae"), "both the text and vae tables", "the encoders")}


def check_val_split(stage: str, cfg: PipelineConfig, store: str) -> None:
    """Refuse (one line) when the 'val' split holds no sample evaluate can read after `stage`, or more dropped
    ones than evaluate accepts; nothing to do after a stage that decides nothing about it."""
    if stage not in CHECKED_AFTER:
        return
    from models.collective import main_alone
    from pipeline.launched import launched

    world, _ = launched()
    main_alone(world, f"run all: the 'val' split after {stage}", lambda: _check(stage, cfg, store))


def _check(stage: str, cfg: PipelineConfig, store: str) -> None:
    from features.open import dropped_beyond, images_in_split, reasons_text, split_report

    in_val, samples, version = images_in_split(store, "val")
    if not in_val:
        _refuse(_why_empty(cfg, store, samples, version), stage)
    if stage not in JOINED_AFTER:
        return
    tables, held_by, who = JOINED_AFTER[stage]
    rep = split_report(store, tables, "val")
    where = f"(rows in {rep['quarantine_file']})"
    if not rep["joined"]:
        _refuse(f"{rep['samples']} of {count_text(samples, 'sample')} went to the 'val' split that evaluate (its "
                "last stage) "
                f"reads, and {who} left out all {rep['samples']} (none is in {held_by}): {reasons_text(rep)} "
                f"{where}; fix those inputs, add samples or raise resize.val_fraction", stage)
    too_many = dropped_beyond(rep, cfg.evaluate.max_dropped_fraction, "evaluate", held_by)
    if too_many:  # evaluate's own rule: it would refuse the split after the whole training
        _refuse(f"of the 'val' split that evaluate (its last stage) reads, {too_many}, so evaluate would refuse it; "
                "fix those inputs, use a model that accepts them, or raise evaluate.max_dropped_fraction to use "
                "the rest", stage)


def _why_empty(cfg: PipelineConfig, store: str, samples: int, version: int) -> str:
    """What, why, what to do for an empty 'val' split: resize-bucket's quarantine where it took every sample the
    hash split put there (their split is known: the key, and the pictures' identity a row records), the hash split
    itself otherwise. The split rule and val_fraction are the version's own, as its schema records them
    (stages/resize/split_rule.py; the config's where a version records none)."""
    from features.open import quarantined_keys
    from stages.resize.split_rule import recorded_rule, split_for
    from stages.resize.images_table import STAGE
    from store.manifest_files import read_schema
    from store.store import Store

    st = Store(store, create=False)
    attrs = read_schema(st.version_dir("images", version)).attrs
    rule = recorded_rule(attrs)
    fraction = (attrs.get("resize") or {}).get("val_fraction", cfg.resize.val_fraction)  # what split the version
    keys, reasons, pictures = quarantined_keys(store, STAGE)
    would_be = {k: r for k, r, p in zip(keys, reasons, pictures)  # one reason per key
                if (rule == "key" or p is not None) and split_for(k, p, fraction, rule) == "val"}
    if would_be:
        counts = Counter(would_be.values())
        why = ", ".join(f"{r} {n}" for r, n in sorted(counts.items()))
        return (f"0 of {count_text(samples, 'sample')} are in the 'val' split that evaluate (its last stage) reads: "
                "the hash "
                f"split with resize.val_fraction {fraction} put {len(would_be)} there, and resize-bucket "
                f"quarantined all {len(would_be)} ({why}; rows in {Path(store) / fmt.QUARANTINE}, store "
                f"{store}, images v{version}); fix those inputs, add samples or raise resize.val_fraction")
    of = "key" if rule == "key" else "pictures"
    return (f"0 of {count_text(samples, 'sample')} went to the 'val' split that evaluate (its last stage) reads: "
            "the hash split "
            f"of each sample's {of} with resize.val_fraction {fraction} put none of the {samples} there (store "
            f"{store}, images v{version}); raise resize.val_fraction or add samples")


def _refuse(what_why_fix: str, stage: str) -> None:
    rest = ", ".join(f"`pipeline run {s}`" for s in CHECKED_AFTER[stage])
    raise UserError(f"`pipeline run all` stopped before training: {what_why_fix}, then rerun (`pipeline run all` "
                    f"continues from the finished stages); or train without evaluating: {rest}")
