"""What a `pipeline` command does when a launcher starts it on several ranks (`pipeline launch`, torchrun,
accelerate launch: WORLD_SIZE > 1 in every rank's environment). Each command does one of five things:

- shares its work between the ranks, which take their decisions together (models/collective/): `run
  encode-text`, `run encode-vae`, `run train`, `run evaluate --all-checkpoints`, `run all`;
- runs on rank 0 alone while the other ranks wait for it (`rank_0_alone`, as `run all` runs it): `run
  resize-bucket`, the one writer of the `images` table, so a job script can launch every stage alike;
- is refused on every rank with one line (`one_process`; `run evaluate` of one LoRA by its stage): a command
  that does its whole work in one process, where every rank would do all of it, racing into the same files
  (store gc / repair / push / pull, migrate, predict, lora, compare, the demo and its builders) or reading a
  whole store once per rank (store verify);
- reads and prints on rank 0 alone, the other ranks exiting 0 quietly (`rank_0_only`): `store inspect`, whose
  read of a store URL fetches its manifests (tens of MB each at a million samples) once per rank otherwise;
- is left as it is: commands that read a little and print (`config show`, `plan`: every rank prints the same),
  and `launch`, which starts ranks (a platform may set WORLD_SIZE for the launchers it starts on each node, as
  Kubeflow's PyTorchJob does).

`UNDER_A_LAUNCHER` holds every command's entry; tests/pipeline/test_launched_commands.py checks that none is missing.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, TypeVar

T = TypeVar("T")


# Each command's behaviour under a launcher (the module's docstring says what each does). `pipeline launch` starts
# the commands that run on several ranks and refuses the others before a rank starts (`refused_launch`), in one line
# rather than one per rank (`one_process`) and then the launcher's; `one_process` refuses only the commands named
# ONE_PROCESS here (or SHARES_OR_REFUSED), so the two cannot disagree. A new command must be added.
SHARES = "shares its work between the ranks"
SHARES_OR_REFUSED = "shares its work in one mode, refuses the others on every rank (`one_process`)"
RANK_0_ALONE = "runs on rank 0 alone while the others wait"
RANK_0_PRINTS = "reads and prints on rank 0 alone, the others exit quietly"
EVERY_RANK_PRINTS = "reads a little and prints on every rank"
ONE_PROCESS = "refused on every rank (`one_process`)"
STARTS_RANKS = "starts the ranks"
UNDER_A_LAUNCHER = {
    "run encode-text": SHARES, "run encode-vae": SHARES, "run train": SHARES, "run all": SHARES,
    "run evaluate": SHARES_OR_REFUSED,  # --all-checkpoints shares; one LoRA is refused by the command
    "run resize-bucket": RANK_0_ALONE,
    "store inspect": RANK_0_PRINTS,
    "config show": EVERY_RANK_PRINTS, "plan": EVERY_RANK_PRINTS,
    "launch": STARTS_RANKS,
    **dict.fromkeys(["store verify", "store gc", "store repair", "store push", "store pull", "migrate v1-to-v2",
                     "predict", "lora merge", "lora export", "make-tiny-model", "make-demo-data", "compare",
                     "demo"], ONE_PROCESS),
}
# what `pipeline launch` starts (`run evaluate` of one LoRA is left to the command's refusal, naming --all-checkpoints)
SEVERAL_RANKS = frozenset({SHARES, SHARES_OR_REFUSED, RANK_0_ALONE, RANK_0_PRINTS, EVERY_RANK_PRINTS})


def refused_launch(words: list[str], root) -> str | None:
    """The line refusing `pipeline launch ... WORDS` (WORDS: the pipeline command and its arguments; `root`: the
    CLI's click group), or None where the command runs on several ranks or is no command (its own error says)."""
    group = root.commands.get(words[0]) if words else None
    subcommands = getattr(group, "commands", None)
    if group is None or subcommands is not None and (len(words) < 2 or words[1] not in subcommands):
        return None
    path = " ".join(words[:2]) if subcommands is not None else words[0]
    if UNDER_A_LAUNCHER.get(path) in SEVERAL_RANKS:
        return None
    return (f"`pipeline {path}` runs in one process (it shares no work between ranks): run it without "
            "`pipeline launch`")


def launched() -> tuple[int, bool]:
    """(processes the launcher started, whether this is rank 0); a plain run is (1, True)."""
    return int(os.environ.get("WORLD_SIZE", "1")), os.environ.get("RANK", "0") == "0"


def rank_0_alone(what: str, work: Callable[[], T]) -> T | None:
    """`work()` on rank 0 alone while the other ranks wait for it (`models.collective.main_alone`: however long
    it takes; a failure on rank 0 stops every rank with its one line). Rank 0 gets the result, the others None
    after saying on stderr that they waited (their stdout would repeat rank 0's summary). One process: `work()`."""
    world, main = launched()
    if world <= 1:
        return work()
    from models.collective import main_alone

    result = main_alone(world, what, work)
    if not main:
        print(f"rank {os.environ.get('RANK')}: {what} ran on rank 0 alone; this rank waited for it", file=sys.stderr)
    return result


def rank_0_only() -> None:
    """For a command that reads and prints: rank 0 goes on, the other ranks exit 0 at once, printing nothing (no
    rank waits for another, so none needs the launcher's store). One process: goes on."""
    world, main = launched()
    if world > 1 and not main:
        import typer

        raise typer.Exit(0)


def one_process(command: str, instead: str = "") -> None:
    """Refuse a launch of several ranks for `pipeline COMMAND`, which does its whole work in one process: one
    red line naming what to run instead, exit 1 (as `run evaluate` of one LoRA refuses). Every rank sees the
    same launcher environment and refuses alike, before any work, so no rank waits for another. COMMAND must be
    refused in `UNDER_A_LAUNCHER` (a command that refuses where `pipeline launch` starts it would be an error per
    rank): otherwise a programming error, in any process."""
    if UNDER_A_LAUNCHER.get(command) not in (ONE_PROCESS, SHARES_OR_REFUSED):
        raise AssertionError(f"`pipeline {command}` calls one_process, but pipeline/launched.py's UNDER_A_LAUNCHER "
                             f"has it as {UNDER_A_LAUNCHER.get(command)!r}: list it there as ONE_PROCESS")
    world, _ = launched()
    if world <= 1:
        return
    import typer

    typer.secho(f"error: `pipeline {command}` runs in one process (it shares no work between ranks), but it was "
                f"launched as {world} (WORLD_SIZE={world}: pipeline launch / torchrun / accelerate launch): run it "
                f"without the launcher{instead} (no launcher: a platform set WORLD_SIZE for the job; unset it for this "
                f"command)", fg=typer.colors.RED, err=True)
    raise typer.Exit(1)
