"""Planning an encode job: read the `images` table under a lease, build the lineage (and the ones hashed before
the declared scheme), and find out whether an identical version exists (up to date: under on_damaged=stop not
one that left damaged inputs out, stages/encode/current.py) or the current one is recorded as damaged (recompute
its damaged samples)."""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import pyarrow as pa

from schemas.errors import UserError
from schemas.fixes import made_since, revisions_before, transparency_noted
from schemas.lineage import Lineage, code_version, feature_lineage
from store import Store, repair_context
from store import format as fmt
from store.lease import hold
from store.reuse import FEATURE_LINEAGE_ATTR, LINEAGE_BEFORE_FIXES_ATTR
from store.writer_open import refuse_a_running_writer
from stages.encode.current import serving_version
from stages.encode.intake import check_any_allowed
from stages.encode.job import EncodeJob
from stages.encode.output import adopt
from stages.encode.ranks import Ranks
from stages.encode.summary import Summary

IMAGES_TABLE = "images"


Rule = Callable[[dict[str, Any], dict[str, Any]], bool]  # (images meta, stored row: `ROW_COLUMNS`) -> changed?


@dataclass(frozen=True)
class Fixes:
    """The fixes made since a stage's tables were stored, and which stored samples each changes (schemas/fixes.py):
    samples stored before a fix are carried forward unless it changes them, so a rerun recomputes exactly those.
    Two lists as resize-bucket's `FIXES` (schemas/fixes.py `made_since`): (revision, the rule of the fix made
    after it), oldest first; a sample stored under revision r is redone where a fix made since r says yes. A fix
    of the stage's own appends (n, its rule) to `own` and bumps its revision from "<name>.n" to "<name>.n+1"."""

    # this stage's own: revision n is its feature revision "<name>.n" (`open_job`'s `feature_revision` names the
    # current one), so a table several revisions behind redoes the rows any of the fixes since says yes to
    own: tuple[tuple[int, Rule], ...] = ()
    # resize-bucket's, by images revision: does its fix made after that revision change what this stage read?
    by_images: tuple[tuple[int, Rule], ...] = ()
    # the images meta columns the rules read (the meta they get holds only these): each is called once per
    # distinct value of them and of `ROW_COLUMNS` over a whole version (`changed_rows`), never per row
    reads: tuple[str, ...] = ()
    # those of the rules above whose yes says the sample's mask alone changed, its pictures rendered the same (so
    # its latents, which never read the mask): encode-vae keeps such a row's latents and computes its mask columns
    # (stages/encode/mask_only.py) instead of encoding it whole
    mask_only: tuple[Rule, ...] = ()


def own_revisions(fixes: Fixes, feature_revision: str) -> list[tuple[str, int]]:
    """(feature revision, its number) of each earlier revision of the stage whose tables stay current but for what
    its own fixes made since change, oldest first: ("vae.1", 1) under "vae.2"."""
    if not fixes.own:
        return []
    name, _, current = feature_revision.rpartition(".")
    if not (name and current.isdigit()):
        raise ValueError(f"feature revision {feature_revision!r} is not '<name>.<n>': its own fixes cannot be placed")
    return [(f"{name}.{r}", r) for r in revisions_before(fixes.own, int(current))]


NO_FIXES = Fixes()
# resize.keep_alpha changes only the pictures with transparency: a sample encoded from pictures rendered under the
# other value is carried unless its images row notes transparency (`_lineages_other_alpha`)
OTHER_ALPHA = Fixes(by_images=((0, lambda meta, row: transparency_noted(meta)),), reads=("conversions",))
ROW_COLUMNS = ("length", "empty_length")  # what a stored row gives the rules (text's; vae has neither)


