"""What every command shows before it does anything: `--help` without the model stack, and a model-loading
command without the two known-harmless messages torchao's import logs (while other warnings still show)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from enum import Enum
from pathlib import Path

import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
HEAVY = ("torch", "diffusers", "transformers", "peft", "torchao", "accelerate")

# Runs the CLI in-process with the given args, then prints which heavy modules got imported.
PROBE = """
import sys
from pipeline.cli import app
try:
    app(sys.argv[1:], prog_name="pipeline")
except SystemExit:
    pass
print("IMPORTED", sorted(m for m in {heavy!r} if m in sys.modules))
"""


def _run_probe(*args: str) -> tuple[str, subprocess.CompletedProcess]:
    """The heavy modules `pipeline ARGS` imported, and its process."""
    proc = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), *args], env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert "IMPORTED" in proc.stdout, proc.stderr[-2000:]
    return proc.stdout.rsplit("IMPORTED", 1)[1].strip(), proc


def test_help_does_not_import_the_model_stack():
    """Each `--help` in turn in one cold interpreter (tests/cli_probe.py): a module one loads stays loaded, so the
    first help that imports the model stack is the one named (one cold start instead of six)."""
    from cli_probe import keys, run_each

    helps = [["--help"], ["run", "train", "--help"], ["run", "encode-text", "--help"], ["demo", "--help"],
             ["store", "inspect", "--help"], ["predict", "--help"]]
    added, proc = run_each(helps)
    assert added == {key: [0, []] for key in keys(helps)}, proc.stderr[-3000:]
    assert proc.stdout.count("Usage:") == len(helps), proc.stdout[-3000:]


def test_plan_of_a_mistyped_model_says_so_without_the_model_stack(tmp_path):
    """`pipeline plan --model TYPO` told its one line after importing torch (models.loading and the train
    settings it checks first imported it at their top): seconds and ~700 MB for a path that is not there."""
    imported, proc = _run_probe("plan", "--model", str(tmp_path / "nowhere"))
    assert f"error: model '{tmp_path / 'nowhere'}' is neither a model folder" in proc.stderr, proc.stderr[-2000:]
    assert imported == "[]"


# `python -m pipeline.cli ARGS`, with the controls' VAE view at 256² once the command itself imports models.edit
# (a finder consulted on each import, itself importing nothing, so every module still loads when the command
# loads it): the stock ~1024² view took ~3.5 s of the predict's ~14 s of CPU, and the messages checked are the
# imports', whatever the view's size (as tests/stages/test_predict.py).
SMALL_CONTROLS = """
import runpy, sys
from importlib.abc import MetaPathFinder
from importlib.util import find_spec


class SmallControls(MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "models.edit":
            return None
        sys.meta_path.remove(self)
        spec = find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            module.VAE_AREA = 256 * 256

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, SmallControls())
sys.argv = ["pipeline", *sys.argv[1:]]
runpy.run_module("pipeline.cli", run_name="__main__", alter_sys=True)
"""


def test_model_loading_command_has_no_torchao_import_noise(tiny_plus_model, tmp_path):
    Image.new("RGB", (64, 48), (200, 30, 30)).save(tmp_path / "in.png")
    cmd = [sys.executable, "-c", SMALL_CONTROLS, "predict", "--model", tiny_plus_model, "--image", str(tmp_path / "in.png"),
           "--prompt", "make it blue", "--out", str(tmp_path / "out.png"), "--steps", "2", "--height", "64", "--width", "64"]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "out.png").is_file()
    assert "Enum subclass" not in proc.stderr and "Unable to import `torchao`" not in proc.stderr, proc.stderr[-3000:]
    assert "gemm_4bit_forward" not in proc.stderr, proc.stderr[-3000:]


def test_the_filters_drop_only_torchao_messages(caplog):
    import models.quiet_imports  # noqa: F401  (installs the filters)

    class Mine(Enum):
        A = 1

    Mine.__module__ = "somebody.else"
    torchao_enum = Enum("KernelPreference", "AUTO")
    torchao_enum.__module__ = "torchao.quantization.quantize_.common.kernel_preference"
    msg = "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type."
    pytree = logging.getLogger("torch.utils._pytree")
    with caplog.at_level(logging.WARNING):
        pytree.warning(msg, torchao_enum)
        pytree.warning(msg, Mine)
        pytree.warning("some other pytree problem")
        quantizer = logging.getLogger("diffusers.quantizers.torchao.torchao_quantizer")
        quantizer.warning("Unable to import `torchao` Tensor objects. This may affect loading checkpoints")
        quantizer.warning("a real torchao quantizer problem")
        bnb = logging.getLogger("bitsandbytes.backends.cpu.ops")
        bnb.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure ...", "x")
        bnb.warning("a real bitsandbytes problem")
        trust = logging.getLogger("kernels._internals.hf_hub")
        skipped = "Skipping publisher trust check for '{}' because Hugging Face Hub is in offline mode."
        trust.warning(skipped.format("kernels-community/quantization-bitsandbytes"))
        trust.warning(skipped.format("someone/else"))
    shown = [r.getMessage() for r in caplog.records]
    assert shown == [msg % Mine, "some other pytree problem", "a real torchao quantizer problem",
                     "a real bitsandbytes problem", skipped.format("someone/else")]


def test_an_offline_plan_of_a_published_model_prints_nothing_on_stderr():
    """Offline, bitsandbytes' import (by transformers, building the text encoder's shape) made the `kernels`
    package say it skipped a CPU 4-bit kernel's publisher trust check: a line about nothing the user asked for."""
    cmd = [sys.executable, "-m", "pipeline.cli", "plan", "--model", "Qwen/Qwen-Image-Edit-2509"]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "train" in proc.stdout, proc.stderr[-3000:]
    assert proc.stderr == "", proc.stderr[-3000:]


