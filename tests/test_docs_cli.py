"""README.md and docs/*.md against the real CLI and config: every `pipeline COMMAND --flag` they show is a flag of
that command, every dotted config key they name exists, every `--set` example loads, every default they state
is the code's; and every --help text is shown as written (rich markup drops `[section.key]`) and names real keys.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer
import yaml
from rich.text import Text

from pipeline.cli import app
from pipeline.config import ConfigError, config_keys, load_config
from schemas.config import PipelineConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SECTIONS = list(PipelineConfig.model_fields)
KEYS = set(config_keys())
# a dotted key in prose or code: `train.lora.rank` (not a path like docs/train.md or a module like stages.train)
KEY_RE = re.compile(r"(?<![\w./-])((?:%s)(?:\.[a-z_0-9]+)+)(?![\w/-])" % "|".join(SECTIONS))
FILE_SUFFIXES = (".py", ".md", ".yaml", ".json", ".png", ".html", ".zarr")


def leaf_commands() -> dict[str, tuple[set[str], object]]:
    """'run train' -> (its option names, the click command), for every command that runs something."""
    out = {}

    def walk(cmd, path):
        if hasattr(cmd, "commands"):
            for name, sub in cmd.commands.items():
                walk(sub, path + [name])
        else:
            out[" ".join(path)] = ({o for p in cmd.params for o in p.opts + p.secondary_opts} | {"--help"}, cmd)

    walk(typer.main.get_command(app), [])
    return out


COMMANDS = leaf_commands()
GROUPS = {" ".join(c.split()[:n]) for c in COMMANDS for n in range(1, len(c.split()))}


def code_spans(text: str) -> list[str]:
    """Inline code and the lines of fenced blocks (a `\\` continuation joined to its line)."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    lines = [line for b in blocks for line in b.replace("\\\n", " ").splitlines()]
    return re.findall(r"`([^`\n]+)`", re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S)) + lines


def documented_invocations() -> list[tuple[str, str, str, list[str]]]:
    """(doc, the span, command, its --flags) for every `pipeline COMMAND ...` the docs show."""
    found = []
    for doc in DOCS:
        for span in code_spans(doc.read_text()):
            for m in re.finditer(r"\bpipeline(?:\.cli)? ((?:[a-z0-9-]+ ?)+)", span):
                words = [w for w in m.group(1).split() if not w.startswith("-")]
                cmd = next((c for c in sorted(COMMANDS, key=len, reverse=True) if words[:len(c.split())] == c.split()),
                           None)
                if cmd is None:
                    placeholder = span[m.end():].startswith(("<", "…", "..."))  # `pipeline run <stage>`
                    found.append((doc.name, span, "" if placeholder and words[0] in GROUPS else " ".join(words), []))
                    continue
                rest = span[m.start() + len("pipeline"):]
                stop = re.search(r"[;|&#]|\bpipeline\b", rest)  # the next command or a comment ends this one
                found.append((doc.name, span, cmd, re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)",
                                                             rest[:stop.start()] if stop else rest)))
    return found


def test_every_documented_command_exists_and_takes_its_documented_flags():
    invocations = documented_invocations()
    assert len(invocations) > 50  # the scan finds the docs' commands
    wrong = []
    for doc, span, cmd, flags in invocations:
        if cmd and cmd not in COMMANDS:
            wrong.append(f"{doc}: no command `pipeline {cmd}` in {span!r}")
        elif cmd and cmd != "launch":  # launch passes torchrun's own flags through
            wrong += [f"{doc}: `pipeline {cmd}` has no {f} ({span!r})" for f in flags if f not in COMMANDS[cmd][0]]
    assert not wrong, "\n".join(wrong)


def test_every_documented_config_key_exists():
    texts = {p: p.read_text() for p in [*DOCS, *sorted((ROOT / "configs").glob("*.yaml"))]}
    texts = {p: re.sub(r"unknown key '[^']*'", "", t) for p, t in texts.items()}  # an example of a typo
    named = {(p.name, k) for p, t in texts.items() for k in KEY_RE.findall(t) if not k.endswith(FILE_SUFFIXES)}
    assert len(named) > 50
    wrong = sorted(f"{doc}: {k}" for doc, k in named if k not in KEYS
                   and not k.startswith("predict.devices."))  # a dict: its keys are the components
    assert not wrong, "unknown config keys in the docs:\n" + "\n".join(wrong)


def test_every_shipped_config_and_documented_set_example_loads():
    for f in sorted((ROOT / "configs").glob("*.yaml")):
        load_config(f)
    from pipeline.commands.common import parse_sets

    example = r"--set '((?:%s)\.[a-z_.]+=[^']+)'|(?:--set|-s) ((?:%s)\.[a-z_.]+=[^\s`'\]]+)" % (("|".join(SECTIONS),) * 2)
    items = [a or b for doc in DOCS for a, b in re.findall(example, doc.read_text())]
    assert len(items) >= 2
    for item in items:
        try:
            load_config(None, parse_sets([item]))
        except ConfigError as e:
            pytest.fail(f"documented `--set {item}` does not load: {e}")


def code_default(key: str):
    model, *_ = PipelineConfig, None
    *parents, leaf = key.split(".")
    for p in parents:
        model = model.model_fields[p].annotation
    field = model.model_fields[leaf]
    return field.default_factory() if field.default_factory is not None else field.default