def open_job(store_path: str | Path, stage: str, table: str, settings: dict[str, Any], model: str,
             feature_revision: str, ranks: Ranks, components: tuple[str, ...] = (), on_damaged: str = "stop",
             max_damaged_fraction: float = 0.0, earlier_hashes: tuple[str, ...] = (),
             fixes: Fixes = NO_FIXES, unread: tuple[str, ...] = (),
             serving_hashes: tuple[str, ...] = (),
             by_controls: Callable[[int, str], Any] | None = None,
             partial_hashes: tuple[str, ...] = ()) -> EncodeJob:
    """`_open_job` on every rank, then agreed on (models/collective/), for the features of `settings`
    (`settings.settings_record`: hashed into the lineage, recorded with the version): a rank that cannot open its inputs
    stops every rank with its line before any model is loaded (the others would wait at the commit). Whether the
    table is up to date is decided by all ranks together too (`_agreed_plan`). `serving_hashes`: feature hashes of
    settings whose tables hold all this run's would and more (`settings.serving_config_hashes`): a complete
    version of one is up to date as well. `by_controls`: the model's rule on a sample's control count
    (`intake.read_inputs`): a table it refuses whole stops every rank here, before any model loads.
    `partial_hashes`: feature hashes of settings whose tables hold part of this run's columns (encode-text without
    no_control_embeds): their samples are completed, not encoded whole (`EncodeJob.partial_lineages`)."""
    from models.collective import together

    job = None
    try:
        # uneven: each node hashes its own copy of the model here, once (then cached): a slower disk's node comes
        # minutes later, waited for through the launcher's store (models/collective/arrive.py `arrive_together`)
        with together(ranks.world_size, f"{stage}: opening the inputs", uneven=True):
            job, found = _open_job(store_path, stage, table, settings, model, feature_revision, ranks,
                                   components, on_damaged, max_damaged_fraction, earlier_hashes, fixes, unread,
                                   serving_hashes, partial_hashes)
        found = _agreed_plan(job, found)
        if found is not None:
            from stages.encode.commit import push_node_rows

            with together(ranks.world_size, f"{stage}: reusing table '{table}' v{found}"):
                adopt(job, found)
            push_node_rows(job)  # a merge of this node's rows that failed after the commit is redone
            job.summary.seconds = time.perf_counter() - job.started
            job.close()  # nothing to read: the stage returns the summary
            return job
        job.by_controls = by_controls
        with together(ranks.world_size, f"{stage}: the samples the model takes"):  # one verdict on every rank
            check_any_allowed(job, by_controls, model)
            _check_writable(job.store.root, table)
            refuse_a_running_writer(job.store.root, table, ranks.rank)  # a second encode of the store: before the load
    except BaseException:
        if job is not None:  # another rank failed: this one's reader and lease go now
            job.close()
        raise
    _note_damaged_current(job, job.store, stage, table)
    return job


def _check_writable(root: Path, table: str) -> None:
    """The folder the table's new version goes to (the store's, before its first version), probed before the
    model loads: a store on a read-only mount was told at the writer's first file, after the model had loaded
    (minutes for a VL model). Not where the table is up to date: a read-only store whose tables are is read."""
    from store.io_errors import check_writable

    check_writable(root / table if (root / table).is_dir() else root, f"table '{table}'")


def _agreed_plan(job: EncodeJob, found: int | None) -> int | None:
    """The `images` version every rank reads (models/same_versions.py) and the version every rank reuses,
    agreed by all of them. Each rank leases the current `images` and looks for an identical version itself;
    a resize-bucket commit between two ranks' looks, or a shared filesystem whose view lags on one node, would
    otherwise have ranks encode different inputs, or one rank return "up to date" while the others encode and
    wait for it at the commit. Different `images`: one line on every rank. A version found by some ranks only
    (or different ones): every rank encodes (a duplicate version at worst; the check after the model loads,
    `output.agreed_found`, adopts one a concurrent run committed meanwhile)."""
    from models.collective import differing_ranks, ranks_differ, spread
    from models.same_versions import check_same_versions
    from schemas.lineage import settings_hash

    world = job.ranks.world_size
    if world <= 1:
        return found
    check_same_versions(world, {IMAGES_TABLE: job.images_id}, job.store.root, job.summary.stage)
    # what the table is written under: each rank hashes its own copy of the model and reads the config itself
    model, lineage = differing_ranks(world, [job.lineage.model_fingerprint, settings_hash(job.lineage.to_dict())])
    if model or lineage:
        raise UserError(f"{job.summary.stage}: " + (
            f"the model (--model) is not the same on every rank ({ranks_differ(model)}): the nodes' copies of its "
            "files differ (another version, or a copy cut short); copy the same model folder to every node" if model
            else f"the ranks do not encode with the same settings ({ranks_differ(lineage)}; each node reads --config "
            "and --set itself); use one config"))  # (dtype: auto is agreed on before: `settings.resolve_precision`)
    ((newest, oldest),) = spread(world, [-1 if found is None else found])
    return newest if newest >= 0 and newest == oldest else None