# Every bench script's `--help`, in one interpreter (each alone paid torch's import again: 21 scripts, ~45 s of
# the suite); each runs as `python bench/x.py --help` would run it, under __main__ with its folder on sys.path.
BENCH_HELP = """
import contextlib, io, json, runpy, sys
answers = {}
for path in sys.argv[1:]:
    sys.argv, sys.path[0] = [path, "--help"], path.rsplit("/", 1)[0]
    out, err, code = io.StringIO(), io.StringIO(), None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            code = e.code
    answers[path] = [code, out.getvalue(), err.getvalue()[-2000:]]
print(json.dumps(answers))
"""


def test_bench_scripts_answer_help_without_running():
    import json

    # bench/_common.py and the like are modules the scripts import, no script of their own
    scripts = sorted(str(p) for p in (REPO / "bench").glob("*.py") if not p.name.startswith("_"))
    proc = subprocess.run([sys.executable, "-c", BENCH_HELP, *scripts], env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    answers = json.loads(proc.stdout.splitlines()[-1])
    assert sorted(answers) == scripts
    for script, (code, out, err) in answers.items():
        assert code in (0, None) and out.startswith("usage:"), (script, err)
        assert "==" not in out, script  # no benchmark section ran


def test_python_dash_m_pipeline_is_the_command(tmp_path):
    """`python -m pipeline` said "'pipeline' is a package and cannot be directly executed"; it is the `pipeline`
    command now, as `python -m pipeline.cli` is: the same output and exit status (here a user error: 1)."""
    runs = {module: subprocess.run([sys.executable, "-m", module, "store", "inspect", str(tmp_path / "nowhere")],
                                   env=ENV, capture_output=True, text=True, timeout=120, cwd=tmp_path)
            for module in ("pipeline", "pipeline.cli")}
    for module, proc in runs.items():
        assert proc.returncode == 1 and proc.stderr.startswith("error: "), (module, proc.stderr[-2000:])
    assert runs["pipeline"].stderr == runs["pipeline.cli"].stderr
    helped = subprocess.run([sys.executable, "-m", "pipeline", "--help"], env=ENV, capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert helped.returncode == 0 and "Usage: python -m pipeline" in helped.stdout, helped.stderr[-2000:]


def test_python_dash_m_from_a_folder_holding_a_store_package_uses_the_projects(tmp_path):
    """`-m` puts the current folder first on sys.path: run from a folder holding a `store/` package (here an empty
    one), `from store import Store` found that one, and a mistyped source ended in `ImportError: cannot import
    name 'Store' from 'store'` (a traceback) instead of its line. The `pipeline` script never had that folder."""
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "__init__.py").write_text("")
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", "resize-bucket", "--source",
                           "nowhere", "--store", "st"], env=ENV, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 1 and proc.stderr.startswith(f"error: source {tmp_path / 'nowhere'} does not exist"), proc.stderr[-2000:]


