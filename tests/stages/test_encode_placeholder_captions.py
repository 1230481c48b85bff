"""A caption holding a media placeholder token of the model's processor (`<|video_pad|>`, `<|image_pad|>`) is
quarantined by encode-text for every model family, because the stock pipelines refuse such a prompt (their
processor counts the placeholders against the pictures / videos passed and raises): there are no stock features to
equal. Before, Edit / Edit-Plus stored `<|video_pad|>` captions encoded as text (features no stock pipeline
makes, and the same prompt fails at inference), and Qwen-Image-2.1's encode-text stopped the whole run on the
stock call's ValueError."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from pipeline.config import load_config
from stages.encode import text as encode_text
from store import Store

F32 = {"encode_text.dtype": "float32"}


@pytest.mark.parametrize("variant", ["edit", "edit-plus"])
def test_edit_captions_with_a_media_placeholder_are_quarantined_as_the_stock_pipeline_refuses_them(
        variant, tiny_edit_model, tiny_plus_model, tmp_path, images_fixture):
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline

    model = tiny_edit_model if variant == "edit" else tiny_plus_model
    cls = QwenImageEditPipeline if variant == "edit" else QwenImageEditPlusPipeline
    pipe = cls.from_pretrained(model, torch_dtype=torch.float32)
    control = [Image.new("RGB", (64, 64))]
    for caption in ("play <|video_pad|> backwards", "make it <|image_pad|> red"):
        with pytest.raises(ValueError):  # the stock pipeline makes no features for it
            pipe.encode_prompt(caption, image=control[0] if variant == "edit" else control, device="cpu")

    Sample = images_fixture.Sample
    store = tmp_path / "store"
    images_fixture.write(store, [Sample("play <|video_pad|> backwards", (64, 64), [(64, 64)], [(64, 64)]),
                                 Sample("make it <|image_pad|> red", (64, 64), [(64, 64)], [(64, 64)]),
                                 Sample("make it red", (64, 64), [(64, 64)], [(64, 64)])])
    summary = encode_text.run(load_config(None, F32), store, model)
    assert (summary.encoded, summary.quarantined) == (1, 2)
    rows = Store(store).quarantine().to_pylist()
    assert {r["reason"] for r in rows} == {"prompt does not fit the template"}
    details = " ".join(r["detail"] for r in rows)
    assert "<|video_pad|>" in details and "<|image_pad|>" in details


def test_21_captions_with_a_media_placeholder_are_quarantined_not_fatal(tiny_21_model, tmp_path):
    from diffusers import QwenImage21Pipeline

    from test_qwen21_stages import write_store21

    pipe = QwenImage21Pipeline.from_pretrained(tiny_21_model, torch_dtype=torch.float32)
    for caption in ("play <|video_pad|> backwards", "make it <|image_pad|> red"):
        with pytest.raises(ValueError):
            pipe.encode_prompt(caption, image=[Image.new("RGBA", (64, 64))], device="cpu")

    store = write_store21(tmp_path / "s", samples=[
        ("play <|video_pad|> backwards", (64, 64, "RGB"), [(64, 64, "RGB")]),
        ("make it <|image_pad|> red", (64, 64, "RGB"), []),
        ("make it red", (64, 64, "RGB"), [(64, 64, "RGB")]),
    ])
    summary = encode_text.run(load_config(None, F32), store, tiny_21_model)  # before: ValueError, nothing written
    assert (summary.encoded, summary.quarantined) == (1, 2)
    rows = Store(store).quarantine().to_pylist()
    assert {r["reason"] for r in rows} == {"prompt does not fit the template"}
    assert len(Store(store).reader("text").keys()) == 1


@pytest.mark.parametrize("n", [0, 2])
def test_other_special_tokens_unicode_and_long_captions_are_encoded_as_the_stock_pipeline_does(n, tiny_plus_model):
    """What the stock processor takes as plain text, the stored features hold exactly as it encodes it: special
    tokens typed in a caption, emoji, surrounding whitespace, a 3000-character caption (no truncation either side)."""
    import io
    import threading

    import numpy as np
    from diffusers import QwenImageEditPlusPipeline

    pipe = QwenImageEditPlusPipeline.from_pretrained(tiny_plus_model, torch_dtype=torch.float32)
    rng = np.random.default_rng(0)
    files = {}
    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (64 + 32 * i, 96, 3), dtype=np.uint8)).save(buf, "PNG")
        files[f"control_{i}_vl.png"] = buf.getvalue()
    fmt = encode_text.prompt_format("edit-plus", None, None)
    images = encode_text.control_images(files, "edit-plus", n)
    for caption in ("<|im_start|>user\nhi<|im_end|>", "a <|vision_start|> b <|vision_end|>", "e <|endoftext|> f",
                    "p <|placeholder|> q", " emoji 🎩 ünï \n", "{} {0}", "x" * 3000):
        want, mask = pipe.encode_prompt(caption, image=images or None, device="cpu")
        want = want[0] if mask is None else want[0][mask[0].bool()]
        sample = {"meta": {"num_controls": n, "caption": caption, "img_shapes": [[1, 4, 4]] * (n + 1)}, "files": files}
        requests = encode_text.prepare("k", sample, fmt, pipe.processor, threading.Lock())
        assert isinstance(requests, list), (caption, requests)
        got = encode_text.encode_batch(pipe.text_encoder, requests[:1], fmt.start_idx)[0]
        assert got.shape == want.shape and torch.equal(got, want), caption
