"""`pipeline launch [TORCHRUN OPTIONS] COMMAND ...`: several processes of `pipeline COMMAND` under torchrun.

The same as `torchrun [TORCHRUN OPTIONS] -m pipeline.cli COMMAND ...` (torchrun's own parser reads the options
before the first pipeline command name; from there on, every word is the command's, even one like `--run` that
torchrun itself would take for an abbreviation of its `--run-path`), except when a rank fails: every rank has
already printed the same `error: ...` line (models/collective/), and torchrun would then end in its own
`ChildFailedError` traceback and summary box, which says nothing more. Here the launcher's failure is one line
(which ranks exited how) and exit status 1; stopped by a signal (a scheduler's SIGTERM, Ctrl-C), it is one line
too and exit status 128 + the signal, torchrun having stopped every rank (its agent raised SignalException).
"""

from __future__ import annotations

import logging
import signal
from typing import Collection

import typer

EXAMPLE = "`pipeline launch --nproc-per-node 2 run train --store S --model M --out RUN`"
LAUNCH_SETTINGS = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def command(ctx: typer.Context) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_min_max_nnodes, run

    words = list(ctx.args)
    if words and words[0] in ("-h", "--help"):
        typer.echo(_parser().format_help().rstrip())
        return
    split = _command_start(words, set(ctx.parent.command.list_commands(ctx.parent)) if ctx.parent else set())
    try:
        # torchrun parses its options only: given the command too, argparse refuses a command option that
        # abbreviates two of its own (`--run` matches `--run-path` and `--run_path`)
        args = _parser().parse_args([*words[:split], "pipeline.cli"] if split is not None else words)
    except SystemExit as e:  # argparse printed what was wrong (or the help)
        if e.code:
            typer.echo(f"pipeline launch: torchrun's options, then the pipeline command: {EXAMPLE}", err=True)
        raise typer.Exit(e.code if isinstance(e.code, int) else 2) from None
    # the script is this CLI, run as a module, with the pipeline command as its arguments
    if split is not None:
        args.training_script_args = words[split:]
    else:  # no known command word: torchrun read the first non-option as its script (the command's error says)
        args.training_script_args = [args.training_script, *args.training_script_args]
    args.training_script, args.module = "pipeline.cli", True
    if split is not None and ctx.parent is not None:
        from pipeline.launched import refused_launch

        if (line := refused_launch(words[split:], ctx.parent.command)) is not None:
            typer.secho(f"error: {line}", fg=typer.colors.RED, err=True)
            raise typer.Exit(2)
    if str(args.nproc_per_node).isdigit() and int(args.nproc_per_node) < 1:  # torchrun: a bare AssertionError
        _refused(f"--nproc-per-node {args.nproc_per_node}: at least 1 process per node")
    try:
        parse_min_max_nnodes(args.nnodes)
    except ValueError:  # torchrun's own words name no option: "invalid literal for int() with base 10: 'x'"
        _refused(f"--nnodes {args.nnodes}: a number of nodes or MIN:MAX")
    agent_lines = _drop_agent_lines_ours_says()
    try:
        run(args)
    except ChildFailedError as e:
        typer.secho(f"error: {e.name} stopped: {failed_line(e.failures, _rerun(args), agent_lines.forced)}",
                    fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    except SignalException as e:  # SIGTERM (a scheduler's preemption) or Ctrl-C: torchrun's agent has stopped the ranks
        name = signal.Signals(e.sigval).name
        rerun = _rerun(args)
        typer.secho(f"error: {args.training_script} stopped by {name}: every rank was sent {name} and has "
                    f"ended (what they committed stays: {rerun} to continue from the last checkpoint)",
                    fg=typer.colors.RED, err=True)
        raise typer.Exit(128 + int(e.sigval)) from None
    except (ValueError, AssertionError) as e:  # torchrun's checks of its options, a traceback: `--nnodes x`,
        _refused(str(e) or type(e).__name__)  # `--nproc-per-node abc` (or gpu without CUDA), `--rdzv-conf bad`


_FORCED = "Unable to shutdown process %s via %s, forcefully exiting via %s"


class _AgentLinesOursSays(logging.Filter):
    """torchrun's agent logs the rank that failed first ("E... failed (exitcode: 1) local_rank: 0 (pid: N) of
    binary: ..."), each rank it then stops ("W... Sending process N closing signal SIGTERM") and each it SIGKILLs
    when its grace period is over ("Unable to shutdown process N via ..."): what the launcher's one line says
    (`failed_line`), printed between the ranks' `error:` line and it, so that its "the ranks' own error is the line
    above" pointed at torchrun's log line. Only these three: its others still show. The pids it SIGKILLed are kept
    in `forced`: such a rank was not killed from outside (`kill -9`, the out-of-memory killer)."""

    def __init__(self) -> None:
        super().__init__()
        self.forced: set[int] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == _FORCED and record.args:
            self.forced.add(int(record.args[0]))
        return not str(record.msg).startswith(("failed (exitcode: ", "Sending process %s closing signal", _FORCED))


def _drop_agent_lines_ours_says() -> _AgentLinesOursSays:
    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    ours = next((f for f in logger.filters if isinstance(f, _AgentLinesOursSays)), None)
    if ours is None:
        logger.addFilter(ours := _AgentLinesOursSays())
    return ours


def _rerun(args) -> str:
    # only `run train` takes --resume (and needs it); run all and the encoders continue on a plain rerun
    return "rerun with --resume" if args.training_script_args[:2] == ["run", "train"] else "rerun the same command"


# signals torchrun's agent itself sends the other ranks once one has failed
_STOPS = (signal.SIGTERM, signal.SIGINT)


def failed_line(failures: dict, rerun: str, forced: Collection[int] = ()) -> str:
    """Which ranks exited how (torchrun's `ChildFailedError.failures`: rank -> exit code, negative for a signal).
    A rank that printed its error exits 1 and the line is above; a rank killed by a signal printed nothing (a
    `kill -9`, the out-of-memory killer, a crash in native code), so the line says that and what to do. `forced`:
    the pids torchrun SIGKILLed itself, still running when its grace period after the stop signal it sent the
    ranks was over (a frozen rank): told as such, not as a kill from outside."""
    parts, killed, stopped = [], [], {}
    for rank, f in sorted(failures.items()):
        sig = -f.exitcode if f.exitcode < 0 else None
        if sig is None:
            parts.append(f"rank {rank} exit {f.exitcode}")
            stopped[rank] = f
            continue
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else f"signal {sig}"
        if sig == signal.SIGKILL and getattr(f, "pid", None) in forced:
            parts.append(f"rank {rank} killed by SIGKILL from torchrun (it had not ended within torchrun's grace "
                         "period after its stop signal)")
            continue
        parts.append(f"rank {rank} killed by {name}")
        stopped[rank] = f
        if sig not in _STOPS:
            killed.append((rank, name))
    if not killed:
        return f"{', '.join(parts)}{_why_exited(stopped or failures, rerun)}"
    rank, name = killed[0]
    why = ("printed nothing: a `kill -9`, or the kernel's out-of-memory killer (`dmesg` on its node says which)"
           if name == "SIGKILL" else "printed nothing of its own: a crash in native code (a driver, a library)")
    return (f"{', '.join(parts)}; rank {rank} {why}, and the launcher stopped the others. What they committed "
            f"stays: {rerun} to continue")


def _why_exited(failures: dict, rerun: str) -> str:
    """What the ranks' exit statuses say: a rank's error is its line above; a rank that only exited as the CLI
    does for a stop signal (143, 130) was sent it alone, not through the launcher (`kill PID`, a scheduler
    signalling the ranks), and a launched rank leaves its stop line to the launcher: nothing was said above."""
    stops = {code: s for s in _STOPS for code in (128 + s, -s)}  # the CLI's stop, or the signal's default
    signals = {stops.get(f.exitcode) for f in failures.values()}
    if None in signals:
        return " (the ranks' own error is the line above)"
    name = " / ".join(sorted(signal.Signals(s).name for s in signals))
    return (f": stopped by {name} sent to the ranks, not to the launcher (`kill` of a rank's process, a scheduler "
            f"signalling the processes); what they committed stays: {rerun} to continue")


def _refused(why: str) -> None:
    typer.secho(f"error: pipeline launch: torchrun refused the launch: {why.rstrip('.')}; check its options (`pipeline launch "
                "--help`)", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


USAGE = "pipeline launch [TORCHRUN OPTIONS] COMMAND [ARGS]..."
DESCRIPTION = """\
Run `pipeline COMMAND [ARGS]...` in several processes under torchrun (one per GPU; on a machine without GPUs, CPU
processes over gloo). COMMAND is a pipeline command that splits its work by rank: `run train`, `run encode-text`,
`run encode-vae`, `run evaluate --all-checkpoints`, `run all`; `run resize-bucket` runs on rank 0 while the others
wait, and a command that runs in one process (`store gc`, `predict`, ...) is refused in one line before any rank
starts (exit status 2). The options before it are
torchrun's (below). A failed rank ends the launch in one line (which ranks exited how), exit status 1; SIGTERM
stops every rank, exit status 143."""
EPILOG = """\
examples:
  pipeline launch --nproc-per-node 2 run train --store S --model M --out RUN
  pipeline launch --nproc-per-node 8 run all --config F
  pipeline launch --nnodes 2 --node-rank K --nproc-per-node 8 --master-addr HOST --master-port 29500 \\
      run train --store S --model M --out RUN      (on each node, K = 0 and 1; docs/train.md)
  (a stopped run: the same command with --resume continues from its last checkpoint)"""
# torchrun options that choose what is launched: here it is always `python -m pipeline.cli COMMAND`
_NOT_OURS = ("training_script", "training_script_args", "module", "no_python", "run_path", "print_completion")


def _parser():
    """torchrun's own argument parser (its options, defaults and help), presented as `pipeline launch`: its
    usage would name `training_script`, a positional that here is the pipeline COMMAND."""
    import argparse

    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog, parser.usage, parser.description, parser.epilog = "pipeline launch", USAGE, DESCRIPTION, EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    for action in parser._actions:  # argparse has no public way to hide an option it already holds
        if action.dest in _NOT_OURS:
            action.help = argparse.SUPPRESS
        if action.dest == "training_script":  # named so in "the following arguments are required: ..."
            action.metavar = "COMMAND"
        elif action.dest == "training_script_args":
            action.metavar = "ARGS"
    return parser


def _command_start(words: list[str], commands: set[str]) -> int | None:
    """Where the pipeline command starts: the first command name that torchrun's parser, given the words before
    it, does not take as an option's value (`--rdzv-id run run train`: the second `run`)."""
    import contextlib
    import io

    for i, word in enumerate(words):
        if word not in commands:
            continue
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                parsed = _parser().parse_args([*words[:i], "pipeline.cli"])
        except SystemExit:
            continue
        if parsed.training_script == "pipeline.cli" and not parsed.training_script_args:
            return i
    return None