def test_the_installed_script_is_the_cli_main():
    """The `pipeline` script ran `pipeline.cli:app` itself: none of `main`'s work (SIGTERM ending the command with
    its atexit work and one line, the exit's single garbage collection) reached the command users type."""
    import tomllib

    import pipeline.cli as cli

    target = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["pipeline"]
    module, name = target.split(":")
    assert module == "pipeline.cli" and getattr(cli, name) is cli.main, target


def test_a_mistyped_model_or_lora_is_told_without_the_model_stack(tmp_path):
    """A mistyped --lora of `lora merge` / `lora export`, or --model of `run encode-text` / `encode-vae` / `train` /
    `evaluate`, was refused only after torch's import (the LoRA module, the stage's, or the export formats of
    --format's check): ~2 s and ~700 MB for a path that is not there. The paths are checked first now, by the one
    rule of each (models.loading.resolve_model, models.lora_files.lora_weight_file)."""
    from cli_probe import keys, run_each

    from store import Store

    nowhere, store, run = str(tmp_path / "nowhere"), tmp_path / "store", tmp_path / "run"
    Store(store)  # a store (empty): the model's path is checked after the store's
    (run / "checkpoints" / "step-2").mkdir(parents=True)
    (run / "checkpoints" / "step-2" / "resume.json").write_text("{}")  # a checkpoint to --resume, to evaluate
    lora = tmp_path / "lora.safetensors"
    lora.write_bytes(b"")  # a LoRA file by name: the model's path is checked before it is read
    out = ["--out", str(tmp_path / "out")]
    firsts = [["lora", "export", nowhere, "--out", str(tmp_path / "x.safetensors")],
              ["lora", "merge", "--model", nowhere, "--lora", nowhere, *out],
              ["run", "encode-text", "--store", str(store), "--model", nowhere],
              ["run", "encode-vae", "--store", str(store), "--model", nowhere],
              ["run", "train", "--store", str(store), "--model", nowhere, "--out", str(tmp_path / "new-run")],
              ["run", "evaluate", "--store", str(store), "--model", nowhere, "--lora", str(lora), *out]]
    seconds = [["lora", "merge", "--model", nowhere, "--lora", str(lora), *out],
               ["run", "train", "--store", str(store), "--model", nowhere, "--out", str(run), "--resume"],
               ["run", "evaluate", "--store", str(store), "--model", nowhere, "--run", str(run), "--all-checkpoints",
                *out]]
    no_model = f"error: model '{nowhere}' is neither a model folder nor a hub id"
    no_lora = f"error: no LoRA weights at {nowhere}: pass a folder written by `pipeline run train`"
    commands = firsts + seconds  # one cold interpreter for all (tests/cli_probe.py); 2 LoRA lines, of the firsts
    added, proc = run_each(commands)
    assert added == {key: [1, []] for key in keys(commands)}, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert sum(line.startswith(no_lora) for line in lines) == 2, proc.stderr[-3000:]
    assert sum(line.startswith(no_model) for line in lines) == len(commands) - 2, proc.stderr[-3000:]


def test_a_mistyped_store_is_told_without_the_model_stack(tiny_edit_model, tmp_path):
    """A mistyped --store of `run encode-text` / `encode-vae` / `train` / `evaluate` was refused only where the
    stage opened it, after torch's import (~9-20 s against ~1 s now). A store URL is not refused there: it is
    checked where it is pulled."""
    from cli_probe import keys, run_each

    from pipeline.commands.common import existing_store

    nowhere, run = str(tmp_path / "nowhere"), tmp_path / "run"
    (run / "checkpoints" / "step-2").mkdir(parents=True)
    (run / "checkpoints" / "step-2" / "resume.json").write_text("{}")  # a checkpoint to evaluate
    lora = tmp_path / "lora.safetensors"
    lora.write_bytes(b"")
    out = ["--out", str(tmp_path / "out")]
    store = ["--store", nowhere, "--model", tiny_edit_model]
    commands = [["run", "encode-text", *store], ["run", "encode-vae", *store],
                ["run", "train", *store, "--out", str(tmp_path / "new-run")],
                ["run", "evaluate", *store, "--lora", str(lora), *out],
                ["run", "evaluate", *store, "--run", str(run), "--all-checkpoints", *out]]
    added, proc = run_each(commands)  # one cold interpreter for all (tests/cli_probe.py)
    assert added == {key: [1, []] for key in keys(commands)}, proc.stderr[-3000:]
    no_store = f"error: no store at {nowhere} (no store.json)"
    assert sum(line.startswith(no_store) for line in proc.stderr.splitlines()) == len(commands), proc.stderr[-3000:]
    assert not (tmp_path / "nowhere").exists() and not (tmp_path / "new-run").exists()  # nothing made
    existing_store("s3://bucket/no-such-prefix")  # a URL: no network here, refused (or not) where it is pulled


