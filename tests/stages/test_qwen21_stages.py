"""Qwen-Image-2.1 through the store: encode-text / encode-vae against the unmodified `QwenImage21Pipeline`, then
train from the CLI; the LoRA loads in the stock pipeline and reproduces the trainer's prediction."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from features.pictures import rgb_over_white
from pipeline.config import load_config
from schemas import FieldSpec, Lineage, TableSchema
from stages.encode import text as encode_text
from stages.encode import vae as encode_vae
from store import Store
from train_store import assert_same_training, offloaders_built

F32 = {"encode_text.dtype": "float32", "encode_vae.dtype": "float32"}

# (caption, target (h, w), references [(h, w, mode)]): 0, 1, 3 and 11 references, RGBA among them, sizes in 32s
SAMPLES = [
    ("make the square red", (64, 96, "RGBA"), [(64, 96, "RGBA")]),
    ("a red square", (64, 64, "RGB"), []),
    ("put the hat from picture 2 on the cat", (96, 64, "RGB"), [(64, 64, "RGB"), (96, 32, "RGBA"), (32, 64, "RGB")]),
    ("too many", (64, 64, "RGB"), [(32, 32, "RGB")] * 11),
]


def _png(h, w, mode, rng) -> bytes:
    ch = 4 if mode == "RGBA" else 3
    arr = rng.integers(0, 255, (h, w, ch), dtype=np.uint8)
    if ch == 4:
        arr[: h // 2, :, 3] = 0  # half transparent: alpha matters
    buf = io.BytesIO()
    Image.fromarray(arr, mode).save(buf, format="PNG")
    return buf.getvalue()


def write_store21(root, samples=SAMPLES, val=(), resize=None):
    """An `images` table as resize-bucket writes it for 2.1 (control_{i}.png = each reference, sides in 32s);
    `resize`: the settings it records as made with (`attrs["resize"]`), or none."""
    col = "column"
    schema = TableSchema(name="images", lineage=Lineage("resize-bucket", config_hash="fixture-21", upstream={},
                                                        code_version="fixture"),
                         fields=[FieldSpec("target.png", "png", kind="file"),
                                 FieldSpec("control_{i}.png", "png", kind="file", optional=True),
                                 FieldSpec("caption", "string", kind=col), FieldSpec("split", "string", kind=col),
                                 FieldSpec("img_shapes", "json", kind=col), FieldSpec("num_controls", "int64", kind=col),
                                 FieldSpec("source", "string", kind=col)],
                         attrs={} if resize is None else {"resize": resize})
    rng = np.random.default_rng(0)
    w = Store(root).writer("images", schema)
    for i, (caption, (th, tw, tm), refs) in enumerate(samples):
        files = {"target.png": _png(th, tw, tm, rng)}
        files.update({f"control_{c}.png": _png(h, w_, m, rng) for c, (h, w_, m) in enumerate(refs)})
        shapes = [[1, th // 16, tw // 16]] + [[1, h // 16, w_ // 16] for h, w_, _ in refs]
        w.add(f"{i:032x}", files=files, meta={"caption": caption, "split": "val" if i in val else "train",
                                              "img_shapes": shapes,
                                              "num_controls": len(refs), "source": f"fixture/{i}"})
    w.commit()
    return root


@pytest.fixture
def store21(tmp_path):
    return write_store21(tmp_path / "s")


def _rgba(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGBA")  # what the pipeline does to every reference


def test_encode_text_and_vae_match_the_stock_pipeline(tiny_21_model, store21):
    from diffusers import QwenImage21Pipeline

    pipe = QwenImage21Pipeline.from_pretrained(tiny_21_model)
    cfg = load_config(None, F32)
    t = encode_text.run(cfg, store21, tiny_21_model)
    v = encode_vae.run(cfg, store21, tiny_21_model, batch_size=1)  # batch 1: bit-exact (see test_encode_vae)
    assert (t.encoded, t.quarantined, v.encoded, v.quarantined) == (3, 1, 3, 1)  # 11 references: quarantined
    st = Store(store21)
    images, text, vae = st.reader("images"), st.reader("text"), st.reader("vae")
    assert sorted(text.keys()) == sorted(vae.keys()) == [f"{i:032x}" for i in range(3)]
    for key in text.keys():
        s = images.get(key)
        refs = [_rgba(s["files"][f"control_{i}.png"]) for i in range(s["meta"]["num_controls"])]
        got = text.get(key)["tensors"]
        for caption, e, m in ((s["meta"]["caption"], "prompt_embeds", "slot_mask"), ("", "empty_embeds", "empty_slot_mask")):
            want, _, slots = pipe.encode_prompt(prompt=caption, image=refs or None, device="cpu")
            assert torch.equal(got[e], want[0].to(torch.bfloat16))
            assert torch.equal(got[m], slots[0].bool())
        # VAE: the pipeline's prepare_latents on the same pixels (RGBA, 4 channels), normalised, 64 channels
        lat = vae.get(key)["tensors"]
        target = _rgba(s["files"]["target.png"])
        for name, im in [("target", target)] + [(f"control_{i}", r) for i, r in enumerate(refs)]:
            pixels = pipe.image_processor.preprocess(im, width=im.width, height=im.height).unsqueeze(2)
            assert pixels.shape[1] == 4
            with torch.no_grad():
                want = pipe._encode_vae_image(pixels, None)[0]
            assert lat[name].shape == (64, 1, im.height // 16, im.width // 16)
            assert torch.equal(lat[name], want.to(torch.bfloat16))
    assert st.reader("text").schema.attrs["prompt_format"]["variant"] == "qwen-image-2.1"
    reasons = st.quarantine().column("reason").to_pylist()
    assert reasons.count("qwen-image-2.1 takes at most 10 references") == 2  # one row per stage


def _cli(*args) -> str:
    from typer.testing import CliRunner

    from pipeline.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


def test_train_21_from_the_cli_and_the_stock_pipeline_loads_the_lora(tiny_21_model, tmp_path):
    from diffusers import QwenImage21Pipeline

    from models.lora import load_lora
    from models.qwen21_multires import Qwen21Sample, build_batch, joint_image_mask, latent_tokens, qwen21_forward
    from models.randomness import draw_noise
    from stages.train.data import load
    from train_store import open_split
    from stages.train.recipe import setup_transformer

    mixed = SAMPLES[:3] + [("make it blue", (32, 64, "RGBA"), [(64, 32, "RGB"), (32, 32, "RGBA")]),
                           ("flip it", (64, 32, "RGB"), [(32, 96, "RGB")])]
    store = write_store21(tmp_path / "s", mixed)
    _cli("run", "encode-text", "--store", store, "--model", tiny_21_model)
    _cli("run", "encode-vae", "--store", store, "--model", tiny_21_model)
    run_dir = tmp_path / "run"
    _cli("run", "train", "--store", store, "--model", tiny_21_model, "--out", run_dir, "--max-steps", 2,
         "--batch-size", 3, "--device", "cpu", "--set", "train.learning_rate=0.02", "--set", "train.lora.rank=4",
         "--set", "train.caption_dropout=0.5", "--set", "train.gradient_checkpointing=true")
    assert (run_dir / "lora" / "pytorch_lora_weights.safetensors").is_file()

    # The trainer's prediction on a stored sample with references == the stock 2.1 transformer + the LoRA.
    tables = open_split(store, tiny_21_model)
    sample = next(s for s in (load(tables, k) for k in tables.keys) if len(s.controls) > 1)
    x_t = latent_tokens(sample.target).float() * 0.6 + latent_tokens(draw_noise(sample, 0, 0)) * 0.4
    sigma = torch.tensor([0.4])
    cfg = load_config(None, {"train.lora.rank": 4})
    ours_model = setup_transformer(tiny_21_model, cfg.train, torch.device("cpu")).eval()
    load_lora(ours_model, run_dir / "lora")
    hw = tuple(sample.img_shapes[0][1:])
    batch = build_batch([Qwen21Sample(sample.prompt_embeds.float(), sample.slot_mask,
                                      [c.float() for c in sample.controls], x_t, hw)])
    with torch.no_grad():
        ours = qwen21_forward(ours_model, batch, sigma)[0][batch.target_mask[0]]

    pipe = QwenImage21Pipeline.from_pretrained(tiny_21_model)
    tokens = torch.cat([latent_tokens(c).float() for c in sample.controls] + [x_t])[None]
    slots, _ = joint_image_mask(sample.slot_mask, x_t.shape[0])
    shapes = [[(1, c.shape[-2], c.shape[-1]) for c in sample.controls] + [(1, *hw)]]

    def stock() -> torch.Tensor:
        with torch.no_grad():
            out = pipe.transformer(hidden_states=tokens, encoder_hidden_states=sample.prompt_embeds.float()[None],
                                   timestep=sigma, img_shapes=shapes, img_mask=slots[None], return_dict=False)[0]
        return out[0, -x_t.shape[0]:]

    base = stock()
    pipe.load_lora_weights(run_dir / "lora")
    theirs = stock()
    assert not torch.equal(theirs, base)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_run_all_with_the_21_config_on_demo_data(tmp_path):
    """`pipeline run all --config configs/qwen-image-2.1.yaml` on the tiny 2.1 model and the demo data: every
    stage's --json summary, a LoRA, and a held-out loss report."""
    import json
    from pathlib import Path

    model = tmp_path / "tiny-21"
    _cli("make-tiny-model", model, "--variant", "qwen-image-2.1")
    _cli("make-demo-data", tmp_path / "data", "--n", "10", "--max-controls", "3")
    config = Path(__file__).parents[2] / "configs" / "qwen-image-2.1.yaml"
    paths = {"source": tmp_path / "data", "store": tmp_path / "store", "model": model, "run": tmp_path / "run",
             "report": tmp_path / "report"}
    sets = [x for k, v in paths.items() for x in ("--set", f"paths.{k}={v}")]
    from typer.testing import CliRunner

    from pipeline.cli import app

    # split by key: 2 of these 10 demo samples in 'val' for the 2 generated val images below (the pictures split: 1)
    result = CliRunner().invoke(app, [str(a) for a in ("run", "all", "--config", config, "--json", *sets, "--set",
                                                       "train.max_steps=4", "--set", "train.checkpoint_every=2",
                                                       "--set", "resize.split_by=key")])
    assert result.exit_code == 0, result.output
    summaries = json.loads(result.stdout)
    assert [s["stage"] for s in summaries][:4] == ["resize-bucket", "encode-text", "encode-vae", "train"]
    print(summaries)
    assert summaries[1]["encoded"] > 0 and summaries[2]["encoded"] > 0
    assert {s["variant"] for s in summaries} == {"qwen-image-2.1"}  # every stage's record names the variant
    assert (tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors").is_file()
    metrics = json.loads((tmp_path / "report" / "metrics.json").read_text())
    assert metrics["loss"]["overall"]["n"] > 0
    assert len(metrics["generation"]["samples"]) == 2 and "psnr_lora" in metrics["generation"]["samples"][0]  # val images, base vs LoRA


MIXED = SAMPLES[:3] + [("make it blue", (32, 64, "RGBA"), [(64, 32, "RGB"), (32, 32, "RGBA")]),
                       ("flip it", (64, 32, "RGB"), [(32, 96, "RGB")])]


@pytest.fixture(scope="module")
def encoded21(tiny_21_model, tmp_path_factory):
    store = write_store21(tmp_path_factory.mktemp("q21") / "s", MIXED)
    cfg = load_config(None, F32)
    encode_text.run(cfg, store, tiny_21_model)
    encode_vae.run(cfg, store, tiny_21_model)
    return store


def _train_cfg(**train):
    base = {"train.device": "cpu", "train.batch_size": 2, "train.learning_rate": 0.01, "train.lora.rank": 4,
            "train.sigma.sampling": "dynamic_shift", "train.sigma.max_shift": 1.15,
            "train.sigma.max_image_seq_len": 4096, "train.caption_dropout": 0.3}
    return load_config(None, {**base, **{f"train.{k}": v for k, v in train.items()}})


def test_21_stop_and_resume_gives_identical_lora_and_int8_base_trains(tiny_21_model, encoded21, tmp_path):
    from models.lora import read_lora
    from stages.train.recipe import run, setup_transformer

    run(_train_cfg(max_steps=4, checkpoint_every=2), encoded21, tiny_21_model, tmp_path / "straight")
    run(_train_cfg(max_steps=2, checkpoint_every=2), encoded21, tiny_21_model, tmp_path / "resumed")
    result = run(_train_cfg(max_steps=4, checkpoint_every=2), encoded21, tiny_21_model, tmp_path / "resumed",
                 resume=True)
    assert result.start_step == 2 and result.steps == 4
    a, b = read_lora(tmp_path / "straight" / "lora")[0], read_lora(tmp_path / "resumed" / "lora")[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    cfg = _train_cfg(max_steps=2, quantize_base="int8")
    model = setup_transformer(tiny_21_model, cfg.train, torch.device("cpu"))
    assert "Int8" in type(model.transformer_blocks[0].attn.to_q.base_layer.weight).__name__
    result = run(cfg, encoded21, tiny_21_model, tmp_path / "int8")
    assert all(torch.isfinite(torch.tensor(result.losses)))
    int8 = read_lora(tmp_path / "int8" / "lora")[0]
    assert any(v.abs().sum() > 0 for k, v in int8.items() if "lora_B" in k)


def test_21_reference_dropout_trains_on_the_text_to_image_prompt(tiny_21_model, tmp_path):
    from diffusers import QwenImage21Pipeline

    from models.flow import prepare_flow_batch
    from models.randomness import with_control_dropout
    from stages.train.data import load
    from train_store import open_split
    from stages.train.recipe import run

    store = write_store21(tmp_path / "s", MIXED)
    cfg = load_config(None, {**F32, "encode_text.no_control_embeds": True})
    encode_text.run(cfg, store, tiny_21_model)
    encode_vae.run(cfg, store, tiny_21_model)
    pipe = QwenImage21Pipeline.from_pretrained(tiny_21_model)
    tables = open_split(store, tiny_21_model)
    sample = next(s for s in (load(tables, k) for k in tables.keys) if s.controls)
    caption = Store(store).reader("images").meta(sample.key)["caption"]
    want, _, _ = pipe.encode_prompt(prompt=caption, image=None, device="cpu")  # the text-to-image template
    assert torch.equal(sample.nocontrol_embeds, want[0].to(torch.bfloat16))

    # the sampler's lengths are the exact joint sequence lengths the transformer runs
    from models.qwen21_multires import Qwen21Sample, build_batch, latent_tokens

    for i, key in enumerate(tables.keys):
        s = load(tables, key)
        hw = tuple(s.img_shapes[0][1:])
        row = Qwen21Sample(s.prompt_embeds, s.slot_mask, list(s.controls), latent_tokens(s.target), hw)
        assert tables.lengths[i] == build_batch([row]).lengths[0]

    (dropped,) = with_control_dropout([sample], 0, 0, 1.0)
    assert dropped.controls == [] and not dropped.slot_mask.any() and dropped.img_shapes == sample.img_shapes[:1]
    fb = prepare_flow_batch([dropped], torch.tensor([0.5]), [torch.zeros_like(sample.target.float())], [True],
                            (1.0, 1.0), torch.device("cpu"), torch.float32)
    n_target = sample.img_shapes[0][1] * sample.img_shapes[0][2]
    assert fb.batch.lengths == [sample.nocontrol_embeds.shape[0] + n_target]  # no reference tokens left

    result = run(_train_cfg(max_steps=2, control_dropout=0.5), store, tiny_21_model, tmp_path / "run")
    assert all(torch.isfinite(torch.tensor(result.losses)))


def test_21_predict_cli_is_the_stock_pipeline_with_the_lora(tiny_21_model, encoded21, tmp_path):
    from diffusers import QwenImage21Pipeline

    from stages.train.recipe import run

    run(_train_cfg(max_steps=2), encoded21, tiny_21_model, tmp_path / "run")
    ref = tmp_path / "ref.png"
    _rgba_img = Image.fromarray(np.random.default_rng(3).integers(0, 255, (64, 96, 4), dtype=np.uint8), "RGBA")
    _rgba_img.save(ref)
    out = tmp_path / "out.png"
    _cli("predict", "--model", tiny_21_model, "--lora", tmp_path / "run" / "lora", "--image", ref, "--prompt",
         "make the square red", "--steps", 2, "--cfg", 1.0, "--height", 64, "--width", 96, "--out", out)
    got = np.asarray(Image.open(out))
    assert got.shape == (64, 96, 4)  # RGBA out

    pipe = QwenImage21Pipeline.from_pretrained(tiny_21_model)
    pipe.load_lora_weights(tmp_path / "run" / "lora")
    want = pipe(image=[Image.open(ref)], prompt="make the square red", num_inference_steps=2, height=64, width=96,
                output_resolution=78, generator=torch.Generator().manual_seed(0), output_type="pil").images[0]
    np.testing.assert_array_equal(got, np.asarray(want))


def test_21_predict_without_references_is_the_stock_text_to_image_call(tiny_21_model, tiny_edit_model, tmp_path):
    """A 2.1 sample holds 0..10 references, and training takes the ones with none (text-to-image), but predict
    required an --image: a LoRA trained on such samples could not be tried. Without --image a 2.1 model now gives
    the stock pipeline's image=None call bit for bit; the Edit models still refuse it in one line (exit 2)."""
    from diffusers import QwenImage21Pipeline

    out = tmp_path / "t2i.png"
    _cli("predict", "--model", tiny_21_model, "--prompt", "a red square", "--steps", 2, "--height", 64, "--width",
         96, "--out", out)
    pipe = QwenImage21Pipeline.from_pretrained(tiny_21_model)
    want = pipe(prompt="a red square", num_inference_steps=2, height=64, width=96,
                generator=torch.Generator().manual_seed(0), output_type="pil").images[0]
    np.testing.assert_array_equal(np.asarray(Image.open(out)), np.asarray(want))

    from typer.testing import CliRunner

    from pipeline.cli import app

    result = CliRunner().invoke(app, ["predict", "--model", str(tiny_edit_model), "--prompt", "x", "--out",
                                      str(tmp_path / "edit.png")])
    assert result.exit_code == 2 and "pass at least one --image" in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "edit.png").exists()


def test_21_lora_merge_gives_a_folder_the_stock_pipeline_loads_with_the_lora_fused(tiny_21_model, encoded21, tmp_path):
    from diffusers import QwenImage21Pipeline

    from stages.train.recipe import run

    run(_train_cfg(max_steps=2), encoded21, tiny_21_model, tmp_path / "run")
    _cli("lora", "merge", "--model", tiny_21_model, "--lora", tmp_path / "run" / "lora", "--out", tmp_path / "merged")
    merged = QwenImage21Pipeline.from_pretrained(tmp_path / "merged")
    ref = QwenImage21Pipeline.from_pretrained(tiny_21_model)
    ref.load_lora_weights(tmp_path / "run" / "lora")
    g = torch.Generator().manual_seed(0)
    tokens, text = torch.randn(1, 2 * 2 + 4 * 2, 64, generator=g), torch.randn(1, 5, 32, generator=g)
    slots = torch.tensor([[False, True, False, False, False, True, True]])  # text with 1 reference slot, 2 target slots

    def out(pipe):
        with torch.no_grad():
            return pipe.transformer(hidden_states=tokens, encoder_hidden_states=text, timestep=torch.tensor([0.3]),
                                    img_shapes=[[(1, 2, 2), (1, 2, 4)]], img_mask=slots, return_dict=False)[0]

    torch.testing.assert_close(out(merged), out(ref), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(out(merged), out(QwenImage21Pipeline.from_pretrained(tiny_21_model)))  # LoRA in it


def test_21_merge_refuses_a_lora_bias_the_model_has_no_bias_for(tiny_21_model, tmp_path, monkeypatch):
    """A LoRA with a bias (`lora_B.bias`: read from its keys, as diffusers reads it) on 2.1's bias-free linears:
    predict applies it, but peft cannot fuse it into the weights, and `lora merge` ended in peft's RuntimeError
    traceback after the transformer had loaded. Now one line before the transformer loads, no folder written."""
    from safetensors.torch import save_file
    from typer.testing import CliRunner

    import models.loading
    from models.loading import load_component
    from pipeline.cli import app

    stock = load_component(tiny_21_model, "transformer")
    lora = {}
    for m in ("transformer_blocks.0.attn.to_q", "transformer_blocks.1.attn.to_v"):
        lin = stock.get_submodule(m)
        lora[f"transformer.{m}.lora_A.weight"] = torch.randn(2, lin.in_features) * 0.1
        lora[f"transformer.{m}.lora_B.weight"] = torch.randn(lin.out_features, 2) * 0.1
        lora[f"transformer.{m}.lora_B.bias"] = torch.randn(lin.out_features) * 0.1
    save_file(lora, tmp_path / "bias.safetensors")

    def no_load(*a, **k):
        raise AssertionError("the transformer was loaded")

    monkeypatch.setattr(models.loading, "load_component", no_load)
    result = CliRunner().invoke(app, ["lora", "merge", "--model", str(tiny_21_model), "--lora",
                                      str(tmp_path / "bias.safetensors"), "--out", str(tmp_path / "merged")])
    assert result.exit_code == 1 and "adds a bias (lora_B.bias) to 2 layer(s) that have none" in result.output, \
        result.output
    assert "transformer_blocks.0.attn.to_q" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "merged").exists()


def test_21_two_processes_train_the_same_lora_as_one(tiny_21_model, tmp_path):
    """DDP on 2.1 goes through the `Qwen21Batched` wrapper, so the ranks' gradients are all-reduced: two gloo
    processes at batch 1 train the LoRA one process trains at batch 2 (two processes of their own, started warm
    through the CLI's entry point: tests/stages/two_ranks.py)."""
    import yaml

    from models.lora import read_lora
    from stages.train.recipe import run
    from two_ranks import launch_two

    # 4 samples: global batch 2 gives the same two steps (same pairs) at 1 x 2 and 2 x 1
    store = write_store21(tmp_path / "s", MIXED[:4])
    encode_text.run(load_config(None, F32), store, tiny_21_model)
    encode_vae.run(load_config(None, F32), store, tiny_21_model)
    train = {"learning_rate": 0.01, "lora": {"rank": 4}, "max_steps": 2, "checkpoint_every": 2,
             "sigma": {"sampling": "dynamic_shift", "max_shift": 1.15, "max_image_seq_len": 4096}}
    cfg_file = tmp_path / "train.yaml"
    cfg_file.write_text(yaml.safe_dump({"train": train}))
    run(load_config(cfg_file, {"train.batch_size": 2, "train.device": "cpu"}), store, tiny_21_model,
        tmp_path / "one")
    (rc0, _, err0), (rc1, _, err1) = launch_two(
        "rank_cli.py", "run", "train", "--store", str(store), "--model", tiny_21_model,
        "--out", str(tmp_path / "two"),
        "--config", str(cfg_file), "--batch-size", "1", timeout=300)
    assert rc0 == rc1 == 0, (rc0, rc1, err0[-3000:], err1[-3000:])
    one, two = read_lora(tmp_path / "one" / "lora")[0], read_lora(tmp_path / "two" / "lora")[0]
    diff = torch.cat([(one[k] - two[k]).abs().flatten() for k in one])
    assert one.keys() == two.keys() and diff.max() <= 1e-4 * 0.01 * 2, diff.max()  # float reassociation only


def test_21_offloaded_blocks_train_the_same_lora(tiny_21_model, encoded21, tmp_path):
    """offload=blocks on 2.1 (the stock blocks are called through their module, so the offload hooks fire;
    storage and compute on the CPU, every onload a real copy) = no offload, bit for bit; also with the resident
    block left out of checkpointing."""
    from stages.train.recipe import run

    plain = run(_train_cfg(max_steps=2, gradient_checkpointing=True), encoded21, tiny_21_model, tmp_path / "plain")
    with offloaders_built() as seen:
        off = run(_train_cfg(max_steps=2, offload="blocks", offload_blocks_on_device=1), encoded21, tiny_21_model,
                  tmp_path / "off")
        # block 0 resident and left out of checkpointing (train.uncheckpointed_blocks): the same LoRA too
        partial = run(_train_cfg(max_steps=2, offload="blocks", offload_blocks_on_device=1, uncheckpointed_blocks=1),
                      encoded21, tiny_21_model, tmp_path / "partial")
    offloader = seen[0]
    assert offloader.onloads >= 2 * 2  # forward + recompute of block 1, per step
    for other in (off, partial):
        assert_same_training(plain, other)


def test_21_validation_loss_while_training(tiny_21_model, tmp_path):
    from stages.train.recipe import run

    store = write_store21(tmp_path / "s", MIXED, val=(1, 2))
    encode_text.run(load_config(None, F32), store, tiny_21_model)
    encode_vae.run(load_config(None, F32), store, tiny_21_model)
    result = run(_train_cfg(max_steps=2, validate_every=1, sample_every=2, sample_steps=2), store, tiny_21_model,
                 tmp_path / "run")
    assert all(torch.isfinite(torch.tensor(result.losses)))
    assert list((tmp_path / "run" / "logs").iterdir())  # val/loss logged to TensorBoard
    grid = Image.open(tmp_path / "run" / "samples" / "step-000002.png")
    assert grid.size == (64 + 64, 96)  # the two val samples (64x64 and 96x64 px targets) side by side


def _rows_written_by(monkeypatch, module, name: str) -> list:
    """The rows `module.name(out, metrics, rows)` (a report writer) is handed, collected as it writes them."""
    rows, write = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda out, metrics, r: (rows.extend(r), write(out, metrics, r))[1])
    return rows


