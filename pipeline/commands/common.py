"""Helpers shared by the command wrappers: config loading with flag overrides, error reporting."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NoReturn

import typer
from typer.core import TyperGroup

from schemas.config import PipelineConfig

from pipeline.config import ConfigError, load_config

# flags left unset take the config's value: `config show` prints every key with its default (a flag's help shows its key's)
ConfigOpt = typer.Option(None, "--config", "-c", help="YAML config file (sections per stage); unset flags take its "
                         "values, else the defaults: `pipeline config show` prints them all.", exists=False)
SetOpt = typer.Option(
    [], "--set", "-s", metavar="<key=value>", help="Set any config key: --set train.lora.rank=32 (value parsed as YAML, null included; "
    "repeatable).",
)


def with_config_defaults(command: Callable[..., None]) -> Callable[..., None]:
    """COMMAND with each flag that stands for a config key (its help names it: `(encode_text.device)`) showing that
    key's default in --help, `[default: (cpu)]`: such a flag's own default is None (unset: the config's value), so
    help showed none, and `run encode-text --help` never said the encoder runs on the CPU unless told otherwise.
    A key whose default is None, and a help that states its default itself, are left as they are."""
    import inspect

    from typer.models import OptionInfo

    for param in inspect.signature(command).parameters.values():
        info = param.default
        if not isinstance(info, OptionInfo) or info.default is not None or "default" in (info.help or ""):
            continue
        if (key := _key_in_help(info.help or "")) is not None and (value := config_default(key)) is not None:
            info.show_default = value
    return command


def _key_in_help(text: str) -> str | None:
    """The first dotted config key a flag's help names in parentheses: `... (resize.val_fraction; ...)`."""
    import re

    sections = "|".join(PipelineConfig.model_fields)
    found = re.search(rf"\(((?:{sections})(?:\.[a-z_0-9]+)+)", text)
    return found.group(1) if found else None


def config_default(key: str) -> str | None:
    """The default of dotted KEY as a config file writes it (`cpu`, `8`, `0.1`), None where it has none (unset)."""
    import json

    value: Any = _defaults()
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if value is None or isinstance(value, (dict, list)) and not value:
        return None
    if isinstance(value, str) and value.strip() == value:
        return value
    return json.dumps(value)  # a list, a boolean (true / false), a blank prompt (" ") as YAML reads them


@lru_cache(maxsize=1)
def _defaults() -> dict[str, Any]:
    """Every key's default, as `config show` prints them."""
    return PipelineConfig().model_dump(mode="json")


JsonOpt = typer.Option(False, "--json", help="Print the summary as one JSON object on stdout (messages go to stderr).")


@contextmanager
def json_mode(enabled: bool) -> Iterator[None]:
    """With --json, everything the stage prints goes to stderr, so stdout holds only the JSON."""
    if not enabled:
        yield
        return
    from contextlib import redirect_stdout

    with redirect_stdout(sys.stderr):
        yield


def emit(summary: Any, as_json: bool, model: str | None = None) -> None:
    """The stage's one-line summary, or its `to_json()` as one JSON line (with the model's `variant` when the
    stage ran on a model)."""
    import json

    echo(json.dumps(with_variant(summary.to_json(), model), sort_keys=True) if as_json else str(summary))


def with_variant(record: dict, model: str | None) -> dict:
    """The summary record plus `variant` (edit, edit-plus, edit-2511, qwen-image-2.1) of the model it ran on."""
    if model is None:
        return record
    from models.loading import model_variant

    return {**record, "variant": model_variant(model)}


def parse_sets(items: list[str], flag: str = "--set", form: str = "SECTION.KEY=VALUE") -> dict[str, Any]:
    """`["train.batch_size=8", ...]` -> `{"train.batch_size": 8}` (values parsed as YAML). `flag` / `form`: how
    the mistake names the option (`store push -o KEY=VALUE` parses its items here too). A mistake is a
    `usage_error`."""
    import yaml

    from pipeline.config import yaml_problem
    from schemas.errors import without_secrets

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            usage_error(f"{flag}: expected {form}, got {without_secrets(item)!r}")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as e:  # PyYAML's own message is a caret drawing over several lines
            # no caret drawing either: it shows the value, and a `-o secret=...` never goes into a message
            where = "" if without_secrets(item) != item else f" ({yaml_problem(e)})"
            usage_error(f"{flag} {without_secrets(item)!r}: the value is not valid YAML{where}; fix it, or quote a "
                         "string value")
    return out


def usage_error(line: str) -> NoReturn:
    """A mistake on the command line found by the command's own checks (a flag's callback, or after parsing): one
    red `error: LINE` and exit 2, as `config_from`'s; a `typer.BadParameter` raised there printed typer's boxed
    usage panel instead."""
    report_error(line)
    raise typer.Exit(2)


class OneLineUsageErrors(TyperGroup):
    """The root app's group: a mistake click finds while parsing (`--max-steps abc`, an unknown option, a missing
    argument) or a `typer.BadParameter` a flag's callback raises (`finite`, `one_of`) is one red `error: LINE`
    naming the command's help, exit 2, as `usage_error`'s; typer printed its boxed usage panel over several lines.
    Subcommands are parsed inside the root's `invoke`, so one class on the root covers every command."""

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        _flags_show_no_type(self, self.context_class)  # before parsing: `pipeline --help` prints as it parses
        with _one_line():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: Any) -> Any:
        with _one_line():
            return super().invoke(ctx)

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        """typer suggests the nearest of a group's own commands (`pipeline stor`: 'store'); a stage's name typed at
        the root (`pipeline trian`, `pipeline train`) matched none of them and was told only "No such command":
        the nearest command one level down is suggested too ('run train')."""
        try:
            return super().resolve_command(ctx, args)
        except _CLICK_EXCEPTIONS.UsageError as e:
            typo = args[0] if args else ""
            if self.get_command(ctx, typo) is None and not typo.startswith("-"):
                e.message = _with_nested_guess(e.message, typo, self.commands)
            raise


