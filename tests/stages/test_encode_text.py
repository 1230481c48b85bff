"""encode-text against the unmodified diffusers pipelines, batching, quarantine, lineage, loads, kill + resume."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from pipeline.config import load_config
from stages.encode import text as encode_text
from stages.encode.common import batches_by_shape
from store import Store
import warm_start

F32 = {"encode_text.dtype": "float32"}


def _pil(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


def _reference(pipe, variant: str, caption: str, files: dict[str, bytes], n: int) -> torch.Tensor:
    """What the unmodified pipeline's encode_prompt returns for this sample alone, trimmed by its mask."""
    if variant == "edit":
        image = _pil(files["control_0.png"])  # the pipeline gives the VL model its (bucket-sized) condition image
    else:
        image = [_pil(files[f"control_{i}_vl.png"]) for i in range(n)] or None
    embeds, mask = pipe.encode_prompt(caption, image=image, device="cpu")
    return embeds[0] if mask is None else embeds[0][mask[0].bool()]


@pytest.mark.parametrize("variant", ["edit", "edit-plus"])
def test_matches_diffusers_encode_prompt(variant, tiny_edit_model, tiny_plus_model, edit_store, plus_store):
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline

    model, store = (tiny_edit_model, edit_store) if variant == "edit" else (tiny_plus_model, plus_store)
    cls = QwenImageEditPipeline if variant == "edit" else QwenImageEditPlusPipeline
    pipe = cls.from_pretrained(model, torch_dtype=torch.float32)
    images = Store(store).reader("images")
    refs = {}
    for key in images.keys():
        s = images.get(key)
        n = s["meta"]["num_controls"]
        refs[key] = {kind: _reference(pipe, variant, text, s["files"], n)
                     for kind, text in (("prompt", s["meta"]["caption"]), ("empty", ""))}

    # float32 through the stage's own prepare -> same-shape batches -> forward: bit-exact (max abs diff 0).
    fmt = encode_text.prompt_format(variant, None, None)
    lock = __import__("threading").Lock()
    requests = [r for key in images.keys()
                for r in encode_text.prepare(key, images.get(key), fmt, pipe.processor, lock)]
    batches = list(batches_by_shape(requests, lambda r: r.shape, batch_size=8))
    assert max(len(b) for b in batches) > 1, "fixture must put several samples into one batch"
    assert len({len(r.inputs["input_ids"][0]) for r in requests}) > 2, "fixture must vary instruction lengths"
    for batch in batches:
        for req, emb in zip(batch, encode_text.encode_batch(pipe.text_encoder, batch, fmt.start_idx)):
            ref = refs[req.key][req.kind]
            assert emb.shape == ref.shape
            assert (emb - ref).abs().max().item() == 0.0

    # The stored table (bf16): exactly the float32 reference rounded to bf16 (tolerance 0 after rounding).
    cfg = load_config(None, {**F32, "encode_text.batch_size": 8})
    summary = encode_text.run(cfg, store, model)
    assert summary.encoded == len(refs) and summary.quarantined == 0
    text = Store(store).reader("text")
    assert sorted(text.keys()) == sorted(refs)
    for key, ref in refs.items():
        got = text.get(key)
        assert got["tensors"]["prompt_embeds"].dtype == torch.bfloat16
        assert torch.equal(got["tensors"]["prompt_embeds"], ref["prompt"].to(torch.bfloat16))
        assert torch.equal(got["tensors"]["empty_embeds"], ref["empty"].to(torch.bfloat16))
        assert got["meta"]["length"] == ref["prompt"].shape[0]
        assert got["meta"]["empty_length"] == ref["empty"].shape[0]
        assert got["meta"]["img_shapes"] == images.meta(key)["img_shapes"]


def test_batch_size_does_not_change_the_table(tiny_plus_model, plus_store, tmp_path):
    other = Path(shutil.copytree(plus_store, tmp_path / "other"))
    encode_text.run(load_config(None, F32), plus_store, tiny_plus_model, batch_size=1)
    encode_text.run(load_config(None, F32), other, tiny_plus_model, batch_size=8)
    a, b = Store(plus_store).reader("text"), Store(other).reader("text")
    assert a.keys() == b.keys()
    for key in a.keys():
        ta, tb = a.tensors(key), b.tensors(key)
        assert all(torch.equal(ta[n], tb[n]) for n in ("prompt_embeds", "empty_embeds"))