def _extra_prompt_pictures(tmp_path) -> tuple:
    """A 96x64 RGBA reference and an RGB target, random pixels: (ref, target) paths."""
    ref, target = tmp_path / "ref.png", tmp_path / "target.png"
    Image.fromarray(np.random.default_rng(5).integers(0, 255, (64, 96, 4), dtype=np.uint8), "RGBA").save(ref)
    Image.fromarray(np.random.default_rng(6).integers(0, 255, (64, 96, 3), dtype=np.uint8)).save(target)
    return ref, target


def _stock_21_image(pipe, ref, seed: int):
    """The stock `QwenImage21Pipeline` call the extra prompt stands for, with whatever LoRA `pipe` holds."""
    return pipe(image=[Image.open(ref)], prompt="make the square red", num_inference_steps=2, height=64, width=96,
                output_resolution=78, generator=torch.Generator().manual_seed(seed), output_type="pil").images[0]


def test_21_evaluate_extra_prompts_are_the_stock_pipeline_base_and_lora(tiny_21_model, tmp_path, monkeypatch,
                                                                          capsys):
    """`evaluate.extra_prompts` on 2.1 (refused before): the report's extra row holds the stock
    `QwenImage21Pipeline`'s image without the LoRA (base) and with `load_lora_weights` (LoRA), same seed. A
    negative prompt without true CFG is unused (the stock call's image without it) and said so: it was silent."""
    import json

    from diffusers import QwenImage21Pipeline

    from stages.evaluate import checkpoint_report, checkpoints
    from stages.evaluate import stage as evaluate
    from stages.train.recipe import run

    store = write_store21(tmp_path / "s", MIXED, val=(0,))
    cfg = load_config(None, F32)
    encode_text.run(cfg, store, tiny_21_model)
    encode_vae.run(cfg, store, tiny_21_model)
    run(_train_cfg(max_steps=2, checkpoint_every=1), store, tiny_21_model, tmp_path / "run")
    ref, target = _extra_prompt_pictures(tmp_path)

    rows = _rows_written_by(monkeypatch, evaluate, "write_report")
    ev = load_config(None, {"evaluate.dtype": "float32", "evaluate.num_samples": 0, "evaluate.num_inference_steps": 2,
                            "evaluate.true_cfg_scale": 1.0, "evaluate.negative_prompt": "blurry",
                            "evaluate.extra_prompts": [{"prompt": "make the square red", "images": [str(ref)],
                                                        "target": str(target), "height": 64, "width": 96}]}).evaluate
    capsys.readouterr()
    evaluate.run(ev, store, tiny_21_model, tmp_path / "run" / "lora", tmp_path / "report")
    said = capsys.readouterr().out
    assert said.count("note: evaluate.negative_prompt is unused") == 1 and "true_cfg_scale" in said, said
    (row,) = rows
    assert row.title == "extra 1" and row.caption == "make the square red" and "psnr_lora" in row.scores
    samples = json.loads((tmp_path / "report" / "metrics.json").read_text())["generation"]["samples"]
    assert [s["title"] for s in samples] == ["extra 1"]

    pipe = QwenImage21Pipeline.from_pretrained(tiny_21_model)
    base = _stock_21_image(pipe, ref, ev.seed)
    pipe.load_lora_weights(tmp_path / "run" / "lora")
    lora = _stock_21_image(pipe, ref, ev.seed)
    assert not np.array_equal(np.asarray(base), np.asarray(lora))
    np.testing.assert_array_equal(np.asarray(row.base), np.asarray(rgb_over_white(base)))
    np.testing.assert_array_equal(np.asarray(row.lora), np.asarray(rgb_over_white(lora)))

    # --all-checkpoints: the same extra row from the base and the best checkpoint
    ck_rows = _rows_written_by(monkeypatch, checkpoint_report, "write_checkpoint_report")
    ckpts = [(n, tmp_path / "run" / "checkpoints" / f"step-{n}" / "lora") for n in (1, 2)]
    best = checkpoints.run(ev, store, tiny_21_model, ckpts, tmp_path / "ck-report").metrics["checkpoints"]["best"]
    (ck,) = ck_rows
    pipe.unload_lora_weights()
    pipe.load_lora_weights(best["path"])
    np.testing.assert_array_equal(np.asarray(ck.outputs["base"]), np.asarray(rgb_over_white(base)))
    np.testing.assert_array_equal(np.asarray(ck.outputs[f"best (step {best['step']})"]),
                                  np.asarray(rgb_over_white(_stock_21_image(pipe, ref, ev.seed))))


