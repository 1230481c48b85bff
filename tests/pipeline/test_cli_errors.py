"""Mistakes a user makes get one actionable line and a non-zero exit, and never touch existing data."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.config import ConfigError, load_config


def _run(args: list[str]):
    return CliRunner().invoke(app, args)


def test_demo_data_and_tiny_model_refuse_a_non_empty_folder(tmp_path):
    out = tmp_path / "data"
    assert _run(["make-demo-data", str(out), "--n", "3"]).exit_code == 0
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    r = _run(["make-demo-data", str(out), "--n", "2", "--seed", "5"])
    assert r.exit_code == 2 and "not empty" in r.output and "Traceback" not in r.output  # a usage mistake
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # nothing mixed in
    r = _run(["make-tiny-model", str(out)])
    assert r.exit_code == 2 and "not empty" in r.output


# each command's OUT given on the command line; the model a folder here (lora merge refuses an OUT inside it)
OUT_ARGS = {
    "make-tiny-model": lambda out, model: ["make-tiny-model", str(out)],
    "make-demo-data": lambda out, model: ["make-demo-data", str(out), "--n", "2"],
    "lora merge": lambda out, model: ["lora", "merge", "--model", str(model), "--lora", "L", "--out", str(out)],
    "run evaluate": lambda out, model: ["run", "evaluate", "--store", "S", "--model", str(model), "--lora", "L",
                                        "--out", str(out)],
}


def _tree(root) -> list:
    return sorted((str(p.relative_to(root)), p.read_text() if p.is_file() else None) for p in root.rglob("*"))


@pytest.mark.parametrize("command, case", [(c, case) for c in OUT_ARGS for case in ("not empty", "a file", "under a file")]
                         + [("lora merge", "inside the model")])
def test_an_output_path_refused_before_any_work_is_a_usage_mistake_exit_2(command, case, tmp_path):
    """An output folder named on the command line that the command refuses before writing anything (someone's
    folder, a file, a path under a file, a folder inside the input) is a mistake on the command line: exit 2 and
    one line naming it, as `pipeline demo --workdir`'s (README). It was 1, a failure found while working."""
    model, busy, file = tmp_path / "model", tmp_path / "busy", tmp_path / "notes.txt"
    model.mkdir()
    busy.mkdir()
    (busy / "mine.txt").write_text("mine")
    file.write_text("mine")
    out, said = {"not empty": (busy, f"{busy} "), "a file": (file, f"{file} is a file: pass a new or empty folder"),
                 "under a file": (file / "sub", f"{file / 'sub'} lies under {file}, which is a file"),
                 "inside the model": (model / "merged", f"{model / 'merged'} is inside the model folder {model}")}[case]
    before = _tree(tmp_path)
    r = _run(OUT_ARGS[command](out, model))
    assert r.exit_code == 2, r.output
    assert r.output.startswith("error: ") and r.output.count("\n") == 1 and said in r.output, r.output
    assert case != "not empty" or "not empty" in r.output, r.output
    assert _tree(tmp_path) == before  # nothing written


def test_predict_rejects_a_non_lora_file_a_missing_gpu_and_a_tiny_size(tiny_edit_model, tmp_path):
    from PIL import Image

    img = tmp_path / "in.png"
    Image.new("RGB", (64, 48), (200, 10, 10)).save(img)
    not_lora = tmp_path / "c.yaml"
    not_lora.write_text("train: {}\n")
    base = ["predict", "--model", tiny_edit_model, "--image", str(img), "--prompt", "x", "--steps", "2"]
    r = _run(base + ["--lora", str(not_lora), "--out", str(tmp_path / "a.png")])
    assert r.exit_code == 1 and "no LoRA weights" in r.output
    r = _run(base + ["--height", "8", "--width", "8", "--out", str(tmp_path / "b.png")])
    assert r.exit_code == 2 and "greater than or equal to 16" in r.output  # a usage mistake, before any loading
    r = _run(base + ["--transformer-device", "cuda:7", "--out", str(tmp_path / "c.png")])
    assert r.exit_code == 1 and "predict.devices.transformer" in r.output and "CUDA device" in r.output
    assert not any((tmp_path / n).exists() for n in ("a.png", "b.png", "c.png"))


