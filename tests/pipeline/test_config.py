"""Typed config: YAML sections, flag overrides, unknown keys and wrong types rejected with the key named."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.config import ConfigError, load_config


def test_file_values_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  batch_size: 2\n  lora:\n    rank: 4\nresize:\n  target_area: 9216\n")
    cfg = load_config(f, {"train.batch_size": 8, "train.max_steps": None})
    assert cfg.train.batch_size == 8  # flag beats file
    assert cfg.train.lora.rank == 4 and cfg.resize.target_area == 9216
    assert cfg.train.max_steps == 100  # None override = keep default


def test_unknown_key_is_named(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  batch_sise: 2\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert "unknown key 'train.batch_sise'" in str(e.value) and str(f) in str(e.value)


def test_unknown_section_is_named(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("trian:\n  batch_size: 2\n")
    with pytest.raises(ConfigError, match="unknown key 'trian'"):
        load_config(f)


def test_wrong_type_is_named(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  lora:\n    rank: sixteen\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert "'train.lora.rank'" in str(e.value) and "sixteen" in str(e.value)


def test_fingerprint_changes_with_a_setting():
    a = load_config(None, {})
    b = load_config(None, {"resize.target_area": 4096})
    assert a.resize.fingerprint() != b.resize.fingerprint()
    assert a.train.fingerprint() == b.train.fingerprint()


def test_config_show_prints_effective_config(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  batch_size: 3\n")
    r = CliRunner().invoke(app, ["config", "show", "--config", str(f), "--set", "train.max_steps=7"])
    assert r.exit_code == 0, r.output
    assert "batch_size: 3" in r.output and "max_steps: 7" in r.output


def test_config_show_rejects_bad_file_with_exit_2(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  nope: 1\n")
    r = CliRunner().invoke(app, ["config", "show", "--config", str(f)])
    assert r.exit_code == 2 and "unknown key 'train.nope'" in r.output


def test_help_lists_every_command_with_one_line_help():
    r = CliRunner().invoke(app, ["--help"])
    assert r.exit_code == 0
    for cmd in ["make-tiny-model", "make-demo-data", "config", "store", "migrate", "run", "predict", "lora", "demo"]:
        assert cmd in r.output
    r = CliRunner().invoke(app, ["run", "--help"])
    for cmd in ["resize-bucket", "encode-text", "encode-vae", "train", "evaluate", "all"]:
        assert cmd in r.output


def test_help_lists_the_demo_and_the_stages_first_and_the_builders_last():
    """typer listed single commands before groups in registration order: make-tiny-model first, `run` 11th."""
    r = CliRunner().invoke(app, ["--help"])
    commands = r.output[r.output.index("Commands"):]
    listed = [line.split()[1] for line in commands.splitlines() if line.startswith("│ ") and line[2] != " "]
    assert listed[:3] == ["demo", "run", "predict"] and listed[-2:] == ["make-tiny-model", "make-demo-data"], listed


COMMANDS_READING_CONFIG = [
    ["run", "resize-bucket", "--source", "S", "--store", "ST"],
    ["run", "encode-text", "--store", "ST", "--model", "M"],
    ["run", "encode-vae", "--store", "ST", "--model", "M"],
    ["run", "train", "--store", "ST", "--model", "M", "--out", "O"],
    ["run", "evaluate", "--store", "ST", "--model", "M", "--lora", "L", "--out", "O"],
    ["predict", "--model", "M", "--image", "I.png", "--prompt", "p", "--out", "O.png"],
    ["config", "show"],
]


@pytest.mark.parametrize("args", COMMANDS_READING_CONFIG, ids=lambda a: " ".join(a[:2]))
def test_every_command_that_reads_the_config_takes_set(args, tmp_path):
    runner = CliRunner()
    bad = runner.invoke(app, args + ["--set", "train.lora.rnak=4"])
    assert bad.exit_code == 2 and "unknown key 'train.lora.rnak'" in bad.output, bad.output
    wrong = runner.invoke(app, args + ["--set", "train.batch_size=zero"])
    assert wrong.exit_code == 2 and "'train.batch_size'" in wrong.output, wrong.output


def test_set_values_are_yaml_and_flags_win_over_them(tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["config", "show", "--set", "train.lora.target_modules=[to_q, to_k]",
                            "-s", "train.caption_dropout=0.25", "--set", "paths.model=m"])
    assert r.exit_code == 0, r.output
    assert "- to_q\n    - to_k" in r.output and "caption_dropout: 0.25" in r.output
    from pipeline.commands.common import config_from

    cfg = config_from(None, {"train.max_steps": 7}, ["train.max_steps=3", "train.seed=5"])
    assert (cfg.train.max_steps, cfg.train.seed) == (7, 5)
    assert runner.invoke(app, ["config", "show", "--set", "no-equals-sign"]).exit_code == 2


@pytest.mark.parametrize("key, value, meant", [
    ("train.lora.rnak", 8, "train.lora.rank"),  # a typo: the close spelling in the same section
    ("train.batchsize", 8, "train.batch_size"),
    ("train.lr", 0.1, "train.learning_rate"),  # its words' initials (spelling closeness said train.lora)
    ("train.bs", 8, "train.batch_size"),
    ("trian", {}, "train"),
    ("resize.aera", 8, "resize.area"),  # consumed on load, not a field, still a valid key
    ("train.rank", 8, "train.lora.rank"),  # the right name in the wrong place
    ("lerning_rate", 0.1, "train.learning_rate"),  # misspelt and misplaced
    ("evaluate.extra_prompts", [{"prompt": "p", "images": ["a.png"], "hieght": 8}],
     "evaluate.extra_prompts.0.height"),  # inside a list of sections
])
def test_unknown_key_suggests_the_key_meant(key, value, meant):
    with pytest.raises(ConfigError) as e:
        load_config(None, {key: value})
    reported = meant.rsplit(".", 1)[0] + ".hieght" if "extra_prompts" in key else key
    assert f"unknown key '{reported}' (did you mean '{meant}'?)" in str(e.value)


@pytest.mark.parametrize("key, meant", [("evaluate.steps", "evaluate.num_inference_steps"),
                                        ("predict.cfg", "predict.true_cfg_scale"),
                                        ("evaluate.cfg", "evaluate.true_cfg_scale")])
def test_a_flags_name_written_as_a_key_suggests_the_key_the_flag_sets(key, meant):
    """`pipeline evaluate --steps 20` sets evaluate.num_inference_steps; `--set evaluate.steps=20` was answered
    "did you mean 'evaluate.timesteps'" (the held-out loss's timesteps: another setting altogether)."""
    with pytest.raises(ConfigError) as e:
        load_config(None, {key: 20})
    assert f"unknown key '{key}' (did you mean '{meant}'? the flag --{key.split('.')[1]} sets it)" in str(e.value)
    load_config(None, {meant: 20})  # the key suggested exists


def test_unknown_key_without_a_near_one_points_at_config_show():
    r = CliRunner().invoke(app, ["config", "show", "--set", "paths.out=x"])
    assert r.exit_code == 2 and "unknown key 'paths.out' (`pipeline config show` prints every valid key)" in r.output


def test_an_error_says_whether_the_file_or_the_command_line_set_the_key(tmp_path):
    """A key typed with --set (or a flag's value) is marked as such: the header names the file too, and the user
    would otherwise search it for a key that is not there."""
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  lerning_rate: 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_config(f, {"train.max_step": 3, "train.batch_size": 0, "train.seed": None, "encode-text.batch_size": 2})
    lines = str(e.value).splitlines()
    assert lines[0] == f"invalid config ({f} + --set / flags):"
    assert "  unknown key 'train.lerning_rate' (did you mean 'train.learning_rate'?)" in lines
    assert "  unknown key 'train.max_step' (did you mean 'train.max_steps'?) [--set / flag]" in lines
    assert "  unknown key 'encode-text' (did you mean 'encode_text'?) [--set / flag]" in lines  # a typo'd section
    assert any(line.startswith("  'train.batch_size': ") and line.endswith("[--set / flag]") for line in lines)


def test_a_misspelt_predict_device_component_is_refused_with_the_name_meant():
    """predict.devices is a dict, which extra="forbid" does not check: `transfomer: cuda` was accepted and the
    transformer then ran on the CPU (read as absent) or predict failed later without a suggestion."""
    with pytest.raises(ConfigError) as e:
        load_config(None, {"predict.devices.transfomer": "cuda"})
    assert "unknown component 'transfomer' (did you mean 'transformer'?)" in str(e.value)
    assert load_config(None, {"predict.devices.vae": "cuda:1"}).predict.devices == {"vae": "cuda:1"}


def test_overrides_apply_in_the_order_given():
    """A section set whole, then one of its keys: the key is kept (set iteration order would lose it at random)."""
    cfg = load_config(None, {"train.lora": {"rank": 4}, "train.lora.alpha": 8.0, "train.lora.dropout": 0.1})
    assert (cfg.train.lora.rank, cfg.train.lora.alpha, cfg.train.lora.dropout) == (4, 8.0, 0.1)


CONFIG_MISTAKES = {  # what the user wrote -> the start of the one line that must name it
    "bad YAML": ("train: {lr: [}\n", [], "error: config file {f} is not valid YAML: line 1, column 14: "),
    "unknown key": ("train:\n  batch_sise: 2\n", [], "error: invalid config ({f}"),
    "wrong type": ("train:\n  batch_size: two\n", [], "error: invalid config ({f}"),
    "--set naming nothing": ("{}\n", ["--set", "x=y"], "error: invalid config ({f} + --set / flags):"),
    # typer's boxed usage panel, not the one line
    "--set without =": ("{}\n", ["--set", "train.max_steps"],
                        "error: --set: expected SECTION.KEY=VALUE, got 'train.max_steps'\n"),
}


@pytest.mark.parametrize("mistake", CONFIG_MISTAKES, ids=str)
@pytest.mark.parametrize("args", [*COMMANDS_READING_CONFIG, ["run", "all"], ["plan", "--model", "M"], ["demo"],
                                  ["store", "repair", "ST"]], ids=lambda a: " ".join(a[:2]))
def test_a_config_mistake_is_an_error_line_and_exit_2_from_every_command(args, mistake, tmp_path):
    """Config mistakes printed without the `error: ` every other user error starts with (a multi-line PyYAML
    caret drawing for bad YAML): one `error: ` line naming the file (and the line, column of a YAML mistake),
    exit 2 as for a missing flag, nothing else on the way."""
    text, extra, first = CONFIG_MISTAKES[mistake]
    f = tmp_path / "c.yaml"
    f.write_text(text)
    r = CliRunner().invoke(app, [*args, "--config", str(f), *extra])
    assert r.exit_code == 2, r.output
    assert r.output.startswith(first.format(f=f)), r.output
    if mistake == "bad YAML":
        assert r.output.count("\n") == 1 and "fix the file there" in r.output, r.output
    if mistake == "--set without =":
        assert r.output == first, r.output


def test_a_folder_passed_as_the_config_is_named_as_a_folder_with_its_yaml(tmp_path):
    """`--config demo-workdir` said "config file not found: demo-workdir" about a folder that is there."""
    (tmp_path / "config.yaml").write_text("train:\n  max_steps: 3\n")
    r = CliRunner().invoke(app, ["config", "show", "--config", str(tmp_path)])
    assert r.exit_code == 2, r.output
    assert r.output == f"error: config file {tmp_path} is a folder: pass its YAML file (e.g. {tmp_path / 'config.yaml'})\n"


def test_a_config_not_found_says_where_it_was_looked_for_and_how_to_make_one(tmp_path, monkeypatch):
    """Before: "config file not found: c.yaml" and nothing on what to do. A relative path names the folder it was
    read from; the default config that `pipeline config show` prints (the command it names) loads back as it is."""
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["config", "show", "--config", "c.yaml"])
    assert r.exit_code == 2 and r.output == (
        f"error: config file not found: c.yaml (looked for in {tmp_path}); pass an existing YAML file, or write the "
        "defaults to edit with `pipeline config show > c.yaml` (examples: the repository's configs/)\n"), r.output
    defaults = CliRunner().invoke(app, ["config", "show"]).output
    (tmp_path / "c.yaml").write_text(defaults)
    assert CliRunner().invoke(app, ["config", "show", "--config", "c.yaml"]).output == defaults


