"""encode-text / encode-vae on a Qwen-Image-2.1 model against the unmodified `QwenImage21Pipeline`."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.config import load_config
from schemas import FieldSpec, Lineage, TableSchema
from stages.encode import text as encode_text
from stages.encode import vae as encode_vae
from store import Store

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


@pytest.fixture
def store21(tmp_path):
    col = "column"
    schema = TableSchema(name="images", lineage=Lineage("resize-bucket", config_hash="fixture-21", upstream={},
                                                        code_version="fixture"),
                         fields=[FieldSpec("target.png", "png", kind="file"),
                                 FieldSpec("control_{i}.png", "png", kind="file", optional=True),
                                 FieldSpec("caption", "string", kind=col), FieldSpec("split", "string", kind=col),
                                 FieldSpec("img_shapes", "json", kind=col), FieldSpec("num_controls", "int64", kind=col),
                                 FieldSpec("source", "string", kind=col)])
    rng = np.random.default_rng(0)
    w = Store(tmp_path / "s").writer("images", schema)
    for i, (caption, (th, tw, tm), refs) in enumerate(SAMPLES):
        files = {"target.png": _png(th, tw, tm, rng)}
        files.update({f"control_{c}.png": _png(h, w_, m, rng) for c, (h, w_, m) in enumerate(refs)})
        shapes = [[1, th // 16, tw // 16]] + [[1, h // 16, w_ // 16] for h, w_, _ in refs]
        w.add(f"{i:032x}", files=files, meta={"caption": caption, "split": "train", "img_shapes": shapes,
                                              "num_controls": len(refs), "source": f"fixture/{i}"})
    w.commit()
    return tmp_path / "s"


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
