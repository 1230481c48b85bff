"""encode-vae against the pipelines' own `_encode_vae_image`, mask weights against diffusers' packing, lineage,
loads, quarantine, kill + resume; and both encode stages under `accelerate launch` with 2 processes."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from pipeline.config import load_config
from stages.encode import vae as encode_vae
from store import Store
import warm_start
from two_ranks import launch_two

F32 = {"encode_vae.dtype": "float32"}


def _images_of(sample: dict) -> dict[str, Image.Image]:
    names = ["target"] + [f"control_{i}" for i in range(sample["meta"]["num_controls"])]
    return {n: Image.open(io.BytesIO(sample["files"][f"{n}.png"])).convert("RGB") for n in names}


def test_matches_diffusers_encode_vae_image_and_mask_weights_follow_packing(tiny_edit_model, edit_store, tmp_path):
    from diffusers import QwenImageEditPipeline

    pipe = QwenImageEditPipeline.from_pretrained(tiny_edit_model, torch_dtype=torch.float32)
    images = Store(edit_store).reader("images")
    refs: dict[str, dict[str, torch.Tensor]] = {}
    with torch.no_grad():
        for key in images.keys():
            pixels = {n: pipe.image_processor.preprocess(im, im.height, im.width).unsqueeze(2)
                      for n, im in _images_of(images.get(key)).items()}
            refs[key] = {n: pipe._encode_vae_image(x, generator=None)[0] for n, x in pixels.items()}

    # Batch size 1: bit-exact, the stored bf16 is the pipeline's float32 latent rounded to bf16.
    batched = Path(shutil.copytree(edit_store, tmp_path / "batched"))
    encode_vae.run(load_config(None, F32), edit_store, tiny_edit_model, batch_size=1)
    # Batch size 8 (same-size images only): oneDNN's conv3d rounds differently per batch size (first difference
    # at encoder.conv_in, ~3e-7 in float32), so within half a bf16 ulp of the float32 reference + 1e-6.
    encode_vae.run(load_config(None, F32), batched, tiny_edit_model, batch_size=8)
    for store in (edit_store, batched):
        vae = Store(store).reader("vae")
        assert vae.schema.attrs["latents_mean"] == list(pipe.vae.config.latents_mean)
        assert vae.schema.attrs["latents_std"] == list(pipe.vae.config.latents_std)
        assert sorted(vae.keys()) == sorted(refs)
        for key, ref in refs.items():
            got = vae.get(key)
            assert got["meta"]["latent_shapes"] == [list(r.shape) for r in ref.values()]
            assert got["meta"]["img_shapes"] == images.meta(key)["img_shapes"]
            for name, r in ref.items():
                t = got["tensors"][name]
                assert t.dtype == torch.bfloat16
                if store == edit_store:
                    assert torch.equal(t, r.to(torch.bfloat16)), name
                else:
                    assert ((t.float() - r).abs() <= r.abs() * 2**-8 + 1e-6).all(), name

    # Mask weights: the mask averaged over each 8x8-pixel latent cell, packed exactly like diffusers packs
    # latents (2x2 latent patches -> one token), then averaged over the patch = fraction of edited pixels.
    vae = Store(edit_store).reader("vae")
    fractional = 0
    for key in vae.keys():
        sample, meta = vae.get(key), vae.meta(key)
        has = "mask.png" in images.files(key)
        assert meta["has_mask"] == has and ("mask_weight" in sample["tensors"]) == has
        if not has:
            continue
        m = np.asarray(Image.open(io.BytesIO(images.files(key)["mask.png"])), dtype=np.float64) / 255.0
        H, W = m.shape
        cells = torch.from_numpy(m.reshape(H // 8, 8, W // 8, 8).mean(axis=(1, 3))).view(1, 1, 1, H // 8, W // 8)
        packed = QwenImageEditPipeline._pack_latents(cells, 1, 1, H // 8, W // 8)  # [1, tokens, 1 * 2 * 2]
        weight = sample["tensors"]["mask_weight"]
        assert weight.dtype == torch.float32 and weight.shape == (meta["img_shapes"][0][1] * meta["img_shapes"][0][2],)
        torch.testing.assert_close(weight, packed.mean(-1)[0].float(), rtol=0, atol=1e-6)
        assert 0.0 <= weight.min() and weight.max() == 1.0
        fractional += int(((weight > 0) & (weight < 1)).sum())
    assert fractional > 0


def test_loads_only_the_vae_quarantines_and_lineage(tiny_edit_model, tmp_path, images_fixture):
    from models.loading import LOAD_LOG

    fx, store = images_fixture, tmp_path / "s"
    keys = list(fx.write(store, [
        fx.Sample("no mask", (64, 64), [(64, 64)], [(64, 64)]),
        fx.Sample("mask of another size", (64, 64), [(64, 64)], [(64, 64)], mask=True, mask_size=(48, 48)),
        fx.Sample("broken control", (64, 64), [(64, 64)], [(64, 64)], corrupt_control=True),
    ]))
    cfg = load_config(None, F32)
    LOAD_LOG.clear()
    first = encode_vae.run(cfg, store, tiny_edit_model)
    assert [c for _, c in LOAD_LOG] == ["vae"]  # never the VL model or the transformer
    assert (first.encoded, first.quarantined) == (1, 2)
    vae = Store(store).reader("vae")
    assert vae.keys() == [keys[0]] and vae.meta(keys[0])["has_mask"] is False  # a store without masks works
    assert "mask_weight" not in vae.tensors(keys[0])
    reasons = {r["key"]: r["reason"] for r in Store(store).quarantine().to_pylist() if r["stage"] == "encode-vae"}
    assert reasons == {keys[1]: "mask size differs from the target", keys[2]: "image unreadable"}

    listing = sorted((p, p.stat().st_mtime_ns) for p in (store / "vae").rglob("*"))
    again = encode_vae.run(cfg, store, tiny_edit_model, batch_size=2)
    assert again.up_to_date and again.version == first.version
    assert sorted((p, p.stat().st_mtime_ns) for p in (store / "vae").rglob("*")) == listing  # nothing written

    other_model = Path(shutil.copytree(tiny_edit_model, tmp_path / "other-model"))
    (other_model / "tiny_model.json").write_text(json.dumps({"variant": "edit", "seed": 0, "note": "changed"}))
    assert encode_vae.run(cfg, store, str(other_model)).version == first.version + 1
    assert encode_vae.run(load_config(None, {"encode_vae.dtype": "bfloat16"}), store,
                          tiny_edit_model).version == first.version + 2  # a setting that can change numbers
    fx.write(store, [fx.Sample("no mask", (64, 64), [(64, 64)], [(64, 64)])], tag="other-resize-settings")
    assert encode_vae.run(cfg, store, tiny_edit_model).version == first.version + 3


def test_another_device_spelling_reuses_every_sample(tiny_edit_model, tmp_path, images_fixture):
    """Where a value runs is never a feature (issue 24.5): cpu -> cpu:0 -> [cpu] encodes nothing again."""
    fx, store = images_fixture, tmp_path / "s"
    fx.write(store, [fx.Sample("a", (64, 64), [(64, 64)], [(64, 64)]), fx.Sample("b", (64, 32), [(64, 32)], [(64, 32)])])
    first = encode_vae.run(load_config(None, {**F32, "encode_vae.device": "cpu"}), store, tiny_edit_model)
    assert first.encoded == 2
    for device in ("cpu:0", ["cpu"]):
        again = encode_vae.run(load_config(None, {**F32, "encode_vae.device": device, "encode_vae.num_workers": 0}),
                               store, tiny_edit_model, batch_size=1)
        assert (again.up_to_date, again.encoded, again.version) == (True, 0, first.version)


def test_a_changed_setting_says_what_differs_from_the_newest_version(tiny_edit_model, tmp_path, images_fixture, capsys):
    """A new version comes with one line naming what differs from the newest complete one (before: a full
    re-encode with no reason); an up-to-date run says nothing of the kind."""
    fx, store = images_fixture, tmp_path / "s"
    fx.write(store, [fx.Sample("a", (64, 64), [(64, 64)], [(64, 64)])])
    encode_vae.run(load_config(None, F32), store, tiny_edit_model)
    assert encode_vae.run(load_config(None, F32), store, tiny_edit_model).up_to_date
    assert "is not this run's" not in capsys.readouterr().out
    assert encode_vae.run(load_config(None, {"encode_vae.dtype": "bfloat16"}), store, tiny_edit_model).version == 2
    why = [line for line in capsys.readouterr().out.splitlines() if "is not this run's" in line]
    assert len(why) == 1 and why[0].startswith("encode-vae: table 'vae' v1 is not this run's (encode_vae settings "), why
    assert why[0].endswith("; encode_vae.dtype: 'float32' -> 'bfloat16'): writing a new version"), why


def test_a_table_encoded_before_the_declared_lineage_scheme_stays_current(tiny_edit_model, tmp_path, images_fixture,
                                                                          monkeypatch):
    """A table hashed the old way (its config hash held `device`) is up to date for the same settings."""
    from stages.encode.common import earlier_config_hashes

    from typer.testing import CliRunner

    from damage import flip_bit, key_at, sample_byte
    from pipeline.cli import app

    fx, store = images_fixture, tmp_path / "s"
    fx.write(store, [fx.Sample(c, (64, 64), [(64, 64)], [(64, 64)]) for c in ("a", "b")])
    cfg = load_config(None, {**F32, "encode_vae.device": "cpu", "encode_vae.shard_size_mb": 0.001})
    from schemas.lineage import hashed_settings, settings_hash

    def hashed_before(section):  # the settings as hashed before the scheme: `device` among them
        record = {"section": {**hashed_settings(section), "device": section.model_dump(mode="json")["device"]}}
        assert settings_hash(record) == earlier_config_hashes(section)[0]  # pinned in tests/schemas
        return record

    with monkeypatch.context() as m:  # how the code before the scheme hashed
        m.setattr(encode_vae, "settings_record", hashed_before)
        m.setattr(encode_vae, "earlier_config_hashes", lambda section: ())
        old = encode_vae.run(cfg, store, tiny_edit_model)
    assert old.encoded == 2
    for device in ("cpu", ["cpu"]):  # the device it was encoded with, or another spelling of it
        now = encode_vae.run(load_config(None, {**F32, "encode_vae.device": device}), store, tiny_edit_model)
        assert (now.up_to_date, now.encoded, now.version) == (True, 0, old.version)
    # `store repair` of such a table recomputes only its damaged sample, under the table's own lineage
    flip_bit(*sample_byte(store, "vae", key_at(store, "vae", 0), None, 5), 5)
    res = CliRunner().invoke(app, ["store", "repair", str(store), "--model", tiny_edit_model])
    assert res.exit_code == 0 and "encoded 1," in res.output, res.output


KILL_SCRIPT = """
import sys
from pipeline.config import load_config
from stages.encode import vae as encode_vae
cfg = load_config(None, {"encode_vae.shard_size_mb": 0.002, "encode_vae.batch_size": 2, "encode_vae.dtype": "float32"})
encode_vae.run(cfg, sys.argv[1], sys.argv[2])
"""


def test_killed_run_resumes_to_a_complete_verified_table(tiny_edit_model, edit_store):
    from store.verify import verify_store

    env = {**os.environ, "STORE_CRASH_AT": "after_shard_commit", "HF_HUB_OFFLINE": "1"}
    proc = warm_start.run([sys.executable, "-c", KILL_SCRIPT, str(edit_store), tiny_edit_model], env=env,
                          timeout=600)  # a bound for a loaded machine
    assert proc.returncode == -9, proc.stderr[-2000:]  # SIGKILL right after the first shard was committed
    assert "vae" not in Store(edit_store).tables()
    # begun as a release before the settings were recorded (`attrs.settings`) began it: still resumed
    begun = edit_store / "vae" / "v1" / "schema.json"
    schema = json.loads(begun.read_text())
    assert schema["attrs"].pop("settings")["section"]["dtype"] == "float32"
    begun.write_text(json.dumps(schema))
    cfg = load_config(None, {**F32, "encode_vae.shard_size_mb": 0.002})
    summary = encode_vae.run(cfg, edit_store, tiny_edit_model)
    images = Store(edit_store).reader("images")
    assert summary.version == 1 and Store(edit_store).versions("vae") == [1]
    assert summary.skipped >= 1 and summary.skipped + summary.encoded == len(images)
    vae = Store(edit_store).reader("vae")
    assert sorted(vae.keys()) == sorted(images.keys()) and len(vae.manifest) == len(images)  # each exactly once
    assert verify_store(edit_store, progress=False) == []


TWO_STAGES = """
import sys
from pipeline.cli import app
store, model, config = sys.argv[1:4]
for stage, extra in (("encode-text", ["--batch-size", "2"]), ("encode-vae", [])):
    app(["run", stage, "--store", store, "--model", model, "--config", config, *extra], standalone_mode=False)
