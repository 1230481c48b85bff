"""Control-image dropout: encode-text (`encode_text.no_control_embeds`) also stores the instruction encoded without
its control images, exactly as the unmodified Edit-Plus pipeline encodes it with image=None (a new table version:
the setting is in the lineage); `train.control_dropout` draws per sample from (seed, step, key) and trains those
samples on that encoding."""

from __future__ import annotations


import torch
from typer.testing import CliRunner

from pipeline.cli import app
from store import Store


def _cli(*args, code: int = 0) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == code, result.output
    return result.output


def test_no_control_embeds_and_control_dropout_training(tiny_plus_model, plus_store, tmp_path, monkeypatch):
    from diffusers import QwenImageEditPlusPipeline

    import models.loading

    from models.flow import flow_loss
    from models.randomness import draw_caption_dropout, draw_control_dropout, draw_noise, draw_sigma, with_control_dropout
    from pipeline.config import load_config
    from stages.train.data import load
    from train_store import open_split
    from stages.train.recipe import run, setup_transformer

    f32 = ["--set", "encode_text.dtype=float32"]
    _cli("run", "encode-text", "--store", plus_store, "--model", tiny_plus_model, *f32)
    _cli("run", "encode-vae", "--store", plus_store, "--model", tiny_plus_model)
    loaded, real_load = [], models.loading.load_component
    monkeypatch.setattr(models.loading, "load_component", lambda *a, **k: loaded.append(a[1]) or real_load(*a, **k))
    out = _cli("run", "train", "--store", plus_store, "--model", tiny_plus_model, "--out", tmp_path / "refused",
               "--max-steps", 1, "--device", "cpu", "--set", "train.control_dropout=1.0", code=1)  # no such embeds yet
    # refused before the transformer loads (before: at the first dropped sample, after the load)
    assert "train.control_dropout 1.0 needs the text table's nocontrol_embeds" in out and "v1" in out, out
    assert "encode_text.no_control_embeds: true" in out and "transformer" not in loaded, (out, loaded)
    monkeypatch.setattr(models.loading, "load_component", real_load)
    # what following it costs (it once said "reusing the rest", then "every sample encoded again")
    assert "only its instruction without the control images is encoded" in out, out
    again = _cli("run", "encode-text", "--store", plus_store, "--model", tiny_plus_model, *f32,
                 "--set", "encode_text.no_control_embeds=true")
    assert "encoded 0, reused 0, completed " in again, again  # the stored embeddings carried, nocontrol computed
    st = Store(plus_store)
    assert st.tables()["text"] == 2  # the option is in the lineage: a new version

    pipe = QwenImageEditPlusPipeline.from_pretrained(tiny_plus_model, torch_dtype=torch.float32)
    text, images = st.reader("text"), st.reader("images")
    for key in images.keys():
        caption = images.meta(key)["caption"]
        ref, mask = pipe.encode_prompt(caption, image=None, device="cpu")
        ref = ref[0] if mask is None else ref[0][mask[0].bool()]
        assert torch.equal(text.get(key)["tensors"]["nocontrol_embeds"], ref.to(torch.bfloat16))
        if images.meta(key)["num_controls"]:
            assert text.get(key)["tensors"]["nocontrol_embeds"].shape != text.get(key)["tensors"]["prompt_embeds"].shape

    # per-sample draws: deterministic in (seed, step, key), about p of the samples
    tables = open_split(plus_store, tiny_plus_model)
    samples = [load(tables, k) for k in tables.keys]
    draws = [draw_control_dropout(s, 0, step, 0.5) for step in range(40) for s in samples]
    assert draws == [draw_control_dropout(s, 0, step, 0.5) for step in range(40) for s in samples]
    assert 0.35 < sum(draws) / len(draws) < 0.65
    dropped = with_control_dropout(samples, 0, 0, 1.0)
    assert all(torch.equal(d.prompt_embeds, s.nocontrol_embeds) and d.controls is s.controls for d, s in zip(dropped, samples))

    # train's first step with p = 1 is the flow loss on the no-control encodings (LoRA B = 0: the base model)
    cfg = load_config(None, {"train.device": "cpu", "train.batch_size": len(samples), "train.max_steps": 1,
                             "train.control_dropout": 1.0, "train.sigma.sampling": "uniform", "train.lora.rank": 4})
    result = _cli("run", "train", "--store", plus_store, "--model", tiny_plus_model, "--out", tmp_path / "run",
                  "--max-steps", 1, "--batch-size", len(samples), "--device", "cpu", "--set", "train.control_dropout=1.0",
                  "--set", "train.sigma.sampling=uniform", "--set", "train.lora.rank=4")
    loss = run(cfg, plus_store, tiny_plus_model, tmp_path / "run2").losses[0]
    model = setup_transformer(tiny_plus_model, cfg.train, torch.device("cpu"))
    with torch.no_grad():
        ref = flow_loss(model, dropped, torch.stack([draw_sigma(s, 0, 0, cfg.train.sigma) for s in dropped]),
                        [draw_noise(s, 0, 0) for s in dropped]).mean()
        plain = flow_loss(model, samples, torch.stack([draw_sigma(s, 0, 0, cfg.train.sigma) for s in samples]),
                          [draw_noise(s, 0, 0) for s in samples]).mean()
    assert not any(draw_caption_dropout(s, 0, 0, 0.0) for s in samples)
    assert abs(loss - float(ref)) < 1e-5 and abs(float(ref) - float(plain)) > 1e-4
    assert f"{loss:.4f}" in result