def test_edit_model_quarantines_samples_without_exactly_one_control(tiny_edit_model, tmp_path, images_fixture):
    from models.loading import LOAD_LOG

    fx = images_fixture
    samples = fx.edit_samples()[:3] + [
        fx.Sample("two controls", (64, 64), [(64, 64), (64, 64)], [(64, 64), (64, 64)]),
        fx.Sample("no control", (64, 64)),
        fx.Sample("broken control", (64, 64), [(64, 64)], [(64, 64)], corrupt_control=True),
        fx.Sample("aspect ratio 212", (64, 64), [(16, 3392)], [(16, 3392)]),  # Qwen2-VL's processor refuses > 200
    ]
    keys = list(fx.write(tmp_path / "s", samples))
    LOAD_LOG.clear()
    summary = encode_text.run(load_config(None), tmp_path / "s", tiny_edit_model)
    # encode-text loads the VL model and its processor only: never the transformer or the VAE.
    assert sorted(c for _, c in LOAD_LOG) == ["processor", "text_encoder"]
    assert (summary.encoded, summary.quarantined) == (3, 4)
    st = Store(tmp_path / "s")
    assert sorted(st.reader("text").keys()) == sorted(keys[:3])
    q = st.quarantine().to_pylist()
    reasons = {r["key"]: r["reason"] for r in q if r["stage"] == "encode-text"}
    assert reasons[keys[3]] == reasons[keys[4]] == "edit model needs exactly one control image"
    assert reasons[keys[5]] == "control image unreadable"
    assert reasons[keys[6]] == "processor rejected the sample"
    # A rerun is up to date and adds no duplicate quarantine rows.
    assert encode_text.run(load_config(None), tmp_path / "s", tiny_edit_model).up_to_date
    assert len(Store(tmp_path / "s").quarantine()) == len(q)


def _text_versions(store: Path) -> list[int]:
    return Store(store).versions("text")


def _why_new(out: str) -> str:
    """The line an encode run prints when it writes a new version instead of reusing the newest complete one."""
    lines = [line for line in out.splitlines() if "is not this run's" in line]
    assert len(lines) == 1, out
    return lines[0]


def test_lineage_up_to_date_and_every_change_makes_a_new_version(tiny_edit_model, edit_store, tmp_path, images_fixture,
                                                                 capsys):
    cfg = load_config(None)
    first = encode_text.run(cfg, edit_store, tiny_edit_model)
    listing = sorted((p, p.stat().st_mtime_ns) for p in (edit_store / "text").rglob("*"))
    again = encode_text.run(cfg, edit_store, tiny_edit_model, batch_size=3)  # batch size: not a feature setting
    assert again.up_to_date and again.version == first.version and again.encoded == 0
    assert sorted((p, p.stat().st_mtime_ns) for p in (edit_store / "text").rglob("*")) == listing  # nothing written
    assert "is not this run's" not in capsys.readouterr().out  # a first version, then one up to date: no reason

    # Each change says, in one line, what differs from the newest complete version (as train says why it trains
    # afresh); before, a full re-encode came with no reason.
    # The prompt template.
    tmpl = encode_text.prompt_format("edit", None, None).template.replace("Describe", "List")
    new_template = load_config(None, {"encode_text.prompt_template": tmpl, "encode_text.prompt_template_start_idx": 64})
    changed = encode_text.run(new_template, edit_store, tiny_edit_model)
    assert not changed.up_to_date and changed.version == first.version + 1
    why = _why_new(capsys.readouterr().out)
    assert why.startswith("encode-text: table 'text' v1 is not this run's (encode_text settings ") and \
        why.endswith("): writing a new version"), why
    assert "encode_text.prompt_template: None -> " in why and "List the key" in why, why
    assert "encode_text.prompt_template_start_idx: None -> 64" in why and "model" not in why, why
    # The model (any file of it changes the fingerprint).
    other_model = Path(shutil.copytree(tiny_edit_model, tmp_path / "other-model"))
    (other_model / "tiny_model.json").write_text(json.dumps({"variant": "edit", "seed": 0, "note": "changed"}))
    assert encode_text.run(cfg, edit_store, str(other_model)).version == first.version + 2
    why = _why_new(capsys.readouterr().out)  # against v2: the template back to its default, and the model
    assert why.startswith("encode-text: table 'text' v2 is not this run's (encode_text settings "), why
    assert "; model fingerprint " in why and "-> None" in why and "prompt_format" not in why, why
    # A resize setting: a new `images` version upstream.
    images_fixture.write(edit_store, images_fixture.edit_samples(), tag="other-resize-settings")
    assert encode_text.run(cfg, edit_store, tiny_edit_model).version == first.version + 3
    why = _why_new(capsys.readouterr().out)
    assert why.startswith("encode-text: table 'text' v3 is not this run's (input images:v1-"), why
    assert "-> images:v2-" in why and "model fingerprint " in why and "settings" not in why, why
    # Back to the first inputs: that version is found again and made current, nothing re-encoded.
    Store(edit_store).set_current("images", 1)
    back = encode_text.run(cfg, edit_store, tiny_edit_model)
    assert back.up_to_date and back.version == first.version and Store(edit_store).tables()["text"] == first.version
    assert _text_versions(edit_store) == [1, 2, 3, 4]


