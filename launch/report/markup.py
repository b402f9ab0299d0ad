"""The report's HTML building blocks, shared by its pages (`page.py`, `gating.py`): the inline
style sheet, the document around a page's body, and the escaped pieces a section is made of
(values, tables, notes on missing data, preformatted text, intervals)."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;
max-width:1100px;color:#222;line-height:1.45;padding:0 16px}
h1{margin-bottom:4px} h2{border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:32px}
table{border-collapse:collapse;margin:8px 0 16px} td,th{border:1px solid #ddd;padding:4px 8px;
text-align:right;font-variant-numeric:tabular-nums} th{background:#f5f5f5}
td:first-child,th:first-child{text-align:left}
.chart{margin:6px 12px 6px 0;font-size:11px;font-family:inherit} .chart .ct{font-size:13px;
font-weight:600} .chart .frame{fill:none;stroke:#999} .chart .grid{stroke:#eee}
.chart .ci{stroke:#222;stroke-width:1.5;fill:none} .chart .small{font-size:10px}
.charts{display:flex;flex-wrap:wrap}
.note{color:#555;font-size:14px} .missing{color:#a33}
pre{background:#f7f7f7;border:1px solid #e3e3e3;padding:6px;margin:0;white-space:pre-wrap;
word-break:break-all;font-size:12px;max-height:220px;overflow:auto}
.side{display:grid;grid-template-columns:1fr 1fr 1fr;gap:8px;margin:10px 0 18px}
.side h4{margin:0 0 4px;font-size:13px} .ok{color:#1a7f37} .bad{color:#b42318}
"""


def document(title: str, body: str) -> str:
    """A whole self-contained page: the style inline, nothing loaded from the network."""
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>{body}</body></html>"
    )


def fmt(v: Any, digits: int = 3) -> str:
    """A value as the page shows it: – for none, yes/no, floats to `digits`, text escaped."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return html.escape(str(v))


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A table: the header escaped, each cell as `fmt` shows it."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{fmt(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def missing(what: str, how: str) -> str:
    """What a section lacks and what would write it."""
    return (
        f'<p class="missing">No {html.escape(what)} in this run directory ({html.escape(how)}).</p>'
    )


def pre_block(text: str | None) -> str:
    """Text as written (a command, an observation), escaped."""
    return f"<pre>{html.escape(text if text is not None else '(none)')}</pre>"


def interval(v: Any) -> str:
    """A [low, high] pair as `[0.123, 0.456]`; – for anything else."""
    return f"[{v[0]:.3f}, {v[1]:.3f}]" if isinstance(v, list | tuple) and len(v) == 2 else "–"