UNITS = {"Mpx": 1 << 20, "GiB": 1 << 30}


def parse_documented(value: str):
    value = value.strip().strip("`*")
    if m := re.fullmatch(r"([\d.]+) (Mpx|GiB)", value):
        return float(m.group(1)) * UNITS[m.group(2)]
    return yaml.safe_load(value)


PAGE_SECTIONS = {"train.md": ["train"], "resize-bucket.md": ["resize"], "evaluate.md": ["evaluate"],
                 "encode.md": ["encode_text", "encode_vae"]}


def documented_defaults() -> list[tuple[str, str, str]]:
    """(doc, key, value) for `key` (default X), `key`, **default X**, a `| `key` | `X` |` row of a key/default
    table, `key: X` (default) and, in train.md's options table, `train_key` (X)."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"`([a-z_.]+)`(?: \(default:? |, \*\*default )([^),;*]+)", text):
            out.append((doc.name, m.group(1), m.group(2)))
        for m in re.finditer(r"^\| ((?:`[a-z_.]+`(?:, )?)+) \| `([^`]+)` \|", text, re.M):
            out += [(doc.name, k, m.group(2)) for k in re.findall(r"`([a-z_.]+)`", m.group(1))]
        for m in re.finditer(r"`([a-z_.]+): ([^`]+)` \(default\)", text):
            out.append((doc.name, m.group(1), m.group(2)))
        if doc.name == "train.md":  # its options table: `validate_max_samples` (8)
            out += [(doc.name, k, v) for k, v in re.findall(r"`([a-z_]+)` \(([\d.\[\], ]+)\)", text)]
    return out


def test_every_documented_default_is_the_codes():
    found = documented_defaults()
    assert len(found) >= 15
    wrong = []
    for doc, key, value in found:
        # a page names its own section's keys without the section: `val_fraction` (0.1) in resize-bucket.md
        full = [key] if key in KEYS else [f"{s}.{key}" for s in PAGE_SECTIONS.get(doc, ()) if f"{s}.{key}" in KEYS]
        for k in full:  # none: `stop` (default: ...) describes a value, not a key
            expected, stated = code_default(k), parse_documented(value)
            if stated != (list(expected) if isinstance(expected, tuple) else expected):
                wrong.append(f"{doc}: {k} documented default {value!r}, code {expected!r}")
    assert not wrong, "\n".join(wrong)


def helps() -> list[tuple[str, str, str]]:
    out = []
    for cmd_name, (_, cmd) in COMMANDS.items():
        out.append((cmd_name, "(command)", cmd.help or ""))
        out += [(cmd_name, p.opts[0], getattr(p, "help", None) or "") for p in cmd.params]
    return out


def test_every_option_has_help_shown_as_written():
    """typer renders help as rich markup: `[predict.seed]` was dropped from predict's --help, leaving blanks."""
    wrong = []
    for cmd, opt, text in helps():
        if not text.strip() and opt != "--help" and cmd != "launch":
            wrong.append(f"pipeline {cmd} {opt}: no help")
        elif Text.from_markup(text).plain != text:
            wrong.append(f"pipeline {cmd} {opt}: help {text!r} is shown as {Text.from_markup(text).plain!r}")
    assert not wrong, "\n".join(wrong)


def test_every_command_that_reads_a_config_file_takes_set():
    """docs/architecture.md: every command that reads the config takes `--config F` and `--set section.key=value`
    (plan and store repair took --config only: `--set train.quantize_base=int8`, the option plan suggests, failed)."""
    missing = [c for c, (opts, _) in COMMANDS.items() if "--config" in opts and "--set" not in opts]
    assert not missing, f"--config without --set: {missing}"


def test_config_keys_named_in_help_exist():
    wrong = [f"pipeline {cmd} {opt}: {k}" for cmd, opt, text in helps() for k in KEY_RE.findall(text)
             if k not in KEYS and not k.startswith("predict.devices.")]
    assert not wrong, "\n".join(wrong)


def test_readme_cli_overview_lists_every_command():
    readme = (ROOT / "README.md").read_text()
    overview = readme[readme.index("## CLI overview"):]
    overview = overview[overview.index("```"):][:overview[overview.index("```") + 3:].index("```") + 3]
    missing = [c for c in COMMANDS if not any(c.split()[0] in line and c.split()[-1] in line
                                              for line in overview.splitlines() if line.startswith("pipeline"))]
    assert not missing, f"README's CLI overview does not show: {missing}"


def test_every_option_of_every_command_is_documented():
    """The other direction: a flag in --help that no page names (make-demo-data --n, plan --text-tokens, run
    evaluate --num-samples, store push / pull --option were only in --help)."""
    text = "\n".join(doc.read_text() for doc in DOCS)
    missing = []
    for cmd, (_, command) in sorted(COMMANDS.items()):
        for param in command.params:
            flags = [o for o in param.opts + param.secondary_opts if o.startswith("--") and o != "--help"]
            if flags and not any(re.search(re.escape(f) + r"(?![\w-])", text) for f in flags):
                missing.append(f"pipeline {cmd} {flags[0]}")
    assert not missing, "options no page documents:\n" + "\n".join(missing)