def test_a_damaged_lora_is_told_before_a_hub_model_is_downloaded(tmp_path, monkeypatch):
    """`lora merge` / `predict` with a hub --model not in the cache and a LoRA whose checksum record is damaged:
    the model's resolve (a download of tens of GB, online) came before the LoRA's check, which is local and takes
    a second; the damaged LoRA was told after the download. The LoRA is checked first again."""
    import huggingface_hub
    import pytest

    from pipeline.commands.common import checked_lora
    from schemas.errors import UserError

    lora = tmp_path / "lora"
    lora.mkdir()
    (lora / "pytorch_lora_weights.safetensors").write_bytes(b"weights")
    (lora / "checksums.json").write_bytes(b'{"files": {"pytorch_lora_weights.safe')  # cut short: no record
    downloads: list[str] = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **_: downloads.append(repo) or "")
    with pytest.raises(UserError, match="checksums.json is damaged"):
        checked_lora(lora, "Qwen/Qwen-Image-Edit-2509")
    assert downloads == []


# `pipeline ARGS` as its entry point runs it (or `python -m pipeline`: runpy, as -m runs it), a signal sent to itself
# at cli.py's first import after its own (typer's): the earliest moment, ~0.3 s before main() installs its handlers.
SIGNAL_WHILE_IMPORTING = """
import os, runpy, signal, sys
from importlib.abc import MetaPathFinder


class SignalOnTyper(MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "typer":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.{signal})
        return None


sys.meta_path.insert(0, SignalOnTyper())
if {dash_m}:
    runpy.run_module("pipeline", run_name="__main__", alter_sys=True)
else:
    sys.argv[0] = "pipeline"
    from pipeline.cli import main
    main()
"""


@pytest.mark.parametrize("signal_name, dash_m, status", [
    ("SIGTERM", False, 143),
    ("SIGTERM", True, 143),  # before: silent, -15 (the early handler was the `pipeline` script's alone)
    ("SIGINT", False, 130),  # before: a KeyboardInterrupt traceback from the import under way
])
def test_a_signal_while_the_cli_imports_stops_with_its_line_and_status(signal_name, dash_m, status, tmp_path):
    """Before: the default SIGTERM action ended the process at once, silently (-15), no line (still so under
    `python -m pipeline` until now); a Ctrl-C printed a traceback ending in the import it interrupted."""
    script = SIGNAL_WHILE_IMPORTING.format(signal=signal_name, dash_m=dash_m)
    proc = subprocess.run([sys.executable, "-c", script, "run", "all", "--config", str(tmp_path / "c.yaml")],
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == status, (proc.returncode, proc.stderr[-2000:])
    said = "SIGINT (Ctrl-C)" if signal_name == "SIGINT" else signal_name
    assert proc.stderr.strip().splitlines()[-1] == (f"stopped by {said}: what it committed is kept; rerun the same "
                                                    "command to continue from there"), proc.stderr[-2000:]


# the `pipeline` entry point with an import that hangs (a stalled network filesystem) after two Ctrl-Cs have come
HUNG_IMPORT = """
import os, signal, sys, time
from importlib.abc import MetaPathFinder


class HangOnTyper(MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "typer":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), SECOND)
            time.sleep(60)
        return None


SECOND = getattr(signal, sys.argv.pop(1))
sys.meta_path.insert(0, HangOnTyper())
sys.argv[0] = "pipeline"
from pipeline.cli import main
main()
"""


@pytest.mark.parametrize("second, said", [("SIGINT", "SIGINT (Ctrl-C)"), ("SIGTERM", "SIGTERM")])
def test_a_second_signal_while_the_cli_imports_stops_it_at_once(tmp_path, second, said):
    """Before: every Ctrl-C during the imports was held for main(), so an import that waited could not be
    interrupted (here the sleep ran its 60 s). Now the first is held, a second (a Ctrl-C again, a launcher's
    SIGTERM) stops it: one line, 128 + its number."""
    proc = subprocess.run([sys.executable, "-c", HUNG_IMPORT, second, "run", "all", "--config",
                           str(tmp_path / "c.yaml")], env=ENV, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 128 + getattr(signal, second), (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.strip().splitlines() == [f"stopped by {said} while the command was starting: nothing was "
                                                "done"], proc.stderr[-2000:]
