"""The evaluate report: metrics.json, grid.png and a self-contained index.html (images as data URIs).

Everything here is plain data in, files out: evaluate computes, this module only lays out. The page has no
external reference (no CDN, no linked file), so it opens from disk, from an e-mail attachment or a CI artefact.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw
from tqdm.auto import tqdm

from features.pictures import rgb_over_white

TILE = 160  # grid cell side in pixels (images are fitted inside, aspect kept)
THUMB = 128  # side of the images in the page's sample table
LABEL_H = 16


@dataclass
class SampleRow:
    """One row of the grid: what went in, what should come out, what base and LoRA produced."""

    title: str  # e.g. the key or "extra 1"
    caption: str
    controls: list[Image.Image]
    target: Image.Image | None
    base: Image.Image
    lora: Image.Image
    scores: dict[str, float] = field(default_factory=dict)  # psnr/ssim of base and lora vs target


# ------------------------------------------------------------------------------------------------ metrics
# Written with numpy rather than taken from scikit-image / torchmetrics: two short functions do not justify a
# runtime dependency on scipy (or a second metrics stack) for every user; tests/stages/test_evaluate_metrics.py
# checks both against scikit-image's (a `test` extra) on random, photo-like and demo images.


def psnr(a: Image.Image, b: Image.Image) -> float:
    """Peak signal-to-noise ratio in dB over RGB uint8 (b is resized to a's size if they differ)."""
    x, y = _pair(a, b)
    mse = float(np.mean((x - y) ** 2))
    return math.inf if mse == 0 else 10.0 * math.log10(255.0**2 / mse)


SCORES = ("psnr_base", "psnr_lora", "ssim_base", "ssim_lora")


def score_means(rows: list[SampleRow]) -> dict[str, dict[str, Any]]:
    """{"mean": score -> mean over the finite values, "mean_over": score -> (finite, identical)}. An output
    identical to its target has an infinite PSNR, which no mean can hold: it is counted apart, not dropped
    silently (the page and metrics.json say "mean over N finite, M identical")."""
    scored = [r.scores for r in rows if r.scores]
    means: dict[str, float] = {}
    over: dict[str, dict[str, int]] = {}
    for m in SCORES:
        values = [s[m] for s in scored if m in s]
        finite = [v for v in values if math.isfinite(v)]
        means[m] = sum(finite) / len(finite) if finite else math.nan
        over[m] = {"finite": len(finite), "identical": sum(v == math.inf for v in values)}
    return {"mean": means, "mean_over": over}


def mean_line(gen: dict) -> str:
    """The samples' mean scores as the page shows them, with what each mean is over when an output was
    identical to its target (infinite PSNR, left out of the mean)."""
    mean, over = gen.get("mean") or {}, gen.get("mean_over") or {}
    if not mean:
        return ""
    parts = []
    for m in ("psnr", "ssim"):
        pair = " / ".join(_fmt(mean.get(f"{m}_{w}", math.nan)) for w in ("base", "lora"))
        parts.append(f"{m.upper()}{' dB' if m == 'psnr' else ''} (base / LoRA) {pair}")
    notes = [f"{w}: mean over {o['finite']} finite, {o['identical']} identical to the target (infinite PSNR)"
             for w in ("base", "LoRA") if (o := over.get(f"psnr_{w.lower()}")) and o["identical"]]
    return "Mean over the scored samples: " + "; ".join(parts) + (f" ({'; '.join(notes)})" if notes else "")


def ssim(a: Image.Image, b: Image.Image) -> float:
    """Structural similarity (Wang et al. 2004: 11x11 Gaussian window, sigma 1.5, K1 0.01, K2 0.03, range 255),
    mean over the RGB channels; valid-window region only, as the reference implementation."""
    x, y = _pair(a, b)
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    vals = []
    for ch in range(3):
        u, v = x[..., ch], y[..., ch]
        mu_u, mu_v = _gauss(u), _gauss(v)
        var_u = _gauss(u * u) - mu_u**2
        var_v = _gauss(v * v) - mu_v**2
        cov = _gauss(u * v) - mu_u * mu_v
        s = ((2 * mu_u * mu_v + c1) * (2 * cov + c2)) / ((mu_u**2 + mu_v**2 + c1) * (var_u + var_v + c2))
        vals.append(float(s.mean()))
    return float(np.mean(vals))


def _pair(a: Image.Image, b: Image.Image) -> tuple[np.ndarray, np.ndarray]:
    if b.size != a.size:
        b = b.resize(a.size, Image.BICUBIC)
    # over white, as the targets are: Pillow's convert("RGB") would score an RGBA output (Qwen-Image-2.1 decodes
    # four channels) by the colours its transparent pixels store
    return np.asarray(rgb_over_white(a), dtype=np.float64), np.asarray(rgb_over_white(b), dtype=np.float64)


def _gauss(img: np.ndarray, size: int = 11, sigma: float = 1.5) -> np.ndarray:
    """Separable Gaussian filter, 'valid' mode (windows that fit; a smaller window for images under 11 px)."""
    size = min(size, img.shape[0], img.shape[1])
    r = np.arange(size) - (size - 1) / 2
    k = np.exp(-(r**2) / (2 * sigma**2))
    k /= k.sum()
    rows = np.apply_along_axis(lambda m: np.convolve(m, k, mode="valid"), 1, img)
    return np.apply_along_axis(lambda m: np.convolve(m, k, mode="valid"), 0, rows)


# ------------------------------------------------------------------------------------------------ grid


def _fit(img: Image.Image, side: int) -> Image.Image:
    img = rgb_over_white(img)
    scale = side / max(img.size)
    # Nearest for upscaling: tiny demo images stay crisp instead of blurred.
    resample = Image.NEAREST if scale > 1 else Image.BICUBIC
    return img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))), resample)