def test_one_inference_step_is_a_valid_config_and_none_is_not():
    """1 step samples Qwen-Image-2.1 (its scheduler has no terminal stretch); the Edit models refuse it where the
    model is known (tests/stages/test_one_step_sampling.py). Before, the config refused 1 for every model."""
    for key in ("predict.steps", "evaluate.num_inference_steps", "train.sample_steps"):
        section, name = key.split(".")
        assert getattr(getattr(load_config(None, {key: 1}), section), name) == 1
        with pytest.raises(ConfigError, match=name):
            load_config(None, {key: 0})


@pytest.mark.parametrize("key,value", [
    ("evaluate.timesteps", [1.5]), ("evaluate.timesteps", [0.0]), ("train.validate_timesteps", [-0.1]),
    ("train.learning_rate", float("inf")), ("train.learning_rate", float("nan")), ("train.lora.alpha", 0),
    ("train.adam_betas", [0.9, 1.0]), ("train.adam_eps", 0), ("train.max_grad_norm", float("inf")),
    ("evaluate.lora_scale", float("nan")), ("resize.max_aspect", float("inf")), ("train.sigma.logit_std", 0),
    # past torch's generator range: an OverflowError traceback once the model had loaded
    ("train.seed", 1 << 64), ("evaluate.seed", 10**23), ("predict.seed", -(1 << 63) - 1),
    ("evaluate.noise_seeds", [0, 1 << 64]), ("train.validate_noise_seeds", [1 << 70]),
])
def test_out_of_range_and_non_finite_settings_are_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=key.split(".")[-1]):
        load_config(None, {key: value})


def test_every_seed_torch_takes_is_a_valid_setting():
    cfg = load_config(None, {"train.seed": (1 << 64) - 1, "evaluate.seed": -(1 << 63), "predict.seed": -5,
                             "evaluate.noise_seeds": [0, (1 << 63) - 1]})  # int64: the losses file's column
    assert (cfg.train.seed, cfg.evaluate.noise_seeds[1]) == ((1 << 64) - 1, (1 << 63) - 1)


def test_non_finite_yaml_through_the_cli_is_one_line(tmp_path):
    r = _run(["config", "show", "--set", "train.learning_rate=.inf"])
    assert r.exit_code == 2 and "learning_rate" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("args,flag", [
    (["lora", "merge", "--model", "M", "--lora", "L", "--out", "OUT", "--scale", "nan"], "--scale"),
    (["predict", "--model", "M", "--image", "I.png", "--prompt", "x", "--out", "OUT.png", "--lora-scale", "inf"],
     "--lora-scale"),
    (["plan", "--model", "M", "--gpu-memory", "nan"], "--gpu-memory"),
    (["plan", "--model", "M", "--gpu-memory", "-5"], "--gpu-memory"),
    (["plan", "--model", "M", "--tokens-per-sample", "0"], "--tokens-per-sample"),
    (["plan", "--model", "M", "--text-tokens", "-1"], "--text-tokens"),
    (["plan", "--model", "M", "--device", "tpu"], "--device"),
    (["store", "gc", "ST", "--incomplete-after", "-1"], "--incomplete-after"),
    # checked by hand after parsing, exit 1 (the README's rule: a mistake on the command line is 2)
    (["make-demo-data", "OUT", "--n", "0"], "--n"),
    (["make-demo-data", "OUT", "--max-controls", "-1"], "--max-controls"),
    (["make-demo-data", "OUT", "--format", "zip"], "--format"),
    (["make-tiny-model", "OUT", "--full-width", "--layers", "0"], "--layers"),
    (["lora", "export", "L", "--out", "OUT"], "--out"),
    (["lora", "export", "L", "--format", "kohya", "--out", "OUT.safetensors"], "--format"),
    (["lora", "merge", "--model", "M", "--lora", "L", "--out", "OUT", "--dtype", "float8"], "--dtype"),
    (["predict", "--model", "M", "--image", "I.png", "--prompt", "x", "--out", "OUT"], "--out"),
    (["predict", "--model", "M", "--image", "I.png", "--prompt", "x", "--out", "OUT.png", "--width", "8"], "--width"),
    (["run", "train", "--store", "s3://b/p", "--model", "M", "--out", "OUT", "--cache-gb", "-5"], "--cache-gb"),
    (["run", "encode-vae", "--store", "s3://b/p", "--model", "M", "--cache-gb", "nan"], "--cache-gb"),
], ids=lambda a: " ".join(a[:2]) if isinstance(a, list) else a)
def test_a_flag_value_out_of_its_range_is_a_usage_error_before_any_work(args, flag, tmp_path, monkeypatch):
    """Flags outside their config checks took any float: `lora merge --scale nan` wrote a model of NaNs (exit 0),
    `plan --gpu-memory -5` said "DOES NOT FIT in -5 GiB", `--tokens-per-sample -4` planned negative memory and
    `--device tpu` planned a CPU under that name. Now exit 2 naming the flag, nothing read or written."""
    monkeypatch.chdir(tmp_path)
    r = _run(args)
    assert r.exit_code == 2, r.output
    # typer's own range check says "'--flag'"; the command's own checks start their one line with the flag
    assert (f"'{flag}'" in r.output or r.output.startswith(f"error: {flag} ")) and "Traceback" not in r.output, \
        r.output
    assert not (tmp_path / "OUT").exists()