def _open_job(store_path: str | Path, stage: str, table: str, settings: dict[str, Any], model: str,
              feature_revision: str, ranks: Ranks, components: tuple[str, ...] = (), on_damaged: str = "stop",
              max_damaged_fraction: float = 0.0, earlier_hashes: tuple[str, ...] = (),
              fixes: Fixes = NO_FIXES, unread: tuple[str, ...] = (),
              serving_hashes: tuple[str, ...] = (),
              partial_hashes: tuple[str, ...] = ()) -> tuple[EncodeJob, int | None]:
    """Read the `images` table, build the lineages (`_job_lineages`), and find out whether an identical version
    already exists (this rank's look: `open_job` agrees on it). `unread`: render settings this stage does not read
    (schemas/pictures_lineage.py): its samples' lineage leaves them out.

    An identical complete version is made current and reused ("up to date"), as is one of settings that only add
    columns (`serving_hashes`); anything else that differs (model fingerprint, config, images version, code
    revision) leads to a new version, never a silent reuse. An incomplete version of such settings is not resumed
    (a writer resumes only its own schema, and finishing it would encode the columns this run was not asked for).
    """
    from schemas.lineage import settings_hash

    path = Path(store_path)
    if not (path / "store.json").is_file():
        raise UserError(f"no store at {path} (no store.json); run `pipeline run resize-bucket --store {path}` first")
    store = Store(path, create=False)
    # A read lease on the images version (store/lease.py): `store gc` keeps it while this stage reads it.
    lease = hold(store.root, {IMAGES_TABLE: None}, stage)
    images = job = None
    try:
        images = store.reader(IMAGES_TABLE, lease.version(IMAGES_TABLE), on_damaged=on_damaged)
        # The images version's identity (not just its number) goes into the hash: a deleted and rebuilt images
        # table restarts at v1 with other contents, and must not match features encoded from the old one.
        images_id = images.view.version_id()
        lineages = _job_lineages(store, images, images_id, stage, table, settings_hash(settings), model, components,
                                 feature_revision, earlier_hashes, fixes, unread, serving_hashes, partial_hashes)
        repair_context.check(lineages.lineage, table)
        summary = Summary(stage=stage, table=table, rank=ranks.rank, world_size=ranks.world_size, store=str(path),
                          quarantine_file=str(store.root / "quarantine.parquet"))
        job = EncodeJob(store=store, images=images, images_id=images_id, lineage=lineages.lineage, ranks=ranks,
                        summary=summary, feature_lineage=lineages.feature, earlier_lineages=lineages.earlier,
                        lease=lease, on_damaged=on_damaged, settings=settings,
                        max_damaged_fraction=max_damaged_fraction, changed_by_fixes=lineages.changed_by_fixes,
                        serving=lineages.serving, model_files=lineages.model_files,
                        partial_lineages=lineages.partial, part_record=lineages.part_record)
        weakref.finalize(job, lease.release)
        found = _reusable_version(job, lineages.hashed_before, fixes, feature_revision)
        if found is None and ranks.rank == 0 and not repair_context.active():
            _say_why_new(job)
        return job, serving_version(store, stage, table, found, on_damaged, say=ranks.rank == 0,
                                    remote_rows=ranks.rank == 0)  # the ranks then agree (`_agreed_plan`)
    except BaseException:  # (a model fingerprint that fails, a store error): nothing of this job is left open
        if job is not None:
            job.close()
        else:
            if images is not None:
                images.close()
            lease.release()
        raise


class JobLineages(NamedTuple):
    """What an encode job is written and looked up under (`_job_lineages`)."""

    lineage: Lineage  # the version's (under `store repair`: the repaired version's own, where it is another)
    feature: str  # its samples' feature lineage (store/reuse.py)
    earlier: tuple[str, ...]  # feature lineages whose stored samples are carried forward too
    # those of samples stored before a fix (among `earlier`) -> "does a fix change this stored row?"
    changed_by_fixes: dict[str, Callable[[pa.Table], np.ndarray]]
    hashed_before: list[Lineage]  # the version's lineage as hashed before the declared scheme
    serving: tuple[Lineage, ...]  # versions of settings that store more (extra columns): they serve this run too
    model_files: tuple  # the model's files (schemas/model_files.py), recorded in the version's schema
    partial: tuple[str, ...] = ()  # feature lineages of samples holding part of this run's columns (completed)
    # what the version records of them: that of the settings as hashed now, as `feature_lineage` names its own;
    # not the earlier spellings' (which follow `device`) nor those of the store's other `images` versions: the
    # schema, compared whole on a store URL, would differ between runs and caches of the very same settings
    part_record: tuple[str, ...] = ()


