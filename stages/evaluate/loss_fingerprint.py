"""What the held-out losses of `evaluate --all-checkpoints` depend on, named: the loss array's fingerprint
(`loss_fingerprint`: store tables, model, the evaluate settings that change the numbers, the evaluation revision),
the same with the tables the val samples were read from (`read_fingerprint`, `content_fingerprint`), and the
earlier spellings of those settings an array or a report recorded under stays current by (`earlier_settings`,
`known_fingerprint`, `spelled_as`)."""

from __future__ import annotations

from pathlib import Path

from schemas.config import EvaluateConfig
from schemas.lineage import hashed_settings
from schemas.up_to_date import UNRECORDED_REVISION
from stages.evaluate.ema_curve import FOLDER as EMA_LOSSES
from stages.evaluate.loss_groups import group_hash
from store import Store
from store.loss_array import LossGroup, recorded_setting


#: hashed evaluate settings (schemas/config.py declares which) that change the numbers in the array (the others
#: only change the pictures); device and batch size are throughput: a change keeps the array. on_damaged changes
#: them only through the samples read (the array's sample axis, the base caches' keys): it is hashed as its
#: default, and listed so that the arrays recorded with it stay current (as set: `earlier_settings`).
LOSS_SETTINGS = ("noise_seeds", "timesteps", "max_loss_samples", "lora_scale", "dtype",
                 "attention_backend", "quantize_base", "on_damaged")


# What evaluate computes from its inputs (store tables, model, LoRA bytes, hashed settings): bump it with a release
# that changes a report's numbers or pictures for those same inputs (the held-out loss or its use of the noise
# seeds and σ grid, generation, PSNR / SSIM, the summaries and their pairing) - not for speed, layout or wording.
# Recorded in the loss array's setting (`loss_fingerprint`, so also the base images' and base losses' keys) and
# in a single-LoRA report's inputs: a report of another revision is recomputed, its loss array kept aside.
# Reports from before it was recorded: `schemas.up_to_date.UNRECORDED_REVISION`.
EVALUATION_REVISION = 1


def loss_fingerprint(cfg: EvaluateConfig, store: str | Path, model: str) -> tuple[str, dict]:
    """(hash, settings) of everything the held-out losses depend on besides the LoRA, the code's evaluation
    revision included: equal = same array. The store's path is not one of them: the tables' identities (number
    and manifest hash) name the data, and a store moved, or a store URL's cache in another folder, gives the same
    numbers (`known_fingerprint`)."""
    from models.loading import model_fingerprint

    st = Store(store, create=False)
    settings = {
        "tables": {t: st.version_id(t, v) for t, v in sorted(st.tables().items()) if t in ("text", "vae")},
        "model_fingerprint": model_fingerprint(model),
        "evaluate": _loss_settings(cfg),
        "evaluation_revision": EVALUATION_REVISION,
    }
    return group_hash(settings), settings


def _loss_settings(cfg: EvaluateConfig, as_set: bool = False) -> dict:
    return {k: v for k, v in hashed_settings(cfg, as_set=as_set).items() if k in LOSS_SETTINGS}


def read_fingerprint(settings: dict, tables) -> tuple[str, dict]:
    """`loss_fingerprint` with the text / vae tables the val samples were read from (`tables`, `read_tables`): the
    store's current versions, looked up before the tables were opened, may have moved since (an encode beside
    evaluate), and an array keyed by those would hold the new version's losses under the old one's name (reused
    by the next run that reads the old one). `max_loss_samples` as the samples it reads (`samples_read`)."""
    tables_read = read_tables(tables, settings["evaluate"].get("max_loss_samples"))
    settings = {**settings, "tables": tables_read, "evaluate": samples_read(settings["evaluate"], len(tables))}
    return group_hash(settings), settings


def read_tables(tables, cap: int | None) -> dict:
    """The text / vae tables the val samples were read from (`tables`, the val split's join), named by what
    evaluate reads from them: the content ids (`JoinedTables.content_ids`: keys, sample checksums, img_shapes,
    lengths) of the rows the loss passes read (`features.damaged.rows_read` of `cap`, max_loss_samples), so an
    `images` rerun that changed no sample (encode carries every sample forward into new versions) keeps the
    losses, and so does a val sample added or changed after those rows (keyed by the whole split, it evaluated
    every checkpoint and the base again, and `pipeline compare` refused two reports of one held-out set); the
    version ids read where a table has none (`JoinedTables.content_names`, as train's validation curve names
    them)."""
    from features.damaged import rows_read

    return tables.content_names(rows_read(tables, cap))