@pytest.mark.parametrize("args, said", [
    (["compare", "a", "--out", "cmp"], "error: INPUTS: pass at least two reports or runs"),
    (["compare", "a", "a", "--out", "cmp"], "error: INPUTS: a is given twice: pass each run once"),
    (["plan", "--model", "M", "--device", "tpu"], "error: --device 'tpu': plan for cuda (cuda:N) or cpu"),
    (["lora", "export", "L", "--out", "OUT"],
     "error: --out OUT: the export is one .safetensors file; name it *.safetensors"),
    (["lora", "export", "L", "--out", "ü" * 128 + ".safetensors"], "error: --out "),
    (["predict", "--model", "M", "--image", "I.png", "--prompt", "x", "--out", "OUT"],
     "error: --out OUT: the name has no image extension; name it .png"),
    (["make-tiny-model", "OUT", "--variant", "edit-3000"],
     "error: --variant 'edit-3000': use 'edit', 'edit-plus', 'edit-2511' or 'qwen-image-2.1'"),
    (["make-tiny-model", "OUT", "--layers", "2"], "error: --layers needs --full-width"),
    (["make-tiny-model", "OUT", "--full-width", "--variant", "edit-2511"],
     "error: --variant 'edit-2511': --full-width builds 'edit', 'edit-plus' or 'qwen-image-2.1'"),
    (["run", "evaluate", "--store", "ST", "--model", "M", "--lora", "L", "--all-checkpoints"],
     "error: --lora names one LoRA, --all-checkpoints evaluates every checkpoint"),
], ids=lambda a: " ".join(a[:2]) if isinstance(a, list) else None)
def test_a_mistake_the_command_checks_itself_is_one_error_line_not_a_usage_box(args, said, tmp_path, monkeypatch):
    """A `typer.BadParameter` raised by a command's own check (a flag's callback, or after parsing) printed typer's
    boxed usage panel over several lines; every other mistake is one red `error: ` line. Exit 2 either way."""
    monkeypatch.chdir(tmp_path)
    r = _run(args)
    assert r.exit_code == 2 and r.output.startswith(said) and r.output.count("\n") == 1, r.output
    assert not set(r.output) & set("╭│╰─"), r.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, said", [
    (["lora", "merge", "--model", "M", "--lora", "L", "--out", "OUT", "--scale", "nan"],
     "error: Invalid value for '--scale': nan is not a finite number (`root lora merge --help` lists its options)"),
    (["make-demo-data", "OUT", "--format", "zip"],
     "error: Invalid value for '--format': 'zip' is not one of folder, webdataset, jsonl, parquet"),
    (["run", "train", "--max-steps", "abc"], "error: Invalid value for '--max-steps': "),
    (["run", "train", "--no-such-flag"], "error: No such option: --no-such-flag"),
    (["make-demo-data"], "error: Missing argument"),
    (["run", "no-such-stage"], "error: No such command 'no-such-stage'."),
], ids=lambda a: " ".join(a[:3]) if isinstance(a, list) else None)
def test_a_mistake_click_finds_while_parsing_is_one_error_line_not_a_usage_box(args, said, tmp_path, monkeypatch):
    """`finite()` / `one_of()` callbacks and click's own parse errors (a value of the wrong type, an unknown
    option, a missing argument or command) printed typer's boxed usage panel over five lines, while every other
    mistake is one red `error: ` line: now one line too, naming the command's help. Exit 2 either way."""
    monkeypatch.chdir(tmp_path)
    r = _run(args)
    assert r.exit_code == 2 and r.output.startswith(said) and r.output.count("\n") == 1, r.output
    assert not set(r.output) & set("╭│╰─") and "Usage:" not in r.output, r.output
    assert list(tmp_path.iterdir()) == []