def test_21_extra_prompt_without_images_is_the_stock_text_to_image_call(tiny_21_model, tiny_plus_model):
    """An `evaluate.extra_prompts` entry needed an image (the schema's min_length 1), as predict needed an --image:
    a 2.1 LoRA trained on samples without references could not be shown on a text-to-image prompt. On 2.1 an entry
    with no images now gives the stock pipeline's image=None call; an Edit-Plus model refuses it in one line at
    evaluate's start (`check_settings`)."""
    from diffusers import QwenImage21Pipeline

    from models.loading import load_component
    from schemas import UserError
    from stages.evaluate.qwen21 import extra_inputs_21
    from stages.evaluate.settings import for_model

    settings = {"evaluate.dtype": "float32", "evaluate.num_samples": 0, "evaluate.num_inference_steps": 2,
                "evaluate.extra_prompts": [{"prompt": "a red square", "images": [], "height": 64, "width": 96}]}
    ev = for_model(load_config(None, settings).evaluate, tiny_21_model)  # its start check passes
    transformer = load_component(tiny_21_model, "transformer", dtype=torch.float32)
    vae = load_component(tiny_21_model, "vae", dtype=torch.float32)
    ((title, prompt, controls, _, cond, *_),) = list(extra_inputs_21(tiny_21_model, transformer, vae, ev))
    assert (title, prompt, controls) == ("extra 1", "a red square", [])
    pipe = QwenImage21Pipeline.from_pretrained(tiny_21_model)
    want = pipe(prompt="a red square", num_inference_steps=2, height=64, width=96,
                generator=torch.Generator().manual_seed(ev.seed), output_type="pil").images[0]
    np.testing.assert_array_equal(np.asarray(cond()), np.asarray(rgb_over_white(want)))

    with pytest.raises(UserError, match=r"extra_prompts\[0\]\.images: none listed.*list at least one"):
        for_model(load_config(None, settings).evaluate, tiny_plus_model)