def samples_read(evaluate: dict, n: int) -> dict:
    """The loss settings with `max_loss_samples` at or above the val split's `n` samples spelled `None`: it reads
    every sample, as `None` does (`read_val_samples`), so the numbers are the same. Spelled as set, a 50-sample
    split evaluated again under `null` (or a cap of 512) set the array aside and evaluated every checkpoint and
    the base again. The tables' content ids name the split, so one spelling never covers two sample counts."""
    cap = evaluate.get("max_loss_samples")
    return {**evaluate, "max_loss_samples": None} if cap is not None and cap >= n else evaluate


def content_fingerprint(cfg: EvaluateConfig, store: str | Path, model: str, settings: dict,
                        out: Path | None = None, metrics=None) -> tuple[str, dict, list, list[str], int]:
    """`read_fingerprint` of the val split as evaluate would read it now (opened and closed here: the up-to-date
    check before anything is loaded), its `earlier_settings`, the keys of the val samples the loss passes
    will read (`val_share.loss_keys`: the loss array's sample axis) and the split's size. `metrics`: OUT's report
    as the check read it (`report.report_metrics`; None: none, or damaged)."""
    from features.open import open_configured
    from models.loading import model_files
    from stages.evaluate.val_share import loss_keys

    with open_configured(cfg, "evaluate", store, model, model_files(model), "val") as tables:
        # the samples OUT's report left out as damaged (on_damaged=skip): its read took as many rows more
        # (`features.damaged.rows_read`), as a read now would where they are still damaged
        tables.damaged.update(damaged_read(metrics))
        fingerprint, settings = read_fingerprint(settings, tables)
        return (fingerprint, settings, earlier_settings(settings, tables, cfg, out, metrics), loss_keys(cfg, tables),
                len(tables))


def damaged_read(metrics) -> dict[str, str]:
    """The val samples a report (`metrics`, its metrics.json as the up-to-date check read it) records the loss
    passes' read left out as damaged (`run.damaged_samples`; not the pictures' `images:` rows); none when there is
    no such record, or no intact report to hold one (None: the check says a damaged one, and the report is
    written again)."""
    try:
        damaged = (metrics.get("run") or {}).get("damaged_samples")
    except AttributeError:  # None (no intact report) or other JSON than a report's
        return {}
    if not isinstance(damaged, dict):
        return {}
    return {str(k): str(v) for k, v in damaged.items() if not str(k).startswith("images:")}


# `earlier_settings`' and `unset_array_backend`'s `metrics` when the caller has not read OUT's report: read there,
# and only where needed (an array that records its attention backend unset)
UNREAD = object()


def earlier_settings(settings: dict, tables, cfg: EvaluateConfig, out: Path | None = None,
                     metrics=UNREAD) -> list[dict]:
    """`read_fingerprint`'s settings as spelled before: the tables named by the version ids read (before they
    were named by content) or by the whole split's content (before the rows read; both only where a group in OUT
    records other tables: `_other_tables_recorded`), the evaluate settings with max_loss_samples as set (before
    `samples_read`; also as OUT's loss array records it, where that cap read every sample too) and all as set (`cfg`'s; before on_damaged was
    hashed as its default), each with both table spellings; each also with the attention backend unset (before it
    was hashed as resolved) where OUT's loss array records it unset and its evidence says that was this backend
    (`unset_array_backend`); none that is the present spelling: an array or a report recorded so is still
    current. Not the base caches (`base_images`): their keys hold the source digest, which the release that
    spelled them so had another of. `metrics`: OUT's report as the caller read it (`UNREAD`: read if needed)."""
    n = len(tables)
    evaluates = [settings["evaluate"], *(e for as_set in (False, True) for e in
                                         (_loss_settings(cfg, as_set), samples_read(_loss_settings(cfg, as_set), n)))]
    cap = _recorded_cap(out) if out is not None else None
    if settings["evaluate"].get("max_loss_samples") is None and cap is not None and cap >= n:
        evaluates += [{**e, "max_loss_samples": cap} for e in evaluates]
    # the tables named by the whole split's content (before they were named by the rows read, `read_tables`): the
    # same split, so the same rows read; only where a group in OUT records other tables than today's
    named = [settings["tables"]]
    if out is None or _other_tables_recorded(out, settings["tables"]):
        named += [tables.content_names(), tables.versions()]
    spellings = [{**settings, "tables": t, "evaluate": e} for e in evaluates for t in named]
    used = unset_array_backend(out, metrics) if out is not None else None
    if used is not None and used == settings["evaluate"].get("attention_backend"):
        spellings += [{**s, "evaluate": {**s["evaluate"], "attention_backend": None}} for s in spellings]
    return [s for i, s in enumerate(spellings) if s != settings and s not in spellings[:i]]


