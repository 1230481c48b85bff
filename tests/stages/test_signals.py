"""SIGTERM and SIGINT end `pipeline run train` with its read lease released (SIGTERM used to kill the process
before any cleanup, leaving the lease that keeps `store gc` from removing versions)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer

from store.lease import LEASES_DIR
from train_store import make_train_store, mixed_specs
import warm_start
from warm_start import WarmProcess


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_releases_the_read_lease(tiny_edit_model, tmp_path, sig):
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(4, 0))
    proc = WarmProcess(  # a real process of its own, started warm (tests/warm_start.py): torch imported already
        [sys.executable, "-m", "pipeline.cli", "run", "train", "--store", str(store), "--model", tiny_edit_model,
         "--out", str(tmp_path / "run"), "--max-steps", "100000", "--device", "cpu"], env={**os.environ})
    leases = store / LEASES_DIR
    try:
        # wait for training to have taken its lease (a condition, not a duration: no timing assert; the bound
        # only keeps a regression from training 100000 steps)
        deadline = time.monotonic() + 600
        while proc.poll() is None and not (leases.is_dir() and any(leases.glob("*.json"))):
            assert time.monotonic() < deadline, "training never took its read lease"
            time.sleep(0.2)
        assert proc.poll() is None, proc.output()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "Traceback" not in out + err, err
    assert not list(leases.glob("*.json")), err
    if sig == signal.SIGINT:  # Ctrl-C: before, typer's silent exit 130
        assert proc.returncode == 130
        # the CLI's line; or, where the KeyboardInterrupt landed in a finalizer (gc during the start: Python ignores
        # it, twice in CI), the training loop's own after the next step's checkpoint (stages/train/stop.EARLIER);
        # or, where it landed inside a library's call that made another error of it (a TypeError once, during the
        # start: pyarrow's lazy import of pandas, which the store's code now spares it,
        # tests/store/test_pandas_import_error.py), the CLI's line naming that error (pipeline/cli.py: the signal the
        # cause, everything unwound)
        lost = re.search(r"stopped by SIGINT \(Ctrl-C\) after optimizer step \d+: its checkpoint .* is written", out + err)
        made_other = re.search(r"stopped by SIGINT \(\w+ while stopping\)$", err.rstrip())
        # (before the run folder holds its train_config.yaml, the line advises the same command: no --resume yet)
        assert lost or made_other or err.rstrip().endswith((
            "stopped by SIGINT (Ctrl-C): the run's checkpoints are kept; rerun with --resume to continue from the "
            "last one", "stopped by SIGINT (Ctrl-C): nothing of the run was written yet; rerun the same command to "
            "start it")), err


def _main_of(monkeypatch, app) -> int:
    """`pipeline.cli.main` running `app` in place of the CLI's, the signal handlers it installs restored after:
    its exit status."""
    import pipeline.cli as cli

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(cli, "app", app)
    # tqdm's class left as it is: the log-line bars main() sets up for a captured stderr would stay process-wide
    monkeypatch.setattr(cli, "_set_up_bars", lambda: None)
    monkeypatch.setattr(cli, "_signalled", [])
    # the handler records a SIGTERM for a training loop yet to come (stages/train/stop.EARLIER): in a real process
    # the exit ends it with the process; here it would stop a later test's training in this worker after step 1
    import stages.train.stop as stop

    monkeypatch.setattr(stop, "EARLIER", [])
    monkeypatch.setattr(stop, "ANNOUNCED", [])
    # and the signals it records as received (schemas/interruptible.py): this worker's later tests took none
    from schemas import interruptible

    monkeypatch.setattr(interruptible, "_received", {"fd": None, "seen": set()})
    try:
        with pytest.raises(SystemExit) as stop:
            cli.main()
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(-1)
        for end in ("fd", "write"):  # the pipe's two ends (record_signals')
            if interruptible._received.get(end) is not None:
                os.close(interruptible._received[end])
    return stop.value.code


@pytest.mark.parametrize("sig,name", [(signal.SIGINT, "SIGINT (Ctrl-C)"), (signal.SIGTERM, "SIGTERM")])
@pytest.mark.parametrize("words,kept", [
    (["run", "train", "--out", "RUN"], ": nothing of the run was written yet; rerun the same command to start it"),
    (["run", "train", "--out", "RUN", "--resume"], ": the run's checkpoints are kept; rerun with --resume to "
                                                   "continue from the last one"),
    (["run", "encode-vae", "--store", "S"], ": what it committed is kept; rerun the same command to continue from "
                                            "there"),
    (["store", "verify", "S"], ""),
])
def test_a_stop_ends_in_one_line_saying_what_is_kept(monkeypatch, capsys, words, kept, sig, name):
    """Ctrl-C came out of typer as a silent exit 130, a SIGTERM (a scheduler's kill, `timeout`) as a silent 143:
    the prompt came back with no word on what was kept or how to go on. Now one line, with the rerun that
    continues where there is one."""
    import pipeline.cli as cli

    fake = typer.Typer()  # one command: it takes every word of the command line

    @fake.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def stopped(ctx: typer.Context) -> None:
        # as the real handlers do when the signal lands mid-stage
        (cli._interrupt if sig == signal.SIGINT else cli._terminate)(sig, None)

    monkeypatch.setattr(sys, "argv", ["pipeline", *words])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert _main_of(monkeypatch, fake) == 128 + sig
    assert capsys.readouterr().err == f"stopped by {name}{kept}\n"


@pytest.mark.parametrize("written,advice", [
    (False, ": nothing of the run was written yet; rerun the same command to start it"),
    (True, ": the run's checkpoints are kept; rerun with --resume to continue from the last one"),
])
def test_a_train_stop_advises_resume_only_where_the_run_folder_has_a_start(monkeypatch, capsys, tmp_path, written,
                                                                           advice):
    """`run train` stopped before its run folder held a start (the model still loading) advised `--resume`, which
    then refused: "--resume: nothing to resume, RUN does not exist" (bench/chaos_kill.py, SIGINT 6 s in). It says
    so now and advises the same command; once the folder holds its train_config.yaml, --resume as before."""
    import pipeline.cli as cli
    import pipeline.commands.train as train_command

    run_dir = tmp_path / "run"
    if written:
        run_dir.mkdir()
        (run_dir / "train_config.yaml").write_text("train: {}\n")
    fake = typer.Typer()

    @fake.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def stopped(ctx: typer.Context) -> None:
        train_command.RUN_FOLDER.append(str(run_dir))  # as the command does once it resolved --out
        cli._interrupt(signal.SIGINT, None)

    monkeypatch.setattr(train_command, "RUN_FOLDER", [])
    monkeypatch.setattr(sys, "argv", ["pipeline", "run", "train", "--out", str(run_dir)])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert _main_of(monkeypatch, fake) == 128 + signal.SIGINT
    assert capsys.readouterr().err == f"stopped by SIGINT (Ctrl-C){advice}\n"


def test_a_stop_inside_a_progress_bar_loop_is_a_line_of_its_own(monkeypatch, capsys):
    """A Ctrl-C inside `for x in tqdm(...)` (evaluate's `generate (base)`) left the bar open - the loop's frame
    lives on in the traceback - and the stop line was appended to the bar (bench/chaos_kill.py, evaluate)."""
    import pipeline.cli as cli
    from tqdm import tqdm

    fake = typer.Typer()

    @fake.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def stopped(ctx: typer.Context) -> None:
        [cli._interrupt(signal.SIGINT, None) for _ in tqdm(range(3), desc="generate (base)", leave=False)]

    monkeypatch.setattr(sys, "argv", ["pipeline", "run", "evaluate", "--out", "R"])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert _main_of(monkeypatch, fake) == 128 + signal.SIGINT
    shown = capsys.readouterr().err.replace("\r", "\n").splitlines()  # as a terminal shows it: \r starts over
    assert shown[-1] == ("stopped by SIGINT (Ctrl-C): what it committed is kept; rerun the same command to "
                         "continue from there")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_lost_before_the_stop_module_was_loaded_still_stops_training(monkeypatch, sig):
    """A Ctrl-C while the model stack was imported, before stages.train.stop was (so not in its EARLIER), that a
    finalizer swallowed (`Exception ignored in: regex ... __del__ ... KeyboardInterrupt`): the run trained every
    step and exited 0 (bench/chaos_kill.py). The training loop now takes it from the CLI's record too."""
    import pipeline.cli as cli
    import stages.train.stop as stop

    monkeypatch.setattr(stop, "EARLIER", [])  # recorded before the module was loaded: only the CLI holds it
    monkeypatch.setattr(cli, "_signalled", [sig])
    monkeypatch.setattr(signal, "signal", lambda s, h: signal.SIG_DFL)  # the loop's handler left as it is
    with stop.StopOnSignal() as stopping:
        assert stopping.signum == sig  # the first step's checkpoint, then the stop (as for one in EARLIER)


def test_a_sigterm_mid_stage_is_one_line_and_keeps_what_was_committed(tmp_path):
    """A real `run resize-bucket` sent SIGTERM right after its version's manifest (it stops itself there,
    STORE_PAUSE_AT, so the signal lands at the same point whatever the machine's load): exit 143 with the line
    (before: nothing), its writer lock released, and a rerun finds the version it committed."""
    from pipeline.demo_data import make_demo_data

    make_demo_data(tmp_path / "data", n=4, seed=3)
    words = ["run", "resize-bucket", "--source", str(tmp_path / "data"), "--store", str(tmp_path / "store"),
             "--area", "4096"]
    proc = WarmProcess([sys.executable, "-m", "pipeline.cli", *words],
                       env={**os.environ, "STORE_PAUSE_AT": "commit_after_manifest"})
    try:
        deadline = time.monotonic() + 600  # a bound for a regression, not a timing assert

        def stopped() -> bool:  # state "T": it stopped itself right after the manifest
            return open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "T"

        while proc.poll() is None and not stopped():
            assert time.monotonic() < deadline, "resize-bucket never reached its manifest"
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)  # pending until it continues
        proc.send_signal(signal.SIGCONT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.splitlines()[-1] == ("stopped by SIGTERM: what it committed is kept; rerun the same command to "
                                    "continue from there"), err
    assert "Traceback" not in err
    again = warm_start.run([sys.executable, "-m", "pipeline.cli", *words], timeout=600, env={**os.environ})
    assert again.returncode == 0, again.stderr  # no lock left behind, and the version is there
    assert "images v1" in again.stdout, again.stdout


def test_a_signal_that_a_library_turns_into_another_error_is_one_line(monkeypatch, capsys):
    """SIGINT landing inside safetensors' load comes out of diffusers as an OSError (seen under load in the test
    above): the CLI knows a signal stopped it, so it says so in one line with 128 + the signal, no traceback."""
    import pipeline.cli as cli

    def loading_when_interrupted():
        try:
            cli._interrupt(signal.SIGINT, None)
        except KeyboardInterrupt:
            raise OSError("Unable to load weights from checkpoint file") from None

    assert _main_of(monkeypatch, loading_when_interrupted) == 128 + signal.SIGINT
    assert capsys.readouterr().err.strip() == "stopped by SIGINT (OSError while stopping)"

    with pytest.raises(OSError, match="a real error"):  # no signal: the error is the error
        _main_of(monkeypatch, lambda: (_ for _ in ()).throw(OSError("a real error")))


LOST_IN_A_FINALIZER = """
import os, signal, sys, weakref
LOST = signal.Signals[sys.argv.pop(1)]  # an argument, not a variable: one warm parent serves every case
from stages.train import recipe
real = recipe.build_training
class Thing:
    pass
def lost():
    os.kill(os.getpid(), LOST)
    for _ in range(100000):  # the handler runs here, inside the finalizer: Python ignores its exception
        pass
def build_training(*a, **k):
    thing = Thing()
    weakref.finalize(thing, lost)
    del thing
    return real(*a, **k)
recipe.build_training = build_training
from pipeline.cli import main
sys.argv = ["pipeline", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_lost_in_a_finalizer_still_stops_training(tiny_edit_model, tmp_path, sig):
    """A SIGTERM or Ctrl-C that lands while a finalizer runs (a garbage collection during setup) raises its
    SystemExit / KeyboardInterrupt there, and Python ignores it: before, the process went on and trained every
    step (seen in loaded suite runs, a SIGTERM once and later a SIGINT: 100000 steps, the test's timeout). Now the
    training loop acts on it as on one it recorded: the first step's checkpoint, then the stop (status 128 +
    signal), the read lease released."""
    store, out = tmp_path / "store", tmp_path / "run"
    make_train_store(store, tiny_edit_model, mixed_specs(4, 0))
    proc = warm_start.run([sys.executable, "-c", LOST_IN_A_FINALIZER, sig.name, "run", "train", "--store",
                           str(store), "--model", tiny_edit_model, "--out", str(out), "--max-steps", "20", "--device",
                           "cpu"], timeout=600)
    assert proc.returncode == 128 + sig, (proc.returncode, proc.stderr[-2000:])
    said = f"stopped by {'SIGINT (Ctrl-C)' if sig == signal.SIGINT else sig.name}"  # the signal, named
    assert f"{said} after optimizer step 1" in proc.stdout + proc.stderr, proc.stderr[-2000:]
    assert f"{said}:" not in proc.stderr, proc.stderr[-2000:]  # the loop's line, not the CLI's second one
    assert (out / "checkpoints" / "step-1").is_dir() and not (out / "lora").exists()
    assert not list((store / LEASES_DIR).glob("*.json"))


def test_a_sigterm_while_the_process_exits_is_no_traceback(tmp_path):
    """torchrun sends SIGTERM to the other ranks once one has exited; a rank that had printed its line and was
    running its atexit work (the process group's close) raised SystemExit there from the handler: "Exception
    ignored in atexit callback" and a traceback after its line (seen in a 2-rank launch whose rank 1 was killed).
    The command's exit status stays the one it ended with."""
    script = tmp_path / "exiting.py"
    script.write_text(
        "import atexit, os, signal, sys, time\n"
        "import pipeline.cli as cli\n"
        "def ended_work():\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(0.2)  # the handler runs between bytecodes of this callback\n"
        "    print('exit work done', file=sys.stderr)\n"
        "def app():\n"
        "    atexit.register(ended_work)\n"
        "    print('error: the rank\\'s own line', file=sys.stderr)\n"
        "    raise SystemExit(1)\n"
        "cli.app = app\n"
        "cli.main()\n")
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr and p.stderr.endswith("exit work done\n"), p.stderr


# A SIGTERM sent to this process while `models.collective` is being imported: the moment its code starts to run,
# the module in sys.modules without its names yet (a loader of its spec that signals first). The window was
# torch's import (a second or more) while the module imported torch at its top; now shorter, but still there.
_SIGTERM_MID_IMPORT = '''
import importlib.machinery, os, signal, sys
class _SigtermMidImport:
    def find_spec(self, name, path=None, target=None):
        if name != "models.collective":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run_module = spec.loader.exec_module
        def signal_then_run(module):
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, the module empty in sys.modules
            run_module(module)
        spec.loader.exec_module = signal_then_run
        return spec
sys.meta_path.insert(0, _SigtermMidImport())
'''


def test_a_sigterm_while_the_collective_module_is_imported_stops_with_the_line(tmp_path):
    """The CLI's SIGTERM handler asked the half-imported models.collective for `peer_failure`: an AttributeError
    instead of SystemExit, so the stop said "stopped by SIGTERM (AttributeError while stopping)", and where an
    import on the way swallowed `Exception`, the command went on and exited 0 (seen: `run resize-bucket` sent
    SIGTERM 0.5-1 s after its start ran to the end). A real process, the signal sent at that point (a hook)."""
    from pipeline.demo_data import make_demo_data

    make_demo_data(tmp_path / "data", n=2, seed=3)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_SIGTERM_MID_IMPORT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(Path(__file__).resolve().parents[2])])}
    words = ["run", "resize-bucket", "--source", str(tmp_path / "data"), "--store", str(tmp_path / "store")]
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", *words], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 128 + signal.SIGTERM, p.stderr[-2000:]
    assert p.stderr.splitlines()[-1] == ("stopped by SIGTERM: what it committed is kept; rerun the same command "
                                         "to continue from there"), p.stderr[-2000:]
    assert not (tmp_path / "store").exists()  # stopped before it wrote anything


