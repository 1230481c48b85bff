"""`pipeline` CLI: the root app. Each command lives in `pipeline/commands/<name>.py`; this file only wires them."""

from __future__ import annotations

import os
import signal
import sys

# A SIGTERM before main() installs its handlers - while the imports below run, ~0.3 s - killed the process at once,
# silently (-15), and a Ctrl-C ended in a KeyboardInterrupt traceback from whatever was being imported. The
# `pipeline` entry point (or `python -m pipeline` / `-m pipeline.cli`, a launched rank) holds them until main()
# stops with the usual line, 143 or 130; a process that imports this module for `app` (a test) keeps its own
# handling. (Before this line runs, Python's own start - ~50 ms - is beyond any handler of ours.)
_early_signals: list[int] = []


def _hold(signum, frame) -> None:
    # Held, but a second signal (a second Ctrl-C, a launcher's SIGTERM after it) ends the process here: an import
    # that waits (interruptibly: a slow network filesystem) may never reach main(). os._exit and a raw write: nothing
    # ran yet to unwind, and a raise could be swallowed by (or a print collide with) the import's code under way.
    if _early_signals:
        said = "SIGINT (Ctrl-C)" if signum == signal.SIGINT else signal.Signals(signum).name
        try:
            os.write(2, f"stopped by {said} while the command was starting: nothing was done\n".encode())
        except OSError:  # no stderr: the status says it
            pass
        os._exit(128 + signum)
    _early_signals.append(signum)