def _job_lineages(store: Store, images, images_id: str, stage: str, table: str, feature_hash: str, model: str,
                  components: tuple[str, ...], feature_revision: str, earlier_hashes: tuple[str, ...], fixes: Fixes,
                  unread: tuple[str, ...], serving_hashes: tuple[str, ...],
                  partial_hashes: tuple[str, ...] = ()) -> JobLineages:
    """The lineages of a job encoding `images` (its version's identity: `images_id`) with the settings hashed as
    `feature_hash` (the other arguments: `open_job`'s): of the version, of its samples (over the part of the
    pictures the stage reads), and those of earlier samples it carries forward (hashed before the declared scheme,
    over the whole pictures, stored before a fix) or completes (`partial_hashes`, looked up the same ways). Under
    `store repair`, those of the version repaired."""
    from models.loading import component_fingerprint, model_files
    from schemas.model_files import fingerprint_of

    files = model_files(model)  # one walk: the fingerprint and the record of the files (schemas/model_files.py)
    lineage = Lineage(
        stage=stage, config_hash=f"{feature_hash}-images:{images_id}", model_fingerprint=fingerprint_of(files),
        upstream={IMAGES_TABLE: images.version}, code_version=code_version(feature_revision),
    )
    # Per-sample reuse: the features depend on these settings, the components loaded and the images' own
    # feature lineage (render settings), not on the images version (a relabelled split is the same pixels).
    whole = _images_feature_lineage(store, images, images_id)
    reads = _read_lineage(images.schema, unread)
    upstream = reads or whole
    fingerprint = component_fingerprint(model, components) if components else lineage.model_fingerprint
    superseding = _supersedes_repaired(lineage, images_id, earlier_hashes, fixes, feature_revision)
    if reads is not None and not superseding and _repairs_whole_lineage(store, table, {
            feature_lineage(stage, h, fingerprint, code_version(rev), whole)
            for h in (feature_hash, *earlier_hashes)
            for rev in (feature_revision, *(r for r, _ in own_revisions(fixes, feature_revision)))}):
        upstream = whole  # `store repair` of a version encoded before `unread`: completed under its own lineage
    samples = _SampleLineages(store, images, stage, fingerprint, feature_revision, upstream, whole, reads, unread,
                              fixes)
    (fl, *earlier), same_reads, changed = samples.of((feature_hash, *earlier_hashes))
    # The same features as hashed before the declared lineage scheme (tables encoded then stay current, and
    # `store repair` of such a table resumes its repair version under its own lineage).
    hashed_before = [(replace(lineage, config_hash=f"{h}-images:{images_id}"), e) for h, e in zip(earlier_hashes, earlier)]
    # Versions of settings that store more (extra columns): they serve this run too, but not a repair, which
    # completes the version it repairs under that version's own lineage.
    serving = [] if repair_context.active() else \
        [replace(lineage, config_hash=f"{h}-images:{images_id}") for h in serving_hashes]
    lineage, fl = next(((old, e) for old, e in hashed_before if repair_context.expected() == old), (lineage, fl))
    partial, partial_reads, partial_changed = samples.of(partial_hashes) if partial_hashes else ([], [], {})
    return JobLineages(lineage=lineage, feature=fl, earlier=tuple(dict.fromkeys((*earlier, *same_reads, *changed))),
                       changed_by_fixes={**partial_changed, **changed}, hashed_before=[old for old, _ in hashed_before],
                       serving=tuple(serving), model_files=files,
                       partial=tuple(dict.fromkeys((*partial, *partial_reads, *partial_changed))),
                       part_record=tuple(partial[:1]))