def _flags_show_no_type(command: Any, context_class: type) -> None:
    """typer's help shows a flag's type as if it took a value (`--resume <bool>`, `--help <bool>`; `--resume true`
    is refused): a flag of COMMAND or of any command below it shows none. Its help option is made as its own
    context makes it (the names in its context_settings), and kept by the command for its help."""
    params = command.get_params(context_class(command, **(command.context_settings or {})))
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    for sub in getattr(command, "commands", {}).values():
        _flags_show_no_type(sub, context_class)


def _with_nested_guess(message: str, typo: str, commands: dict[str, Any]) -> str:
    """MESSAGE with "Did you mean 'run train'?" when TYPO is close to no command of the root (typer's own guess
    is among those) but to a command of one of its groups."""
    from difflib import get_close_matches

    if get_close_matches(typo, list(commands)):
        return message  # typer named the root's nearest already
    nested = {f"{group} {name}": name for group, command in commands.items()
              for name in getattr(command, "commands", {})}
    guesses = [path for name in get_close_matches(typo, list(set(nested.values())))
               for path, sub in nested.items() if sub == name]
    if not guesses:
        return message
    return f"{message.rstrip('.')}. Did you mean {', '.join(repr(g) for g in guesses)}?"


# click's exceptions as typer raises them: typer >= 0.22 carries its own copy of click, so they are found from
# `typer.BadParameter`'s module rather than imported from click (whose classes those are not)
_CLICK_EXCEPTIONS = sys.modules[typer.BadParameter.__module__]
_HELP_FOR_NO_ARGS = getattr(_CLICK_EXCEPTIONS, "NoArgsIsHelpError", ())  # click >= 8.2: `pipeline store` alone


@contextmanager
def _one_line() -> Iterator[None]:
    try:
        yield
    except _HELP_FOR_NO_ARGS:  # the command's help, as before
        raise
    except _CLICK_EXCEPTIONS.UsageError as e:  # BadParameter, NoSuchOption, MissingParameter included
        # a group's help lists its commands (`pipeline trian`), a command's its options
        what = "commands" if hasattr(getattr(e.ctx, "command", None), "commands") else "options"
        where = f" (`{e.ctx.command_path} --help` lists its {what})" if e.ctx is not None else ""
        usage_error(f"{e.format_message()}{where}")


