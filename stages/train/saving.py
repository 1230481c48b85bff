"""Writing what training made: each checkpoint (agreed on by all ranks, committed by rename), the final LoRA,
and `cleanup`, the last phase, which closes whatever setup opened."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from models.collective import together
from models.ema_file import LORA_EMA
from models.lora import save_lora
from schemas.units import count_text
from stages.train import guard, state as train_state
from stages.train.prefetch import data_wait_line
from stages.train.result import TrainResult
from store.format import atomic_dir, pause_point

if TYPE_CHECKING:
    from stages.train.recipe import Run


def checkpoint(r: Run) -> None:
    """Every rank adds its RNG state; rank 0 writes the rest, the resume record last, and commits the folder
    (rename) once all are in. Each part is agreed on by all ranks (models/collective/, also the barriers):
    a full disk on rank 0 stops every rank with rank 0's one line, instead of the others waiting for it."""
    epoch, batch = r.position
    # the trackers' state too: a resume off the log cadence or mid-epoch logs the straight run's curve, under another
    # log_every as well (its first window may begin before this one's last log point: the last KEPT_LOSSES kept)
    kept = min(r.step, max(r.cfg.log_every, train_state.KEPT_LOSSES))
    since_log = r.logged_losses(kept)
    extra = {**r.record.extra, **train_state.curve_state(since_log, r.epoch_tokens, r.step_tokens[-kept:])}
    if r.damage is not None:  # the damaged-sample limit goes on counting across a resume
        extra[train_state.DAMAGED_READS] = [r.damage.damaged, r.damage.read]
    record = replace(r.record, step=r.step, epoch=epoch, batch_in_epoch=batch, extra=extra)
    acc, tmp = r.accelerator, train_state.temp_dir(r.checkpoints, r.step)
    final = train_state.checkpoint_dir(r.checkpoints, r.step)
    what = f"checkpoint step-{r.step}"

    def step_of_all(part: str, uneven: bool = False):
        return together(r.world, f"{what} ({part})", uneven=uneven)

    with ExitStack() as folder:  # rank 0's temp folder: committed by `folder.close()`, removed on an error
        with step_of_all("temp folder"), guard.one_line_errors(what, r.checkpoints, guard.resume_advice(r.rerun)):
            if r.main:
                guard.check_lora_finite(r.params, final)
                folder.enter_context(atomic_dir(final, tmp))
        with step_of_all("RNG state"), guard.one_line_errors(what, r.checkpoints, guard.resume_advice(r.rerun)):
            train_state.save_rng(tmp, acc.process_index, cuda=r.device.type == "cuda")
        # uneven: rank 0 writes alone (GBs of a large LoRA's optimizer state and EMA, fsynced) while the others wait
        with step_of_all("write", uneven=True), guard.one_line_errors(what, r.checkpoints,
                                                                      guard.resume_advice(r.rerun)):
            if r.main:
                save_lora(r.transformer, tmp / "lora", base_fingerprint=r.record.model_fingerprint)
                train_state.save_optimizer(r.optimizer, tmp)
                train_state.save_scheduler(r.scheduler, tmp)
                if r.ema is not None:
                    r.ema.save(tmp)
                # what the run reads, by content (hashed at setup): a resume from tables carried forward whole
                # into new versions continues this run (`state.compared_tables`)
                train_state.write_record(tmp, replace(record, table_contents=r.tables.content_ids()))
                folder.close()  # fsync + rename: the checkpoint is committed
                train_state.prune(r.checkpoints, r.cfg.keep_checkpoints)
    pause_point("train_after_checkpoint")


def finish(r: Run) -> TrainResult:
    """The final LoRA (written into a temp folder, then swapped in, like a checkpoint)."""
    r.bar.close()
    r.batches.close()
    r.result.steps = r.step
    # rank 0 writes (uneven: alone, while the others wait); every rank learns whether it could
    with together(r.world, "the final LoRA", uneven=True):
        if r.main:
            guard.check_lora_finite(r.params, r.result.lora_dir)
            # the EMA LoRA first: `lora/`, committed last, vouches for both (a kill between the two left `lora/`
            # alone, which `run all`'s up-to-date check took for the finished run, its lora_ema/ missing or stale)
            if r.ema is not None:
                with guard.one_line_errors("the EMA LoRA", r.run_dir, guard.resume_advice(r.rerun)), \
                        atomic_dir(r.run_dir / LORA_EMA, r.run_dir / f".{LORA_EMA}.tmp") as tmp, r.ema.swapped_in():
                    _save_final_lora(r, tmp)
            with guard.one_line_errors("the final LoRA", r.run_dir, guard.resume_advice(r.rerun)), \
                    atomic_dir(r.result.lora_dir, r.run_dir / ".lora.tmp") as tmp:
                _save_final_lora(r, tmp)
            r.writer.close()
            tqdm.write(f"LoRA after {count_text(r.step, 'step')}: {r.result.lora_dir}")
            if (waited := data_wait_line(r.result.step_data_times, r.result.step_times, r.cfg.prefetch)) is not None:
                tqdm.write(waited)
            if r.damage is not None and r.damage.damaged:
                tqdm.write(f"left out {r.damage.damaged} damaged sample read(s) of {r.damage.read} "
                           f"(train.on_damaged=skip), listed in {r.run_dir / guard.DAMAGED_REPORT}")
    return r.result


def _save_final_lora(r: Run, folder: Path) -> None:
    """The LoRA users load elsewhere: alpha folded in (every loader applies the same weights), the base model's
    fingerprint in its metadata, and a sealed checksum record that every later load checks."""
    from store.checksum import write_folder_record

    save_lora(r.transformer, folder, fold_alpha=True, base_fingerprint=r.record.model_fingerprint)
    write_folder_record(folder)


def cleanup(r: Run | None, locks: list) -> None:
    """The last phase, after a finished run or an error (torchtune's recipes end the same way): whatever setup
    opened is closed - the micro-batch stream and its reader thread, the readers' shard descriptors and
    check-ahead threads, the read lease (gc may take the versions now), the TensorBoard writer, the progress bar
    and the run folder's locks - so a process that goes on (`pipeline run all`, tests) holds no descriptor of
    this run. Every step here is idempotent (`finish` closed some of them already)."""
    if r is not None:
        if r.batches is not None:
            r.batches.close()
        if r.bar is not None:
            r.bar.close()
        if r.writer is not None:
            r.writer.close()
        r.tables.close()
    for lock in locks:
        if lock is not None:
            lock.release()