@dataclass(frozen=True)
class _SampleLineages:
    """What the feature lineages of a job's samples are hashed from, but the settings' hash (`of`)."""

    store: Store
    images: Any
    stage: str
    fingerprint: str
    revision: str
    upstream: str  # the images' read lineage, else their whole one
    whole: str
    reads: str | None
    unread: tuple[str, ...]
    fixes: Fixes

    def of(self, hashes: tuple[str, ...]) -> tuple[list[str], list[str], dict[str, Callable[[pa.Table], np.ndarray]]]:
        """For these settings' hashes: (their samples' lineage each, in order; those of samples encoded from
        pictures whose read part was the same, stored under their whole lineage as every sample was before
        `unread`; those of samples stored before a fix or under the other keep_alpha -> "changed?")."""
        stage, fp, code = self.stage, self.fingerprint, code_version(self.revision)
        own = [feature_lineage(stage, h, fp, code, self.upstream) for h in hashes]
        same_reads = [feature_lineage(stage, h, fp, code, w)
                      for w in _same_read_lineages(self.store, self.reads, self.unread) for h in hashes]
        changed = {}
        befores = _pictures_before_fixes(self.images.schema, self.unread)
        for up, before in {(self.upstream, tuple((read or whole_b, r) for read, whole_b, r in befores)),
                           (self.whole, tuple((whole_b, r) for _, whole_b, r in befores))}:  # under either scheme
            changed.update(_lineages_before_fixes(self.images, self.fixes, stage, hashes, fp, self.revision, up,
                                                  before))
        changed.update(_lineages_other_alpha(self.images, stage, hashes, fp, self.revision, self.unread))
        return own, same_reads, changed


def _supersedes_repaired(lineage: Lineage, images_id: str, earlier_hashes: tuple[str, ...], fixes: Fixes,
                         feature_revision: str) -> bool:
    """Under `store repair` of a version encoded before this stage's fixes (this run's lineage, or one hashed
    before the declared scheme, under the revision before them): the samples recomputed are this revision's, so
    the job writes under this run's lineage (store/repair_context.py `supersede`) - a new version recomputing the
    damaged samples and those the fixes change, the rest carried - and the next run reuses every sample. Before,
    they were written under the old revision's lineage and the next run recomputed them again."""
    befores = [code_version(rev) for rev, _ in own_revisions(fixes, feature_revision)]
    if not befores or not repair_context.active():
        return False
    olds = [lineage, *(replace(lineage, config_hash=f"{h}-images:{images_id}") for h in earlier_hashes)]
    if repair_context.expected() not in [replace(old, code_version=before) for old in olds for before in befores]:
        return False
    repair_context.supersede(lineage)
    return True


def _say_why_new(job: EncodeJob) -> None:
    """One line: what differs between this run and the table's newest complete version (its settings, named
    where both record them; the model; the `images` version; the code revision), as train says why it trains
    afresh (`schemas.up_to_date`). Nothing when there is none, or nothing differs (a version recorded as damaged,
    whose samples this run recomputes: `_note_damaged_current` says so)."""
    from tqdm.auto import tqdm

    from schemas import up_to_date
    from stages.encode.settings import SETTINGS_ATTR

    table, section = job.summary.table, job.summary.stage.replace("-", "_")
    newest = job.store.newest_complete(table)
    if newest is None:
        return
    version, schema = newest
    differences = up_to_date.lineage_differences(
        schema.lineage, job.lineage, {"settings": f"{section} settings", "data": "input"})
    before = schema.attrs.get(SETTINGS_ATTR)
    if isinstance(before, dict) and differences:
        # the section's keys (a setting added later is hashed, and recorded, only away from its default:
        # `schemas.lineage`); the stage's extras derived from them and the model (the effective prompt format)
        # only where no key of the section differs
        sections = [record.get("section") or {} for record in (before, job.settings)]
        extras = [{k: v for k, v in record.items() if k != "section"} for record in (before, job.settings)]
        differences += up_to_date.changed_settings(*sections, section, missing="(default)") or \
            up_to_date.changed_settings(*extras, section)
    if schema.lineage.model_fingerprint != job.lineage.model_fingerprint:  # which of the model's files differ
        from schemas.model_files import MODEL_FILES_ATTR, differing_files

        files = differing_files(schema.attrs.get(MODEL_FILES_ATTR), job.model_files)
        differences += [files] if files else []
    if differences:
        tqdm.write(up_to_date.new_version_line(job.summary.stage, table, version, differences))