def config_from(path: Path | None, overrides: dict[str, Any], sets: list[str] = (),
                shared: bool = False) -> PipelineConfig:
    """The config file, then `--set` items, then the command's own flags (those that were given). `shared`: a
    command whose launched ranks share their work, each reading the file on its own node: one outcome for every
    rank (`together_before_group`), so a node without the file (or with a broken copy) stops every rank with its
    line instead of leaving the others waiting for it at the process group's start; and the settings read must be
    the same on every rank (pipeline/node_settings.py)."""
    from schemas.errors import UserError

    sets_ = parse_sets(list(sets))
    try:
        if not shared:
            return load_config(path, overrides, sets=sets_)
        from models.collective import together_before_group
        from pipeline.launched import launched
        from pipeline.node_settings import refuse_differing_settings

        with together_before_group(launched()[0], "the config"):
            try:
                cfg = load_config(path, overrides, sets=sets_)
            except ConfigError as e:  # agreed on as a user's mistake: its own line, on every rank
                raise UserError(str(e)) from None
        refuse_differing_settings(launched()[0], cfg)  # each node read its own copy: the same settings on all
        return cfg
    except (ConfigError, UserError) as e:  # a usage error, like a missing flag (`require`): exit 2; a stage's is 1
        collective = sys.modules.get("models.collective")  # launched (shared): a refusal of every rank ends its watch
        report_error(str(e) if collective is None else collective.failure_line(e, str(e)))
        raise typer.Exit(2) from None


def report_error(line: str) -> None:
    """Print the one red `error: LINE` a command ends with. Once models.collective is imported (a launched rank
    may watch the others' failures there), through its `report_once`: the rank's watch thread may print a line
    another rank published at the same moment, the same one where every rank met the failure, and a rank prints
    one line. Not imported: no watch thread (and a config's mistake is told without importing torch)."""
    collective = sys.modules.get("models.collective")
    if collective is None:
        typer.secho(f"error: {line}", fg=typer.colors.RED, err=True)
    else:
        collective.report_once(line)


@contextmanager
def usage_errors() -> Iterator[None]:
    """Checks of the flags and the config made before any work (a model folder's JSON configs read at most): what
    they refuse is a usage mistake, one red line and exit 2 as `config_from`'s; what the work finds is 1
    (`user_errors`). Published as `user_errors`' lines are: a check of this node's files (predict's --out) may
    refuse on one rank alone, which left the others waiting for it (a decision: 30 minutes)."""
    from schemas.errors import UserError

    try:
        yield
    except UserError as e:
        from models.collective import failure_line  # several ranks: the others stop with the same line

        report_error(failure_line(e, str(e)))
        raise typer.Exit(2) from None


@contextmanager
def user_errors(output: Path | str | None = None) -> Iterator[None]:
    """Turn expected errors (bad input, missing table, ...) into one red line and exit 1, not a traceback.
    `output`: the folder or file the command writes, named when a full disk does not say which file it hit."""
    from schemas.errors import UserError

    from store.io_errors import describe

    try:
        yield
    except typer.Exit:  # decided and said already (an inner `usage_errors`' exit 2): no second line
        raise
    except (UserError, ConfigError) as e:
        from models.collective import failure_line  # several ranks: the others stop with the same line

        report_error(failure_line(e, str(e)))
        raise typer.Exit(1) from None
    except (FileExistsError, NotADirectoryError) as e:  # e.g. --out / --store naming an existing file
        from models.collective import failure_line  # one node's own copy of the path: the others stop too

        name = e.filename or output
        report_error(failure_line(e, _not_a_folder(name)))
        raise typer.Exit(1) from None
    except Exception as e:  # a full disk / read-only folder missed by a closer handler: still one line
        import signal

        from schemas.interruptible import received

        if received(signal.SIGINT):  # a Ctrl-C this rank took, made another error by a library's call: the CLI's
            raise  # main names the stop (130, its own line); not a peer's line of the same Ctrl-C and exit 1
        from models.collective import failure_line, peer_line, rank_error_line
        if (peer := peer_line(e)) is not None:  # another rank's failure (published, or a rank killed) seen here
            report_error(peer)
            raise typer.Exit(1) from None
        err = describe(e, "output", Path(getattr(e, "filename", None) or output or "."))
        if err is None:
            failure_line(e, rank_error_line(e))  # the other ranks stop naming this rank; its traceback is its own
            raise
        report_error(failure_line(e, str(err)))
        raise typer.Exit(1) from None


