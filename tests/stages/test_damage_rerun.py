"""Damage found is recorded and acted on, through the real CLI on the tiny model:
- a damaged `text` sample makes train refuse; the rerun of encode-text then recomputes exactly that sample (the
  rest carried forward), the store verifies and train runs; with nothing recorded the rerun says "up to date"
  and that the bytes were not re-read (naming `pipeline store verify`);
- encode-text / encode-vae / evaluate skip-and-report damaged inputs when asked (default: stop), up to a threshold;
  the encoders quarantine them as `damaged-input`, which train's join then reports;
- after `store repair` of `images` (re-rendered bytes identical) and after a resize-bucket rerun on an `images`
  version `store verify` found damaged, encode-text and encode-vae reuse every sample (encoded 0)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pyarrow.parquet as pq
import torch
import yaml
from typer.testing import CliRunner

from damage import flip_bit, sample_byte
from pipeline.cli import app
from store import Store
from store import format as fmt

runner = CliRunner()
SMALL_SHARDS = ["--set", "encode_text.shard_size_mb=0.005", "--set", "encode_vae.shard_size_mb=0.005"]


def invoke(*args) -> object:
    return runner.invoke(app, [str(a) for a in args])


def encode_json(stage: str, store: Path, model: str, *extra: str) -> dict:
    res = invoke("run", stage, "--store", store, "--model", model, "--device", "cpu", *SMALL_SHARDS, *extra, "--json")
    assert res.exit_code == 0, res.output
    return json.loads([ln for ln in res.stdout.splitlines() if ln.strip()][-1])


def split_keys(root: Path, split: str) -> list[str]:
    r = Store(root).reader("images")
    return sorted(k for k, s in zip(r.keys(), r.manifest.column("split").to_pylist()) if s == split)


def no_check_ahead_threads() -> bool:
    return not [t for t in threading.enumerate() if t.name.startswith("check-ahead")]


def train_args(store: Path, model: str, out: Path) -> list:
    return ["run", "train", "--store", store, "--model", model, "--out", out, "--max-steps", "4", "--batch-size", "2",
            "--device", "cpu"]


def test_rerun_of_encode_text_recomputes_exactly_the_damaged_sample(tiny_edit_model, edit_store, tmp_path):
    encode_json("encode-text", edit_store, tiny_edit_model)
    encode_json("encode-vae", edit_store, tiny_edit_model)
    res = invoke("run", "encode-text", "--store", edit_store, "--model", tiny_edit_model, "--device", "cpu",
                 *SMALL_SHARDS)  # nothing recorded: up to date, and it says what it did not check
    assert res.exit_code == 0 and "is up to date" in res.output
    assert "bytes were not re-read" in res.output and f"pipeline store verify {edit_store}" in res.output

    key = split_keys(edit_store, "train")[2]
    flip_bit(*sample_byte(edit_store, "text", key), 4)
    res = invoke(*train_args(edit_store, tiny_edit_model, tmp_path / "run"))
    assert res.exit_code == 1 and "Traceback" not in res.output
    line = [ln for ln in res.output.splitlines() if "error:" in ln][0]
    assert key in line and "table 'text' v1" in line
    assert no_check_ahead_threads()  # the read thread ended with the failed run
    marker = json.loads(fmt.damaged_marker(edit_store, "text", 1).read_text())
    assert key in marker["damaged"]  # train's detection was recorded in the store

    rec = encode_json("encode-text", edit_store, tiny_edit_model)
    n = len(Store(edit_store).reader("images"))
    assert (rec["up_to_date"], rec["encoded"], rec["reused"], rec["version"], rec["repaired_from"]) == \
        (False, 1, n - 1, 2, 1)
    res = invoke("store", "verify", edit_store)
    assert res.exit_code == 0 and "ok:" in res.output
    res = invoke(*train_args(edit_store, tiny_edit_model, tmp_path / "run2"))
    assert res.exit_code == 0, res.output
    assert no_check_ahead_threads()


def test_rerun_of_encode_text_after_a_truncated_shard_recomputes_only_the_samples_past_the_cut(tiny_edit_model,
                                                                                               edit_store):
    """A text shard cut short: the encode that meets it stops and records it; its rerun carries the samples before
    the cut forward (checked) and encodes those past it. Before, the carry refused every sample of the shard: the
    rerun stopped with the same "truncated; run `pipeline store repair`" line, every time."""
    encode_json("encode-text", edit_store, tiny_edit_model)
    clean = {k: Store(edit_store).reader("text").tensors(k) for k in Store(edit_store).reader("text").keys()}
    rows = pq.read_table(edit_store / "text" / "v1" / "manifest.parquet", columns=["shard", "sample_offset"])
    starts: dict[str, list[int]] = {}
    for name, at in zip(rows.column("shard").to_pylist(), rows.column("sample_offset").to_pylist()):
        starts.setdefault(name, []).append(at)
    name, at = next((n, sorted(a)) for n, a in sorted(starts.items()) if len(a) > 1)
    shard = edit_store / "text" / "v1" / name  # cut inside its last sample: the ones before it stay intact
    shard.write_bytes(shard.read_bytes()[: at[-1] + 16])
    res = invoke("run", "encode-text", "--store", edit_store, "--model", tiny_edit_model, "--device", "cpu",
                 *SMALL_SHARDS)
    assert res.exit_code == 1 and "truncated" in res.output  # met and recorded
    rec = encode_json("encode-text", edit_store, tiny_edit_model)
    assert rec["version"] == 2 and rec["encoded"] == 1 and rec["reused"] == len(clean) - 1
    r = Store(edit_store).reader("text")
    assert sorted(r.keys()) == sorted(clean)
    for k in clean:  # the same tensors (encoded alone now: within float32 rounding, stored bf16)
        for n, t in r.tensors(k).items():
            assert torch.allclose(t.float(), clean[k][n].float(), rtol=1e-2, atol=1e-3), (k, n)
    assert invoke("store", "verify", edit_store).exit_code == 0


def test_encoders_skip_and_report_damaged_images_up_to_a_threshold(tiny_edit_model, edit_store, tmp_path):
    key = split_keys(edit_store, "train")[1]
    flip_bit(*sample_byte(edit_store, "images", key, "target.png"), 4)
    res = invoke("run", "encode-text", "--store", edit_store, "--model", tiny_edit_model, "--device", "cpu")
    assert res.exit_code == 1 and key in res.output and "table 'images' v1" in res.output  # default: stop
    res = invoke("run", "encode-vae", "--store", edit_store, "--model", tiny_edit_model, "--device", "cpu",
                 "--set", "encode_vae.on_damaged=skip")  # 1 of 6 > the default 1%
    assert res.exit_code == 1 and "more than encode_vae.max_damaged_fraction 0.01" in res.output
    for stage, section in (("encode-text", "encode_text"), ("encode-vae", "encode_vae")):
        res = invoke("run", stage, "--store", edit_store, "--model", tiny_edit_model, "--device", "cpu",
                     "--set", f"{section}.on_damaged=skip", "--set", f"{section}.max_damaged_fraction=0.2")
        assert res.exit_code == 0, res.output
        assert "skipped 1 damaged input sample(s) of table 'images'" in res.output and key in res.output
    st = Store(edit_store)
    assert key not in st.reader("text").keys() and key not in st.reader("vae").keys()
    q = st.quarantine().to_pylist()
    assert {(r["stage"], r["reason"]) for r in q if r["key"] == key} == \
        {("encode-text", "damaged-input"), ("encode-vae", "damaged-input")}
    res = invoke(*train_args(edit_store, tiny_edit_model, tmp_path / "run"), "--set", "train.max_dropped_fraction=0.5")
    assert res.exit_code == 0, res.output
    assert "damaged-input 1" in res.output  # the join names why the sample is missing


def test_evaluate_skips_and_reports_damaged_val_samples(tiny_edit_model, tmp_path):
    from train_store import make_train_store, mixed_specs

    root = tmp_path / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(4, 4))
    res = invoke("run", "train", "--store", root, "--model", tiny_edit_model, "--out", tmp_path / "run",
                 "--max-steps", "1", "--batch-size", "2", "--device", "cpu")
    assert res.exit_code == 0, res.output
    r = Store(root).reader("vae")
    val = sorted(k for k, s in zip(r.keys(), r.manifest.column("split").to_pylist()) if s == "val")
    r.close()
    flip_bit(*sample_byte(root, "vae", val[1]), 4)
    args = ["run", "evaluate", "--store", root, "--model", tiny_edit_model, "--lora", tmp_path / "run" / "lora",
            "--device", "cpu", "--num-samples", "0", "--set", "evaluate.timesteps=[0.5]",
            "--set", "evaluate.noise_seeds=[0]"]
    res = invoke(*args, "--out", tmp_path / "a")
    assert res.exit_code == 1 and val[1] in res.output and "table 'vae' v1" in res.output  # default: stop
    res = invoke(*args, "--out", tmp_path / "b", "--set", "evaluate.on_damaged=skip")  # 1 of 4 > 1%
    assert res.exit_code == 1 and "more than evaluate.max_damaged_fraction = 0.01" in res.output
    res = invoke(*args, "--out", tmp_path / "c", "--set", "evaluate.on_damaged=skip",
                 "--set", "evaluate.max_damaged_fraction=0.3")
    assert res.exit_code == 0, res.output
    assert "held-out loss on 3 val samples" in res.output and "skipped 1 damaged val sample(s)" in res.output
    metrics = json.loads((tmp_path / "c" / "metrics.json").read_text())
    assert list(metrics["run"]["damaged_samples"]) == [val[1]] and val[1] not in metrics["loss"]["per_sample"]
    assert no_check_ahead_threads()


def demo_store(tmp_path: Path, n: int = 8) -> tuple[Path, Path]:
    """(store, config): an `images` table made by resize-bucket from `n` demo samples, small shards (its rows carry
    what the vae stage's carry-forward compares, mask_sha256, which the fixture stores' rows lack)."""
    from pipeline.demo_data import make_demo_data

    settings = {"resize": {"target_area": 64 * 64, "control_vl_area": 48 * 48, "control_vae_area": 64 * 64,
                           "multiple": 16, "min_side": 16, "shard_size_mb": 0.01}}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(settings))
    make_demo_data(tmp_path / "src", n=n, fmt="folder", max_controls=1, seed=1)
    store = tmp_path / "store"
    assert invoke("run", "resize-bucket", "--config", config, "--source", tmp_path / "src", "--store",
                  store).exit_code == 0
    return store, config


def test_images_repair_and_resize_rerun_keep_every_encoded_sample(tiny_plus_model, tmp_path):
    store, config = demo_store(tmp_path)
    n = len(Store(store).reader("images"))
    for stage in ("encode-text", "encode-vae"):
        assert encode_json(stage, store, tiny_plus_model, "--config", config)["encoded"] == n

    keys = Store(store).reader("images").keys()
    flip_bit(*sample_byte(store, "images", keys[3], "target.png"), 4)  # repaired by `store repair`, from the source
    res = invoke("store", "repair", store, "--config", config)
    assert res.exit_code == 0 and "ok:" in res.output, res.output
    for stage in ("encode-text", "encode-vae"):
        rec = encode_json(stage, store, tiny_plus_model, "--config", config)
        assert (rec["encoded"], rec["reused"], rec["up_to_date"]) == (0, n, False)  # new images version, same bytes

    # found by `store verify`, repaired by the stage's rerun
    flip_bit(*sample_byte(store, "images", keys[5], "target.png"), 4)
    assert invoke("store", "verify", store).exit_code == 1
    res = invoke("run", "resize-bucket", "--config", config, "--source", tmp_path / "src", "--store", store, "--json")
    assert res.exit_code == 0, res.output
    rec = json.loads([ln for ln in res.stdout.splitlines() if ln.strip()][-1])
    assert (rec["encoded"], rec["reused"], rec["repaired_from"]) == (1, n - 1, 2)
    for stage in ("encode-text", "encode-vae"):
        rec = encode_json(stage, store, tiny_plus_model, "--config", config)
        assert (rec["encoded"], rec["reused"]) == (0, n)
    res = invoke("store", "verify", store)
    assert res.exit_code == 0, res.output



def test_a_version_that_skipped_damaged_inputs_is_not_up_to_date_under_stop(tiny_plus_model, tmp_path):
    """on_damaged is in no hash, so a version made under skip (the damaged inputs left out) used to be "up to
    date" for a rerun under stop: that user trained without those samples, told nothing. Now the rerun stops on
    them, and once they are repaired encodes exactly them into a new version holding every sample."""
    store, config = demo_store(tmp_path)
    key = Store(store).reader("images").keys()[3]
    shard, pos = sample_byte(store, "images", key, "target.png")
    clean = flip_bit(shard, pos, 4)
    n = len(Store(store).reader("images"))
    stages = (("encode-text", "encode_text", "text"), ("encode-vae", "encode_vae", "vae"))
    for stage, section, _ in stages:
        skip = ["--config", config, "--set", f"{section}.on_damaged=skip",
                "--set", f"{section}.max_damaged_fraction=0.2"]
        rec = encode_json(stage, store, tiny_plus_model, *skip)
        assert (rec["encoded"], rec["version"], rec["damaged_inputs"]) == (n - 1, 1, [key])
        rec = encode_json(stage, store, tiny_plus_model, *skip)
        assert rec["up_to_date"] and rec["version"] == 1  # under skip it stays current

    for stage, _, table in stages:  # under stop (the default): the left-out sample is read, and stops the run
        res = invoke("run", stage, "--store", store, "--model", tiny_plus_model, "--device", "cpu", "--config", config,
                     *SMALL_SHARDS)
        assert res.exit_code == 1 and "Traceback" not in res.output, res.output
        assert "left out 1 damaged input sample(s)" in res.output  # said before the model loads
        line = [ln for ln in res.output.splitlines() if "error:" in ln][0]
        assert key in line and "table 'images' v" in line
        assert Store(store).tables()[table] == 1

    shard.write_bytes(clean)  # the input repaired
    for stage, _, table in stages:
        rec = encode_json(stage, store, tiny_plus_model, "--config", config)
        # the stopped run's version resumed: the samples it carried forward are done already
        assert (rec["up_to_date"], rec["encoded"], rec["reused"] + rec["resumed"], rec["version"]) == \
            (False, 1, n - 1, 2)
        r = Store(store).reader(table)
        assert r.version == 2 and sorted(r.keys()) == sorted(Store(store).reader("images").keys())
        r.close()
        assert encode_json(stage, store, tiny_plus_model, "--config", config)["up_to_date"]  # whole: current


def test_a_version_whose_schema_json_is_damaged_says_every_sample_is_encoded_again(tiny_edit_model, edit_store,
                                                                                    tmp_path):
    """A damaged schema.json holds the lineage that vouches for the version's samples: nothing of it is carried
    forward. The advice and the rerun's line said "(reusing its intact samples)" and "the rest carried forward"
    over "encoded 8, reused 0"."""
    import shutil

    store = Path(shutil.copytree(edit_store, tmp_path / "store"))
    version = encode_json("encode-text", store, tiny_edit_model)["version"]
    (store / "text" / f"v{version}" / fmt.SCHEMA_JSON).write_text("nope")
    assert invoke("store", "verify", store).exit_code == 1  # records the damage
    res = invoke("store", "repair", store, "--dry-run")
    assert "it writes a new version of 'text' (its samples computed again)" in res.output, res.output
    assert "reusing" not in res.output, res.output
    res = invoke("run", "encode-text", "--store", store, "--model", tiny_edit_model, "--device", "cpu")
    n = len(Store(store).reader("images"))
    [line] = [ln for ln in res.output.splitlines() if "was recorded as damaged" in ln]
    assert f"encoded {n}, reused 0, skipped (already done) 0" in line, line
    assert "none of its samples carried forward (every sample encoded again)" in line and "the rest" not in line, line
    assert "carrying the intact ones forward" not in res.output, res.output  # the run's first line too
