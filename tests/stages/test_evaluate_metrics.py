"""evaluate's PSNR and SSIM (stages/evaluate/report.py) against scikit-image's `peak_signal_noise_ratio` and
`structural_similarity` with the Wang et al. 2004 settings (Gaussian window sigma 1.5, population covariance,
range 255, mean over RGB): random images, photo-like ones, and the demo scenes with the errors a model makes
(noise, blur, JPEG artefacts, a shifted object)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image, ImageFilter
from skimage.metrics import peak_signal_noise_ratio, structural_similarity

from pipeline.demo_data import generate_samples
from stages.evaluate.report import psnr, ssim


def _reference(a: Image.Image, b: Image.Image) -> tuple[float, float]:
    x, y = np.asarray(a.convert("RGB")), np.asarray(b.convert("RGB"))
    p = peak_signal_noise_ratio(x, y, data_range=255)
    s = structural_similarity(x.astype(np.float64), y.astype(np.float64), gaussian_weights=True, sigma=1.5,
                              use_sample_covariance=False, data_range=255, channel_axis=-1)
    return p, s


def _jpeg(im: Image.Image, quality: int) -> Image.Image:
    buf = io.BytesIO()
    im.convert("RGB").save(buf, format="JPEG", quality=quality)
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


def _photo_like(rng: np.random.Generator, h: int, w: int) -> Image.Image:
    """Smooth gradients, an edge and fine texture: what a photograph has and a flat test card lacks."""
    yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
    base = np.stack([np.sin(6 * xx) * 80 + 120, np.cos(4 * yy) * 70 + 110, (xx + yy) * 90 + 40], -1)
    base[: h // 2, w // 3 :] += 50  # a hard edge
    base += rng.normal(0, 6, base.shape)  # texture
    return Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))


def _pairs() -> list[tuple[str, Image.Image, Image.Image]]:
    rng = np.random.default_rng(0)
    out = []
    for h, w in ((64, 48), (17, 33), (120, 96)):
        a, b = (Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(2))
        out.append((f"random {h}x{w}", a, b))
    photo = _photo_like(rng, 96, 128)
    noisy = Image.fromarray(np.clip(np.asarray(photo) + rng.normal(0, 10, (96, 128, 3)), 0, 255).astype(np.uint8))
    out += [("photo + noise", photo, noisy), ("photo blurred", photo, photo.filter(ImageFilter.GaussianBlur(2))),
            ("photo jpeg q30", photo, _jpeg(photo, 30))]
    for s in generate_samples(3, max_controls=1, seed=3, with_masks=False):
        target = Image.open(io.BytesIO(s.target)).convert("RGB")
        out += [(f"demo {s.stem} jpeg q20", target, _jpeg(target, 20)),
                (f"demo {s.stem} shifted", target, Image.fromarray(np.roll(np.asarray(target), 3, axis=1)))]
    return out


@pytest.mark.parametrize("name, a, b", _pairs(), ids=lambda v: v if isinstance(v, str) else "")
def test_psnr_and_ssim_match_scikit_image(name, a, b) -> None:
    ref_psnr, ref_ssim = _reference(a, b)
    assert psnr(a, b) == pytest.approx(ref_psnr, rel=1e-9, abs=1e-9), name
    assert ssim(a, b) == pytest.approx(ref_ssim, rel=1e-6, abs=1e-7), name


def test_identical_images() -> None:
    im = _photo_like(np.random.default_rng(1), 40, 40)
    assert psnr(im, im) == float("inf") and ssim(im, im) == pytest.approx(1.0)


def test_an_rgba_output_is_scored_over_white_as_its_target_is():
    """Qwen-Image-2.1 decodes RGBA; its targets are composited over white (features.pictures). An output equal
    to its target, transparent where the target is, scores a perfect PSNR / SSIM: Pillow's convert("RGB") scored
    the colour the transparent pixels store (here red: PSNR 3.0 dB)."""
    from features.pictures import rgb_over_white

    px = np.zeros((32, 32, 4), np.uint8)
    px[..., 0] = 255  # red everywhere, stored under the transparency too
    px[8:24, 8:24] = (20, 120, 200, 255)  # an opaque square
    output = Image.fromarray(px, "RGBA")
    target = rgb_over_white(output)
    assert np.asarray(target)[0, 0].tolist() == [255, 255, 255]
    assert psnr(output, target) == float("inf")
    assert ssim(output, target) == pytest.approx(1.0)


def test_a_qwen21_val_image_is_composited_over_white(monkeypatch):
    """evaluate's 2.1 val image (stages/evaluate/qwen21.py) is RGB over white, not the RGBA's stored colours."""
    import types

    import models.qwen21_generate as gen
    from stages.evaluate.qwen21 import image_21

    px = np.zeros((16, 16, 4), np.uint8)
    px[..., 0] = 255  # transparent red
    monkeypatch.setattr(gen, "generate_21", lambda *a, **k: Image.fromarray(px, "RGBA"))
    monkeypatch.setattr(gen, "scheduler_and_sigmas", lambda config: (None, None))
    s = types.SimpleNamespace(img_shapes=[(1, 1, 1)], prompt_embeds=None, slot_mask=None, controls=[],
                              empty_embeds=None, empty_slot_mask=None)
    cfg = types.SimpleNamespace(num_inference_steps=1, seed=0, true_cfg_scale=1.0)
    image = image_21(None, None, {}, s, cfg)
    assert image.mode == "RGB" and np.asarray(image)[0, 0].tolist() == [255, 255, 255]