def test_the_training_stop_line_comes_after_the_training_bar(monkeypatch):
    """The trainer's stop line (the checkpoint written, how to go on) was written with the train bar still open:
    tqdm drew the bar again under it, so a terminal's last line was the bar, the stop's line above it."""
    import io

    from tqdm.std import tqdm

    from stages.train import stop

    screen = io.StringIO()  # stdout and stderr on one terminal
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.setattr(sys, "stderr", screen)
    monkeypatch.setattr(stop, "ANNOUNCED", [])
    bar = tqdm(total=10, desc="train", file=screen)
    bar.update(3)
    line = "stopped by SIGTERM after optimizer step 3: its checkpoint RUN/checkpoints/step-3 is written"
    try:
        with pytest.raises(SystemExit) as e:
            stop.StopOnSignal().stop_now(line)
    finally:
        bar.close()
    assert e.value.code == 128 + signal.SIGTERM
    assert screen.getvalue().endswith(f"\n{line}\n"), repr(screen.getvalue()[-300:])


def test_the_training_stop_line_names_the_signal_this_process_got():
    """Train's stop lines name the signal as the CLI's own stop lines do ("stopped by SIGTERM: ..."); a rank
    stopped on another rank's signal has none of its own to name."""
    from stages.train.stop import StopOnSignal

    stop = StopOnSignal()
    assert stop.by() == "a signal"
    stop.signum = signal.SIGTERM
    assert stop.by() == "SIGTERM"
    stop.signum = signal.SIGINT
    assert stop.by() == "SIGINT (Ctrl-C)"
