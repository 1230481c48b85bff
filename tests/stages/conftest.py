"""Fixtures for stage tests: small `images` tables written with the store writer directly (the layout
stages/resize_bucket.py writes: target.png, control_{i}.png = VAE view, control_{i}_vl.png = VL view, optional
mask.png, and the manifest columns), so the encode stages can be tested without running resize-bucket.
"""

from __future__ import annotations

import hashlib
import io
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from schemas import FieldSpec, Lineage, TableSchema
from store import Store

CAPTIONS = [
    "make the square red",
    "add a hat and change the sky to sunset, then make it brighter",
    "rotate",
    "make the square blue",  # same token count as the first: shares batches with it
    "remove the circle and replace the car with a bicycle",
]


@dataclass
class FixtureSample:
    caption: str
    target: tuple[int, int]  # (height, width) of the bucket, multiples of 16
    controls: list[tuple[int, int]] = field(default_factory=list)  # VAE views (h, w)
    controls_vl: list[tuple[int, int]] = field(default_factory=list)  # VL views (h, w)
    mask: bool = False
    corrupt_control: bool = False
    mask_size: tuple[int, int] | None = None  # (h, w) of a mask that does not match the target (quarantine)


def _png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _noise(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    # Smooth-ish content (not pure noise) so resizes and the VAE see image-like data.
    base = rng.integers(0, 255, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
    up = np.kron(base, np.ones((8, 8, 1), dtype=np.uint8))[:h, :w]
    return np.clip(up.astype(np.int16) + rng.integers(-20, 20, (h, w, 3)), 0, 255).astype(np.uint8)


def images_schema(tag: str, mask_sha256: bool = False) -> TableSchema:
    col = "column"
    return TableSchema(
        name="images",
        lineage=Lineage("resize-bucket", config_hash=f"fixture-{tag}", upstream={}, code_version="fixture"),
        fields=[
            FieldSpec("target.png", "png", kind="file"),
            FieldSpec("control_{i}.png", "png", kind="file", optional=True),
            FieldSpec("control_{i}_vl.png", "png", kind="file", optional=True),
            FieldSpec("mask.png", "png", kind="file", optional=True),
            FieldSpec("caption", "string", kind=col),
            FieldSpec("split", "string", kind=col),
            FieldSpec("img_shapes", "json", kind=col),
            FieldSpec("bucket", "json", kind=col),
            FieldSpec("control_sizes", "json", kind=col),
            FieldSpec("num_controls", "int64", kind=col),
            FieldSpec("source", "string", kind=col),
            FieldSpec("has_mask", "bool", kind=col),
        ] + ([FieldSpec("mask_sha256", "string", kind=col)] if mask_sha256 else []),
    )


def write_images_table(store_path: Path, samples: list[FixtureSample], seed: int = 0,
                       tag: str = "a", val=lambda i: i % 4 == 3, mask_sha256: bool = False) -> dict[str, FixtureSample]:
    """Write one `images` version; returns key -> sample. A new `tag` gives a new lineage (a new version); `val`:
    whether sample i is in the val split (the same samples under another split: a re-split). `mask_sha256`: the
    column as resize-bucket writes it ("" without a mask), which encode-vae's carry compares."""
    rng = np.random.default_rng(seed)
    st = Store(store_path)
    w = st.writer("images", images_schema(tag, mask_sha256))
    out = {}
    for i, s in enumerate(samples):
        h, w_ = s.target
        files = {"target.png": _png(_noise(rng, h, w_))}
        for c, ((ch, cw), (vh, vw)) in enumerate(zip(s.controls, s.controls_vl)):
            files[f"control_{c}.png"] = _png(_noise(rng, ch, cw))
            files[f"control_{c}_vl.png"] = _png(_noise(rng, vh, vw))
        if s.corrupt_control:
            files["control_0.png"] = files["control_0_vl.png"] = b"\x89PNG\r\n\x1a\n-not-really-a-png"
        if s.mask:
            mh, mw = s.mask_size or (h, w_)
            m = np.zeros((mh, mw), dtype=np.uint8)
            m[mh // 4 : mh // 2 + 3, mw // 3 : mw - 5] = 255  # edges off the 16-px token grid: fractional weights
            files["mask.png"] = _png(m)
        key = hashlib.sha256(b"".join(files[k] for k in sorted(files)) + s.caption.encode()).hexdigest()[:32]
        shapes = [[1, h // 16, w_ // 16]] + [[1, ch // 16, cw // 16] for ch, cw in s.controls]
        w.add(key, files=files, meta={
            "caption": s.caption, "split": "val" if val(i) else "train", "img_shapes": shapes,
            "bucket": [h, w_], "control_sizes": [list(c) for c in s.controls], "num_controls": len(s.controls),
            "source": f"fixture/{i}", "has_mask": s.mask,
            **({"mask_sha256": hashlib.sha256(files["mask.png"]).hexdigest() if s.mask else ""} if mask_sha256 else {}),
        })
        out[key] = s
    w.commit()
    return out


def edit_samples() -> list[FixtureSample]:
    """One control each (an Edit model's input): varied instruction lengths and control sizes; samples 0, 3, 5
    share token count and control size (one batch), 1 and 4 share a control size; 2's control is too small to
    batch exactly (encoded alone)."""
    big, wide, small = (160, 160), (128, 192), (64, 64)
    spec = [(0, (64, 64), big, True), (1, (48, 80), wide, False), (2, (64, 64), small, True),
            (3, (96, 64), big, False), (4, (64, 64), wide, True), (0, (48, 80), big, False)]
    return [FixtureSample(CAPTIONS[c], target=t, controls=[ctrl], controls_vl=[ctrl], mask=m) for c, t, ctrl, m in spec]


def plus_samples() -> list[FixtureSample]:
    """0..3 controls, VL views at their own sizes (a 56² one is too small to batch exactly); some masks."""
    return [
        FixtureSample(CAPTIONS[0], (64, 64), [(64, 64)], [(160, 160)], mask=True),
        FixtureSample(CAPTIONS[1], (48, 80), [(48, 80), (64, 64)], [(128, 192), (160, 160)]),
        FixtureSample(CAPTIONS[2], (64, 48), [], []),
        FixtureSample(CAPTIONS[3], (64, 64), [(64, 64)], [(160, 160)], mask=True),
        FixtureSample(CAPTIONS[4], (80, 48), [(80, 48), (32, 32), (64, 64)], [(192, 128), (56, 56), (160, 160)]),
        FixtureSample(CAPTIONS[0], (64, 64), [(64, 64)], [(160, 160)]),
    ]


@pytest.fixture
def without_proxies(monkeypatch) -> None:
    """No proxy variables: requests to a test's server on 127.0.0.1 go straight to it, not to the machine's proxy."""
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


@pytest.fixture(scope="session")
def _store_templates(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("images-stores")
    out = {}
    for name, samples in (("edit", edit_samples()), ("plus", plus_samples())):
        write_images_table(root / name, samples)
        out[name] = root / name
    return out


@pytest.fixture
def edit_store(_store_templates, tmp_path) -> Path:
    """A fresh store holding an `images` table for an Edit model (one control per sample)."""
    return Path(shutil.copytree(_store_templates["edit"], tmp_path / "edit-store"))


@pytest.fixture
def plus_store(_store_templates, tmp_path) -> Path:
    """A fresh store holding an `images` table for an Edit-Plus model (0..3 controls per sample)."""
    return Path(shutil.copytree(_store_templates["plus"], tmp_path / "plus-store"))


@pytest.fixture
def images_fixture() -> SimpleNamespace:
    """The builders, for tests that write their own images tables (conftest modules are not importable)."""
    return SimpleNamespace(write=write_images_table, Sample=FixtureSample, edit_samples=edit_samples,
                           plus_samples=plus_samples)