def make_grid(rows: list[SampleRow]) -> Image.Image:
    """Rows of [control 1..n | target | base | LoRA], each cell labelled; missing cells stay blank."""
    n_controls = max((len(r.controls) for r in rows), default=0)
    headers = [f"control {i + 1}" for i in range(n_controls)] + ["target", "base", "LoRA"]
    cols = len(headers)
    row_h = TILE + LABEL_H
    grid = Image.new("RGB", (cols * TILE, LABEL_H + max(1, len(rows)) * row_h), "white")
    draw = ImageDraw.Draw(grid)
    for c, h in enumerate(headers):
        draw.text((c * TILE + 4, 2), h, fill="black")
    for r, row in enumerate(rows):
        y = LABEL_H + r * row_h
        draw.text((4, y + 2), f"{row.title}: {row.caption}"[: cols * TILE // 6], fill=(60, 60, 60))
        cells = list(row.controls) + [None] * (n_controls - len(row.controls)) + [row.target, row.base, row.lora]
        for c, img in enumerate(cells):
            if img is None:
                continue
            tile = _fit(img, TILE - 4)
            grid.paste(tile, (c * TILE + (TILE - tile.width) // 2, y + LABEL_H + (TILE - tile.height) // 2))
    return grid


# ------------------------------------------------------------------------------------------------ html


def data_uri(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "–" if math.isnan(v) else ("∞" if math.isinf(v) else f"{v:.4g}")
    return html.escape(str(v))


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _img(img: Image.Image | None, alt: str) -> str:
    if img is None:
        return "<td class='empty'>–</td>"
    return f"<td><img src='{data_uri(_fit(img, THUMB))}' alt='{html.escape(alt)}'></td>"


def render_html(metrics: dict, rows: list[SampleRow], grid: Image.Image) -> str:
    sections = _loss_sections(metrics["loss"]) + (_samples(metrics.get("generation", {}), rows, grid) if rows else [])
    return page("LoRA evaluation report", sections, metrics, extra_css="""
td.score { white-space: nowrap; }
th { max-width: 110px; }
.note { color: #7a4b00; background: #fff6e0; padding: 6px 10px; border-left: 3px solid #e0a000; }""")


def _loss_sections(loss: dict) -> list[str]:
    """The page's first part, metrics.json's `loss`: base and LoRA overall and per bucket, their paired
    difference, inside / outside the edit mask."""
    overall = [["overall", loss["overall"]["n"], loss["overall"]["base"], loss["overall"]["lora"],
                loss["overall"]["lora"] - loss["overall"]["base"]]]
    buckets = [[b, v["n"], v["base"], v["lora"], v["lora"] - v["base"]] for b, v in loss["per_bucket"].items()]
    sections = [
        "<h2>Held-out flow-matching loss (val split)</h2>",
        f"<p>{html.escape(loss['protocol'])}</p>",
        _table(["bucket (h×w)", "samples", "base", "LoRA", "LoRA − base"], overall + buckets),
    ]
    diff = loss.get("lora_minus_base")
    if diff:  # stages/evaluate/paired.py
        from stages.evaluate.paired import signed

        sections.append(f"<p>LoRA − base, paired over the {diff['n']} val samples (same noise and σ): "
                        f"{html.escape(signed(diff))} (± standard error); within about two standard errors the "
                        "held-out set does not tell them apart.</p>")
    mask = loss.get("mask")
    if mask:
        sections += [
            "<h3>Inside / outside the edit mask</h3>",
            f"<p>{html.escape(mask['note'])}</p>",
            _table(["region", "samples", "base", "LoRA", "LoRA − base"],
                   [[r, mask[r]["n"], mask[r]["base"], mask[r]["lora"], mask[r]["lora"] - mask[r]["base"]]
                    for r in ("inside", "outside")]),
        ]
    return sections


def _samples(gen: dict, rows: list[SampleRow], grid: Image.Image) -> list[str]:
    """The page's second part: each pictured sample's controls, target, base and LoRA outputs with their PSNR /
    SSIM, the generation settings (`gen`, metrics.json's `generation`) and means, and the grid of all."""
    n_controls = max(len(r.controls) for r in rows)
    headers = ["sample", "instruction"] + [f"control {i + 1}" for i in range(n_controls)] + \
        ["target", "base", "LoRA", "PSNR dB (base / LoRA)", "SSIM (base / LoRA)"]
    body = []
    for r in rows:
        cells = [f"<td><code>{html.escape(r.title)}</code></td>", f"<td class='caption'>{html.escape(r.caption)}</td>"]
        cells += [_img(c, f"control {i + 1}") for i, c in enumerate(r.controls)]
        cells += ["<td class='empty'>–</td>"] * (n_controls - len(r.controls))
        cells += [_img(r.target, "target"), _img(r.base, "base output"), _img(r.lora, "LoRA output")]
        s = r.scores
        for m in ("psnr", "ssim"):
            pair = f"{_fmt(s.get(m + '_base', math.nan))} / {_fmt(s.get(m + '_lora', math.nan))}"
            cells.append(f"<td class='score'>{pair}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    return [
        "<h2>Samples</h2>",
        f"<p>{html.escape(gen.get('settings', ''))}</p>",
        f"<p class='note'>{html.escape(gen.get('note', ''))}</p>",
        f"<p class='means'>{html.escape(mean_line(gen))}</p>",
        f"<table class='samples'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>",
        "<h2>Grid</h2>",
        f"<img class='grid' src='{data_uri(grid)}' alt='grid of all samples'>",
    ]


_CSS = """body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; }
table { border-collapse: collapse; margin: 8px 0 16px; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: center; vertical-align: middle; }
th { background: #f3f3f3; }
td img { display: block; margin: auto; image-rendering: pixelated; }
td.caption { max-width: 180px; text-align: left; }
img.grid { max-width: 100%; image-rendering: pixelated; }
p.trained-val { color: #8a1f11; background: #fdecea; padding: 6px 10px; border-left: 3px solid #d93025; }"""


def page(title: str, sections: list[str], metrics: dict, extra_css: str = "") -> str:
    """One self-contained report page (no script): a warning of val samples the run trained on first (its held-out
    loss is not held out: stages/evaluate/trained_val.py; one per training), the sections, then the run record."""
    from stages.evaluate.trained_val import recorded_warnings

    warnings = recorded_warnings(metrics)
    sections = ([f"<p class='trained-val'>{html.escape(w)}</p>" for w in warnings] + sections
                + ["<h2>Run</h2>", f"<pre>{html.escape(json.dumps(metrics.get('run', {}), indent=2))}</pre>"])
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
{_CSS}{extra_css}
</style></head>
<body>
<h1>{title}</h1>
{''.join(sections)}
</body></html>
"""


def _json_safe(v: Any) -> Any:
    """NaN / inf are not JSON: write them as null (strict readers such as `jq` reject NaN)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


def write_report(out: str | Path, metrics: dict, rows: list[SampleRow]) -> Path:
    """Write metrics.json, grid.png and index.html into OUT; returns the page's path."""
    grid = make_grid(rows)
    return write_report_files(out, metrics, grid, render_html(metrics, rows, grid))


def write_report_files(out: str | Path, metrics: dict, grid: Image.Image, page: str) -> Path:
    """grid.png, index.html, then metrics.json: its presence means the report is complete. An earlier report's
    metrics.json is removed first (the removal made durable): a run killed, or out of disk, between the files
    leaves no report, never the earlier settings' metrics.json - "up to date" to a rerun of them - beside this
    run's page."""
    from schemas.atomic_write import fsync_dir
    from store.checksum import seal
    from store.format import atomic_write_bytes
    from store.io_errors import writing

    out = Path(out)
    buf = io.BytesIO()
    grid.save(buf, format="PNG")
    with writing("the evaluate report", out):
        out.mkdir(parents=True, exist_ok=True)
        try:
            (out / "metrics.json").unlink()
            fsync_dir(out)
        except FileNotFoundError:
            pass
        atomic_write_bytes(out / "grid.png", buf.getvalue())
        atomic_write_bytes(out / "index.html", page.encode("utf-8"))
        atomic_write_bytes(out / "metrics.json", seal(_json_safe(metrics)))
    return out / "index.html"


def _load_metrics(path: Path) -> Any:
    """PATH's object, checked against the checksum `write_report_files` sealed into it (a report from before it
    was sealed: plain JSON); SealError when damaged, OSError / ValueError when unreadable."""
    from store.checksum import is_sealed, unseal

    data = path.read_bytes()
    return unseal(data) if is_sealed(data) else json.loads(data)


def read_metrics(out: str | Path, say: bool = True) -> Any:
    """REPORT/metrics.json's object, checked (`_load_metrics`), for a caller that rebuilds what a damaged report
    held: the up-to-date checks read the report's numbers and best checkpoint from it (a flipped bit there passed
    as "up to date" and was printed). A damaged file is read as no report (None), and said in one line (`say`:
    by a caller where the report is written, a single-LoRA evaluate or rank 0 of --all-checkpoints, `Ranks.main`;
    each check reads it once, `report_metrics`), so the rerun writes the report again (from its loss array); an
    unreadable or missing one is None too."""
    from store.checksum import SealError

    path = Path(out) / "metrics.json"
    try:
        return _load_metrics(path)
    except SealError as e:
        if say:
            tqdm.write(f"{path} is damaged ({e}): the report is written again")
    except (OSError, ValueError):
        pass
    return None


def report_metrics(out: str | Path) -> Any:
    """OUT's metrics.json as an up-to-date check reads it, once (`read_metrics`, a damaged one said; None: none).
    The check passes it to all that it takes from it; whether the report is whole (`report_whole`) is its own."""
    return read_metrics(out) if (Path(out) / "metrics.json").is_file() else None


def report_whole(out: str | Path) -> bool:
    """Are metrics.json and index.html both in OUT (metrics.json is written last: a report is whole or absent)?"""
    return (Path(out) / "metrics.json").is_file() and (Path(out) / "index.html").is_file()


def checked_metrics(out: str | Path, rerun: str, missing_ok: bool = False) -> dict | None:
    """REPORT/metrics.json's object for a caller that takes its numbers as they are (`pipeline compare`, `run
    all`'s closing line): a damaged, unreadable or missing one (None where `missing_ok`) is refused in one line
    naming the file and `rerun`, the command that writes it again."""
    from schemas.errors import UserError
    from store.checksum import SealError

    path = Path(out) / "metrics.json"
    if missing_ok and not path.exists():
        return None
    try:
        metrics = _load_metrics(path)
    except SealError as e:
        raise UserError(f"{path} is damaged ({e}): its numbers cannot be trusted; {rerun} to write the report "
                        "again") from None
    except FileNotFoundError:
        raise UserError(f"{path} is missing: {rerun} to write the report") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{path} cannot be read ({e}); {rerun} to write the report again") from None
    if not isinstance(metrics, dict):
        raise UserError(f"{path} is not a report's metrics (no JSON object); {rerun} to write the report again")
    return metrics
