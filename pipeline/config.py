"""Reading the configuration: one YAML file with a section per stage, then `--set section.key=value` and CLI
flag overrides, validated into `schemas.config.PipelineConfig` (the section types live there, as pure data).
"""

from __future__ import annotations

import difflib
import os
import re
import sys
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from schemas.config import PipelineConfig


class ConfigError(ValueError):
    """A config file or override that does not validate; the message names every offending key."""


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The config section type inside a field's annotation (`Annotated[...]`, `X | None`, `list[X]`), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if (found := _section_model(arg)) is not None:
            return found
    return None


def _key_names(model: type[BaseModel]) -> list[str]:
    # resize.area is a valid key that its section consumes on load (schemas/config.py), so it is no field
    return list(model.model_fields) + (["area"] if "control_vae_area" in model.model_fields else [])


def config_keys(model: type[BaseModel] = PipelineConfig, prefix: str = "") -> list[str]:
    """Every valid dotted key (`train.lora.rank`), sections included."""
    keys = []
    for name in _key_names(model):
        keys.append(prefix + name)
        field = model.model_fields.get(name)
        if field is not None and (sub := _section_model(field.annotation)) is not None:
            keys += config_keys(sub, f"{prefix}{name}.")
    return keys


# A flag's name that is not its key's (`pipeline evaluate --steps` sets evaluate.num_inference_steps): users write
# the flag's name as a key, and spelling closeness would point elsewhere (evaluate.steps -> evaluate.timesteps).
_FLAG_NAMES = {
    "evaluate.steps": "evaluate.num_inference_steps",
    "evaluate.cfg": "evaluate.true_cfg_scale",
    "predict.cfg": "predict.true_cfg_scale",
}


def _initials_of(name: str, keys: list[str]) -> list[str]:
    """The keys NAME abbreviates by their words' initials (`lr`: learning_rate, `bs`: batch_size): spelling
    closeness pointed `train.lr` at train.lora."""
    return [k for k in keys if "_" in k and name == "".join(word[:1] for word in k.split("_"))]


def _did_you_mean(loc: tuple) -> str:
    """A typo'd key's likely meaning: a flag's own name (`_FLAG_NAMES`), a close spelling in its own section,
    else the same name in another place (`train.rank` -> `train.lora.rank`); otherwise where the keys are listed."""
    if (flag_key := _FLAG_NAMES.get(".".join(map(str, loc)))) is not None:
        return f" (did you mean '{flag_key}'? the flag --{loc[-1]} sets it)"
    model: type[BaseModel] | None = PipelineConfig
    for part in loc[:-1]:  # list indices (evaluate.extra_prompts.0) stay on the list's item type
        if isinstance(part, str) and model is not None:
            field = model.model_fields.get(part)
            model = _section_model(field.annotation) if field is not None else None
    name, parent = str(loc[-1]), "".join(f"{p}." for p in loc[:-1])
    if model is not None and (close := _initials_of(name, _key_names(model))
                              or difflib.get_close_matches(name, _key_names(model), n=1, cutoff=0.6)):
        return f" (did you mean '{parent}{close[0]}'?)"
    every = config_keys()
    elsewhere = [k for k in every if k.rsplit(".", 1)[-1] == name]
    if not elsewhere:  # misspelt and misplaced: `lerning_rate` at the top
        close = difflib.get_close_matches(name, {k.rsplit(".", 1)[-1] for k in every}, n=1, cutoff=0.8)
        elsewhere = [k for k in every if k.rsplit(".", 1)[-1] in close]
    if elsewhere:
        return f" (did you mean {' or '.join(repr(k) for k in elsewhere[:3])}?)"
    return " (`pipeline config show` prints every valid key)"