if (__name__ == "__main__" or os.path.basename(sys.argv[0]).removesuffix(".exe") == "pipeline"
        or getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", None) == "pipeline.__main__"):
    for _held in (signal.SIGTERM, signal.SIGINT):
        signal.signal(_held, _hold)

import typer

import models.quiet_imports  # noqa: F401  (before any command imports torchao: drops two harmless messages)
from pipeline import exit_gc
from schemas.interruptible import note_signal, record_signals
from pipeline.commands.common import OneLineUsageErrors, with_config_defaults
from pipeline.commands import (
    compare,
    demo,
    encode,
    evaluate,
    launch,
    lora,
    plan,
    predict,
    resize_bucket,
    run_all,
    store_cmd,
    store_remote,
    tools,
    train,
)

# `pipeline --help` lists the root's commands in the order a new user meets them: typer lists single commands
# before groups, each in the order registered, and showed make-tiny-model first and `run` near the end
_HELP_ORDER = ("demo", "run", "predict", "compare", "plan", "lora", "launch", "store", "migrate", "config",
               "make-tiny-model", "make-demo-data")


class _Root(OneLineUsageErrors):
    def list_commands(self, ctx) -> list[str]:
        names = super().list_commands(ctx)
        return sorted(names, key=lambda name: _HELP_ORDER.index(name) if name in _HELP_ORDER else len(_HELP_ORDER))


app = typer.Typer(
    help="Fine-tune Qwen-Image-Edit LoRAs through a staged, versioned feature store.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    cls=_Root,  # click's usage errors as one line, exit 2 (not typer's boxed panel); the help's order
)
run_app = typer.Typer(help="Run one pipeline stage (or all of them).", no_args_is_help=True)
config_app = typer.Typer(help="Inspect the effective configuration.", no_args_is_help=True)

app.command("make-tiny-model", help="Build a tiny random-init model folder offline (--variant: Edit, Edit-Plus, Edit-2511, Qwen-Image-2.1).")(
    tools.make_tiny_model
)
app.command("make-demo-data", help="Write a synthetic mixed-resolution paired-edit dataset.")(tools.make_demo_data)
config_app.command("show", help="Print the effective config (file + flag overrides).")(tools.config_show)
app.add_typer(config_app, name="config")
store_cmd.store_app.command("push", help="Copy a local store's committed versions to a URL (s3://bucket/prefix): "
                             "those its gc keeps (current, complete and never current past it, leased, made from by a "
                             "kept one) that the remote lacks, "
                             "manifests last, resumable.")(store_remote.push)
store_cmd.store_app.command("pull", help="Copy a remote store's committed versions that its gc keeps into a local "
                             "folder, every file checked against its checksum before the version becomes "
                             "visible.")(store_remote.pull)
app.add_typer(store_cmd.store_app, name="store", help="Inspect, verify, repair, gc and push / pull a feature store.")
app.add_typer(store_cmd.migrate_app, name="migrate", help="Upgrade a store's schemas.")

run_app.command("resize-bucket", help="Source dataset -> `images` table (resize, bucket, quarantine).")(
    with_config_defaults(resize_bucket.command)
)
run_app.command("encode-text", help="`images` -> `text` table (Qwen2.5-VL / Qwen3-VL prompt embeds).")(
    with_config_defaults(encode.text_command)
)
run_app.command("encode-vae", help="`images` -> `vae` table (target and control latents).")(with_config_defaults(encode.vae_command))
run_app.command("train", help="`text` + `vae` tables -> LoRA run directory.")(with_config_defaults(train.command))
run_app.command("evaluate", help="Held-out loss and samples, base vs LoRA -> report directory.")(with_config_defaults(evaluate.command))
run_app.command("all", help="Every stage in order, each skipped when up to date.")(run_all.command)
app.add_typer(run_app, name="run")
app.command("launch", context_settings=launch.LAUNCH_SETTINGS,
            help="Several processes of a command under torchrun: pipeline launch [TORCHRUN OPTIONS] COMMAND ...")(
    launch.command
)

app.command("compare", help="Several runs' held-out loss curves and best checkpoints on one page + a CSV.")(
    compare.command
)
app.command("predict", help="Edit an image with the model (+ optional LoRA).")(with_config_defaults(predict.command))
app.command("plan", help="Predicted peak memory per stage for a config; fits --gpu-memory?")(plan.command)
app.add_typer(lora.lora_app, name="lora", help="Fuse a LoRA into the model (merge) or write it for ComfyUI (export).")
app.command("demo", help="Tiny model + synthetic data + every stage end to end, then a report.")(demo.command)


_signalled: list[int] = []  # the signals that stopped this process (SIGTERM, SIGINT)


def _terminate(signum, frame) -> None:
    # SIGTERM's default kills the process at once: no finally block, no atexit (read leases, locks, temp files
    # stay behind). As SystemExit in the main thread, everything unwinds as on Ctrl-C.
    _signalled.append(signum)
    note_signal(signum)
    earlier = _loaded("stages.train.stop", "EARLIER")  # the training loop acts on it if this exit is lost
    if earlier is not None:
        earlier.append(signum)
    ending_line = _loaded("models.collective", "ending_line")  # never imported here (a signal may come mid-import)
    if ending_line is not None and (line := ending_line()) is not None:
        # torchrun stops the other ranks once one exits: they print its line too (models/collective/), or the line
        # of a failure all ranks agreed on that this one was about to print
        sys.modules["models.collective"].report_once(line)
    raise SystemExit(128 + signum)


def _loaded(module: str, name: str):
    """`module.name` once that module has defined it, else None. A signal that lands while the module is being
    imported finds it in sys.modules without its names yet: the handler raised AttributeError instead of SystemExit, a stop line naming that error, and where an
    import swallows `Exception` (torch's own), no stop at all (the command ran on and exited 0)."""
    return getattr(sys.modules.get(module), name, None)


def _exiting(signum, frame) -> None:
    # The command has ended (its line printed, its exit status set): what is left is the exit's own work, atexit's
    # (the process group's close, bounded by models/collective/timing.py CLOSE_SECONDS; lease releases). A SIGTERM now -
    # torchrun stopping the other ranks once one has exited - raised SystemExit inside an atexit callback: a
    # traceback after the rank's own line, and the rest of the exit's work skipped. Recorded, not raised.
    _signalled.append(signum)


def _interrupt(signum, frame) -> None:
    _signalled.append(signum)
    note_signal(signum)
    earlier = _loaded("stages.train.stop", "EARLIER")  # as a SIGTERM's: a KeyboardInterrupt a finalizer swallowed
    if earlier is not None:
        earlier.append(signum)
    raise KeyboardInterrupt  # Python's own SIGINT behaviour; only recorded first


def _stop_now(signum: int) -> None:
    """Stop as the handler of SIGNUM does, for one that came while this module was imported: a SIGTERM's
    SystemExit(143); a Ctrl-C's KeyboardInterrupt as typer ends it, SystemExit(130) caused by it (a launched rank
    publishes it: `_publish_interrupt`)."""
    if signum != signal.SIGINT:
        _terminate(signum, None)
    try:
        _interrupt(signum, None)
    except KeyboardInterrupt as stop:
        raise SystemExit(128 + signum) from stop


# commands a rerun continues (committed shards, checkpoints, pushed versions kept): what a stop's line advises
_RESUMABLE = ("run", "demo", "store repair", "store push", "store pull", "migrate")
_SIGNAL_NAMES = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM"}


def stopped_line(words: list[str], signum: int = signal.SIGINT) -> str:
    """The line a Ctrl-C or a SIGTERM (a scheduler's kill, `timeout`) ends `pipeline WORDS...` with: both came out
    as a silent exit (typer's 130, the handler's 143), and a user saw the prompt come back without knowing what
    was kept or how to go on."""
    command = " ".join(w for w in words if not w.startswith("-"))
    line = f"stopped by {_SIGNAL_NAMES.get(signum, signal.Signals(signum).name)}"
    if command.startswith("run train"):  # `run all` resumes its training itself; `run train` needs --resume
        if "--resume" in words or _run_to_resume():
            return line + ": the run's checkpoints are kept; rerun with --resume to continue from the last one"
        # stopped before its run folder held a start: --resume would refuse, "nothing to resume"
        return line + ": nothing of the run was written yet; rerun the same command to start it"
    if command.startswith(_RESUMABLE):
        return line + ": what it committed is kept; rerun the same command to continue from there"
    return line


def _run_to_resume() -> bool:
    """Whether the run folder `run train` resolved holds what --resume continues (a checkpoint, or a start's
    train_config.yaml); False when the stop came before the folder was resolved."""
    folders = _loaded("pipeline.commands.train", "RUN_FOLDER")
    if not folders:
        return False
    from pathlib import Path

    from stages.train.resume import nothing_to_resume

    return nothing_to_resume(Path(folders[-1])) is None


def _close_progress_bars() -> None:
    """Close the progress bars still open (a `for x in tqdm(...)` the signal left: its frame lives on in the
    traceback until the exit), so the stop line starts a line of its own; it was appended to the bar, e.g.
    `generate (base):   0%|          | 0/1 [00:00<?, ?image/s]stopped by SIGINT (Ctrl-C): ...`."""
    bar_class = _loaded("tqdm.std", "tqdm")
    for bar in list(getattr(bar_class, "_instances", ())):
        bar.close()


def _said_by_training() -> bool:
    """Whether the training loop ended on the signal with a line of its own (the checkpoint it wrote)."""
    return bool(_loaded("stages.train.stop", "ANNOUNCED"))


def _publish_uncaught(error: Exception) -> str | None:
    """An error no handler turned into a line (a bug, a broken install on this node) ends this rank in its
    traceback; a launched rank first publishes it (models/collective/), so the others - waiting for this one
    at an agreement before the process group exists, or inside a collective - stop at once naming it, instead of
    waiting out their timeout (30 minutes before the group) saying nothing of this rank. Also when this rank failed
    before it imported the collective: the others may wait for it at their first exchange already. Once: one
    `user_errors` re-raised is published already. Another rank's failure seen here (its published line, a rank
    killed) is that rank's line, returned: the process ends with it, as `user_errors` ends it."""
    from pipeline.launched import launched

    if launched()[0] <= 1:
        return None
    try:
        import torch.distributed  # noqa: F401  (what publishing goes through; models.collective imports it lazily)
    except Exception:  # noqa: BLE001 - an install that cannot import torch: nothing to publish with
        return None
    from models import collective

    return collective.publish_uncaught(error)


def _publish_interrupt(error: BaseException) -> None:
    """A launched rank stopped by one Ctrl-C outside the blocks that publish it themselves (models/collective/
    `publish_interrupt`): the ranks waiting for it stop at once with its line. Not a stop the ranks agreed on (the
    training loop's, whose SystemExit no KeyboardInterrupt caused), nor after a second Ctrl-C (the user insists:
    the exit goes on, not held for the store). Its own line and exit status are unchanged."""
    if _signalled != [signal.SIGINT] or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    try:
        # imported here where the rank stopped before its first exchange (the others may wait for it already); not
        # in the signal's handler, which may land mid-import. models.collective imports torch only to publish.
        from models.collective import publish_interrupt

        publish_interrupt(error)
    except KeyboardInterrupt:
        pass
    except Exception:  # noqa: BLE001 - an install that cannot import what publishing needs: nothing to publish with
        pass


def _interrupted(error: BaseException) -> BaseException | None:
    """The KeyboardInterrupt that caused `error` (typer's exit 130 for a Ctrl-C), if any."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _set_up_bars() -> None:
    """Progress bars for what stderr is (pipeline/bars.py); a bad PIPELINE_PROGRESS_SECONDS is a usage error."""
    from pipeline import bars
    from schemas.errors import UserError

    try:
        bars.for_this_stderr()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def main() -> None:  # pragma: no cover
    exit_gc.collect_once_at_exit()  # first: it must run after the atexit work the command registers
    _set_up_bars()
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _interrupt)
    # any thread may ask whether a signal came, before this handler has run (a launched rank's watch thread: a
    # Ctrl-C on every rank is each rank's own stop, not a peer's line to end on; models/collective/)
    record_signals()
    _signalled.clear()  # an earlier in-process run's stop (the training loop reads it: stages/train/stop.py)
    early, _early_signals[:] = _early_signals[:], []  # came while this module was imported
    # an earlier run's collective state in this process (never imported here: a plain command does not pay for it)
    new_run = _loaded("models.collective", "new_run")
    if new_run is not None:
        new_run()
    try:
        if early:
            _stop_now(early[0])  # as if it came now: the stop line below, exit 143 or 130
        app()
    except SystemExit as e:
        from pipeline.launched import launched

        # launched by torchrun, its agent says it once for every rank (pipeline/commands/launch.py); in a plain
        # env:// launch none does: a Ctrl-C on one rank's terminal ended it silently (the others print its line)
        alone = launched()[0] <= 1 or not os.environ.get("TORCHELASTIC_RUN_ID")
        if _signalled and e.code == 128 + _signalled[0] and alone and not _said_by_training():
            _close_progress_bars()
            print(stopped_line(sys.argv[1:], _signalled[0]), file=sys.stderr)
        if e.code == 128 + signal.SIGINT and (interrupt := _interrupted(e)) is not None:
            _publish_interrupt(interrupt)
        raise
    except Exception as e:
        if not _signalled:
            if (line := _publish_uncaught(e)) is None:
                raise
            from pipeline.commands.common import report_error

            report_error(line)
            raise SystemExit(1) from None
        # The stop raised inside a library's native call comes out as whatever that library makes of it (e.g.
        # safetensors' load as a ValueError that diffusers turns into an OSError): the signal is the cause, and
        # everything has unwound (leases, locks released) - one line, no traceback.
        name = signal.Signals(_signalled[0]).name
        print(f"stopped by {name} ({type(e).__name__} while stopping)", file=sys.stderr)
        _publish_interrupt(_interrupted(e) or e)  # the KeyboardInterrupt's mark says whether it was told already
        raise SystemExit(128 + _signalled[0]) from None
    finally:
        signal.signal(signal.SIGTERM, _exiting)


if __name__ == "__main__":  # pragma: no cover
    main()
