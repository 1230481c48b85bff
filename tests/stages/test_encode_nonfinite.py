"""Features holding NaN or inf (float16 overflowing an encoder, a damaged weight) are quarantined by encode-text and
encode-vae, never stored: stored, they passed for features until train's first step on them stopped on a NaN loss."""

from __future__ import annotations


from pipeline.config import load_config
from stages.encode import text as encode_text
from stages.encode import vae as encode_vae
from store import Store

F32 = {"encode_text.dtype": "float32", "encode_vae.dtype": "float32"}


def _reasons(store) -> dict[tuple[str, str], tuple[str, str]]:
    return {(r["stage"], r["key"]): (r["reason"], r["detail"]) for r in Store(store).quarantine().to_pylist()}


def test_text_with_a_nan_embedding_is_quarantined(tiny_plus_model, plus_store, monkeypatch):
    keys = sorted(Store(plus_store).reader("images").keys())
    poisoned = keys[1]
    real = encode_text.encode_batch

    def forward(text_encoder, batch, *args, **kwargs):
        out = real(text_encoder, batch, *args, **kwargs)
        return [e.fill_(float("nan")) if (r.key, r.kind) == (poisoned, "empty") else e for r, e in zip(batch, out)]

    monkeypatch.setattr(encode_text, "encode_batch", forward)
    summary = encode_text.run(load_config(None, F32), plus_store, tiny_plus_model, batch_size=4)
    assert (summary.encoded, summary.quarantined) == (len(keys) - 1, 1)
    assert sorted(Store(plus_store).reader("text").keys()) == [k for k in keys if k != poisoned]
    reason, detail = _reasons(plus_store)[("encode-text", poisoned)]
    assert reason == "non-finite features" and "empty_embeds hold NaN or inf" in detail
    assert "encode_text.dtype float32" in detail


def test_a_latent_with_inf_is_quarantined(tiny_plus_model, plus_store, monkeypatch):
    keys = sorted(Store(plus_store).reader("images").keys())
    real = encode_vae.encode_batch
    poisoned = next(k for k in keys if Store(plus_store).reader("images").meta(k)["num_controls"] >= 1)

    def forward(vae, batch, *args):
        out = real(vae, batch, *args)
        for i, r in enumerate(batch):
            if (r.key, r.name) == (poisoned, "control_0"):
                out[i, 0, 0, 0, 0] = float("inf")
        return out

    monkeypatch.setattr(encode_vae, "encode_batch", forward)
    summary = encode_vae.run(load_config(None, F32), plus_store, tiny_plus_model, batch_size=4)
    assert (summary.encoded, summary.quarantined) == (len(keys) - 1, 1)
    assert poisoned not in Store(plus_store).reader("vae").keys()
    reason, detail = _reasons(plus_store)[("encode-vae", poisoned)]
    assert reason == "non-finite features" and detail.startswith("control_0 hold NaN or inf")


def test_21_text_with_a_nan_embedding_is_quarantined(tiny_21_model, tmp_path, images_fixture, monkeypatch):
    import models.qwen21_text

    fx = images_fixture
    store = tmp_path / "s"
    keys = list(fx.write(store, [fx.Sample(c, (64, 64), [(64, 64)], [(64, 64)]) for c in ("fine", "overflows")]))
    real = models.qwen21_text.encode_prompt

    def encode(encoder, caption, references):
        embeds, slots = real(encoder, caption, references)
        return (embeds.clone().fill_(float("nan")) if caption == "overflows" else embeds), slots

    monkeypatch.setattr(models.qwen21_text, "encode_prompt", encode)
    summary = encode_text.run(load_config(None, F32), store, tiny_21_model)
    assert (summary.encoded, summary.quarantined) == (1, 1)
    assert list(Store(store).reader("text").keys()) == [keys[0]]
    reason, detail = _reasons(store)[("encode-text", keys[1])]
    assert reason == "non-finite features" and "prompt_embeds hold NaN or inf" in detail
