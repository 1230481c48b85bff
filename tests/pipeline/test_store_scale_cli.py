"""The store at dataset scale, through the real CLI on the tiny model (issue 11): adding samples encodes only
them, touching files or changing the val split encodes nothing (JSON counts), an Edit (v1) model on mixed
control counts trains on what both tables hold and says so, and `store gc` killed at any step leaves a store
that verifies. `store verify` is clean after each step."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from store import Store
import warm_start

SMALL = ["--set", "resize.target_area=4096", "--set", "resize.control_vae_area=4096",
         "--set", "resize.control_vl_area=3136", "--set", "resize.max_controls=2",
         "--set", "encode_text.dtype=float32", "--set", "encode_vae.dtype=float32"]


def cli(*args: str) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.stdout


def run_json(stage: str, *args: str) -> dict:
    out = cli("run", stage, *args, *SMALL, "--json")
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1, out  # stdout holds the JSON object only
    rec = json.loads(lines[0])
    assert {"stage", "table", "version", "encoded", "reused", "quarantined", "bytes_written", "seconds"} <= rec.keys()
    assert rec["stage"] == stage
    return rec


def verify_clean(store: Path) -> None:
    assert "ok:" in cli("store", "verify", store)


def split_of(store: Path, table: str) -> dict[str, str]:
    r = Store(store).reader(table)
    return dict(zip(r.keys(), r.manifest.column("split").to_pylist()))


def _stems(folder: Path) -> list[str]:
    return sorted(p.stem for p in (folder / "target").glob("*.png"))


def _copy_samples(src: Path, dst: Path, stems: list[str]) -> None:
    for f in src.rglob("*"):
        if f.is_file() and f.name.split(".")[0] in stems:
            to = dst / f.relative_to(src)
            to.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, to)


def test_added_touched_and_relabelled_samples_reuse_features(tmp_path, tiny_plus_model):
    from pipeline.demo_data import make_demo_data

    make_demo_data(tmp_path / "full", n=10, fmt="folder", max_controls=2, seed=3)
    stems = _stems(tmp_path / "full")
    src, store = tmp_path / "src", tmp_path / "store"
    _copy_samples(tmp_path / "full", src, stems[:8])
    common = ["--store", store]
    enc = [*common, "--model", tiny_plus_model]

    first = run_json("resize-bucket", "--source", src, *common)
    assert (first["encoded"], first["reused"], first["quarantined"]) == (8, 0, 0)
    t1, v1 = run_json("encode-text", *enc), run_json("encode-vae", *enc)
    assert (t1["encoded"], t1["reused"], v1["encoded"], v1["reused"]) == (8, 0, 8, 0)
    verify_clean(store)

    # 2 more samples: only they are rendered and encoded; the 8 are carried forward (hard-linked shards)
    _copy_samples(tmp_path / "full", src, stems[8:])
    grown = run_json("resize-bucket", "--source", src, *common)
    assert (grown["version"], grown["encoded"], grown["reused"]) == (2, 2, 8)
    t2, v2 = run_json("encode-text", *enc), run_json("encode-vae", *enc)
    assert (t2["version"], t2["encoded"], t2["reused"]) == (2, 2, 8)
    assert (v2["version"], v2["encoded"], v2["reused"]) == (2, 2, 8)
    old, new = Store(store).reader("text", 1), Store(store).reader("text", 2)
    k = old.keys()[0]
    assert (old.tensors(k)["prompt_embeds"] == new.tensors(k)["prompt_embeds"]).all()
    assert os.path.samefile(old.dir / old.manifest.column("shard")[0].as_py(),
                            new.dir / new.view.samples.shard_of(new.row_of(k)))  # one file, two links
    verify_clean(store)

    # touching every source file (same bytes): nothing is new
    for f in src.rglob("*"):
        os.utime(f, (1e9, 1e9))
    touched = [run_json(s, *a) for s, a in (("resize-bucket", ["--source", src, *common]),
                                            ("encode-text", enc), ("encode-vae", enc))]
    assert all(t["up_to_date"] and t["encoded"] == 0 and t["version"] == 2 for t in touched), touched

    # another val_fraction: relabelled everywhere, nothing rendered or encoded
    relabel = ["--set", "resize.val_fraction=0.9"]  # moves labels under the pictures split of these 10
    r3 = run_json("resize-bucket", "--source", src, *common, *relabel)
    t3, v3 = run_json("encode-text", *enc), run_json("encode-vae", *enc)
    assert [(x["encoded"], x["reused"], x["bytes_written"]) for x in (r3, t3, v3)] == [(0, 10, 0)] * 3
    splits = split_of(store, "images")
    assert split_of(store, "text") == splits == split_of(store, "vae")
    assert splits != split_of_version(store, "images", 2)  # the labels did change
    verify_clean(store)

    # gc: only the current versions (and what they reference) stay; they still verify and read
    out = cli("store", "gc", store, "--dry-run")
    assert "would remove" in out and Store(store).versions("text") == [1, 2, 3]
    cli("store", "gc", store)
    assert Store(store).versions("text") == [3] and Store(store).versions("images") == [3]
    verify_clean(store)
    assert (Store(store).reader("text").tensors(k)["prompt_embeds"] == new.tensors(k)["prompt_embeds"]).all()


def split_of_version(store: Path, table: str, version: int) -> dict[str, str]:
    r = Store(store).reader(table, version)
    return dict(zip(r.keys(), r.manifest.column("split").to_pylist()))


def test_edit_v1_on_mixed_controls_trains_on_the_intersection(tmp_path, tiny_edit_model):
    from pipeline.demo_data import make_demo_data

    src, store, run = tmp_path / "src", tmp_path / "store", tmp_path / "run"
    make_demo_data(src, n=10, fmt="folder", max_controls=2, seed=4)
    one_control = [s for s in _stems(src) if (src / "control" / f"{s}.png").exists()
                   and not (src / "control_1" / f"{s}.png").exists()]
    assert len(one_control) >= 2
    # a caption holding the image placeholder: encode-text rejects it, encode-vae has no reason to
    (src / "target" / f"{one_control[0]}.txt").write_text("swap <|image_pad|> for a cat")
    common = ["--store", store, "--set", "resize.val_fraction=0"]
    enc = [*common, "--model", tiny_edit_model]
    run_json("resize-bucket", "--source", src, *common)
    text, vae = run_json("encode-text", *enc), run_json("encode-vae", *enc)
    wrong_count = 10 - len(one_control)
    assert vae["quarantined"] == wrong_count  # the Edit (v1) control rule in both stages
    assert text["quarantined"] == wrong_count + 1
    verify_clean(store)

    train = ["run", "train", "--store", store, "--model", tiny_edit_model, "--out", run, "--set", "train.max_steps=2",
             "--set", "train.batch_size=2", "--set", "train.device=cpu", "--set", "train.checkpoint_every=2"]
    refused = CliRunner().invoke(app, [str(a) for a in train])
    assert refused.exit_code == 1
    msg = refused.output
    assert "encode-text: edit model needs exactly one control image" in msg and "max_dropped_fraction" in msg
    assert "prompt does not fit the template 1" in msg and "encode-vae" in msg
    assert not list((store / ".leases").glob("*.json"))  # the refused reader's read lease is gone at once

    out = cli(*train, "--set", "train.max_dropped_fraction=0.9", "--json")
    rec = json.loads(out.strip().splitlines()[-1])
    data = rec["data"]
    assert (data["samples"], data["joined"], data["dropped"]) == (10, len(one_control) - 1, wrong_count + 1)
    assert data["reasons"]["encode-text"]["prompt does not fit the template"] == 1
    assert data["only_in"] == {"text": 0, "vae": 1} and rec["steps"] == 2
    assert json.loads((run / "data.json").read_text()) == data  # logged in the run
    verify_clean(store)


@pytest.mark.parametrize("point", ["gc_before_rename", "gc_after_rename", "gc_mid_delete"])
def test_gc_killed_at_any_step_leaves_a_verifiable_store(tmp_path, point):
    from pipeline.demo_data import make_demo_data

    src, store = tmp_path / "src", tmp_path / "store"
    make_demo_data(src, n=6, fmt="folder", max_controls=1, seed=5)
    for frac in ("0.2", "0.6", "0.9"):  # three images versions, the last two carried forward
        run_json("resize-bucket", "--source", src, "--store", store, "--set", f"resize.val_fraction={frac}")
    before = Store(store).reader("images")
    want = {k: before.files(k)["target.png"] for k in before.keys()}
    env = {**os.environ, "STORE_CRASH_AT": point, "PYTHONPATH": os.pathsep.join(sys.path)}
    killed = warm_start.run([sys.executable, "-m", "pipeline.cli", "store", "gc", str(store)], env=env)
    assert killed.returncode == -9, killed.stderr
    verify_clean(store)
    assert Store(store).versions("images")[-1] == 3
    cli("store", "gc", store)  # the rerun finishes the job
    assert Store(store).versions("images") == [3]
    assert not [p for p in (store / "images").iterdir() if p.name.startswith(".v")]
    verify_clean(store)
    after = Store(store).reader("images")
    assert {k: after.files(k)["target.png"] for k in after.keys()} == want


def test_another_model_with_the_same_vae_files_reuses_the_latents(tmp_path, tiny_edit_model, tiny_plus_model):
    """Edit -> Edit-Plus with identical `vae/` files: every latent encode-vae already holds is carried forward;
    only the samples the Edit (v1) model had rejected (0 or 2 controls) are encoded."""
    from pipeline.demo_data import make_demo_data

    plus = tmp_path / "plus-with-edit-vae"
    shutil.copytree(tiny_plus_model, plus)
    shutil.rmtree(plus / "vae")
    shutil.copytree(Path(tiny_edit_model) / "vae", plus / "vae")
    src, store = tmp_path / "src", tmp_path / "store"
    make_demo_data(src, n=8, fmt="folder", max_controls=2, seed=6)
    run_json("resize-bucket", "--source", src, "--store", store)
    edit = run_json("encode-vae", "--store", store, "--model", tiny_edit_model)
    assert edit["encoded"] + edit["quarantined"] == 8 and edit["encoded"] > 0
    switched = run_json("encode-vae", "--store", store, "--model", plus)
    assert (switched["version"], switched["reused"], switched["encoded"]) == (2, edit["encoded"], edit["quarantined"])
    verify_clean(store)


def test_a_changed_mask_is_recomputed_where_it_matters(tmp_path, tiny_plus_model):
    """The mask is not part of the sample key: a new mask re-renders that sample and recomputes its mask_weight,
    its latents kept (the same pictures: stages/encode/mask_only.py, counted "completed") and its text features
    reused."""
    from pipeline.demo_data import make_demo_data

    src, store = tmp_path / "src", tmp_path / "store"
    make_demo_data(src, n=4, fmt="folder", max_controls=1, seed=7, with_masks=True)
    enc = ["--store", store, "--model", tiny_plus_model]
    run_json("resize-bucket", "--source", src, "--store", store)
    run_json("encode-text", *enc), run_json("encode-vae", *enc)
    mask = sorted((src / "mask").glob("*.png"))[0]
    before = Store(store).reader("vae")
    weights = {k: before.tensors(k)["mask_weight"].clone() for k in before.keys() if "mask_weight" in before.tensors(k)}
    from PIL import Image

    with Image.open(mask) as im:
        Image.new("L", im.size, 255).save(mask)  # the whole image is now the edit region
    r = run_json("resize-bucket", "--source", src, "--store", store)
    t, v = run_json("encode-text", *enc), run_json("encode-vae", *enc)
    assert (r["encoded"], r["reused"]) == (1, 3)
    assert (t["encoded"], t["reused"]) == (0, 4) and (v["encoded"], v["completed"], v["reused"]) == (0, 1, 3), v
    vae = Store(store).reader("vae")
    changed = [k for k in weights if not (vae.tensors(k)["mask_weight"] == weights[k]).all()]
    assert len(changed) == 1 and (vae.tensors(changed[0])["mask_weight"] == 1).all()  # the new mask, all edited
    verify_clean(store)


def _as_schema_v1(vdir: Path) -> None:
    """Rewrite a schema-v2 `images` version as the schema-v1 table an earlier release wrote (docs/store-format.md,
    "Schema v1"): pixel-size columns instead of img_shapes, no feature lineage; shards untouched."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from store import format as fmt
    from store.integrity import write_version_checksums

    m = pq.read_table(vdir / fmt.MANIFEST)
    buckets, controls = m.column("bucket").to_pylist(), m.column("control_sizes").to_pylist()
    assert all(len(c) <= 1 for c in controls)  # v1 knew one control at most
    m = m.drop_columns(["img_shapes"])
    for name, values in (("height", [b[0] for b in buckets]), ("width", [b[1] for b in buckets]),
                         ("control_height", [c[0][0] if c else None for c in controls]),
                         ("control_width", [c[0][1] if c else None for c in controls])):
        m = m.append_column(name, pa.array(values, pa.int64()))
    schema = json.loads((vdir / fmt.SCHEMA_JSON).read_text())
    schema["schema_version"] = 1
    schema["fields"] = [f for f in schema["fields"] if f["name"] != "img_shapes"] + [
        {"name": n, "kind": "column", "dtype": "int64", "rank": 0, "optional": n.startswith("control")}
        for n in ("height", "width", "control_height", "control_width")]
    del schema["attrs"]["feature_lineage"]
    fmt.atomic_write_json(vdir / fmt.SCHEMA_JSON, schema)
    data = fmt.parquet_bytes(m)
    write_version_checksums(vdir, m, data)
    fmt.atomic_write_bytes(vdir / fmt.MANIFEST, data)