def test_a_command_group_without_its_command_still_shows_its_help():
    r = _run(["store"])
    assert r.exit_code == 2 and "Usage:" in r.output and "inspect" in r.output, r.output


@pytest.mark.parametrize("args, flags", [
    (["--help"], ["--help"]),
    (["run", "--help"], ["--help"]),
    (["run", "train", "--help"], ["--resume", "--new-run", "--json", "--help"]),
    (["make-demo-data", "--help"], ["--with-masks", "--help"]),
    (["predict", "--help"], ["--strict-base", "--help"]),
    (["store", "push", "--help"], ["--help"]),
], ids=lambda a: " ".join(a) if isinstance(a, list) and a[-1] == "--help" else None)
def test_help_shows_no_type_for_a_flag(args, flags):
    """typer's help showed `--resume <bool>` and `--help <bool>`, as if the flag took a value (`--resume true` is
    refused: an extra argument); a flag now shows no type, an option taking a value still does. A repeatable
    option showed a Python type, `--set <list[str]>`: now what one value is, `<key=value>`, `--image <path>`."""
    r = CliRunner().invoke(app, args, env={"COLUMNS": "200"})  # each row on one line
    assert r.exit_code == 0 and "<bool>" not in r.output and "<list[" not in r.output, r.output
    rows = {m.group(1): line for line in r.output.splitlines() if (m := re.match(r"│[\s*]*(--[\w-]+)", line))}
    assert all(flag in rows for flag in flags), r.output
    if "--max-steps" in rows:
        assert "<int>" in rows["--max-steps"], r.output
    for repeatable in ("--set", "--option"):
        if repeatable in rows:
            assert "<key=value>" in rows[repeatable], r.output


@pytest.mark.parametrize("args, said", [
    (["trian"], "error: No such command 'trian'. Did you mean 'run train'? (`root --help` lists its commands)\n"),
    (["train"], "error: No such command 'train'. Did you mean 'run train'?"),
    (["inspct", "ST"], "error: No such command 'inspct'. Did you mean 'store inspect'?"),
    (["stor", "inspect"], "error: No such command 'stor'. Did you mean 'store'?"),  # typer's own, unchanged
    (["run", "trian"], "error: No such command 'trian'. Did you mean 'train'? (`root run --help` lists its commands)"),
    (["xyz"], "error: No such command 'xyz'. (`root --help` lists its commands)\n"),
], ids=lambda a: " ".join(a) if isinstance(a, list) else None)
def test_a_mistyped_command_suggests_the_nearest_one_level_down_too(args, said):
    """`pipeline trian` said only "No such command 'trian'" (and that the root's help lists its options): typer
    suggests the nearest command of the group typed into, and a stage is one level down (`run train`)."""
    r = _run(args)
    assert r.exit_code == 2 and r.output.startswith(said) and r.output.count("\n") == 1, r.output