def test_a_key_given_twice_in_the_file_is_refused_with_both_lines(tmp_path):
    """PyYAML keeps the last of two equal keys silently: a second `train:` section dropped the first one's
    settings (here lora.rank 64 trained as the default)."""
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  lora:\n    rank: 64\nresize:\n  target_area: 9216\ntrain:\n  max_steps: 5\n")
    r = CliRunner().invoke(app, ["config", "show", "--config", str(f)])
    assert r.exit_code == 2, r.output
    assert r.output == (f"error: config file {f} is not valid YAML: line 6, column 1: 'train' is given twice (first "
                        "on line 1): keep one; fix the file there\n"), r.output
    f.write_text("train:\n  max_steps: 5\n  lora: {rank: 4, alpha: 4, rank: 8}\n")
    with pytest.raises(ConfigError, match="line 3, column 29: 'rank' is given twice"):
        load_config(f)
    f.write_text("base: &b {rank: 4}\ntrain:\n  lora:\n    <<: *b\n    rank: 2\n")  # overriding a merged key: no repeat
    with pytest.raises(ConfigError, match="unknown key 'base'"):
        load_config(f)


def test_a_set_to_null_is_applied_not_dropped(tmp_path):
    """`--set k=null` was dropped as if not given (None meant "flag unset"): a file's value could not be reset,
    and `--set train.nope=null` named nothing without a word."""
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  attention_backend: sdpa\n")
    runner = CliRunner()
    r = runner.invoke(app, ["config", "show", "--config", str(f), "--set", "train.attention_backend=null"])
    assert r.exit_code == 0 and "attention_backend: sdpa" not in r.output, r.output
    r = runner.invoke(app, ["config", "show", "--set", "train.nope=null"])
    assert r.exit_code == 2 and "unknown key 'train.nope'" in r.output, r.output
    r = runner.invoke(app, ["config", "show", "--set", "train.max_steps="])  # an empty value is YAML's null
    assert r.exit_code == 2 and "'train.max_steps': Input should be a valid integer (got None)" in r.output, r.output
    from pipeline.commands.common import config_from

    cfg = config_from(f, {"train.attention_backend": None, "train.max_steps": 9}, ["train.max_steps=3"])
    assert (cfg.train.attention_backend, cfg.train.max_steps) == ("sdpa", 9)  # an unset flag changes nothing