def test_a_failure_in_the_21_text_loop_is_shared_with_the_other_ranks(tiny_21_model, store21, monkeypatch):
    """The 2.1 encode-text loop hands its error to `job.failed` (the launcher's store tells the other ranks at
    once, models/collective/), as encode-text and encode-vae do. Before: it did not, so the other ranks never
    got its line; started without a launcher that tears the group down (tests/stages/two_ranks.py) they encoded
    their whole share and then waited for the failed rank at the commit."""
    import models.qwen21_text
    from schemas.errors import UserError
    from stages.encode import commit

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    shared = []
    monkeypatch.setattr(models.qwen21_text, "encode_prompt", out_of_memory)
    monkeypatch.setattr(commit, "failed", lambda job, error: shared.append((job.summary.stage, error)))
    with pytest.raises(UserError, match=r"ran out of memory encoding sample \w+ alone"):  # one line, no traceback
        encode_text.run(load_config(None, F32), store21, tiny_21_model)
    assert [(stage, isinstance(e, UserError)) for stage, e in shared] == [("encode-text", True)]  # (TooLargeAlone)


def test_a_caption_past_the_21_rope_table_is_quarantined_not_encoded(tiny_21_model, tmp_path):
    """A prompt whose joint sequence runs past QwenImage21Rope's frame positions (8192 in diffusers' table) is
    quarantined as "caption too long" before it reaches the encoder. Before: it was encoded, and train's stock
    RoPE read negative positions for the overflow (silently wrong), then failed with an index error."""
    from models.qwen21_text import frame_positions
    from stages.encode.qwen21 import caption_length_rejection_21

    assert frame_positions() == 8192
    assert caption_length_rejection_21("k", 8191, [[1, 4, 8]]) is None  # the target at the table's last row
    assert caption_length_rejection_21("k", 8192, [[1, 4, 8]]).reason == "caption too long"
    long_caption = "paint " * 9000
    store = write_store21(tmp_path / "s", samples=[SAMPLES[1], (long_caption, (64, 64, "RGB"), [(64, 64, "RGB")])])
    t = encode_text.run(load_config(None, F32), store, tiny_21_model)
    assert (t.encoded, t.quarantined) == (1, 1)
    [row] = Store(store).quarantine().to_pylist()
    assert row["reason"] == "caption too long" and "8192 frame positions" in row["detail"], row


