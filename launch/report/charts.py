"""Inline SVG charts for the report: a line chart of series over steps and a grouped bar chart;
no JavaScript, nothing loaded from the network."""

from __future__ import annotations

import html
from collections.abc import Sequence

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")


def _nice(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 1:
        return f"{v:.2f}".rstrip("0").rstrip(".")
    return f"{v:.3g}"


def line_chart(
    title: str,
    series: dict[str, list[tuple[float, float]]],
    *,
    xlabel: str = "step",
    width: int = 460,
    height: int = 240,
) -> str:
    """An inline SVG line chart of one or more (x, y) series, with axes, min/max ticks and a
    legend; an empty chart says there is no data."""
    esc = html.escape
    pts = [p for s in series.values() for p in s if p[1] is not None]
    left, right, top, bottom = 56, 12, 28, 36
    w, h = width - left - right, height - top - bottom
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'role="img" aria-label="{esc(title)}" class="chart">',
        f'<text x="{width / 2}" y="16" text-anchor="middle" class="ct">{esc(title)}</text>',
    ]
    if not pts:
        parts.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle">no data</text>')
        return "".join(parts) + "</svg>"
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - (abs(y0) * 0.1 or 1), y1 + (abs(y1) * 0.1 or 1)

    def sx(x):
        return left + (x - x0) / (x1 - x0) * w

    def sy(y):
        return top + h - (y - y0) / (y1 - y0) * h

    parts.append(f'<rect x="{left}" y="{top}" width="{w}" height="{h}" class="frame"/>')
    for y in (y0, (y0 + y1) / 2, y1):
        parts.append(
            f'<line x1="{left}" x2="{left + w}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" '
            f'class="grid"/><text x="{left - 4}" y="{sy(y) + 4:.1f}" '
            f'text-anchor="end">{_nice(y)}</text>'
        )
    for x in (x0, x1):
        parts.append(
            f'<text x="{sx(x):.1f}" y="{top + h + 14}" text-anchor="middle">{_nice(x)}</text>'
        )
    parts.append(
        f'<text x="{left + w / 2}" y="{height - 4}" text-anchor="middle">{esc(xlabel)}</text>'
    )
    for i, (name, s) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        s = [(x, y) for x, y in s if y is not None]
        if not s:
            continue
        d = " ".join(
            f"{'M' if j == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for j, (x, y) in enumerate(s)
        )
        parts.append(f'<path d="{d}" fill="none" stroke="{color}" stroke-width="1.8"/>')
        if len(s) <= 40:
            parts += [
                f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.2" fill="{color}"/>' for x, y in s
            ]
        ly = top + 12 + 14 * i
        parts.append(
            f'<rect x="{left + 8}" y="{ly - 8}" width="10" height="3" fill="{color}"/>'
            f'<text x="{left + 22}" y="{ly - 3}">{esc(name)}</text>'
        )
    return "".join(parts) + "</svg>"


def bar_chart(
    title: str,
    groups: dict[str, dict[str, float | None]],
    *,
    width: int = 460,
    height: int = 240,
    intervals: dict[str, dict[str, Sequence[float]]] | None = None,
) -> str:
    """Grouped bars in [0, 1] (e.g. success by arm, before and after): {group: {bar: value}};
    `intervals` ({group: {bar: [low, high]}}) draws an error bar on a bar (a 95% interval)."""
    esc = html.escape
    left, top, bottom = 40, 28, 40
    w, h = width - left - 12, height - top - bottom
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'role="img" aria-label="{esc(title)}" class="chart">',
        f'<text x="{width / 2}" y="16" text-anchor="middle" class="ct">{esc(title)}</text>',
        f'<rect x="{left}" y="{top}" width="{w}" height="{h}" class="frame"/>',
    ]
    for y in (0.0, 0.5, 1.0):
        yy = top + h - y * h
        parts.append(
            f'<line x1="{left}" x2="{left + w}" y1="{yy}" y2="{yy}" class="grid"/>'
            f'<text x="{left - 4}" y="{yy + 4}" text-anchor="end">'
            f"{y:g}</text>"
        )
    names = list(groups)
    bars = sorted({b for g in groups.values() for b in g}, key=lambda b: (b != "before", b))
    gw = w / max(len(names), 1)
    bw = gw * 0.7 / max(len(bars), 1)
    for gi, name in enumerate(names):
        gx = left + gi * gw + gw * 0.15
        for bi, bar in enumerate(bars):
            v = groups[name].get(bar)
            if v is None:
                continue
            bh = max(0.0, min(1.0, v)) * h
            x = gx + bi * bw
            parts.append(
                f'<rect x="{x:.1f}" y="{top + h - bh:.1f}" width="{bw - 2:.1f}" '
                f'height="{bh:.1f}" fill="{PALETTE[bi % len(PALETTE)]}"/>'
                f'<text x="{x + bw / 2 - 1:.1f}" y="{top + h - bh - 3:.1f}" '
                f'text-anchor="middle" class="small">{v:.2f}</text>'
            )
            ci = (intervals or {}).get(name, {}).get(bar)
            if ci:
                lo, hi = (top + h - max(0.0, min(1.0, c)) * h for c in ci)
                cx = x + bw / 2 - 1
                parts.append(
                    f'<path d="M{cx:.1f} {lo:.1f}V{hi:.1f}M{cx - 4:.1f} {lo:.1f}'
                    f'h8M{cx - 4:.1f} {hi:.1f}h8" class="ci"/>'
                )
        parts.append(
            f'<text x="{left + gi * gw + gw / 2:.1f}" y="{top + h + 14}" '
            f'text-anchor="middle">{esc(name)}</text>'
        )
    for bi, bar in enumerate(bars):
        parts.append(
            f'<rect x="{left + 8 + 90 * bi}" y="{height - 12}" width="10" height="8" '
            f'fill="{PALETTE[bi % len(PALETTE)]}"/><text x="{left + 22 + 90 * bi}" '
            f'y="{height - 4}">{esc(bar)}</text>'
        )
    return "".join(parts) + "</svg>"