def test_migrating_images_v1_to_v2_keeps_text_and_vae_usable(tmp_path, tiny_plus_model):
    """An `images` table of schema v1 (an earlier release) encoded by this code, then `migrate v1-to-v2`: the
    encode stages encode nothing (every sample carried forward), train runs, the store verifies."""
    from pipeline.demo_data import make_demo_data

    src, store = tmp_path / "src", tmp_path / "store"
    make_demo_data(src, n=8, fmt="folder", max_controls=1, seed=8)
    run_json("resize-bucket", "--source", src, "--store", store, "--set", "resize.val_fraction=0.25")
    _as_schema_v1(store / "images" / "v1")
    verify_clean(store)
    enc = ["--store", store, "--model", tiny_plus_model]
    t1, v1 = run_json("encode-text", *enc), run_json("encode-vae", *enc)
    assert (t1["encoded"], v1["encoded"]) == (8, 8)
    before = {t: Store(store).reader(t) for t in ("text", "vae")}

    out = cli("migrate", "v1-to-v2", store)
    assert "images: v1 (schema v1) -> v2 (schema v2)" in out and Store(store).tables()["images"] == 2
    verify_clean(store)
    t2, v2 = run_json("encode-text", *enc), run_json("encode-vae", *enc)
    assert [(x["encoded"], x["reused"], x["bytes_written"]) for x in (t2, v2)] == [(0, 8, 0)] * 2
    after = {t: Store(store).reader(t) for t in ("text", "vae")}
    for t, name in (("text", "prompt_embeds"), ("vae", "target")):
        assert after[t].schema.lineage.upstream == {"images": 2}  # built from the migrated images version
        assert all((after[t].tensors(k)[name] == before[t].tensors(k)[name]).all() for k in before[t].keys())
    rec = json.loads(cli("run", "train", *enc, "--out", tmp_path / "run", "--set", "train.max_steps=2",
                         "--set", "train.batch_size=2", "--set", "train.device=cpu", "--json").strip().splitlines()[-1])
    n_train = list(split_of(store, "images").values()).count("train")
    assert rec["steps"] == 2 and rec["data"]["dropped"] == 0 and rec["data"]["joined"] == n_train > 0
    verify_clean(store)