def _stock_rope_reads_true_positions(text_tokens: int, target, refs) -> bool:
    """Whether diffusers' `QwenImage21Rope` gives the joint sequence (text, then each reference, then the target,
    as the 2.1 pipeline lays it out) the rotations of its true positions: the stock table against the same
    module with a longer positive table (same negative rows, which the height/width axes index from the end)."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21Rope

    shapes = [(1, h, w) for h, w in refs] + [(1, *target)]
    mask = torch.tensor([False] * text_tokens + [True] * sum(h * w for _, h, w in shapes))
    stock, longer = QwenImage21Rope(10000, [2, 2, 2]), QwenImage21Rope(10000, [2, 2, 2])
    neg = torch.arange(1024).flip(0) * -1 - 1
    longer.freqs = [torch.cat([longer.rope_params(torch.arange(20000), 2), longer.rope_params(neg, 2)])] * 3
    try:
        got = stock(shapes, mask, "cpu")
    except IndexError:
        return False
    return torch.equal(got, longer(shapes, mask, "cpu"))


@pytest.mark.parametrize("target,refs", [((4, 8), []), ((64, 64), [(48, 80), (2, 2)])])
def test_the_21_caption_limit_is_exactly_where_the_stock_rope_runs_out(target, refs):
    """The quarantine boundary is the stock RoPE's: the target block sits at the frame position after all text
    tokens and the references' max(h, w) each, and that position must be a row of the 8192-row table. Before,
    the target's own max(h, w) was counted too, quarantining captions the model reads correctly."""
    from stages.encode.qwen21 import caption_length_rejection_21

    shapes = [[1, *target]] + [[1, h, w] for h, w in refs]  # the images table's order: target first
    last_ok = 8191 - sum(max(h, w) for h, w in refs)
    assert caption_length_rejection_21("k", last_ok, shapes) is None
    assert _stock_rope_reads_true_positions(last_ok, target, refs)
    assert caption_length_rejection_21("k", last_ok + 1, shapes).reason == "caption too long"
    assert not _stock_rope_reads_true_positions(last_ok + 1, target, refs)


