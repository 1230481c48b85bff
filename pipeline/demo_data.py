"""Synthetic paired-edit dataset (`pipeline make-demo-data`): a learnable edit at mixed sizes and control counts.

Every sample is a flat-coloured scene (background, a square, a circle) drawn without anti-aliasing, so an edit
changes an exact pixel set and the optional mask (white = edited) is exactly that set. Edit kinds:
- "make the square <colour>": target = control 0 with the square recoloured;
- "mirror the scene": target = control 0 flipped left-right;
- "remove the circle": target = control 0 with the circle painted over by the background;
- "add a <colour> circle": target = control 0 with a new circle.
Extra controls (control_1, control_2, ...) are reference images of their own size and aspect: a swatch of the
colour the edit uses (the instruction then names "picture 2"), or a small scene. A sample with 0 controls is a
generate-from-text sample: the caption describes the scene, and its mask is all white (everything is new).

Sizes: aspect ratios from `ASPECTS` (9 distinct), sides 48..320 px. The same seed gives the same bytes, and the
three formats hold byte-identical PNGs and the same captions (each PNG is encoded once and written to every
format).

Samples are generated one at a time and written as they come (a tar of 16, a parquet row group of 8 at most
held): memory stays bounded whatever `n` (holding them all took ~1.8 GB at 1M samples).
"""

from __future__ import annotations

import io
import json
import random
import tarfile
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from itertools import islice
from math import gcd
from pathlib import Path

from PIL import Image, ImageChops, ImageDraw, ImageOps

from schemas.errors import UserError

ASPECTS: list[tuple[int, int]] = [(1, 1), (4, 3), (3, 4), (16, 9), (9, 16), (3, 2), (2, 3), (2, 1), (1, 2)]
MIN_SIDE, MAX_SIDE = 48, 320
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 180, 60),
    "blue": (40, 70, 220),
    "yellow": (240, 210, 40),
    "purple": (140, 50, 170),
    "orange": (245, 140, 20),
}
BACKGROUNDS: list[tuple[int, int, int]] = [(235, 235, 235), (200, 200, 210), (60, 60, 70), (250, 240, 220)]
EDITS = ("recolour", "mirror", "remove", "add")
SAMPLES_PER_TAR = 16
FORMATS = ("folder", "webdataset", "jsonl", "parquet")
PARQUET_ROW_GROUP = 8  # rows per row group: several groups even in a small demo, as published datasets have


@dataclass
class DemoSample:
    stem: str
    caption: str
    target: bytes  # PNG
    controls: list[bytes]  # PNGs, in order
    mask: bytes | None  # PNG (mode L), white = edited
    size: tuple[int, int]  # target (width, height)


def make_demo_data(
    out: str | Path,
    n: int = 48,
    fmt: str = "folder",
    max_controls: int = 3,
    seed: int = 0,
    with_masks: bool = False,
) -> str:
    """Write `n` samples in `fmt` under `out`; returns a one-paragraph summary."""
    if fmt not in FORMATS:
        raise UserError(f"unknown demo data format {fmt!r}; use one of {', '.join(FORMATS)}")
    if n < 1 or max_controls < 0:
        raise UserError(f"--n must be >= 1 and --max-controls >= 0 (got n={n}, max_controls={max_controls})")
    out = Path(out)
    if out.exists() and any(out.iterdir()):  # old samples would mix with the new ones (stale controls!)
        raise UserError(f"{out} is not empty: write demo data into a new or empty folder")
    stats = _Stats()
    samples = stats.counted(generate_samples(n=n, max_controls=max_controls, seed=seed, with_masks=with_masks))
    from store.format import atomic_dir  # here: the store package imports torch, this module needs none

    # Written beside OUT and renamed into place: a killed run never leaves a half-written dataset behind.
    with atomic_dir(out) as tmp:
        {"folder": write_folder, "webdataset": write_webdataset, "jsonl": write_jsonl,
         "parquet": write_parquet}[fmt](tmp, samples)

    return (
        f"wrote {n} demo samples ({fmt}{', with masks' if with_masks else ''}) to {out}: "
        f"controls per sample {dict(sorted(stats.controls.items()))}, {len(stats.aspects)} target aspect ratios, "
        f"sides {stats.min_side}..{stats.max_side} px"
    )


@dataclass
class _Stats:
    """The summary's figures, gathered as the samples stream past (none is kept)."""

    controls: Counter = field(default_factory=Counter)
    aspects: set = field(default_factory=set)
    min_side: int = MAX_SIDE
    max_side: int = 0

    def counted(self, samples: Iterable[DemoSample]) -> Iterator[DemoSample]:
        for s in samples:
            self.controls[len(s.controls)] += 1
            self.aspects.add(_reduced(*s.size))
            self.min_side, self.max_side = min(self.min_side, *s.size), max(self.max_side, *s.size)
            yield s