def _reusable_version(job: EncodeJob, hashed_before: list[Lineage], fixes: Fixes, feature_revision: str) -> int | None:
    """A complete version this run would make (`_identical_version`), or, outside a repair, one made before this
    stage's fixes that none made since its revision changes (`_unchanged_by_fixes`; the newest revision first)."""
    table = job.summary.table
    found = _identical_version(job.store, table, job.lineage, hashed_before, job.serving)
    if found is not None or repair_context.active():
        return found
    for revision, since in reversed(own_revisions(fixes, feature_revision)):
        for old in (job.lineage, *hashed_before, *job.serving):
            if (found := _unchanged_by_fixes(job.store, table, job.images, old,
                                             replace(old, code_version=code_version(revision)), fixes,
                                             since)) is not None:
                return found
    return None


def _lineages_before_fixes(images, fixes: Fixes, stage: str, feature_hashes: tuple[str, ...], fingerprint: str,
                           revision: str, upstream: str, upstreams_before: tuple[tuple[str, int | None], ...]
                           ) -> dict[str, Callable[[pa.Table], np.ndarray]]:
    """feature lineage the samples were stored under before a fix (this stage's; the images': `upstreams_before`,
    each with its images revision, none where the images record none) -> stored rows -> "does a fix change
    each?" (`changed_rows`): such versions give the rows no fix changes (store/reuse.py)."""
    revisions = [(revision, None), *own_revisions(fixes, revision)]  # (feature revision, own fixes since it)
    upstreams = [(upstream, None)] + [(up, since) for up, since in upstreams_before if up != upstream]

    def changed_by(own_since: int | None, images_since: int | None) -> Callable[[pa.Table], np.ndarray]:
        return ChangedRows(images, fixes, own_since, images_since)

    return {feature_lineage(stage, h, fingerprint, code_version(rev), up): changed_by(own_since, images_since)
            for h in feature_hashes for rev, own_since in revisions for up, images_since in upstreams
            if own_since is not None or images_since is not None}


def _lineages_other_alpha(images, stage: str, feature_hashes: tuple[str, ...], fingerprint: str, revision: str,
                          unread: tuple[str, ...]) -> dict[str, Callable[[pa.Table], np.ndarray]]:
    """feature lineage of samples encoded from these pictures rendered under the other resize.keep_alpha -> stored
    rows -> "changed?" (those whose images row notes transparency): a flip re-encodes only the samples with a
    transparent picture, not every sample (hours at 1M for the same features)."""
    from schemas.pictures_lineage import other_alpha_lineages

    attrs = images.schema.attrs
    ups = other_alpha_lineages(attrs.get("resize"), attrs.get(FEATURE_LINEAGE_ATTR), images.schema.lineage.code_version,
                               unread)

    def changed(rows: pa.Table) -> np.ndarray:
        return changed_rows(images, OTHER_ALPHA, rows, own_since=None, images_since=0)

    return {feature_lineage(stage, h, fingerprint, code_version(revision), up): changed
            for h in feature_hashes for up in ups}


def _images_fixes_since(fixes: Fixes, revision: int | None) -> list[Rule]:
    """This stage's rules for the images' fixes made since their `revision` (None: no images fix; 0: every one,
    for a revision this code cannot tell)."""
    return made_since(fixes.by_images, revision)


@dataclass(frozen=True)
class ChangedRows:
    """stored rows -> does a fix change each (`changed_rows`); `beyond_mask` / `mask_alone`: the same split by
    the fixes' `mask_only` rules (encode-vae: rows whose mask alone a fix changed keep their latents)."""

    images: Any
    fixes: Fixes
    own_since: int | None
    images_since: int | None

    def __call__(self, rows: pa.Table) -> np.ndarray:
        return changed_rows(self.images, self.fixes, rows, self.own_since, self.images_since)

    def beyond_mask(self, rows: pa.Table) -> np.ndarray:
        """Does a fix change more of each row than its mask (a rule not `mask_only` says yes)?"""
        return changed_rows(self.images, self.fixes, rows, self.own_since, self.images_since, mask_only=False)

    def mask_alone(self, rows: pa.Table) -> np.ndarray:
        """Of rows no fix changes `beyond_mask`: does a `mask_only` rule say yes (its mask changed)?"""
        return changed_rows(self.images, self.fixes, rows, self.own_since, self.images_since, mask_only=True)