def test_a_usage_mistake_found_after_parsing_is_exit_2(tmp_path):
    """`compare` with one run and `make-tiny-model --full-width --variant edit-2511` were refused with exit 1, the
    status of a failure while running: a mistake on the command line is 2 (README), whoever finds it."""
    r = _run(["compare", str(tmp_path / "a"), "--out", str(tmp_path / "cmp")])
    assert r.exit_code == 2 and "INPUTS: pass at least two reports or runs" in r.output, r.output
    r = _run(["make-tiny-model", str(tmp_path / "m"), "--full-width", "--variant", "edit-2511"])
    assert r.exit_code == 2 and "--variant" in r.output, r.output
    assert not (tmp_path / "cmp").exists() and not (tmp_path / "m").exists()


@pytest.mark.parametrize("args, said", [
    (["run", "train", "--store", "ST", "--model", "M", "--out", "OUT", "--set", "train.warmup_steps=10", "--set",
      "train.max_steps=5"], "error: train.warmup_steps (10) exceeds train.max_steps (5)"),
    (["run", "resize-bucket", "--source", "SRC", "--store", "ST", "--multiple", "24"],
     "error: resize.multiple = 24 must be a multiple of 16"),
    # a bucket past any picture read was a MemoryError traceback per sample, or the out-of-memory killer's SIGKILL
    (["run", "resize-bucket", "--source", "SRC", "--store", "ST", "--area", "100000000000"],
     "error: resize.target_area = 100000000000 with resize.multiple 32, min_side 32 and max_aspect 4.0 gives buckets "
     "of up to 316224x316224"),
    (["run", "all", "--config", "c.yaml", "--set", "resize.min_side=1000000"],
     "error: resize.target_area = 1048576 with resize.multiple 32, min_side 1000000"),
    (["run", "resize-bucket", "--source", "SRC", "--store", "ST", "--set", "resize.max_aspect=1e300"],
     "error: resize.target_area = 1048576 with resize.multiple 32, min_side 32 and max_aspect 1e+300 gives buckets "
     "of up to 32x8388608"),
    (["run", "all", "--config", "c.yaml", "--set", "paths.report=null"], "error: `pipeline run all` needs paths.report"),
    (["run", "all", "--config", "c.yaml", "--set", "train.mixed_precision=fp16"],
     "error: train.mixed_precision 'fp16' is not supported"),
    (["plan", "--model", "M", "--set", "train.gradient_checkpointing=false", "--set", "train.uncheckpointed_blocks=1"],
     "error: train.uncheckpointed_blocks (1) leaves blocks out of gradient checkpointing"),
], ids=lambda a: " ".join(a[:2]) + (f" {a[-1]}" if a[1] == "all" else "") if isinstance(a, list) else None)
def test_a_config_mistake_a_stage_checks_at_its_start_is_exit_2_before_any_work(args, said, tmp_path, monkeypatch):
    """The resize and train sections' own checks (and `run all`'s paths) ran inside the stages: exit 1, after a
    store URL was pulled, and in `run all` after resize-bucket and both encoders (train's). The config alone
    decides them: exit 2 right after parsing, as any config mistake."""
    import yaml

    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"paths": {"source": "SRC", "store": "ST", "model": "M",
                                                                "run": "OUT", "report": "REPORT"}}))
    r = _run(args)
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith(said), r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]  # nothing read or written


def test_a_set_or_option_value_that_is_not_yaml_is_one_message_naming_its_flag():
    """`--set k=[` showed PyYAML's caret drawing over five lines; `store push -o foo` was refused as a bad
    `--set` expecting SECTION.KEY=VALUE, a flag the command does not have."""
    r = _run(["config", "show", "--set", "train.batch_size=["])
    assert r.exit_code == 2, r.output
    assert "--set" in r.output and "column 2" in r.output, r.output
    assert "^" not in r.output and "while parsing" not in r.output, r.output  # PyYAML's drawing and its context
    r = _run(["store", "push", "ST", "s3://b/p", "-o", "foo"])
    assert r.exit_code == 2, r.output
    assert "--option" in r.output and "KEY=VALUE" in r.output and "--set" not in r.output, r.output