def _format_errors(err: ValidationError, path: Path | None, overridden: dict[str, Any]) -> str:
    """One line per offending key, saying where it came from: the file, or `--set` / a flag (which the file's
    name alone would hide: the user would search the file for a key they typed)."""
    sources = [f"{path}" if path is not None else "", "--set / flags" if overridden else ""]
    lines = [f"invalid config ({' + '.join(s for s in sources if s) or 'defaults'}):"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        # the override set this key, a section above it, or (a typo'd section: `--set encode-text.x=1`) one below
        typed = " [--set / flag]" if any(k == key or key.startswith(k + ".") or k.startswith(key + ".")
                                          for k in overridden) else ""
        if e["type"] == "extra_forbidden":
            lines.append(f"  unknown key '{key}'{_did_you_mean(e['loc'])}{typed}")
        elif e["type"] == "value_error" and isinstance(e.get("input"), dict):  # a section's own rule (its
            # validator's sentence says what and what to do; the input is the whole section, every key of it)
            lines.append(f"  '{key}': {e.get('ctx', {}).get('error', e['msg'])}{typed}")
        else:
            lines.append(f"  '{key}': {e['msg']} (got {e.get('input')!r}){_yaml_number_hint(e)}{typed}")
    return "\n".join(lines)


# YAML 1.1 (PyYAML) reads a float only with a dot and a signed exponent: `1e6` and `1.0e6` are strings
_EXPONENT_TEXT = re.compile(r"([-+]?)(\d+)(?:\.(\d*))?[eE]([-+]?)(\d+)")


def _yaml_number_hint(error: dict) -> str:
    """'; YAML reads 1e6 as text: write 1000000 or 1.0e+6' for a number in exponent form a numeric key got as a
    string (the error alone, 'unable to parse string as an integer', does not say why 1e6 is not a number)."""
    given, numeric = error.get("input"), error["type"].endswith("_parsing") or error["type"] in ("int_type", "float_type")
    match = _EXPONENT_TEXT.fullmatch(given.strip()) if numeric and isinstance(given, str) else None
    if match is None:
        return ""
    sign, whole, fraction, exp_sign, exponent = match.groups()
    value = float(given)
    plain = str(int(value)) if value.is_integer() and abs(value) < 1e16 else repr(value)
    return f"; YAML reads {given} as text: write {plain} or {sign}{whole}.{fraction or 0}e{exp_sign or '+'}{exponent}"


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping: it keeps the last silently, so a second
    `train:` section (or `lora:` key) dropped every setting of the first one."""

    # Checked where PyYAML flattens `<<` merges, before the merged keys join the mapping's own: an anchored mapping
    # holding a merge can be flattened (merged into another) before it is constructed, and its overriding key
    # then looked given twice. Each mapping once (a flattened one holds its merged keys).
    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._checked: set[int] = set()  # ids of the mapping nodes checked (alive for the whole load)

    def flatten_mapping(self, node):
        if id(node) not in self._checked:
            self._checked.add(id(node))
            self._refuse_a_key_twice(node)
        super().flatten_mapping(node)

    def _refuse_a_key_twice(self, node) -> None:
        first_line: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: keys given here may override those
                continue
            key = self.construct_object(key_node)
            try:
                seen = key in first_line
            except TypeError:  # an unhashable key: PyYAML's own error names it
                break
            if seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key!r} is given twice (first on line {first_line[key] + 1}): keep one",
                    key_node.start_mark)
            first_line[key] = key_node.start_mark.line


def yaml_problem(err: Exception) -> str:
    """`line L, column C: <problem>` of a PyYAML error (1-based, as editors count), on one line."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = getattr(err, "problem", None) or getattr(err, "context", None) or str(err)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + " ".join(str(problem).split())


def _set_dotted(d: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ConfigError(f"cannot set '{dotted}': '{p}' is not a section")
    d[parts[-1]] = value


_ENV_VAR = re.compile(r"\$(?:(\w+)|\{(\w+)\})")


def _expand_paths(data: dict[str, Any], variables: bool = True) -> None:
    """`~` and `$VAR` / `${VAR}` in `paths.*`, as a shell expands them in a flag: YAML does not, and `store: ~/st`
    made a folder named `~` in the working directory (its summary's `~/st/quarantine.parquet` read as the home's).
    An unset variable is refused: left as written, it would name a folder called `$VAR` too. Not `variables`: `~`
    alone (a flag's or --set's value, which the shell has expanded already, except a `~` after `=`: `--store=~/st`;
    a `$` left in it was quoted on purpose: a folder named `price$list`)."""
    paths = data.get("paths")
    if not isinstance(paths, dict):
        return
    for key, value in paths.items():
        if not isinstance(value, str):
            continue
        if not variables:
            paths[key] = os.path.expanduser(value)
            continue
        for m in _ENV_VAR.finditer(value):
            if (name := m.group(1) or m.group(2)) not in os.environ:
                raise ConfigError(f"paths.{key}: {value!r} names ${name}, which is not set in the environment; "
                                  "export it, or write the path out")
        paths[key] = os.path.expanduser(os.path.expandvars(value))


def config_not_found(p: Path) -> str:
    """The line for a --config that is not there: where a relative path was looked for (the working folder), and
    how to make one."""
    where = "" if p.is_absolute() else f" (looked for in {Path.cwd()})"
    return (f"config file not found: {p}{where}; pass an existing YAML file, or write the defaults to edit with "
            f"`pipeline config show > {p}` (examples: the repository's configs/)")


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None,
                sets: dict[str, Any] | None = None) -> PipelineConfig:
    """Read YAML (or nothing), apply `sets` (`--set`), then dotted-key overrides (`{"train.batch_size": 8}`),
    validate.

    Overrides whose value is None are ignored, so CLI options can pass their defaults straight through; a `--set`
    value of null is applied (`--set train.attention_backend=null` resets a file's value; `--set train.nope=null`
    is an unknown key, not nothing).
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():  # "not found" would be wrong: it is there, and the YAML file in it is what was meant
            inside = sorted(f.name for f in p.glob("*.y*ml"))
            raise ConfigError(f"config file {p} is a folder: pass its YAML file"
                              + (f" (e.g. {p / inside[0]})" if inside else ""))
        if not p.is_file():
            raise ConfigError(config_not_found(p))
        try:
            loaded = yaml.load(p.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {p} is not UTF-8 text (byte {e.start}): pass a YAML file") from None
        except OSError as e:
            raise ConfigError(f"config file {p} cannot be read: {e.strerror or e}") from None
        except yaml.YAMLError as e:  # PyYAML's message is several lines (a caret drawing): the place and problem
            raise ConfigError(f"config file {p} is not valid YAML: {yaml_problem(e)}; fix the file there") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections, got {type(loaded).__name__}")
        data = loaded
    _expand_paths(data)  # the file's values; a flag's or --set's only `~` (`_expand_paths`)
    # in order: a section, then its key
    overridden = {**(sets or {}), **{k: v for k, v in (overrides or {}).items() if v is not None}}
    _area_overridden(data, overridden)
    for k, v in overridden.items():
        _set_dotted(data, k, v)
    _expand_paths(data, variables=False)
    try:
        cfg = PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, None if path is None else Path(path), overridden)) from None
    _clean_prompts(cfg)
    return cfg


_AREA_KEYS = ("target_area", "control_vae_area")  # the two keys resize.area sets (schemas/config.py)


def _area_overridden(data: dict[str, Any], overridden: dict[str, Any]) -> None:
    """A flag or --set wins over the file for `resize.area` and the two keys it sets, as for every other key: the
    file's keys that `resize.area` given on the command line sets are dropped, and the file's `area` is resolved
    into its two keys when one of them is given there (before, either clash was refused, naming a shipped file's
    keys to drop; `run all` has no --area flag). A file clashing with itself, or `resize.area` with a differing
    `resize.target_area` / `resize.control_vae_area` both on the command line (--set or flags), are still refused
    (the model's validator), as is resize-bucket's `--area` with a differing `--target-area` / `--control-vae-area`
    (its flags are these keys)."""
    resize = data.get("resize")
    if not isinstance(resize, dict):
        return
    given = [k for k in _AREA_KEYS if f"resize.{k}" in overridden]
    if overridden.get("resize.area") is not None:  # (null: no area, the file's keys stand)
        for k in _AREA_KEYS:
            resize.pop(k, None)
    elif given and resize.get("area") is not None and all(resize.get(k) in (None, resize["area"]) for k in _AREA_KEYS):
        area = resize.pop("area")
        resize.update({k: area for k in _AREA_KEYS})


def cleaned_prompt(given: str, key: str) -> str:
    """A user's prompt (`key` names it: a flag, a config key) cleaned of control characters by the captions' rule
    (stages/resize/caption_text.py): an ESC sequence or a NUL reached the text encoder as text and, printed in a
    report, rewrote the terminal. A note line (stderr) when something was removed, by rank 0 alone under a launcher
    (every rank reads the same config: 8 ranks printed 8 identical lines)."""
    from pipeline.rank_output import is_rank_0
    from stages.resize.caption_text import CONTROLS_REMOVED_NOTE, clean_prompt

    if (cleaned := clean_prompt(given)) != given and is_rank_0():
        print(f"note: {key}: {CONTROLS_REMOVED_NOTE}", file=sys.stderr)
    return cleaned


def empty_prompt(key: str) -> str:
    """The line refusing an edit instruction that is empty once cleaned (an unset shell variable as `--prompt
    "$P"`): the LoRA never trained on one (resize-bucket quarantines an empty caption), so its output says nothing."""
    return (f"{key} is empty (or whitespace / control characters only): pass the edit instruction (training never "
            f"sees an empty one: resize-bucket quarantines it as empty-caption)")


def _clean_prompts(cfg: PipelineConfig) -> None:
    """The prompts a config gives (evaluate's extra prompts, the negative prompts: the file's, --set's or a flag's),
    each `cleaned_prompt`."""
    for i, extra in enumerate(cfg.evaluate.extra_prompts):
        extra.prompt = cleaned_prompt(extra.prompt, f"evaluate.extra_prompts[{i}].prompt")
        if not extra.prompt.strip():
            raise ConfigError(empty_prompt(f"evaluate.extra_prompts[{i}].prompt"))
    for section in ("evaluate", "predict"):
        owner = getattr(cfg, section)
        owner.negative_prompt = cleaned_prompt(owner.negative_prompt, f"{section}.negative_prompt")