def test_21_encode_text_ignores_no_setting_silently(tiny_21_model, store21):
    """2.1 encodes one sample per forward with the stock template: `encode_text.batching` changes nothing, so
    switching it leaves the table current (before: every sample re-encoded to identical values), and a
    `prompt_template` it would not use is refused in one line (before: silently ignored, yet hashed)."""
    from schemas.errors import UserError

    first = encode_text.run(load_config(None, F32), store21, tiny_21_model)
    assert first.encoded == 3
    again = encode_text.run(load_config(None, {**F32, "encode_text.batching": "padded"}), store21, tiny_21_model)
    assert again.up_to_date and again.encoded == 0
    with pytest.raises(UserError, match="prompt_template"):
        encode_text.run(load_config(None, {**F32, "encode_text.prompt_template": "<|im_start|>{}<|im_end|>",
                                           "encode_text.prompt_template_start_idx": 1}), store21, tiny_21_model)


def test_21_predict_refuses_a_prompt_past_the_rope_table(tiny_21_model, tmp_path):
    """predict (and evaluate's extra prompts: the same call) check the prompt as encode-text does: a prompt whose
    target would sit past the 8192 frame positions is one line, no image. Before: the stock pipeline ran it, its
    RoPE reading negative positions for the overflow (a silently wrong image; an IndexError past 9216). The
    boundary is exact: one token less runs."""
    from models.qwen21_predict import check_prompt_fits, load_pipeline_21
    from schemas.errors import UserError

    ref = tmp_path / "ref.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 255, (64, 96, 4), dtype=np.uint8), "RGBA").save(ref)
    pipe = load_pipeline_21(tiny_21_model, torch.float32, {})
    refs = [Image.open(ref)]
    tokenizer = pipe.processor.tokenizer
    # find the longest prompt that fits: the template's own tokens + the reference's max(h, w) = 6 latent tokens
    short = check_prompt_fits(pipe, refs, "a", None, 64, 96)  # positions left after a one-token prompt
    fits = " ".join(["a"] * (short + 1))
    assert check_prompt_fits(pipe, refs, fits, None, 64, 96) == 0
    with pytest.raises(UserError, match="frame position 8192"):
        check_prompt_fits(pipe, refs, fits + " a", None, 64, 96)
    assert len(tokenizer(fits)["input_ids"]) == short + 1  # one token per word, so the boundary above is exact
    from models.qwen21_predict import _text_tokens  # the count is the stock embeddings' text tokens
    from models.qwen21_text import encode_prompt, prompt_encoder

    for prompt, images in (("make it red", refs), ("", refs), ("make it red", [])):
        _, slots = encode_prompt(prompt_encoder(pipe.text_encoder, pipe.processor), prompt,
                                 [pipe.image_processor.resize(im, height=64, width=96) for im in images])
        assert _text_tokens(pipe, prompt, len(images)) == int((~slots).sum())

    out = tmp_path / "out.png"
    from typer.testing import CliRunner

    from pipeline.cli import app

    result = CliRunner().invoke(app, [str(a) for a in ("predict", "--model", tiny_21_model, "--image", ref, "--prompt",
                                                       fits + " a", "--steps", 2, "--height", 64, "--width", 96,
                                                       "--out", out)])
    assert result.exit_code == 1 and not out.exists(), result.output
    assert "shorten the prompt" in result.output and "Traceback" not in result.output


def test_21_predict_refuses_references_the_processor_would_resize(tiny_21_model, tmp_path):
    """predict without --height / --width gives each reference the stock pipeline's 1024² area; the tiny model's
    processor (max_pixels 512²) resizes such a reference for its VLM, so the VLM grid differs from the VAE grid.
    That is one line naming the processor's limit and the output size to pass, before the model loads; before,
    the transformer failed with a shape-mismatch traceback. At a size the processor keeps, predict runs."""
    from typer.testing import CliRunner

    from pipeline.cli import app

    ref = tmp_path / "ref.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 255, (201, 268, 4), dtype=np.uint8), "RGBA").save(ref)
    out = tmp_path / "out.png"
    args = ("predict", "--model", tiny_21_model, "--image", ref, "--prompt", "make it red", "--steps", 1)
    result = CliRunner().invoke(app, [str(a) for a in (*args, "--out", out)])
    assert result.exit_code == 1 and not out.exists(), result.output
    assert "Traceback" not in result.output and "processor" in result.output, result.output
    assert "262144" in result.output and "--height" in result.output, result.output
    _cli(*args, "--height", 96, "--width", 128, "--out", out)  # 12288 px: within the processor's limit
    assert Image.open(out).size == (128, 96)