def test_lora_merge_refuses_a_non_empty_out_before_reading_the_model(tmp_path, monkeypatch):
    """The refusal of a non-empty --out came after the LoRA's base-model check, which hashes the whole model
    (minutes for a 40 GB one) only to be told to pick another folder."""
    import pipeline.commands.lora as lora_cmd

    def read(*a, **k):
        raise AssertionError("the model was read before the refusal")

    monkeypatch.setattr(lora_cmd, "checked_lora", read)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    r = _run(["lora", "merge", "--model", "M", "--lora", "L", "--out", str(busy)])
    assert r.exit_code == 2 and r.output == f"error: --out {busy} is not empty: pass a new folder\n"


def test_a_run_or_checkpoint_folder_passed_as_the_lora_names_its_lora_folder(tmp_path):
    """`--lora RUN` (or RUN/checkpoints/step-N) said only that it holds no weights, though the LoRA is one folder
    down: the line now names that folder."""
    for folder in (tmp_path / "run", tmp_path / "run" / "checkpoints" / "step-10"):
        (folder / "lora").mkdir(parents=True)
        (folder / "lora" / "pytorch_lora_weights.safetensors").write_bytes(b"")
        r = _run(["lora", "export", str(folder), "--out", str(tmp_path / "x.safetensors")])
        assert r.exit_code == 1, r.output
        assert r.output.endswith(f"{folder} is a run or checkpoint folder; pass its LoRA folder {folder / 'lora'}\n")


def test_all_checkpoints_of_a_run_without_any_names_the_run_and_writes_no_report(tmp_path):
    """The line said "the run folder holds no checkpoints" without naming it, after making the report folder
    (left behind with its lock file)."""
    (tmp_path / "run").mkdir()
    r = _run(["run", "evaluate", "--all-checkpoints", "--run", str(tmp_path / "run"), "--store", str(tmp_path / "s"),
              "--model", "M", "--out", str(tmp_path / "report")])
    assert r.exit_code == 1, r.output
    assert r.output.startswith(f"error: no checkpoints to evaluate: {tmp_path / 'run'} holds no checkpoints/step-N")
    # it advised "train with train.checkpoint_every set", a key always set (> 0; training checkpoints at its end too)
    assert "has it trained into this folder?" in r.output and "checkpoint_every set" not in r.output
    assert not (tmp_path / "report").exists()



def test_a_store_linked_to_a_folder_that_is_gone_is_named_as_such(tmp_path):
    """A store (or run) folder that is a symbolic link onto a disk not mounted: the line called it "a file, not a
    folder"; it says the link's target does not exist now. A real file keeps its line."""
    from pipeline.demo_data import make_demo_data

    make_demo_data(tmp_path / "data", n=2, fmt="folder", max_controls=1, seed=1)
    (tmp_path / "store").symlink_to(tmp_path / "unmounted" / "store")
    for store in (tmp_path / "store", tmp_path / "store" / "sub"):
        res = _run(["run", "resize-bucket", "--source", str(tmp_path / "data"), "--store", str(store)])
        assert res.exit_code == 1 and "Traceback" not in res.output, res.output
        assert f"{tmp_path / 'store'} is a symbolic link to {tmp_path / 'unmounted' / 'store'}, which does not " \
               "exist" in res.output, res.output
        assert not (tmp_path / "unmounted").exists()
    (tmp_path / "file").write_text("x")
    res = _run(["run", "resize-bucket", "--source", str(tmp_path / "data"), "--store", str(tmp_path / "file" / "s")])
    assert res.exit_code == 1 and "is a file, not a folder" in res.output, res.output