def test_an_anchored_mapping_overriding_its_own_merge_is_no_key_given_twice(tmp_path):
    """An anchored mapping that overrides a key of its own `<<` merge, merged into a later section: PyYAML
    flattened it (its merged keys prepended) before constructing it, and the check then saw the overriding key
    twice ('rank' is given twice, naming the merged anchor's line) in a valid file."""
    f = tmp_path / "c.yaml"
    f.write_text("defs:\n  root: &root {max_steps: 4, seed: 1}\n  train: &t\n    <<: *root\n    max_steps: 8\n"
                 "train:\n  <<: *t\n  seed: 2\n")
    with pytest.raises(ConfigError, match="unknown key 'defs'"):  # the schema's verdict: the YAML was read
        load_config(f)
    f.write_text("defs:\n  root: &root {seed: 1}\n  train: &t\n    <<: *root\n    seed: 8\n    seed: 9\n"
                 "train:\n  <<: *t\n")
    with pytest.raises(ConfigError, match="line 6, column 5: 'seed' is given twice \\(first on line 5\\)"):
        load_config(f)


def test_home_and_environment_variables_in_a_files_paths_are_expanded(tmp_path, monkeypatch):
    """YAML does not expand `~` or `$VAR` as a shell does a flag's: `store: ~/st` made a folder named `~` in the
    working directory (the summary's `~/st/quarantine.parquet` read as the home's). Now they name the home and the
    variable's folder; an unset variable is one line, not a folder called `$NOPE`."""
    from pipeline.demo_data import make_demo_data
    from store import Store

    home, data, cwd = tmp_path / "home", tmp_path / "data", tmp_path / "cwd"
    for d in (home, cwd):
        d.mkdir()
    make_demo_data(data / "src", n=4, max_controls=1, seed=0)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("DATA", str(data))
    monkeypatch.chdir(cwd)
    f = tmp_path / "c.yaml"
    f.write_text("paths:\n  source: ${DATA}/src\n  store: ~/st\nresize:\n  target_area: 4096\n  multiple: 16\n")
    result = CliRunner().invoke(app, ["run", "resize-bucket", "--config", str(f)])
    assert result.exit_code == 0, result.output
    assert len(Store(home / "st", create=False).reader("images").manifest) == 4
    assert list(cwd.iterdir()) == []
    f.write_text("paths:\n  source: $NOPE/src\n  store: ~/st2\n")
    monkeypatch.delenv("NOPE", raising=False)
    result = CliRunner().invoke(app, ["run", "resize-bucket", "--config", str(f)])
    assert result.exit_code == 2 and "paths.source: '$NOPE/src' names $NOPE, which is not set" in result.output
    assert not (home / "st2").exists() and list(cwd.iterdir()) == []