KILL_SCRIPT = """
import sys
from pipeline.config import load_config
from stages.encode import text as encode_text
cfg = load_config(None, {"encode_text.shard_size_mb": 0.002, "encode_text.batch_size": 2})
encode_text.run(cfg, sys.argv[1], sys.argv[2])
"""


@pytest.mark.parametrize("crash_at", ["after_shard_commit", "after_manifest"])
def test_killed_run_resumes_to_a_complete_verified_table(crash_at, tiny_plus_model, plus_store, tmp_path):
    from store.verify import verify_store

    env = {**os.environ, "STORE_CRASH_AT": crash_at, "HF_HUB_OFFLINE": "1"}
    proc = warm_start.run([sys.executable, "-c", KILL_SCRIPT, str(plus_store), tiny_plus_model], env=env,
                          timeout=600)  # a bound for a loaded machine
    assert proc.returncode == -9, proc.stderr[-2000:]  # SIGKILL at the crash point
    images = Store(plus_store).reader("images")
    if crash_at == "after_shard_commit":
        assert "text" not in Store(plus_store).tables()
    summary = encode_text.run(load_config(None, {"encode_text.shard_size_mb": 0.002}), plus_store, tiny_plus_model)
    if crash_at == "after_shard_commit":
        assert summary.skipped >= 1 and summary.skipped + summary.encoded == len(images)
    else:  # the manifest was written: the rerun only switches store.json to it
        assert summary.up_to_date
    text = Store(plus_store).reader("text")
    assert sorted(text.keys()) == sorted(images.keys())  # every sample exactly once (reader rejects duplicates)
    assert len(text.manifest) == len(images)
    assert verify_store(plus_store, progress=False) == []


def test_batches_by_shape_emits_every_item_once_in_single_shape_batches():
    import random

    rng = random.Random(0)
    items = [(i, rng.choice(["a", "b", "c", None])) for i in range(500)]
    for batch_size in (1, 3, 8):
        for window in (None, 5):
            batches = list(batches_by_shape(items, lambda it: it[1], batch_size, window))
            assert sorted(i for b in batches for i, _ in b) == list(range(500))
            assert all(len({s for _, s in b}) == 1 and 1 <= len(b) <= batch_size for b in batches)
            assert all(len(b) == 1 for b in batches if b[0][1] is None)  # "run alone" items stay alone


# Measured on the tiny Edit-Plus model (CPU float32): max |padded - alone| / max |alone| per embedding 8.9e-8 on
# this fixture, 2.4e-7 on 40 demo-mix samples.
PADDED_RTOL = 1e-6


