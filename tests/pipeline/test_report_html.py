"""The evaluate report: PSNR/SSIM closed forms, and index.html rendered in headless Chromium with every image
actually decoded (naturalWidth > 0), from a copy of the page opened from disk with no network."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess

import numpy as np
import pytest
from PIL import Image

from stages.evaluate.report import SampleRow, psnr, ssim, write_report

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
# Appended to a copy of the page: after `load`, mark every img with whether it decoded.
PROBE = """<script>
window.addEventListener('load', () => {
  const imgs = [...document.images];
  const ok = imgs.filter(i => i.complete && i.naturalWidth > 0).length;
  document.body.setAttribute('data-probe', ok + '/' + imgs.length);
});
</script>"""


def _img(color, size=(40, 32)) -> Image.Image:
    return Image.new("RGB", size, color)


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    assert exe, "headless Chromium is required (scripts/test.sh installs Debian's `chromium`)"
    return exe


def _metrics() -> dict:
    return {
        "loss": {
            "protocol": "2 noise seeds x 3 sigmas",
            "overall": {"n": 3, "base": 1.0, "lora": 0.8},
            "per_bucket": {"32x48": {"n": 2, "base": 1.1, "lora": 0.9}, "48x32": {"n": 1, "base": 0.9, "lora": 0.7}},
            "mask": {"note": "n", "inside": {"n": 2, "base": 1.2, "lora": 1.0},
                     "outside": {"n": 2, "base": 0.9, "lora": float("nan")}},
        },
        "generation": {"settings": "2 steps", "note": "random model"},
        "run": {"steps": 3},
    }


def test_psnr_ssim_closed_forms():
    a, b = _img((100, 100, 100)), _img((110, 110, 110))
    assert psnr(a, a) == math.inf and ssim(a, a) == 1.0
    assert math.isclose(psnr(a, b), 10 * math.log10(255**2 / 100), rel_tol=1e-12)
    # Constant images: the structure/contrast terms are C2/C2 = 1, SSIM is the luminance term alone.
    c1 = (0.01 * 255) ** 2
    assert math.isclose(ssim(a, b), (2 * 100 * 110 + c1) / (100**2 + 110**2 + c1), rel_tol=1e-9)
    rng = np.random.default_rng(0)
    noise = Image.fromarray((rng.random((32, 40, 3)) * 255).astype("uint8"))
    assert ssim(noise, a) < 0.1


def test_mean_psnr_says_how_many_outputs_were_identical_to_their_target(tmp_path):
    """An output identical to its target has an infinite PSNR: the mean was over the finite ones and said
    nothing of it. Now metrics.json and the page both say what each mean is over."""
    from schemas.config import EvaluateConfig
    from stages.evaluate.generation_summary import generation_summary

    target, near, far = _img((100, 100, 100)), _img((110, 110, 110)), _img((130, 130, 130))
    rows = [SampleRow(f"k{i}", "c", [], target, base, lora,
                      {"psnr_base": psnr(target, base), "psnr_lora": psnr(target, lora),
                       "ssim_base": ssim(target, base), "ssim_lora": ssim(target, lora)})
            for i, (base, lora) in enumerate([(near, target), (far, near), (near, far)])]
    metrics = {**_metrics(), "generation": generation_summary(rows, EvaluateConfig())}
    write_report(tmp_path / "report", metrics, rows)
    gen = json.loads((tmp_path / "report" / "metrics.json").read_text())["generation"]
    assert gen["mean_over"]["psnr_lora"] == {"finite": 2, "identical": 1}
    assert gen["mean_over"]["psnr_base"] == {"finite": 3, "identical": 0}
    want_lora = (psnr(target, near) + psnr(target, far)) / 2  # the identical pair left out, and said so
    assert math.isclose(gen["mean"]["psnr_lora"], want_lora, rel_tol=1e-12)
    assert math.isclose(gen["mean"]["psnr_base"], (2 * psnr(target, near) + psnr(target, far)) / 3, rel_tol=1e-12)
    page = (tmp_path / "report" / "index.html").read_text()
    assert "LoRA: mean over 2 finite, 1 identical to the target (infinite PSNR)" in page
    assert "base: mean over" not in page  # nothing identical there: nothing to say


def test_report_renders_in_chromium_with_every_image_loaded(tmp_path):
    rows = [
        SampleRow("k1", "make it red", [_img("red"), _img("blue", (24, 48))], _img("green"), _img("gray"),
                  _img("white"), {"psnr_base": 10.0, "psnr_lora": 12.0, "ssim_base": 0.1, "ssim_lora": 0.2}),
        SampleRow("extra 1", "no target", [_img("yellow")], None, _img("black"), _img("purple")),
    ]
    page = write_report(tmp_path / "report", _metrics(), rows)
    report = tmp_path / "report"
    assert sorted(p.name for p in report.iterdir()) == ["grid.png", "index.html", "metrics.json"]
    metrics = json.loads((report / "metrics.json").read_text())  # strict JSON: NaN became null
    assert metrics["loss"]["mask"]["outside"]["lora"] is None
    grid = Image.open(report / "grid.png")
    grid.load()
    assert grid.width == 5 * 160 and grid.height > 2 * 160

    text = page.read_text()
    srcs = re.findall(r"src='([^']*)'", text)
    # controls 3 + targets 1 + outputs 4 + grid 1; nothing linked outside the file
    assert len(srcs) == 9 and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert "http://" not in text and "https://" not in text

    probe = tmp_path / "probe.html"
    probe.write_text(text.replace("</body>", PROBE + "</body>"))
    dom = subprocess.run(
        [_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chrome'}", "--virtual-time-budget=10000",
         "--dump-dom", probe.as_uri()],
        capture_output=True, text=True, timeout=120,
    ).stdout
    assert 'data-probe="9/9"' in dom, dom[-2000:]
    assert "make it red" in dom and "LoRA − base" in dom


def test_full_disk_writing_the_report_is_one_error_and_leaves_no_temp_file(tmp_path, monkeypatch):
    import errno

    from store.io_errors import DiskFullError

    import os

    real = os.fsync

    def full(fd):  # the page's bytes reach the disk at fsync: fail there, as a full disk does
        if ".index.html.tmp" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(DiskFullError, match="disk full while writing the evaluate report"):
        write_report(tmp_path / "report", _metrics(), [])
    assert not [p for p in (tmp_path / "report").iterdir() if ".tmp" in p.name]
    assert not (tmp_path / "report" / "metrics.json").exists()
    monkeypatch.undo()
    write_report(tmp_path / "report", _metrics(), [])
    assert (tmp_path / "report" / "metrics.json").is_file()