def test_mask_weights_both_zero_are_refused_naming_the_key():
    """foreground 0 and background 0 made every masked sample's loss 0 (it is normalised by the sample's total
    weight): a run that trained nothing from them, printing loss 0.0000, was accepted."""
    with pytest.raises(ConfigError) as e:
        load_config(None, {"train.loss.mask_weight.foreground": 0, "train.loss.mask_weight.background": 0})
    assert "'train.loss.mask_weight'" in str(e.value) and "both 0" in str(e.value)
    assert load_config(None, {"train.loss.mask_weight.background": 0}).train.loss.mask_weight.foreground == 1.0



@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_a_lycoris_adapter_on_an_nf4_base_is_refused_at_startup(kind, tmp_path):
    """peft's LoHa / LoKr cannot train on an NF4 base (models/lora.py refuses it): said before only once the model
    had loaded (minutes for the 20B transformer); now `run train`, `run all` and `plan` stop on the config, in the
    same words. LoRA / DoRA on NF4 and LoHa / LoKr on int8 stay accepted."""
    with pytest.raises(ConfigError) as e:
        load_config(None, {"train.lora.kind": kind, "train.quantize_base": "nf4"})
    assert f"'train': train.lora.kind {kind} on an NF4 base (quantize_base nf4): peft's LoHa / LoKr" in str(e.value)
    f = tmp_path / "c.yaml"
    f.write_text(f"train:\n  quantize_base: nf4\n  lora:\n    kind: {kind}\n")
    for command in (["run", "train"], ["run", "all"], ["plan"]):
        result = CliRunner().invoke(app, [*command, "--config", str(f)])
        assert result.exit_code == 2 and f"train.lora.kind {kind} on an NF4 base" in result.output, command
    assert load_config(None, {"train.lora.kind": "dora", "train.quantize_base": "nf4"}).train.lora.kind == "dora"
    assert load_config(None, {"train.lora.kind": kind, "train.quantize_base": "int8"}).train.quantize_base == "int8"