"""


def _rows(store: Path, table: str) -> list[tuple]:
    """Row by row, everything but where the bytes sit (shard names and offsets differ by rank)."""
    r = Store(store).reader(table)
    out = []
    for key in r.keys():
        meta = {k: v for k, v in r.meta(key).items() if k not in ("shard",)}
        tensors = {n: (t.dtype, tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
                   for n, t in r.tensors(key).items()}
        out.append((key, json.dumps(meta, sort_keys=True, default=str), sorted(tensors.items())))
    return out


def _demo_images_store(store: Path, work: Path) -> None:
    """Real inputs: demo data (masks, 0..2 controls, mixed sizes) through the real resize-bucket stage."""
    from pipeline.demo_data import make_demo_data
    from stages.resize import stage as resize_bucket

    make_demo_data(work / "demo-src", n=6, fmt="folder", max_controls=2, seed=0, with_masks=True)
    cfg = load_config(None, {"resize.target_area": 96 * 96, "resize.control_vae_area": 96 * 96,
                             "resize.control_vl_area": 168 * 168, "resize.val_fraction": 0.3})
    resize_bucket.run(cfg, work / "demo-src", store)


def test_two_gloo_processes_match_one_process(tiny_plus_model, tmp_path):
    from stages.encode import text as encode_text
    from store.verify import verify_store

    one, two = tmp_path / "one", tmp_path / "two"
    _demo_images_store(one, tmp_path)
    shutil.copytree(one, two)
    config = tmp_path / "encode.yaml"
    # VAE at batch size 1: its batched conv round-off depends on which images share a batch, and a rank split
    # regroups them (see the equivalence test); text batches are bit-exact, so batch 2 there.
    config.write_text("encode_vae:\n  dtype: float32\n  batch_size: 1\nencode_text:\n  dtype: float32\n")
    cfg = load_config(config)
    encode_text.run(cfg, one, tiny_plus_model, batch_size=2)
    encode_vae.run(cfg, one, tiny_plus_model)

    # the two ranks start warm (tests/stages/two_ranks.py: the launcher's environment, torch imported already)
    # rather than under a cold `accelerate launch` (~9 s of CPU per process, three of them); one launch of
    # `accelerate launch` itself stays tested (tests/stages/test_train_ddp.py)
    script = tmp_path / "two_stages.py"
    script.write_text(TWO_STAGES)
    (rc0, out0, err0), (rc1, out1, err1) = launch_two(str(script), str(two), tiny_plus_model, str(config), timeout=300)
    assert rc0 == rc1 == 0, (rc0, rc1, err0[-3000:], err1[-3000:])
    stdout = out0 + out1
    # rank 0's lines only, each counting both ranks' shares (stages/encode/summary.py `over_ranks`); the shards
    # below show that both ranks encoded
    with Store(one).reader("images") as images:
        n = len(images)
    for stage, table in (("encode-text", "text"), ("encode-vae", "vae")):
        assert stdout.count(f"{stage} [2 ranks]: table '{table}' v1: encoded {n}, ") == 1, stdout
    assert "[rank " not in stdout, stdout
    for table in ("text", "vae"):
        shards = {p.name for p in (two / table / "v1").glob("shard-*.tar")}
        assert any(s.startswith("shard-r00-") for s in shards) and any(s.startswith("shard-r01-") for s in shards)
        assert _rows(two, table) == _rows(one, table)
    assert any(Store(one).reader("vae").meta(k)["has_mask"] for k in Store(one).reader("vae").keys())
    assert verify_store(two, progress=False) == []