def _not_a_folder(name: Path | str | None) -> str:
    """Why a folder could not be made at NAME: a file is there, or a symbolic link to nothing (a store or run
    linked onto a disk not mounted, which the line called a file)."""
    import os

    if name is not None and os.path.islink(name) and not os.path.exists(name):
        return (f"{name} is a symbolic link to {os.readlink(name)}, which does not exist (a disk not mounted?): "
                "mount or create it, or pass another folder")
    return f"{name} (or a folder on its path) is a file, not a folder: pass a folder path"


def refuse_a_used_folder(out: Path, what: str, advice: str) -> None:
    """OUT, named on the command line for a folder the command creates whole: a file there or on its path, or a
    folder holding anything, is a usage mistake. A UserError for the caller's `usage_errors` (exit 2, before
    anything is written; what the work finds is 1). `what`: how the line names OUT (`--out `, or '' for an
    argument); `advice`: what to do instead."""
    from schemas.errors import UserError
    from schemas.out_folder import refuse_a_file_on_the_path

    refuse_a_file_on_the_path(out, what)
    if out.is_dir() and any(out.iterdir()):
        raise UserError(f"{what}{out} is not empty: {advice}")


def checked_lora(lora: Path | str, model: str | None = None, strict_base: bool = False) -> None:
    """Before a LoRA is applied: its file matches the checksum record train sealed beside it (finite values are
    checked by the loader itself), and, given MODEL, it was trained on that base (a warning, or with
    `strict_base` an error, when its recorded fingerprint differs). The paths are checked before torch is imported
    (models.lora): a mistyped --lora or --model is one line at once. The LoRA's bytes before the model's resolve:
    a hub id not in the cache is a download of tens of GB, after which a damaged LoRA was told."""
    from models.loading import resolve_model
    from models.lora_files import lora_weight_file
    from store.checksum import check_recorded

    check_recorded(lora_weight_file(lora))
    if model is not None:
        resolve_model(model)
        from models.lora import check_base_model

        warning = check_base_model(lora, model, strict_base)
        if warning:
            typer.secho(f"warning: {warning}", fg=typer.colors.YELLOW, err=True)


def existing_store(store: str) -> None:
    """A local --store that holds no store (a typo) is refused in one line before torch's import, not seconds after
    it where the stage opens it. A URL is checked where it is pulled (store.remote_cache.local_store); `run all`
    does not come here (its store is created by its own resize-bucket)."""
    from schemas.errors import UserError
    from store import format as fmt
    from store.remote import is_url

    if not is_url(store) and not (Path(store) / fmt.STORE_JSON).is_file():  # the test of store.Store(create=False)
        # a config file's `paths.store: st` is read from where the command runs, not from the file's folder
        relative = "" if Path(store).is_absolute() else (f" (= {Path(store).absolute()}: a relative path is read "
                                                         "from the current folder, in a config file too)")
        raise UserError(f"no store at {store}{relative} (no {fmt.STORE_JSON}); check --store (paths.store), or run "
                        f"`pipeline run resize-bucket --store {store}` first")


def finite(above: float | None = None, at_least: float | None = None):
    """A typer callback refusing a float flag that is NaN / infinite (which click's ranges let through: every
    comparison with NaN is false), or not above / at least a bound: a LoRA scale of nan wrote a model of NaNs."""
    import math

    def check(value: float | None) -> float | None:
        if value is None:
            return value
        if not math.isfinite(value):
            raise typer.BadParameter(f"{value} is not a finite number")
        if above is not None and not value > above:
            raise typer.BadParameter(f"{value:g} is not above {above:g}")
        if at_least is not None and not value >= at_least:
            raise typer.BadParameter(f"{value:g} is below {at_least:g}")
        return value

    return check


def one_of(choices: Callable[[], Iterable[str]]):
    """A typer callback refusing a value not in `choices()` (called when the flag is parsed, so a module with the
    list is imported only by the command that has the flag): a usage error, exit 2, before any work."""

    def check(value: str | None) -> str | None:
        allowed = list(choices())
        if value is not None and value not in allowed:
            raise typer.BadParameter(f"{value!r} is not one of {', '.join(allowed)}")
        return value

    return check


StrictBaseOpt = typer.Option(False, "--strict-base", help="Refuse a LoRA whose recorded base model differs from --model.")


def require(value: Any, flag: str, key: str) -> Any:
    if value is None:
        report_error(f"{flag} is required (or set `{key}` in the config file)")
        raise typer.Exit(2)
    return value


def echo(msg: str) -> None:
    typer.echo(msg, err=False)
    sys.stdout.flush()
