"""Qwen-Image-2.1 encode-text encodes the empty prompt without references once per run, not once per sample that
has no references (a text-to-image dataset: every sample), and reuses a call it already made for the sample
(an empty caption: its empty prompt is its prompt; no references: its prompt alone is its prompt). The stored
values are bit-for-bit the stock pipeline's per-sample encodings."""

from __future__ import annotations

import torch
from diffusers import QwenImage21Pipeline

import models.qwen21_text
from pipeline.config import load_config
from stages.encode import text as encode_text
from store import Store
from test_qwen21_stages import F32, _rgba, write_store21

SAMPLES = [  # four without references, two with an empty caption
    ("a red square", (64, 64, "RGB"), []),
    ("a blue circle", (64, 96, "RGB"), []),
    ("", (64, 64, "RGB"), []),
    ("a green field", (96, 64, "RGB"), []),
    ("", (64, 96, "RGBA"), [(64, 96, "RGBA")]),
    ("make the square red", (64, 96, "RGBA"), [(64, 96, "RGBA")]),
]


def test_21_empty_prompt_encoded_once_with_the_per_sample_values(tiny_21_model, tmp_path, monkeypatch):
    store = write_store21(tmp_path / "s", SAMPLES)
    real, calls = models.qwen21_text.encode_prompt, []

    def counted(encoder, caption, references):
        calls.append((caption, len(references)))
        return real(encoder, caption, references)

    monkeypatch.setattr(models.qwen21_text, "encode_prompt", counted)
    t = encode_text.run(load_config(None, {**F32, "encode_text.no_control_embeds": True}), store, tiny_21_model)
    assert t.encoded == 6
    # before: prompt, empty and alone per sample = 18 calls; now 8: ("", no reference) once (three samples' empty
    # prompt, one's prompt, one's prompt alone), the other prompts, one empty prompt with references (the other
    # is the empty caption's own prompt), one prompt alone (the others' is their prompt or the empty one)
    assert sorted(calls) == sorted([("a red square", 0), ("a blue circle", 0), ("", 0), ("a green field", 0),
                                    ("", 1), ("make the square red", 1), ("", 1), ("make the square red", 0)])
    pipe = QwenImage21Pipeline.from_pretrained(tiny_21_model)
    st = Store(store)
    images, text = st.reader("images"), st.reader("text")
    for key in text.keys():  # against the stock pipeline, each encoding computed for this sample on its own
        s = images.get(key)
        refs = [_rgba(s["files"][f"control_{i}.png"]) for i in range(s["meta"]["num_controls"])]
        got = text.get(key)["tensors"]
        for caption, e, m in ((s["meta"]["caption"], "prompt_embeds", "slot_mask"), ("", "empty_embeds", "empty_slot_mask"),
                              (s["meta"]["caption"], "nocontrol_embeds", None)):
            want, _, slots = pipe.encode_prompt(prompt=caption, image=(refs or None) if m else None, device="cpu")
            assert torch.equal(got[e], want[0].to(torch.bfloat16)), (key, e)
            if m:
                assert torch.equal(got[m], slots[0].bool())