def _other_tables_recorded(out: Path, tables: dict) -> bool:
    """Does a loss group in OUT (its array, the EMA's, one kept aside beside either) record other tables than
    `tables`? Only such a group can be of an earlier tables spelling (`earlier_settings`), whose whole split's
    content ids hash every row of the split (at 1M val samples seconds and hundreds of MB on every up-to-date
    check, under the default max_loss_samples of 256) and whose version ids hash its manifests."""
    for group in (*out.glob("losses*.zarr"), *(out / EMA_LOSSES).glob("losses*.zarr")):
        try:
            recorded = LossGroup(group).group.attrs.get("settings")
        except Exception:  # noqa: BLE001 - unreadable: no settings that could match (`kept_groups` skips it too)
            continue
        if isinstance(recorded, dict) and recorded.get("tables") != tables:
            return True
    return False


def _recorded_cap(out: Path) -> int | None:
    """The max_loss_samples OUT's loss array records, when a number (None: none, or no such array)."""
    recorded = recorded_setting(out)
    evaluate = recorded[1].get("evaluate") if recorded is not None else None
    cap = evaluate.get("max_loss_samples") if isinstance(evaluate, dict) else None
    return cap if isinstance(cap, int) and not isinstance(cap, bool) else None


def unset_array_backend(out: Path, metrics=UNREAD) -> str | None:
    """The backend OUT's loss array was computed with when it records the attention backend unset (recorded before
    it was hashed as resolved): `stages.evaluate.backend.unset_backend` of its dtype and OUT's report of it; None
    when the array records another or none, or that is unknown. `metrics`: OUT's report as the caller read it
    (`UNREAD`: read here, quietly, where the array needs it)."""
    from stages.evaluate.backend import unset_backend
    from stages.evaluate.report import read_metrics

    recorded = recorded_setting(out)
    evaluate = recorded[1].get("evaluate") if recorded is not None and isinstance(recorded[1], dict) else None
    if not isinstance(evaluate, dict) or "attention_backend" not in evaluate or evaluate["attention_backend"]:
        return None
    if metrics is UNREAD:
        metrics = read_metrics(out, say=False)
    return unset_backend(evaluate.get("dtype"), metrics, recorded[1])  # damaged (None): unknown


def known_fingerprint(out: Path, fingerprint: str, settings: dict, earlier: list[dict] = ()) -> str:
    """The fingerprint OUT's loss array is recorded under when it is this one's earlier spelling (its settings held
    the store's path, which is no longer hashed, or no evaluation revision: `UNRECORDED_REVISION`'s; or named
    the tables by the version ids read, `earlier`, before they were named by content: `read_tables`), else
    `fingerprint`: such an array stays this setting's, its losses kept, and is recorded under the present
    spelling at its next write (`LossStore.refingerprint`)."""
    recorded = recorded_setting(out)
    if recorded is not None and recorded[0] != fingerprint and spelled_as(settings, earlier)(recorded[1]):
        return recorded[0]
    return fingerprint


def spelled_as(settings: dict, earlier: list[dict] = ()):
    """Is a loss array's recorded settings these (`settings`) or an earlier spelling of them (`earlier`, and
    `known_fingerprint`'s: the store's path, no evaluation revision)? One rule for the array in place and for the
    groups kept aside (`kept_groups`): one an earlier release kept aside under its hash of seeds and σ in the
    configured order was never taken back."""
    spellings = [settings, *earlier]

    def spelled(recorded) -> bool:
        return isinstance(recorded, dict) and \
            {"evaluation_revision": UNRECORDED_REVISION, **{k: v for k, v in recorded.items() if k != "store"}} \
            in spellings
    return spelled