def test_21_predict_and_the_sample_grid_default_to_no_guidance(tiny_21_model, tmp_path):
    """Qwen-Image-2.1 is sampled without guidance (the stock pipeline's true_cfg_scale 1.0). `pipeline predict`
    on a 2.1 model without --cfg (or predict.true_cfg_scale) gives the stock default call's image; before it ran
    true CFG 4.0 with the negative " " (the Edit models' default): twice the forwards and another image. Set
    explicitly, the scale is honoured."""
    from diffusers import QwenImage21Pipeline

    ref = tmp_path / "ref.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 255, (64, 96, 4), dtype=np.uint8), "RGBA").save(ref)
    args = ("predict", "--model", tiny_21_model, "--image", ref, "--prompt", "make it red", "--steps", 2,
            "--height", 64, "--width", 96)
    assert "negative" not in _cli(*args, "--out", tmp_path / "default.png")
    _cli(*args, "--cfg", 4.0, "--out", tmp_path / "cfg4.png")
    pipe = QwenImage21Pipeline.from_pretrained(tiny_21_model)

    def stock(**kw):
        return np.asarray(pipe(image=[Image.open(ref)], prompt="make it red", num_inference_steps=2, height=64,
                               width=96, output_resolution=78, generator=torch.Generator().manual_seed(0), **kw)
                          .images[0])

    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "default.png")), stock())
    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "cfg4.png")),
                                  stock(true_cfg_scale=4.0, negative_prompt=" "))
    # a negative prompt without --cfg changes nothing (no guidance): said, as the stock pipeline warns; it was silent
    said = _cli(*args, "--negative-prompt", "blurry", "--out", tmp_path / "negative.png")
    assert "note: --negative-prompt / predict.negative_prompt is unused" in said and "--cfg" in said, said
    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "negative.png")), stock())


def test_21_evaluate_defaults_to_no_guidance_as_predict_does(tiny_21_model, tiny_edit_model):
    """`evaluate.true_cfg_scale` unset on a 2.1 model: 1.0 (no guidance), as predict and the training sample grid
    take it; it was the Edit models' 4.0 (another image than predict's, twice the forwards). Set, it is kept;
    the Edit models keep 4.0. Both evaluate entries (one LoRA, --all-checkpoints) resolve it first."""
    import inspect

    from stages.evaluate import checkpoints, stage
    from stages.evaluate.settings import for_model

    unset = load_config(None, {}).evaluate
    assert for_model(unset, tiny_21_model).true_cfg_scale == 1.0
    assert for_model(unset, tiny_edit_model).true_cfg_scale == 4.0
    explicit = load_config(None, {"evaluate.true_cfg_scale": 4.0}).evaluate
    assert for_model(explicit, tiny_21_model).true_cfg_scale == 4.0
    assert for_model(unset, tiny_21_model).fingerprint() != unset.fingerprint()  # a report made at 4.0 is redone
    for entry, call in ((stage.run, "cfg = for_model(cfg, model)"), (checkpoints._run, "cfg = for_model(cfg, model, check=ranks.main)")):
        assert call in inspect.getsource(entry)


def test_the_merge_check_reads_no_header_of_a_model_without_safetensors(tmp_path, monkeypatch):
    """`check_mergeable` reads the transformer's safetensors headers; a model whose weights are another format
    (.bin) has none to read: the merge goes on (peft says what it meets). Before, every biased LoRA was refused
    there as adding a bias to layers 'that have none'."""
    from safetensors.torch import save_file

    import models.loading
    from models.lora import check_mergeable

    (tmp_path / "model" / "transformer").mkdir(parents=True)
    (tmp_path / "model" / "transformer" / "diffusion_pytorch_model.bin").write_bytes(b"not read")
    m = "transformer.transformer_blocks.0.attn.to_q"
    save_file({f"{m}.lora_A.weight": torch.ones(2, 4), f"{m}.lora_B.weight": torch.ones(4, 2),
               f"{m}.lora_B.bias": torch.ones(4)}, tmp_path / "bias.safetensors")
    monkeypatch.setattr(models.loading, "resolve_model", lambda model: tmp_path / "model")
    check_mergeable("a-bin-model", tmp_path / "bias.safetensors")