def changed_rows(images, fixes: Fixes, rows: pa.Table, own_since: int | None, images_since: int | None,
                 mask_only: bool | None = None) -> np.ndarray:
    """Per stored row (`key`, `ROW_COLUMNS`): does a fix change it (this stage's own made since its revision
    `own_since`; the images' made since their revision `images_since`; None: none)? Yes for a key `images` lacks.
    `mask_only`: only the rules that are (True) or are not (False) among `fixes.mask_only`; None: every one.
    The rules see the images' `Fixes.reads` and the row's `ROW_COLUMNS` and are called once per distinct value of
    those (store/row_rule.py): row by row, each row's whole images meta as Python objects, it was ~80-100 s and
    2.8 GB at 1M rows, now ~2.6 s (bench/fix_rules.py)."""
    from store.row_rule import Declared, per_distinct

    rules = made_since(fixes.own, own_since) + _images_fixes_since(fixes, images_since)
    if mask_only is not None:
        rules = [rule for rule in rules if any(rule is m for m in fixes.mask_only) == mask_only]
    at = images.rows_of_keys(rows.column("key"))
    out = at < 0
    there = np.flatnonzero(~out)
    if not len(there):
        return out
    cols = {}
    for c in fixes.reads:
        if c == "img_shapes" and images.view.is_v1:  # derived from a v1 table's pixel sizes, as `meta` gives it
            cols[f"meta:{c}"] = pa.array([[list(s) for s in images.img_shapes_at(int(i))] for i in at[there]])
        elif images.has_column(c):  # (one the table lacks: absent from the meta, as from `meta(key)`)
            cols[f"meta:{c}"] = images.column(c).take(pa.array(at[there]))
    for c in ROW_COLUMNS:
        if c in rows.column_names:
            cols[f"row:{c}"] = rows.column(c).take(pa.array(there))

    def changed(values: dict[str, Any]) -> bool:
        meta = Declared({k[5:]: v for k, v in values.items() if k.startswith("meta:")}, fixes.reads)
        row = Declared({k[4:]: v for k, v in values.items() if k.startswith("row:")}, ROW_COLUMNS)
        return any(rule(meta, row) for rule in rules)

    out[there] = per_distinct(pa.table(cols), changed) if cols else changed({})
    return out


def _unchanged_by_fixes(store: Store, table: str, images, wanted: Lineage, before: Lineage,
                        fixes: Fixes, since: int) -> int | None:
    """A complete version of this lineage under an earlier revision of this stage (`before`, the same `images`
    version), none of whose samples its fixes made since that revision (`since`) change: still current, so nothing
    downstream reruns. A yes is recorded with the version for `wanted` (its images version and revision: all the
    predicates read), so a rerun of an unchanged store reads no rows (store/reuse.py `unchanged_by_fixes`)."""
    from schemas.lineage import settings_hash
    from store.manifest_files import checked_manifest
    from store.reuse import unchanged_by_fixes

    found = store.find_version(table, before)
    if found is None:
        return None

    def none_changed() -> bool:
        try:
            # the columns an `own` rule reads from a stored row (the rest comes from the images meta)
            rows = checked_manifest(store.version_dir(table, found), ["key", *ROW_COLUMNS])
        except UserError:
            return False
        return not changed_rows(images, fixes, rows, own_since=since, images_since=None).any()

    return found if unchanged_by_fixes(store, table, found, settings_hash(wanted.to_dict()), none_changed) else None


def _images_feature_lineage(store: Store, images, images_id: str) -> str:
    """The images' own feature lineage (render settings), or their version's identity; a table migrated from
    v1 keeps the identity of the version it was migrated from (the very same pixels)."""
    upstream = images.schema.attrs.get(FEATURE_LINEAGE_ATTR) or images_id
    origin = images.schema.attrs.get("migrated_from")  # v1 -> v2 migration: the very same pixels
    if FEATURE_LINEAGE_ATTR not in images.schema.attrs and origin is not None and \
            (store.version_dir(IMAGES_TABLE, int(origin)) / "manifest.parquet").is_file():
        upstream = store.version_id(IMAGES_TABLE, int(origin))
    return upstream


