"""This start's inputs (the tables, opened by all ranks together, and the record of what it trains on) and where
it begins: a fresh run, a checkpoint to resume from (checked against this start), or the run the folder held kept
aside (`--new-run`); then the run folder's files, and restoring the checkpoint once the model is built."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from tqdm.auto import tqdm

from features.open import open_configured
from models.collective import all_max, differing_ranks, ranks_differ, spread, together
from models.lora import WEIGHT_NAME, load_lora
from models.same_versions import check_same_versions
from schemas.config import PipelineConfig, TrainConfig, dump_config
from schemas.errors import UserError
from schemas.lineage import unhashed_names
from schemas.model_files import ModelFile, fingerprint_of
from schemas.record_formats import EARLIER_FINGERPRINTS, UNRECORDED_BACKEND
from stages.train import damaged_log, elastic, guard, previous, shorter, state as train_state
from stages.train.current import damaged_current, nonfinite_current
from stages.train.data import DataStream, write_data_report
from stages.train.resume import CONFIG_FILE, changed_settings
from stages.train.settings import (check_control_dropout, has_masks, init_lora_sha256, known_fingerprint, masks_came,
                                   name_tables, recorded_backend, run_fingerprint, training_revision)
from stages.train.state import ResumeRecord
from store.format import atomic_write_bytes, atomic_write_json
from store.join import JoinedTables

if TYPE_CHECKING:
    from stages.train.recipe import Run


def open_tables(tc: TrainConfig, store: str | Path, model: str, accelerator) -> JoinedTables:
    """The `text` + `vae` samples this run trains on, opened by every rank together: a rank refused alone
    stops every rank, and so do ranks that read different versions (models/same_versions.py)."""
    world = accelerator.num_processes
    files = agreed_model_files(world, model)
    with together(world, "opening the store"):
        # the trainer prints the join's one line itself (`data.write_data_report`)
        tables = open_configured(tc, "train", store, model, files, "train", say_dropped=False)
    name_tables(tc, tables)
    try:
        check_same_versions(world, tables.versions(), tables.store_root, "train")
        with together(world, "train.control_dropout"):  # of the text table opened: its columns
            text = tables.readers["text"]
            check_control_dropout(tc, "nocontrol_embeds" in {f.name for f in text.schema.fields},
                                  f"table 'text' {text.dir.name} of {tables.store_root} was encoded")
    except BaseException:
        tables.close()
        raise
    return tables


def agreed_model_files(world: int, model: str) -> tuple[ModelFile, ...]:
    """The base model's files (`models.loading.model_files`), their fingerprint the same on every rank (so a
    table of another model is refused naming the same files on each). The ranks of a node hash its folder in turn
    (`FileHashes.alone`): the first reads the files, the others find them cached (one 41 GB read per node, not
    one per rank). Each node hashes its own copy, and a node whose files differ stops every rank with the same
    line (decided on the fingerprints' maximum and minimum over the ranks)."""
    from models.loading import model_files

    # uneven: each node hashes its own copy once (then cached): a slower disk's node comes minutes later
    with together(world, f"hashing the model {model}", uneven=True):
        files = model_files(model)
    (odd,) = differing_ranks(world, [fingerprint_of(files)])
    if odd:
        # no rank-local name in the line: every rank raises this same line
        raise UserError(f"the base model (--model) is not the same on every rank ({ranks_differ(odd)}): the nodes' "
                        "copies of its files differ (another version, or a copy cut short); copy the same model "
                        "folder to every node")
    return files


def start_record(tc: TrainConfig, tables: JoinedTables, model: str, world_size: int,
                 attention_backend: str | None = None) -> ResumeRecord:
    """What this start trains on (step, epoch and batch are filled in at each checkpoint); `attention_backend`:
    the one it resolved to (`settings.run_backend`)."""
    from models.loading import model_fingerprint

    return ResumeRecord(
        step=0, epoch=0, batch_in_epoch=0, config_fingerprint=run_fingerprint(tc, tables),
        tables=tables.versions(), store=str(Path(tables.store_root).resolve()),
        model_fingerprint=model_fingerprint(model), world_size=world_size, init_lora_sha256=init_lora_sha256(tc),
        training_revision=training_revision(tc), attention_backend=attention_backend,
    )


def check_same_start(world: int, record: ResumeRecord) -> None:
    """The train config (its precision as all ranks agreed on it), the init LoRA's bytes and the training revision are
    the same on every rank, or every rank stops with one line. Each rank reads --config / --set and the init LoRA itself: per-node copies
    that differ would have ranks with other step counts, checkpoint or validation steps wait in different
    collectives, or with another learning rate drift apart silently (rank 0's weights alone are saved)."""
    config, init, code = differing_ranks(world, [record.config_fingerprint, record.init_lora_sha256 or "0",
                                                 f"{record.training_revision:x}"])
    if config:
        # first: the training revision is one of the config (`training_revision`), so configs that differ in
        # e.g. grad_accum differ there too, and are no matter of installs
        # (not train.dtype: auto, which all ranks decided together: `settings.train_precision`)
        raise UserError(f"the ranks do not train with the same settings (their train config fingerprints differ: "
                        f"{ranks_differ(config)}): each node reads --config and --set itself, and the nodes' copies "
                        "of the config differ; use one config")
    if code:  # the same config (above), so different installs: their steps would be different maths in one LoRA
        raise UserError(f"the ranks do not run the same training code (training revisions differ between the "
                        f"nodes' installs of the pipeline: {ranks_differ(code)}); install the same release on every "
                        "node")
    if init:
        raise UserError(f"train.init_lora is not the same file on every rank (its bytes differ between the nodes' "
                        f"copies: {ranks_differ(init)}); copy the same LoRA to every node")


def _check_resumable(r: Run, record: ResumeRecord, latest: Path) -> None:
    """ResumeMismatch when the checkpoint `latest` (its `record`) cannot be continued by this start: other
    settings or tables (`check_matches`), samples or steps left out under a policy that is not on now, or past
    max_steps. Every rank calls it: the policies' counts are decided together."""
    # on_damaged / on_nonfinite are in no fingerprint (`check_same_start` does not compare them) and the damaged
    # list is read per rank: decided by all ranks together (any rank's refusal is every rank's), so no rank
    # resumes into a collective the others never reach
    steps = train_state.nonfinite_skipped(record)
    # what the checkpoint's steps left out (a killed later start's findings past it are no part of it)
    left_out, skipped = all_max(r.world, [0 if damaged_current(r.run_dir, r.cfg, record.step) else
                                          len(damaged_log.read(r.run_dir, up_to=record.step)),
                                          0 if nonfinite_current(record, r.cfg) else len(steps)])
    record.check_matches(r.record, latest, contents=r.tables.content_ids)
    if left_out:  # as the up-to-date check
        raise train_state.ResumeMismatch(
            f"cannot resume from {latest}: the run left {left_out} damaged sample(s) out under "
            f"train.on_damaged skip ({r.run_dir / damaged_log.NAME}), and train.on_damaged is not skip now"
            f"{'' if r.cfg.on_damaged != 'skip' else ' on every rank'}. Set train.on_damaged: skip to continue it",
            reason=f"train.on_damaged skip -> stop ({left_out} damaged sample(s) left out)")
    if skipped:
        shown = ", ".join(map(str, steps[:10])) + (" …" if len(steps) > 10 else "")
        raise train_state.ResumeMismatch(
            f"cannot resume from {latest}: the run skipped optimizer step(s) {shown} for a non-finite loss "
            f"or gradient under train.on_nonfinite skip_step, and train.on_nonfinite is not skip_step now"
            f"{'' if r.cfg.on_nonfinite != 'skip_step' else ' on every rank'}. Set train.on_nonfinite: skip_step "
            "to continue it",
            reason=f"train.on_nonfinite skip_step -> stop ({skipped} step(s) skipped)")
    if record.step > r.cfg.max_steps:
        point = None if shorter.depends_on_max_steps(r.cfg) else shorter.start_point(r.checkpoints, r.cfg.max_steps)
        if point is None:
            raise train_state.PastMaxSteps(
                f"{latest} is already past train.max_steps ({record.step} > {r.cfg.max_steps}) and no checkpoint at "
                f"or below step {r.cfg.max_steps} is kept to continue from: raise max_steps to continue, or use a "
                "new --out for a shorter run",
                reason=f"train.max_steps {record.step} -> {r.cfg.max_steps}, no checkpoint at or below it kept")
        raise train_state.PastMaxSteps(
            f"{latest} is already past train.max_steps ({record.step} > {r.cfg.max_steps}); under a constant LR its "
            f"steps up to {r.cfg.max_steps} are a straight run's: add --new-run to keep this run (moved to "
            f"{previous.previous_root(r.run_dir)}/N-TIME) and {_shorter_how(r, point)}",
            reason=f"train.max_steps {record.step} -> {r.cfg.max_steps}", point=point)


def _shorter_how(r: Run, point: Path, done: bool = False) -> str:
    """What a start to a lower max_steps does with the kept run's checkpoint `point` (`shorter`): to do (the
    refusal's advice), or `done` (the keep's line: what the fresh folder does)."""
    left = r.cfg.max_steps - train_state.step_of(point)
    take, go_on = ("takes", "continues") if done else ("take", "continue")
    return (f"{take} its checkpoint {point.name} as this run's LoRA (nothing to train)" if not left else
            f"{go_on} from its checkpoint {point.name} ({left} step(s) to train)")


def resume_point(r: Run, resume: bool, cfg: PipelineConfig) -> tuple[Path | None, ResumeRecord | None]:
    """The checkpoint to resume from and its record (checked against this start, files checked once), or
    (None, None); refuses to overwrite a run. Decided by every rank alike (`seen_run`, the record read together)."""
    latest, final = seen_run(r)
    if not resume and r.new_run and _holds_trained_run(r, latest, final):
        return keep_previous(r, "--new-run")
    # a damaged checkpoint first (the more fundamental line: a "pass --resume" before it only led to it); the
    # files' bytes, read once for their check, are kept for `restore` (a second read of every file per rank
    # doubled the shared filesystem's load)
    kept: dict[str, bytes] = {}
    record, none_left = _intact_record(r, latest, resume, kept)
    if none_left:  # --resume --new-run: kept, nothing deleted
        return keep_previous(r, f"no intact checkpoint is left in {r.checkpoints}")
    if latest is not None and not resume:
        raise UserError(_holds_checkpoints(r, latest, cfg))
    if latest is None and final:
        return _final_lora_only(r)
    if not resume or latest is None:
        return None, None
    # the fingerprints and backend the run's earlier checkpoints recorded, carried in its records: one training for
    # evaluate
    earlier = [*record.extra.get(EARLIER_FINGERPRINTS, ()), record.config_fingerprint]
    unrecorded = record.extra.get(UNRECORDED_BACKEND) or (
        r.record.attention_backend if record.attention_backend is None else None)
    record = _as_this_start_reads_it(r, record)
    try:
        _check_resumable(r, record, latest)
    except train_state.ResumeMismatch as e:
        return _not_resumable(r, resume, cfg, e, record.config_fingerprint)
    r.resume_bytes = kept
    _carry_records(r, earlier, unrecorded)
    return latest, record


def _holds_trained_run(r: Run, latest: Path | None, final: bool) -> bool:
    """`previous.holds_trained_run`, as agreed: a checkpoint, a final LoRA, or checkpoints a killed save left
    unrecorded on any rank."""
    (lost,) = all_max(r.world, [int(bool(train_state.unrecorded_checkpoints(r.checkpoints)))])
    return latest is not None or bool(final) or bool(lost)


def _final_lora_only(r: Run) -> tuple[Path | None, ResumeRecord | None]:
    """A finished run whose checkpoints are gone (deleted to save disk, or only lora/ copied): nothing to continue
    from, and a start at step 0 would replace its LoRA at the end. Kept (--new-run) or refused."""
    why = f"{r.run_dir} holds a final LoRA but no checkpoints to continue it from"
    if r.new_run:
        return keep_previous(r, why)
    raise UserError(f"{why}; a new run there would replace {r.run_dir / 'lora'}: use a new --out, or --new-run "
                    f"to keep it as {previous.previous_root(r.run_dir)}/N-TIME and train afresh")


def _as_this_start_reads_it(r: Run, record: ResumeRecord) -> ResumeRecord:
    """The checkpoint's `record` in this start's terms, for `_check_resumable`: a run made when batch_size was
    hashed under a token budget is this run when the rest agrees; one made before init LoRAs were hashed is taken
    as made from the present file (`known_init_lora`); a record from before the backend was recorded has the one
    its run used, where that is known (`recorded_backend`)."""
    backend = recorded_backend(record.attention_backend, record.config_fingerprint, r.cfg, r.run_dir,
                               r.record.attention_backend)
    if record.attention_backend is None and r.world > 1:  # each rank read RUN/attention.json: one decision of all
        (differs,) = all_max(r.world, [int(backend != r.record.attention_backend)])
        backend = None if differs else r.record.attention_backend
    known = known_fingerprint(record.config_fingerprint, r.cfg, r.record.attention_backend, has_masks(r.tables))
    return replace(record, config_fingerprint=known,
                   init_lora_sha256=train_state.known_init_lora(record.init_lora_sha256, r.record.init_lora_sha256),
                   attention_backend=backend)


def _not_resumable(r: Run, resume: bool, cfg: PipelineConfig, e: train_state.ResumeMismatch,
                   fingerprint: str = "") -> tuple[Path | None, ResumeRecord | None]:
    """A checkpoint this start cannot continue (every rank raised `e`: the newest step was agreed, `seen_run`):
    with --new-run the run is kept aside (a run past a lower max_steps under a constant LR: kept whole and its
    checkpoints up to it carried over, then resumed), else refused naming what changed."""
    # where to go on from is decided together too: one listing each
    if r.new_run and isinstance(e, train_state.PastMaxSteps) and not all_max(r.world, [int(e.point is None)])[0]:
        # the run's steps up to max_steps are this run's: kept whole, its checkpoints up to it carried over
        keep_previous(r, f"{e.reason} under a constant LR, whose steps up to it do not depend on max_steps: "
                         f"{r.run_dir} {_shorter_how(r, e.point, done=True)}",
                      then=lambda kept: shorter.seed(kept, r.run_dir, r.cfg.max_steps))
        return resume_point(r, resume, cfg)  # the fresh folder's newest checkpoint, checked as any resume's
    changed = _changed(r, cfg)
    came = masks_came(fingerprint, r.cfg, has_masks(r.tables))
    if came is not None and not any(c.startswith("train.loss.mask_weight") for c in changed):  # else named there
        changed.append(came)
    why = f"{e}\nchanged since {r.run_dir / CONFIG_FILE}:\n  " + "\n  ".join(changed) if changed else str(e)
    if r.new_run:
        return keep_previous(r, "; ".join([e.reason, *changed]))
    raise train_state.ResumeMismatch(
        f"{why}\nTo keep this run (moved to {previous.previous_root(r.run_dir)}/N-TIME) and train afresh into "
        f"{r.run_dir}, add --new-run (what `pipeline run all` does)", reason=e.reason) from None


def _carry_records(r: Run, earlier: list[str], unrecorded: str | None) -> None:
    """Into this run's record: the fingerprints (other than this start's) and the backend its earlier checkpoints
    recorded, so each checkpoint's record names them: one training for evaluate."""
    earlier = [f for f in dict.fromkeys(earlier) if f != r.record.config_fingerprint]
    if earlier:
        r.record = replace(r.record, extra={**r.record.extra, EARLIER_FINGERPRINTS: earlier})
    if unrecorded:
        r.record = replace(r.record, extra={**r.record.extra, UNRECORDED_BACKEND: unrecorded})


def _intact_record(r: Run, latest: Path | None, resume: bool,
                   kept: dict[str, bytes]) -> tuple[ResumeRecord | None, bool]:
    """The record of `latest` when resuming (its files checked, their bytes into `kept`; None when not resuming or
    with no checkpoint), after every rank looked for a damaged checkpoint (`check_no_unrecorded`, with or without
    --resume), and whether to keep the run aside. A damaged one stops every rank with its line, except where no
    intact checkpoint is left under `--resume --new-run`: (None, True), the run kept. Decided together: any rank's
    verdict is every rank's (a rank that cannot read the run is one this launch cannot continue)."""
    found: train_state.CheckpointDamaged | None = None
    record = None
    with together(r.world, f"reading {latest or r.checkpoints}"):  # other errors (a newer release's record): agreed
        try:
            train_state.check_no_unrecorded(r.checkpoints, latest)
            if resume and latest is not None:
                record = ResumeRecord.read(latest / train_state.RESUME_JSON, keep=kept)
        except train_state.CheckpointDamaged as e:
            found = e
    none_left, damaged = all_max(r.world, [int(found is not None and not found.intact_left), int(found is not None)])
    if none_left and resume and r.new_run:
        kept.clear()
        return None, True
    if damaged:
        with together(r.world, f"checking {r.checkpoints}"):  # the lowest damaged rank's line on every rank
            if found is not None:
                raise found
    return record, False


def _holds_checkpoints(r: Run, latest: Path, cfg: PipelineConfig) -> str:
    """Why a start without --resume does not train into a folder holding checkpoints, and the ways on: with
    settings other than those of the run's train_config.yaml, which (a resume continues it only under its own)."""
    keep = f"--new-run to keep it as {previous.previous_root(r.run_dir)}/N-TIME and train afresh"
    changed = _changed(r, cfg)
    if not changed and train_state.step_of(latest) > r.cfg.max_steps:  # a lower max_steps
        # under a decaying LR (listed in `changed` only where train_config.yaml reads) no checkpoint is continued
        point = None if shorter.depends_on_max_steps(r.cfg) else shorter.start_point(r.checkpoints, r.cfg.max_steps)
        shorten = "" if point is None else (f"pass --resume --new-run to keep it (moved to {previous.previous_root(r.run_dir)}"
                                            f"/N-TIME) and {_shorter_how(r, point)}, ")
        return f"{r.run_dir} already holds checkpoints ({latest.name}, past train.max_steps {r.cfg.max_steps}); " \
               f"{shorten}{keep}, or use a new --out"
    if not changed:
        return f"{r.run_dir} already holds checkpoints ({latest.name}); pass --resume to continue it, {keep}, " \
               "or use a new --out"
    return (f"{r.run_dir} already holds checkpoints ({latest.name}) trained with other settings "
            f"({r.run_dir / CONFIG_FILE} -> now):\n  " + "\n  ".join(changed) + "\n--resume continues it only "
            f"with the settings it was trained with (set those back); {keep} with these; or use a new --out")


def _changed(r: Run, cfg: PipelineConfig) -> list[str]:
    """The changed `train.*` settings against the run's train_config.yaml (`resume.changed_settings`), a changed
    max_steps with why it makes another run (it is listed only where the schedule depends on it)."""
    changed = changed_settings(r.run_dir, cfg.model_dump(mode="json"), unhashed_names(r.cfg))
    return [f"{c} ({shorter.why_retrained(r.cfg)})" if c.startswith("train.max_steps:") else c for c in changed]


def seen_run(r: Run) -> tuple[Path | None, bool]:
    """The run folder's newest committed checkpoint and whether it holds a final LoRA, as every rank sees them,
    checked to be the same on all (two integers each, one all-reduce). Each rank reads the folder itself; a shared
    filesystem whose directory caches lag on some nodes (a restart seconds after the last checkpoint) would
    otherwise have ranks resume from different steps, or some keep the old run (collectives the others never
    join) while the rest resume it: one line on every rank instead."""
    latest = train_state.latest_checkpoint(r.checkpoints)
    final = (r.run_dir / "lora").is_dir()
    step = train_state.step_of(latest) if latest is not None else -1
    (newest, oldest), (lora_high, lora_low) = spread(r.world, [step, int(final)])
    if newest == oldest and lora_high == lora_low:
        return latest, final
    seen = (f"newest checkpoint step-{newest} on some, {'none' if oldest == -1 else f'step-{oldest}'} on "
            "others" if newest != oldest else "a final LoRA on some, none on others")
    raise UserError(f"the ranks do not see the same run folder {r.run_dir} ({seen}): --out must be one folder "
                    "every rank sees alike; on a shared filesystem that has not caught up yet, rerun in a minute")


def keep_previous(r: Run, why: str, then: Callable[[Path], None] | None = None) -> tuple[None, None]:
    """Every rank has decided alike (from the same files); once all are past reading the old run, the main
    process moves it aside in one rename and locks the fresh folder. `then(kept)`: what it puts into the fresh
    folder from the kept run (the line then says `why` alone, which tells what it did)."""
    r.accelerator.wait_for_everyone()
    with together(r.world, "keeping the previous run"):  # rank 0 moves it (a failure there stops every rank)
        if r.main:
            if r.before_keep is not None:
                r.before_keep(r.run_dir)
            r.kept_previous = previous.keep(r.run_dir)
            earlier, r.run_lock = r.run_lock, guard.RunDirLock(r.run_dir)
            if earlier is not None:  # a second keep in this start (`shorter`'s folder refused): the first one's
                earlier.release()
            if then is not None:
                then(r.kept_previous)
            tqdm.write(f"kept the previous run of {r.run_dir} (its LoRA and checkpoints) in {r.kept_previous}; "
                       + (f"training afresh into {r.run_dir} ({why})" if then is None else why))
    return None, None


PRECISION_JSON = "precision.json"


def prepare_run_dir(r: Run, cfg: PipelineConfig, fresh: bool) -> None:
    """Main process: the checkpoints folder without stale temp folders, this start's effective config, the data
    report and, under several ranks, the precision they agreed on with each rank's own (`precision.json`; one
    process: none, train_config.yaml says it, and an earlier start's is removed). `fresh`: no checkpoint is
    resumed, so a killed earlier start's damaged-sample list, sample grids, TensorBoard events and profiler
    traces go (its curve does too: stages/train/val_curve.py); the folder holds no checkpoint and no final LoRA
    then (`resume_point`)."""
    r.checkpoints.mkdir(parents=True, exist_ok=True)
    train_state.remove_stale(r.checkpoints)
    if fresh:
        from stages.train.trackers import forget_logs
        from stages.train.validate import forget_grids  # here: its module loads the generation code

        damaged_log.forget(r.run_dir)
        forget_grids(r.run_dir)
        forget_logs(r.run_dir)
    atomic_write_bytes(r.run_dir / CONFIG_FILE, dump_config(cfg).encode())
    if r.precision is not None and r.precision.ranks is not None:
        from models.precision import precision_record

        atomic_write_json(r.run_dir / PRECISION_JSON, precision_record(r.precision))
    else:
        (r.run_dir / PRECISION_JSON).unlink(missing_ok=True)
    tqdm.write(write_data_report(r.run_dir, r.tables))


def restore(r: Run, latest: Path, record: ResumeRecord) -> None:
    """The checkpoint's state into the built model, optimizer, scheduler, RNG and EMA, from the bytes its check
    read (`resume_point`; each file handed over once, then dropped)."""
    kept, r.resume_bytes = r.resume_bytes or {}, None
    load_lora(r.transformer, latest / "lora", data=kept.pop(f"lora/{WEIGHT_NAME}", None))
    train_state.load_optimizer(r.optimizer, latest, kept)
    train_state.load_scheduler(r.scheduler, latest, kept)
    elastic.restore_rng(latest, r.rank, record.world_size == r.world, r.cfg.seed, record.step, kept,
                        cuda=r.device.type == "cuda")
    if r.ema is not None:
        r.ema.load(latest, kept)
    kept.clear()  # other ranks' RNG states
    r.step = record.step
    r.stream = DataStream(r.stream.sampler, record.epoch, record.batch_in_epoch)
    r.carried_losses, r.epoch_tokens, r.step_tokens = train_state.resumed_curve(record)  # the curve goes on as the straight run's
    if r.main:
        tqdm.write(f"resumed from {latest} (step {r.step}, epoch {record.epoch}, batch {record.batch_in_epoch})")
        if record.world_size != r.world:
            tqdm.write(elastic.change_line(record.world_size, r.world, record.canonical, r.cfg.lora.dropout))