def test_21_dynamic_shift_left_unset_is_the_models_scheduler_shift(tiny_21_model, encoded21, tmp_path):
    """`train.sigma.sampling: dynamic_shift` with its shift settings unset trains with the model's own scheduler
    numbers (what the 2.1 pipeline's calculate_shift reads: 0.5 at 256 tokens to 1.15 at 4096), the same LoRA as
    with them spelled out; before, the Edit models' 0.9 at 8192 tokens trained a 2.1 model without a word."""
    import yaml

    from diffusers import FlowMatchEulerDiscreteScheduler

    from models.lora import read_lora
    from stages.train.recipe import run

    sched = FlowMatchEulerDiscreteScheduler.from_pretrained(tiny_21_model, subfolder="scheduler").config
    assert (sched.max_shift, sched.max_image_seq_len) == (1.15, 4096)
    unset = load_config(None, {"train.device": "cpu", "train.batch_size": 2, "train.learning_rate": 0.01,
                               "train.lora.rank": 4, "train.max_steps": 2, "train.sigma.sampling": "dynamic_shift"})
    run(unset, encoded21, tiny_21_model, tmp_path / "unset")
    run(_train_cfg(max_steps=2, caption_dropout=0.0), encoded21, tiny_21_model, tmp_path / "spelled")
    a, b = read_lora(tmp_path / "unset" / "lora")[0], read_lora(tmp_path / "spelled" / "lora")[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    recorded = yaml.safe_load((tmp_path / "unset" / "train_config.yaml").read_text())
    sigma = recorded.get("train", recorded)["sigma"]
    assert (sigma["max_shift"], sigma["max_image_seq_len"]) == (1.15, 4096)  # the run records what it used


def test_a_reference_the_21_vlm_processor_cannot_keep_is_quarantined_before_the_encoder(tiny_21_model, tmp_path):
    """resize.max_aspect above 200 lets through a reference the VLM processor refuses (transformers' smart_resize:
    "absolute aspect ratio must be smaller than 200"): encode-text stopped there with that ValueError's traceback,
    no sample written. A reference the processor would resize (outside its min..max pixels) reached the encoder,
    then was quarantined. Both are quarantined now, before the forward, the other samples encoded."""
    too_long = (32, 32 * 203, "RGB")  # 203:1, within the tiny processor's 1024..262144 px
    too_big = (608, 448, "RGB")  # 272,384 px, over its 262,144
    store = write_store21(tmp_path / "s", samples=[SAMPLES[1], ("wide", (64, 64, "RGB"), [too_long]),
                                                   ("big", (64, 64, "RGB"), [(64, 64, "RGB"), too_big])])
    t = encode_text.run(load_config(None, F32), store, tiny_21_model)
    assert (t.encoded, t.quarantined, t.forwards) == (1, 2, 1), t
    rows = {r["source"]: r for r in Store(store).quarantine().to_pylist()}
    assert rows["fixture/1"]["reason"] == "reference too elongated for the VLM", rows
    assert "6496x32" in rows["fixture/1"]["detail"] and "200:1" in rows["fixture/1"]["detail"], rows
    assert rows["fixture/2"]["reason"] == "VLM grid differs from the VAE grid", rows
    assert "control_1" in rows["fixture/2"]["detail"] and "1024..262144" in rows["fixture/2"]["detail"], rows


@pytest.mark.parametrize("fold_alpha", [True, False], ids=["final-lora", "checkpoint-lora"])
def test_21_trainer_loss_is_the_stock_transformers_with_the_saved_lora(tiny_21_model, encoded21, tmp_path,
                                                                         fold_alpha):
    """The trainer's one loss (`flow_loss`: 0..3 references of different sizes in one padded batch, a different σ
    per sample, one sample on its stored empty prompt) equals, per sample, the unmodified
    `QwenImage21Pipeline.transformer` at batch 1 with the LoRA file loaded by the stock `load_lora_weights`, noised
    and targeted as diffusers' Qwen-Image LoRA training script does ((1-σ)·x0 + σ·ε, target ε - x0, σ as the
    timestep). alpha = 2·rank: the final LoRA folds it into lora_B, a checkpoint keeps it in the adapter metadata;
    the stock loader applies both as the trainer does, and holds the file's tensors bit for bit."""
    from diffusers import QwenImage21Pipeline
    from safetensors.torch import load_file

    from models.flow import flow_loss
    from models.loading import load_component, model_fingerprint
    from models.lora import add_lora, save_lora
    from models.qwen21_multires import joint_image_mask, latent_tokens
    from models.randomness import draw_noise
    from stages.train.data import load
    from train_store import open_split

    tables = open_split(encoded21, tiny_21_model)
    samples = sorted((load(tables, k) for k in tables.keys), key=lambda s: len(s.controls))
    assert [len(s.controls) for s in samples] == [0, 1, 1, 2, 3]
    ours = load_component(tiny_21_model, "transformer").float().eval()
    add_lora(ours, load_config(None, {"train.lora.rank": 4, "train.lora.alpha": 8}).train.lora)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)  # a trained adapter's size: its effect shows far above float32 rounding
    lora = tmp_path / "lora"
    save_lora(ours, lora, fold_alpha=fold_alpha, base_fingerprint=model_fingerprint(tiny_21_model))
    sigmas = torch.tensor([0.9, 0.15, 0.5, 0.35, 0.7])
    noises = [draw_noise(s, 0, i) for i, s in enumerate(samples)]
    empty = [False, False, True, False, False]
    with torch.no_grad():
        got = flow_loss(ours, samples, sigmas, noises, use_empty=empty)

    pipe = QwenImage21Pipeline.from_pretrained(tiny_21_model)
    pipe.load_lora_weights(lora)
    loaded = dict(pipe.transformer.named_parameters())
    for key, value in load_file(lora / "pytorch_lora_weights.safetensors").items():
        module = key.removeprefix("transformer.").replace(".weight", ".default_0.weight")
        assert torch.equal(loaded[module], value), key

    def stock(s, noise, sigma, use_empty):
        x0, eps = latent_tokens(s.target).float(), latent_tokens(noise)
        x_t = (1 - sigma) * x0 + sigma * eps
        embeds, slot_mask = (s.empty_embeds, s.empty_slot_mask) if use_empty else (s.prompt_embeds, s.slot_mask)
        slots, _ = joint_image_mask(slot_mask, x_t.shape[0])
        hw = tuple(int(v) for v in s.img_shapes[0][1:])
        with torch.no_grad():
            out = pipe.transformer(
                hidden_states=torch.cat([latent_tokens(c).float() for c in s.controls] + [x_t])[None],
                encoder_hidden_states=embeds.float()[None], timestep=sigma.view(1), img_mask=slots[None],
                img_shapes=[[(1, c.shape[-2], c.shape[-1]) for c in s.controls] + [(1, *hw)]], return_dict=False)[0]
        return (out[0, -x_t.shape[0]:] - (eps - x0)).pow(2).mean()

    want = torch.stack([stock(*args) for args in zip(samples, noises, sigmas, empty)])
    pipe.unload_lora_weights()
    base = torch.stack([stock(*args) for args in zip(samples, noises, sigmas, empty)])
    assert (want - base).abs().min() > 1e-4  # the LoRA changes every sample's loss
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # measured max |diff| 1.2e-7 (float32)


def test_21_dynamic_shift_sigmas_are_the_stock_schedulers_shift_at_the_21_pipelines_mu(tiny_21_model):
    """`sigma.sampling: dynamic_shift` with the 2.1 model's scheduler numbers draws σ = the stock
    `FlowMatchEulerDiscreteScheduler.time_shift` at the mu the `QwenImage21Pipeline` computes for the sample's
    target tokens (its own `calculate_shift`, not the Edit pipelines')."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift

    from models.flow import sample_sigmas

    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(tiny_21_model, subfolder="scheduler")
    c = scheduler.config
    settings = load_config(None, {"train.sigma.sampling": "dynamic_shift"}).train.sigma
    settings = settings.model_copy(update=dict(base_shift=c.base_shift, max_shift=c.max_shift,
                                               base_image_seq_len=c.base_image_seq_len,
                                               max_image_seq_len=c.max_image_seq_len))
    for tokens in (24, 256, 1024, 4096, 6000):
        u = torch.rand(64, generator=torch.Generator().manual_seed(tokens))
        got = sample_sigmas(64, settings, torch.Generator().manual_seed(tokens), [tokens] * 64)
        mu = calculate_shift(tokens, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
        want = torch.tensor([scheduler.time_shift(mu, 1.0, x) for x in u.tolist()], dtype=torch.float32)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-7)


def test_an_edit_configs_dynamic_shift_on_a_21_model_is_said(tiny_21_model, tiny_edit_model, encoded21, tmp_path,
                                                              capsys):
    """An Edit config carried to 2.1 that spells its scheduler's shift (0.9 at 8192 tokens) trains at it, as set,
    with one note naming the 2.1 scheduler's numbers (1.15 at 4096) and the settings to unset; before, not a word.
    Unset, or set to the model's own numbers: nothing said."""
    from stages.train.recipe import run
    from stages.train.settings import say_other_shift

    edit_numbers = {"train.sigma.max_shift": 0.9, "train.sigma.max_image_seq_len": 8192}
    capsys.readouterr()
    run(load_config(None, {"train.device": "cpu", "train.batch_size": 2, "train.lora.rank": 4, "train.max_steps": 1,
                           "train.sigma.sampling": "dynamic_shift", **edit_numbers}),
        encoded21, tiny_21_model, tmp_path / "run")
    [note] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("note: train.sigma")]
    assert "max_shift 0.9, max_image_seq_len 8192, as set" in note, note
    assert "max_shift 1.15, max_image_seq_len 4096" in note and "unset train.sigma.max_shift / max_image_seq_len" in note
    for model, numbers in ((tiny_21_model, {}), (tiny_21_model, {"train.sigma.max_shift": 1.15}),
                           (tiny_edit_model, edit_numbers)):
        say_other_shift(load_config(None, {"train.sigma.sampling": "dynamic_shift", **numbers}).train.sigma, model)
        assert "note:" not in capsys.readouterr().out