def test_a_flags_path_keeps_its_dollar_as_the_shell_gave_it(tmp_path, monkeypatch):
    """A flag's or --set's value was expanded by the shell already; a `$` left in it was quoted on purpose (a
    folder named `price$list`, an SMB share's `$DATA`). Expanded again, it was refused as an unset variable (no
    way to name that folder) or, set, turned into another path. A `~` is expanded still: the shell leaves the one
    of `--store=~/st`."""
    monkeypatch.delenv("list", raising=False)
    monkeypatch.setenv("DATA", "/elsewhere")
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(None, {"paths.source": "/mnt/price$list/src", "paths.store": "~/st"},
                      sets={"paths.run": "/mnt/share/$DATA/run"})
    assert (cfg.paths.source, cfg.paths.store, cfg.paths.run) == ("/mnt/price$list/src", f"{tmp_path}/st",
                                                                  "/mnt/share/$DATA/run")


@pytest.mark.parametrize("key, values, named, each_once", [
    ("evaluate.noise_seeds", [0, 0], "0 is listed twice", [0]),
    ("evaluate.timesteps", [0.3, 0.7, 0.3], "0.3 is listed twice", [0.3, 0.7]),
    ("evaluate.timesteps", [0.3, 0.30000000001], "0.30000000001 (the same float32 σ as 0.3) is listed twice",
     [0.3, 0.3000001]),
    ("train.validate_noise_seeds", [1, 2, 1], "1 is listed twice", [1, 2]),
    ("train.validate_timesteps", [0.5, 0.5], "0.5 is listed twice", [0.5]),
])
def test_a_noise_seed_or_sigma_listed_twice_is_refused_naming_key_and_value(key, values, named, each_once):
    """A repeated seed or σ was accepted: every loss of that row computed twice, counted twice in the mean, and the
    summary saying "x 2 seeds" of one draw. σ equal in float32 (the precision the loss is computed at) are one σ."""
    with pytest.raises(ConfigError) as e:
        load_config(None, {key: values})
    line = next(line for line in str(e.value).splitlines() if key in line)
    assert line.startswith(f"  '{key}': ") and named in line
    section, name = key.split(".")
    assert getattr(getattr(load_config(None, {key: each_once}), section), name) == each_once


