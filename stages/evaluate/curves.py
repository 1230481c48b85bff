"""Loss-vs-step charts as inline SVG: lines per series, dashed reference lines (the base), a marked best point;
and the one rule that picks the best point (the report's and `pipeline compare`'s).

Written by hand because the page must stay one self-contained file with no script and no plotting dependency:
an SVG of a few polylines is ~80 lines, opens anywhere, and its text (axis values, legend) is searchable.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f"]
W, H = 560, 260
LEFT, RIGHT, TOP, BOTTOM = 64, 150, 24, 36


@dataclass
class Series:
    label: str
    steps: list[int]
    values: list[float]
    reference: float | None = None  # drawn as a dashed horizontal line in the series' colour (e.g. the base)
    best: int | None = None  # the step to mark with a circle


@dataclass
class Chart:
    title: str
    series: list[Series] = field(default_factory=list)


def _finite(xs) -> list[float]:
    return [x for x in xs if x is not None and math.isfinite(x)]


def _ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    return [lo + (hi - lo) * i / n for i in range(n + 1)]


def svg(chart: Chart) -> str:
    """One chart; an empty one (no finite value) says so instead of drawing axes."""
    ys = _finite([v for s in chart.series for v in s.values] + [s.reference for s in chart.series])
    xs = [x for s in chart.series for x in s.steps]
    title = f"<text x='{LEFT}' y='16' font-weight='bold'>{html.escape(chart.title)}</text>"
    if not ys or not xs:
        return f"<svg xmlns='http://www.w3.org/2000/svg' width='{W}' height='40'>{title}</svg>"
    y0, y1 = min(ys), max(ys)
    pad = (y1 - y0) * 0.08 or abs(y1) * 0.05 or 1.0
    y0, y1 = y0 - pad, y1 + pad
    x0, x1 = min(xs), max(xs)
    if x0 == x1:
        x0, x1 = x0 - 1, x1 + 1
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        return TOP + (y1 - y) / (y1 - y0) * ph

    parts = [title, f"<rect x='{LEFT}' y='{TOP}' width='{pw}' height='{ph}' fill='none' stroke='#999'/>"]
    for t in _ticks(y0, y1):
        parts.append(f"<text x='{LEFT - 4}' y='{py(t) + 4:.1f}' text-anchor='end' font-size='10'>{t:.4g}</text>")
    for t in sorted(set(xs)) if len(set(xs)) <= 8 else _ticks(x0, x1):
        parts.append(f"<text x='{px(t):.1f}' y='{TOP + ph + 14}' text-anchor='middle' font-size='10'>{t:.0f}</text>")
    parts.append(f"<text x='{LEFT + pw / 2}' y='{H - 4}' text-anchor='middle' font-size='11'>checkpoint step</text>")
    for i, s in enumerate(chart.series):
        color = COLORS[i % len(COLORS)]
        pts = [(px(x), py(y)) for x, y in zip(s.steps, s.values) if y is not None and math.isfinite(y)]
        if s.reference is not None and math.isfinite(s.reference):
            y = py(s.reference)
            parts.append(f"<line x1='{LEFT}' x2='{LEFT + pw}' y1='{y:.1f}' y2='{y:.1f}' stroke='{color}' "
                         "stroke-dasharray='5,4' stroke-width='1.2'/>")
        if pts:
            parts.append(f"<polyline fill='none' stroke='{color}' stroke-width='2' points='"
                         + " ".join(f"{x:.1f},{y:.1f}" for x, y in pts) + "'/>")
            parts += [f"<circle cx='{x:.1f}' cy='{y:.1f}' r='2.5' fill='{color}'/>" for x, y in pts]
        if s.best is not None and s.best in s.steps:
            v = s.values[s.steps.index(s.best)]
            if v is not None and math.isfinite(v):
                parts.append(f"<circle class='best' cx='{px(s.best):.1f}' cy='{py(v):.1f}' r='7' fill='none' "
                             f"stroke='{color}' stroke-width='2.5'><title>best: step {s.best}, {v:.5g}</title></circle>")
        ly = TOP + 12 + 16 * i
        parts.append(f"<line x1='{W - RIGHT + 10}' x2='{W - RIGHT + 28}' y1='{ly - 4}' y2='{ly - 4}' stroke='{color}' "
                     "stroke-width='2'/>")
        parts.append(f"<text x='{W - RIGHT + 32}' y='{ly}' font-size='11'>{html.escape(s.label)}</text>")
    if any(s.reference is not None for s in chart.series):
        ly = TOP + 12 + 16 * len(chart.series)
        parts.append(f"<text x='{W - RIGHT + 10}' y='{ly}' font-size='10' fill='#555'>dashed: base (no LoRA)</text>")
    if any(s.best is not None for s in chart.series):
        ly = TOP + 28 + 16 * len(chart.series)
        parts.append(f"<text x='{W - RIGHT + 10}' y='{ly}' font-size='10' fill='#555'>ring: best checkpoint</text>")
    return (f"<svg class='curve' xmlns='http://www.w3.org/2000/svg' width='{W}' height='{H}' "
            f"font-family='system-ui, sans-serif'>{''.join(parts)}</svg>")


def pick_best(steps: list[int], overall: list[float]) -> int | None:
    """Index of the lowest finite held-out loss; a tie goes to the earlier step."""
    best = None
    for i in sorted(range(len(steps)), key=lambda i: steps[i]):
        if math.isfinite(overall[i]) and (best is None or overall[i] < overall[best]):
            best = i
    return best