def test_gc_during_a_training_keeps_the_versions_it_reads(tmp_path, tiny_plus_model):
    """`pipeline run train` holds read leases on the text + vae versions it trains on: a new text version and a
    `store gc` while it runs keep the old version's shards, and the training, reopening shards one at a time
    (max_open_shards=1), finishes. Once it exits, gc removes it. The training stops itself (STORE_PAUSE_AT)
    right after its first checkpoint, lease held: a SIGSTOP sent when the test saw that checkpoint could land
    after the training had finished, or had released its lease on the way out (the test then failed under
    load: gc removed text/v1)."""
    import signal
    import time

    from pipeline.demo_data import make_demo_data

    src, store, run = tmp_path / "src", tmp_path / "store", tmp_path / "run"
    make_demo_data(src, n=8, fmt="folder", max_controls=1, seed=9)
    tiny_shards = ["--set", "encode_text.shard_size_mb=0.002", "--set", "encode_vae.shard_size_mb=0.002"]
    enc = ["--store", store, "--model", tiny_plus_model, *tiny_shards]
    run_json("resize-bucket", "--source", src, "--store", store, "--set", "resize.val_fraction=0")
    run_json("encode-text", *enc), run_json("encode-vae", *enc)
    assert len(Store(store).reader("text").shard_paths()) > 2
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "STORE_PAUSE_AT": "train_after_checkpoint"}
    train = warm_start.WarmProcess(  # a real process of its own, started warm (tests/warm_start.py): torch imported already
        [sys.executable, "-m", "pipeline.cli", "run", "train", "--store", str(store), "--model", tiny_plus_model,
         "--out", str(run), "--set", "train.max_steps=8", "--set", "train.batch_size=2", "--set", "train.device=cpu",
         "--set", "train.checkpoint_every=1", "--set", "train.max_open_shards=1", *SMALL], env=env)
    try:
        deadline = time.monotonic() + 240

        def stopped() -> bool:  # state "T": the training stopped itself after its first checkpoint
            return Path(f"/proc/{train.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"

        while train.poll() is None and not stopped() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert train.poll() is None and stopped(), train.output()
        assert (run / "checkpoints" / "step-1").is_dir()
        newer = json.loads(cli("run", "encode-text", *enc, "--set", "encode_text.dtype=bfloat16", "--json"))
        assert newer["version"] == 2 and Store(store).tables()["text"] == 2
        out = cli("store", "gc", store, "--dry-run")
        assert "keep text/v1: not current, but read by reader of the 'train' split" in out, out
        assert "would remove text/v1" not in out
        cli("store", "gc", store)
        assert Store(store).versions("text") == [1, 2]
    finally:
        train.send_signal(signal.SIGCONT)
    output = "".join(train.communicate(timeout=300))  # stdout, then stderr
    assert train.returncode == 0, output[-3000:]
    assert "trained from scratch to step 8" in output and (run / "lora").is_dir()
    assert not list((store / ".leases").glob("*.json"))  # released at exit
    cli("store", "gc", store)
    assert Store(store).versions("text") == [2]
    verify_clean(store)