def generate_samples(n: int, max_controls: int, seed: int, with_masks: bool) -> Iterator[DemoSample]:
    """The samples one at a time (a generator: memory does not grow with `n`)."""
    rng = random.Random(seed)
    # control counts cycle through 0..max so every count occurs; the order is shuffled
    counts = [i % (max_controls + 1) for i in range(n)]  # n small ints: 8 MB at 1M, the rng order needs them
    rng.shuffle(counts)
    from tqdm.auto import tqdm

    for i in tqdm(range(n), desc="demo samples", unit="sample"):
        yield _make_sample(rng, f"sample_{i:04d}", counts[i], with_masks)


def _batches(samples: Iterable[DemoSample], size: int) -> Iterator[list[DemoSample]]:
    it = iter(samples)
    while batch := list(islice(it, size)):
        yield batch


def _reduced(w: int, h: int) -> tuple[int, int]:
    g = gcd(w, h)
    return w // g, h // g


def _random_size(rng: random.Random) -> tuple[int, int]:
    """(width, height) with an aspect from ASPECTS exactly and both sides in MIN_SIDE..MAX_SIDE."""
    aw, ah = rng.choice(ASPECTS)
    lo = -(-MIN_SIDE // min(aw, ah))  # smallest unit so the short side is >= MIN_SIDE
    hi = MAX_SIDE // max(aw, ah)
    unit = rng.randint(lo, hi)
    return aw * unit, ah * unit


@dataclass
class _Scene:
    size: tuple[int, int]
    background: tuple[int, int, int]
    square: tuple[int, int, int, int]  # x0, y0, x1, y1 (inclusive)
    square_colour: str
    circle: tuple[int, int, int, int] | None
    circle_colour: str


def _random_box(rng: random.Random, w: int, h: int, frac: float) -> tuple[int, int, int, int]:
    s = max(6, int(min(w, h) * frac))
    x0, y0 = rng.randint(0, w - s - 1), rng.randint(0, h - s - 1)
    return x0, y0, x0 + s, y0 + s


def _random_scene(rng: random.Random, size: tuple[int, int]) -> _Scene:
    w, h = size
    colours = rng.sample(sorted(COLOURS), 2)
    return _Scene(
        size=size,
        background=rng.choice(BACKGROUNDS),
        square=_random_box(rng, w, h, rng.uniform(0.25, 0.4)),
        square_colour=colours[0],
        circle=_random_box(rng, w, h, rng.uniform(0.2, 0.3)),
        circle_colour=colours[1],
    )


def _draw(scene: _Scene) -> Image.Image:
    im = Image.new("RGB", scene.size, scene.background)
    d = ImageDraw.Draw(im)
    d.rectangle(scene.square, fill=COLOURS[scene.square_colour])
    if scene.circle is not None:
        d.ellipse(scene.circle, fill=COLOURS[scene.circle_colour])
    return im


def _png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG", optimize=False, compress_level=6)
    return buf.getvalue()


def _describe(scene: _Scene) -> str:
    parts = [f"a {scene.square_colour} square"]
    if scene.circle is not None:
        parts.append(f"a {scene.circle_colour} circle")
    return f"{' and '.join(parts)} on a plain background"


def _make_sample(rng: random.Random, stem: str, num_controls: int, with_masks: bool) -> DemoSample:
    size = _random_size(rng)
    scene = _random_scene(rng, size)
    before = _draw(scene)
    # the colour an edit introduces; never the square's own, so a recolour always changes pixels
    extra_colour = rng.choice([c for c in sorted(COLOURS) if c != scene.square_colour])

    if num_controls == 0:
        target, caption = before, _describe(scene)
        changed = Image.new("L", size, 255)
        controls: list[Image.Image] = []
    else:
        kind = rng.choice(EDITS)
        uses_swatch = num_controls >= 2 and kind in ("recolour", "add")
        if kind == "recolour":
            after = _draw(replace(scene, square_colour=extra_colour))
            caption = "make the square the colour of picture 2" if uses_swatch else f"make the square {extra_colour}"
        elif kind == "mirror":
            after, caption = ImageOps.mirror(before), "mirror the scene"
        elif kind == "remove":
            after, caption = _draw(replace(scene, circle=None)), "remove the circle"
        else:
            w, h = size
            after = before.copy()
            ImageDraw.Draw(after).ellipse(_random_box(rng, w, h, 0.2), fill=COLOURS[extra_colour])
            caption = "add a circle in the colour of picture 2" if uses_swatch else f"add a {extra_colour} circle"
        target = after
        changed = _diff_mask(before, after)
        controls = [before] + [_reference(rng, extra_colour if j == 1 else None) for j in range(1, num_controls)]

    return DemoSample(
        stem=stem,
        caption=caption,
        target=_png(target),
        controls=[_png(c) for c in controls],
        mask=_png(changed) if with_masks else None,
        size=size,
    )


def _diff_mask(a: Image.Image, b: Image.Image) -> Image.Image:
    """White where any channel differs: exactly the pixels the edit changed."""
    diff = ImageChops.difference(a, b).convert("L")
    return diff.point(lambda v: 255 if v else 0)


def _reference(rng: random.Random, colour: str | None) -> Image.Image:
    """An extra control with its own size: a colour swatch (when the edit names one) or a small scene."""
    size = _random_size(rng)
    if colour is not None:
        im = Image.new("RGB", size, (255, 255, 255))
        w, h = size
        ImageDraw.Draw(im).rectangle((w // 8, h // 8, w - w // 8, h - h // 8), fill=COLOURS[colour])
        return im
    return _draw(_random_scene(rng, size))


# ---------------------------------------------------------------- writers (same bytes in every format)


def _control_name(i: int) -> str:
    return "control" if i == 0 else f"control_{i}"


def write_folder(out: Path, samples: Iterable[DemoSample]) -> None:
    for s in samples:
        _write(out / "target" / f"{s.stem}.png", s.target)
        _write(out / "target" / f"{s.stem}.txt", s.caption.encode("utf-8"))
        for i, c in enumerate(s.controls):
            _write(out / _control_name(i) / f"{s.stem}.png", c)
        if s.mask is not None:
            _write(out / "mask" / f"{s.stem}.png", s.mask)


def write_webdataset(out: Path, samples: Iterable[DemoSample]) -> None:
    for shard_no, shard in enumerate(_batches(samples, SAMPLES_PER_TAR)):
        path = out / f"demo-{shard_no:06d}.tar"
        tmp = path.with_suffix(".tar.tmp")
        with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tf:
            for s in shard:
                members = [("png", s.target), ("txt", s.caption.encode("utf-8"))]
                members += [(f"{_control_name(i)}.png", c) for i, c in enumerate(s.controls)]
                if s.mask is not None:
                    members.append(("mask.png", s.mask))
                for ext, data in members:
                    info = tarfile.TarInfo(f"{s.stem}.{ext}")
                    info.size, info.mtime, info.mode = len(data), 0, 0o644  # fixed metadata: same bytes per seed
                    tf.addfile(info, io.BytesIO(data))
        tmp.replace(path)


def write_jsonl(out: Path, samples: Iterable[DemoSample]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "samples.jsonl", "wb") as manifest:
        for s in samples:
            manifest.write((_jsonl_line(out, s) + "\n").encode("utf-8"))


def _jsonl_line(out: Path, s: DemoSample) -> str:
    """Writes the sample's images; returns its manifest line."""
    obj: dict[str, object] = {"target": f"images/{s.stem}.png"}
    _write(out / "images" / f"{s.stem}.png", s.target)
    ctrl_paths = []
    for i, c in enumerate(s.controls):
        rel = f"images/{s.stem}.{_control_name(i)}.png"
        _write(out / rel, c)
        ctrl_paths.append(rel)
    obj["controls"] = ctrl_paths
    obj["caption"] = s.caption
    if s.mask is not None:
        obj["mask"] = f"images/{s.stem}.mask.png"
        _write(out / obj["mask"], s.mask)  # type: ignore[operator]
    return json.dumps(obj, ensure_ascii=False)


def write_parquet(out: Path, samples: Iterable[DemoSample]) -> None:
    """HF datasets' layout: `data/train-00000-of-00001.parquet`, images as `Image()` structs {bytes, path};
    columns `target`, `controls` (a list of images), `caption`, `mask` (null when none): resize.columns' defaults.
    One row group (PARQUET_ROW_GROUP rows) is built and written at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("target", image), ("controls", pa.list_(image)), ("caption", pa.string()),
                        ("mask", image)])
    path = out / "data" / "train-00000-of-00001.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    # Statistics for the caption only: an image column's min/max are whole PNGs, which the writer holds until
    # the footer (memory growing with every row group) and every reader then parses (~25% of the file).
    with pq.ParquetWriter(path, schema, write_statistics=["caption"]) as writer:
        for group in _batches(samples, PARQUET_ROW_GROUP):
            writer.write_table(pa.table({
                "target": pa.array([{"bytes": s.target, "path": f"{s.stem}.png"} for s in group], image),
                "controls": pa.array([[{"bytes": c, "path": f"{s.stem}.{_control_name(i)}.png"}
                                       for i, c in enumerate(s.controls)] for s in group], pa.list_(image)),
                "caption": pa.array([s.caption for s in group], pa.string()),
                "mask": pa.array([{"bytes": s.mask, "path": f"{s.stem}.mask.png"} if s.mask is not None else None
                                  for s in group], image),
            }, schema=schema), row_group_size=PARQUET_ROW_GROUP)


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