def _repairs_whole_lineage(store: Store, table: str, whole: set[str]) -> bool:
    """Under `store repair`: is the version repaired one whose samples are recorded under the images' whole
    lineage (`whole`: this run's feature lineages over it), encoded before its stage left out what it does not
    read? The repair version holds that version's schema, which the stage's writer resumes only as it is (under
    the read lineage it made another version, and the repair stopped: "did not complete"). Read unchecked: the
    repair version is in progress (no checksums.json yet), and repair checked the schema it copies."""
    from store.manifest_files import read_schema

    expected = repair_context.expected()
    if expected is None:
        return False
    for v in fmt.list_versions(store.root, table):
        try:
            schema = read_schema(store.version_dir(table, v))
        except UserError:  # a damaged schema.json: not the version repaired (repair refuses those)
            continue
        if schema.lineage == expected and schema.attrs.get(FEATURE_LINEAGE_ATTR) in whole:
            return True
    return False


def _pictures_before_fixes(schema, unread: tuple[str, ...]) -> list[tuple[str | None, str, int]]:
    """(read lineage or None, whole lineage, images revision) of the pictures of an `images` version as each
    earlier revision of resize-bucket rendered them (the ones it records: schemas/pictures_lineage.py); revision 0
    where the code version is not one this code can name (every images fix is then taken to apply)."""
    from schemas.pictures_lineage import CODE_BEFORE_FIXES_ATTR, images_revision, read_lineage, recorded_before_fixes

    pairs = recorded_before_fixes(schema.attrs.get(LINEAGE_BEFORE_FIXES_ATTR), schema.attrs.get(CODE_BEFORE_FIXES_ATTR))
    return [(read_lineage(schema.attrs.get("resize"), whole, code, unread) if unread else None, whole,
             images_revision(code) or 0) for code, whole in pairs]


def _read_lineage(schema, unread: tuple[str, ...]) -> str | None:
    """The lineage of the pictures of an `images` version this stage reads. None: it reads them all, or the
    version's record cannot tell (made by an earlier release): the whole one is used."""
    from schemas.pictures_lineage import read_lineage

    if not unread:
        return None
    return read_lineage(schema.attrs.get("resize"), schema.attrs.get(FEATURE_LINEAGE_ATTR),
                        schema.lineage.code_version, unread)


def _same_read_lineages(store: Store, reads: str | None, unread: tuple[str, ...]) -> list[str]:
    """The whole feature lineages of the complete `images` versions whose read part is `reads` (schema.json of
    each: a few versions, read once per run). Unchecked: `read_lineage` rehashes the recorded settings and code
    version and matches them against the recorded lineage, so a flipped bit in any of the three matches none."""
    from store.manifest_files import read_schema

    if reads is None:
        return []
    found = []
    for v in fmt.list_versions(store.root, IMAGES_TABLE):
        vdir = store.version_dir(IMAGES_TABLE, v)
        if not fmt.is_complete(vdir):
            continue
        try:
            schema = read_schema(vdir)
        except UserError:  # an unreadable old version: its samples are not carried, nothing else
            continue
        if _read_lineage(schema, unread) == reads:
            found.append(schema.attrs[FEATURE_LINEAGE_ATTR])
    return found


def _identical_version(store: Store, table: str, lineage: Lineage, hashed_before: list[Lineage],
                       serving: Sequence[Lineage] = ()) -> int | None:
    """A complete version of `table` with this lineage or a `serving` one (the current one first: a switch to
    settings it serves moves nothing downstream), or with one of the lineages hashed before the declared scheme;
    never a version recorded as damaged."""
    found = store.find_version(table, lineage, serving)
    for old in hashed_before if found is None else ():
        found = store.find_version(table, old)
        if found is not None:
            break
    return found


def _note_damaged_current(job: EncodeJob, store: Store, stage: str, table: str) -> None:
    """A current version recorded as damaged (outside `store repair`): this job recomputes its damaged samples."""
    current = store.tables().get(table)
    if current is not None and fmt.damaged_marker(store.root, table, current).exists() and not repair_context.active():
        from tqdm.auto import tqdm

        from schemas.newer import WrittenByNewer
        from store.manifest_files import checked_schema

        job.repairing = current
        try:
            checked_schema(store.version_dir(table, current), record=False)
            how = "recomputing its damaged samples into a new version, carrying the intact ones forward"
        except WrittenByNewer:
            raise
        except UserError:  # the lineage that vouches for its samples is in the damaged file: none is carried
            how = (f"its {fmt.SCHEMA_JSON} / {fmt.CHECKSUMS} does not read, so every sample is encoded again into "
                   "a new version")
        tqdm.write(f"{stage}: table '{table}' v{current} is recorded as damaged "
                   f"({fmt.damaged_marker(store.root, table, current)}): {how}")