def test_a_yaml_boolean_for_a_number_is_refused_naming_the_key(tmp_path):
    """YAML 1.1 reads `yes` / `on` / `true` as a boolean and pydantic took it for the number 1: `max_steps: yes`
    trained one step, `val_fraction: on` was 1.0, with no word said. Refused now, in a list too; a boolean
    setting still takes one."""
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  max_steps: yes\n  learning_rate: on\n  gradient_checkpointing: yes\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    said = str(e.value)
    assert "'train.max_steps': " in said and "'train.learning_rate': " in said and "boolean" in said, said
    assert "gradient_checkpointing" not in said, said
    with pytest.raises(ConfigError, match="'evaluate.timesteps': .*boolean"):
        load_config(None, {"evaluate.timesteps": [True, 0.5]})
    assert load_config(None, {"train.gradient_checkpointing": True}).train.gradient_checkpointing is True
    with pytest.raises(ConfigError, match=r"'train.offload': Input should be 'none' or 'blocks' \(got False\)"):
        load_config(None, {"train.offload": False})  # a choice of words lists them, as before (`offload: no`)


def test_an_unquoted_yaml_no_for_a_choice_of_words_says_to_quote_it(tmp_path):
    """`mixed_precision: no` is a YAML boolean: the line said "should be 'no', 'bf16' or 'fp16' (got False)", as if
    `no` were not one of the words. Now it says that YAML read a boolean and to quote the word."""
    cfg = tmp_path / "config.yaml"
    cfg.write_text("train:\n  mixed_precision: no\n")
    with pytest.raises(ConfigError, match=r"'train.mixed_precision': .*unquoted no as a boolean .*in quotes, e.g. 'no'"):
        load_config(cfg, {})
    cfg.write_text("train:\n  mixed_precision: 'no'\n")
    assert load_config(cfg, {}).train.mixed_precision == "no"


def test_a_configs_prompts_are_cleaned_of_control_characters_as_captions_are(tmp_path, capsys):
    """evaluate.extra_prompts (a list in the file) and the negative prompts (a flag's override): an ESC sequence or
    a NUL reached the text encoder as text and, printed in a report, rewrote the terminal. Cleaned by the
    captions' rule, a note naming each; outer whitespace kept (the negative prompt " " is the default)."""
    p = tmp_path / "c.yaml"
    p.write_text('evaluate:\n  extra_prompts:\n    - {prompt: "ok", images: [a.png]}\n'
                 '    - {prompt: "\\e[1mbold\\e[0m hat\\0", images: [b.png]}\n')
    cfg = load_config(p, overrides={"predict.negative_prompt": "blurry\x07 "})
    assert [e.prompt for e in cfg.evaluate.extra_prompts] == ["ok", "bold hat"]
    assert cfg.predict.negative_prompt == "blurry " and cfg.evaluate.negative_prompt == " "
    notes = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("note: ")]
    assert [n.split(":")[1].strip() for n in notes] == ["evaluate.extra_prompts[1].prompt", "predict.negative_prompt"]


def test_a_prompts_note_is_printed_by_rank_0_alone_under_a_launcher(tmp_path, capsys, monkeypatch):
    """Every launched rank reads the config: 8 ranks printed 8 identical note lines. Rank 0 prints it (as the other
    launched lines, pipeline/rank_output.py); every rank still gets the cleaned prompt."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    said = {}
    for rank in ("0", "3"):
        monkeypatch.setenv("RANK", rank)
        cfg = load_config(None, overrides={"predict.negative_prompt": "blurry\x07 "})
        assert cfg.predict.negative_prompt == "blurry "
        said[rank] = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("note: ")]
    assert [n.split(":")[1].strip() for n in said["0"]] == ["predict.negative_prompt"] and said["3"] == []


def test_a_relative_store_in_a_config_file_not_found_names_the_folder_it_was_read_from(tmp_path, monkeypatch):
    """`paths.store: st` in project/config.yaml, run from elsewhere: a relative path is read from the current
    folder, not the file's, and the line said only "no store at st" (a store the user could see in project/)."""
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "config.yaml").write_text("paths:\n  store: st\n  model: m\n")
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["run", "encode-vae", "--config", "project/config.yaml"])
    assert res.exit_code == 1, res.output
    line = res.output.strip()
    assert "\n" not in line and line.startswith(f"error: no store at st (= {tmp_path / 'st'}: a relative path is "
                                                "read from the current folder, in a config file too)"), line