@pytest.mark.parametrize("flags, key", [
    (["--target-area", "0"], "resize.target_area"),
    (["--control-vae-area", "0"], "resize.control_vae_area"),
])
def test_resize_bucket_refuses_a_zero_area_flag_rather_than_taking_the_default(flags, key, tmp_path, monkeypatch):
    """`--target-area 0` (or `--control-vae-area 0`) was read as "not given" (`target_area or area`): the stage
    sized every bucket at the default 1024² and exited 0. Now a usage error naming the key, nothing written."""
    monkeypatch.chdir(tmp_path)
    r = _run(["run", "resize-bucket", "--source", "SRC", "--store", "ST", *flags])
    assert r.exit_code == 2 and f"'{key}': should be 1 .. {1 << 40}, pixels (got 0)" in r.output, r.output
    assert "Traceback" not in r.output and list(tmp_path.iterdir()) == []


def test_a_nested_folder_source_is_one_line_saying_to_move_the_files_up(tmp_path, monkeypatch):
    """target/cats/*.png (a common layout): every sub-folder is quarantined and nothing is usable. The line said
    only 'no usable sample: 2 quarantined (see quarantine.parquet)', whose rows told the user to 'replace it [the
    folder] with the file' and that it had 'no matching target image'. Now the line says why, and what to do."""
    from PIL import Image

    monkeypatch.chdir(tmp_path)
    for folder in ("target/cats", "control/cats"):
        (tmp_path / "src" / folder).mkdir(parents=True)
        Image.new("RGB", (64, 48), (200, 10, 10)).save(tmp_path / "src" / folder / "a.png")
    (tmp_path / "src" / "target" / "cats" / "a.txt").write_text("make it blue")
    r = _run(["run", "resize-bucket", "--source", "src", "--store", "st", "--area", "4096"])
    assert r.exit_code == 1 and r.output.count("error:") == 1, r.output
    line = r.output[r.output.index("error:"):]
    assert "src: 2 quarantined, e.g. unsupported-file: " in line and "target/cats (a folder): not a regular file, " \
        "not read: a folder source is flat" in line and "move their files up into target/" in line and "Traceback" not in r.output, line
    from store.quarantine import read

    details = read(tmp_path / "st").column("detail").to_pylist()
    assert sorted(d.split(":")[0] for d in details) == ["control/cats (a folder)", "target/cats (a folder)"]
    assert not any("replace it with the file" in d or "no matching target" in d for d in details), details