def test_padded_batching_matches_diffusers_within_float32_rounding(tiny_plus_model, tmp_path, images_fixture):
    from diffusers import QwenImageEditPlusPipeline

    one, two = [(160, 160)], [(128, 192), (160, 160)]
    captions = ["make the square red", "add a hat and change the sky to sunset, then make it brighter", "rotate",
                "remove the circle and replace the car with a bicycle", "make it blue"]
    spec = [(c, one) for c in captions] + [(captions[1], two), (captions[2], two), (captions[3], []), ("", [])]
    fx = images_fixture
    samples = [fx.Sample(c, (64, 64), [(64, 64)] * len(vl), vl) for c, vl in spec]
    store = tmp_path / "s"
    keys = list(fx.write(store, samples))
    pipe = QwenImageEditPlusPipeline.from_pretrained(tiny_plus_model, torch_dtype=torch.float32)
    images = Store(store).reader("images")
    refs = {}
    for key in keys:
        s = images.get(key)
        n = s["meta"]["num_controls"]
        refs[key] = {kind: _reference(pipe, "edit-plus", text, s["files"], n)
                     for kind, text in (("prompt", s["meta"]["caption"]), ("empty", ""))}

    # The stage's prepare -> padded batches -> forward, float32: each request within PADDED_RTOL of it alone.
    fmt = encode_text.prompt_format("edit-plus", None, None)
    lock = __import__("threading").Lock()
    requests = [r for key in keys for r in encode_text.prepare(key, images.get(key), fmt, pipe.processor, lock)]
    batches = list(encode_text.batches(requests, "padded", batch_size=4))
    assert sorted(id(r) for b in batches for r in b) == sorted(map(id, requests))
    assert sum(len({r.num_tokens for r in b}) > 1 for b in batches) >= 2, "batches must really mix lengths"
    assert any(len({r.grids for r in b}) > 1 for b in batches), "and image sizes / counts"
    # The padding is the one diffusers' processor call makes for a batch of texts (side, pad id, mask).
    sample = images.get(keys[1])
    texts = [fmt.text(sample["meta"]["caption"], 1), fmt.text("", 1)]
    vl = [_pil(sample["files"]["control_0_vl.png"])]
    theirs = pipe.processor(text=texts, images=vl * 2, padding=True, return_tensors="pt")
    ids, mask = encode_text.right_padded(requests[2:4], pipe.tokenizer.pad_token_id)
    assert torch.equal(ids, theirs["input_ids"]) and torch.equal(mask, theirs["attention_mask"])
    for batch in batches:
        embeds = encode_text.encode_batch(pipe.text_encoder, batch, fmt.start_idx, pipe.tokenizer.pad_token_id)
        for req, emb in zip(batch, embeds):
            ref = refs[req.key][req.kind]
            assert emb.shape == ref.shape
            assert (emb - ref).abs().max().item() <= PADDED_RTOL * ref.abs().max().item()

    # The stage: fuller batches than exact, a new table version, stored bf16 within bf16 rounding of the reference.
    cfg = {**F32, "encode_text.batch_size": 4}
    exact = encode_text.run(load_config(None, cfg), store, tiny_plus_model)
    padded = encode_text.run(load_config(None, {**cfg, "encode_text.batching": "padded"}), store, tiny_plus_model)
    assert not padded.up_to_date and padded.version == exact.version + 1 and padded.encoded == len(keys)
    mean_batch = padded.forward_items / padded.forwards
    assert mean_batch > 2 and mean_batch > exact.forward_items / exact.forwards
    text = Store(store).reader("text")
    for key, ref in refs.items():
        got = text.get(key)
        for name, kind in (("prompt_embeds", "prompt"), ("empty_embeds", "empty")):
            r = ref[kind]
            err = (got["tensors"][name].float() - r).abs()
            assert (err <= 2**-8 * r.abs() + PADDED_RTOL * r.abs().max()).all()
        assert got["meta"]["length"] == ref["prompt"].shape[0]
    back = encode_text.run(load_config(None, cfg), store, tiny_plus_model)  # exact again: its version, reused
    assert back.up_to_date and back.version == exact.version