def test_every_flag_for_a_config_key_shows_that_keys_default_in_help():
    """A stage flag's own default is None (unset: the config's value), so --help showed no default: `run encode-text
    --help` never said the text encoder runs on the CPU unless told, nor `run train --help` its 100 steps. Each
    flag whose help names its key now shows the key's default, as `config show` prints it."""
    import re

    import typer

    from pipeline.config import load_config

    key_named = re.compile(r"\(((?:paths|resize|encode_text|encode_vae|train|evaluate|predict)(?:\.[a-z_0-9]+)+)")
    defaults = load_config(None).model_dump(mode="json")
    shown: dict[str, object] = {}

    def walk(cmd, path):
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {name}".strip())
        for p in getattr(cmd, "params", []) if not hasattr(cmd, "commands") else []:
            key = found.group(1) if (found := key_named.search(p.help or "")) else None
            if key is None or p.default is not None or "default" in (p.help or ""):
                continue
            value = defaults
            for part in key.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            if value not in (None, [], {}):
                shown[f"{path} {p.opts[0]}"] = (p.show_default, value)

    walk(typer.main.get_command(app), "")
    assert shown["run encode-text --device"] == ("auto", "auto") and shown["run train --max-steps"] == ("100", 100)
    assert shown["run encode-vae --batch-size"] == ("8", 8)  # its help names encode_vae.batch_size now
    assert shown["predict --negative-prompt"] == ('" "', " ")
    wrong = {flag: pair for flag, pair in shown.items() if pair[0] != _as_yaml_writes_it(pair[1])}
    assert not wrong, wrong
    assert len(shown) >= 30, sorted(shown)  # every stage's flags, not a few
    r = CliRunner().invoke(app, ["run", "encode-text", "--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    assert "(encode_text.device). [default: (auto)]" in r.output, r.output


def _as_yaml_writes_it(value) -> str:
    """`cpu`, `8`, `0.1`; a boolean, a list and a blank string as JSON (`true`, `["to_q"]`, `" "`)."""
    import json

    if isinstance(value, str) and value.strip() == value:
        return value
    return json.dumps(value) if isinstance(value, (str, bool, list, dict)) else str(value)


def test_an_evaluate_that_fails_before_writing_leaves_no_report_folder(tmp_path):
    """`run evaluate --out REPORT` on a store without its `text` table (or stopped while loading) said so in one
    line and left REPORT behind holding only `.evaluate.lock`; `run train` leaves no --out then. A folder that was
    there before is kept, lock and all."""
    from schemas.errors import UserError
    from stages.evaluate.report_folder import REPORT_LOCK
    from stages.evaluate.report_lock import one_evaluate_per_report

    @one_evaluate_per_report
    def refused(cfg, store, model, lora, out):
        raise UserError("store ST has no 'text' table")

    with pytest.raises(UserError):
        refused(None, "ST", "M", "L", tmp_path / "new-report")
    assert not (tmp_path / "new-report").exists()
    (tmp_path / "kept").mkdir()
    with pytest.raises(UserError):
        refused(None, "ST", "M", "L", tmp_path / "kept")
    assert [p.name for p in (tmp_path / "kept").iterdir()] == [REPORT_LOCK]


AREA_CLASH = "  'resize': resize.area = 4096 sets target_area and control_vae_area, but {clash}: set area alone, or " \
             "{keys} without area [--set / flag]"


@pytest.mark.parametrize("flags, clash, keys", [
    (["--area", "4096", "--target-area", "8192"], "target_area is 8192", "target_area"),
    (["--area", "4096", "--control-vae-area", "1024"], "control_vae_area is 1024", "control_vae_area"),
    (["--area", "4096", "--target-area", "0"], "target_area is 0", "target_area"),  # 0 is no "not given"
    # a --set beside --area: the flag silently won before (its copy of the area overrode the --set key)
    (["--area", "4096", "--set", "resize.target_area=8192"], "target_area is 8192", "target_area"),
])
def test_resize_bucket_refuses_area_beside_a_differing_narrower_area_flag(flags, clash, keys, tmp_path, monkeypatch):
    """`--area 4096 --target-area 8192` silently resized targets to 8192 (the narrower flag won): refused, nothing
    written, by the config's own rule for `resize.area` beside a differing key (--area is that key), as a file's
    clash is; the same value twice is no clash."""
    monkeypatch.chdir(tmp_path)
    r = _run(["run", "resize-bucket", "--source", "SRC", "--store", "ST", *flags])
    assert r.exit_code == 2 and r.output.splitlines() == ["error: invalid config (--set / flags):",
                                                          AREA_CLASH.format(clash=clash, keys=keys)], r.output
    assert list(tmp_path.iterdir()) == []
    r = _run(["run", "resize-bucket", "--source", "SRC", "--store", "ST", "--area", "4096", "--target-area", "4096"])
    assert "resize.area = 4096 sets" not in r.output and "SRC does not exist" in r.output, r.output


def test_a_number_yaml_reads_as_text_names_the_spelling_it_reads(tmp_path):
    """`target_area: 1e6` is the string '1e6' to PyYAML (YAML 1.1 floats need a dot and a signed exponent): the
    error said only 'unable to parse string as an integer (got '1e6')', which reads as nonsense. Now it says why
    and what to write; the suggested spelling loads."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("resize:\n  target_area: 1e6\n")
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    assert str(e.value).splitlines()[1].endswith(
        "(got '1e6'); YAML reads 1e6 as text: write 1000000 or 1.0e+6"), str(e.value)
    cfg.write_text("resize:\n  target_area: 1.0e+6\n")
    assert load_config(cfg).resize.target_area == 1000000
    cfg.write_text("resize:\n  target_area: big\n")  # not a number at all: no hint
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    assert "YAML reads" not in str(e.value)
