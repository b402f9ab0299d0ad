"""The one shape every bench reports in: rows of (measure, ours, peer, ratio, target, unit),
printed as a table and, with `--json PATH`, written as `{"bench", "commit", "rows", "detail"}`
so that runs can be tracked and compared across commits. Benches import it by name (bench/ is
on sys.path when one runs as a script)."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

RATIO_OF = ("ours/peer", "peer/ours")
ROW_KEYS = ("measure", "ours", "peer", "ratio", "ratio_of", "target", "unit")


@dataclass(frozen=True)
class Row:
    measure: str
    """What is measured, with its setting (e.g. "decode tokens/s vs HF generate, tiny B=8")."""
    ours: float | None
    peer: float | None
    """The same measure of the peer in the same run; None where the bench has no peer."""
    unit: str
    """Unit of `ours` and `peer` (e.g. "tokens/s", "s", "ms")."""
    target: float | str | None = None
    """The target, on `ratio` (">= 3x") or on `ours` ("< 0.2 ms"); None where only reported."""
    ratio_of: str = "ours/peer"
    """Which quotient `ratio` is: "ours/peer" (e.g. tokens/s) or "peer/ours" (e.g. seconds, so
    that a speed-up reads as a ratio above 1)."""

    def __post_init__(self):
        if self.ratio_of not in RATIO_OF:
            raise ValueError(f"Row.ratio_of={self.ratio_of!r} is invalid: one of {RATIO_OF}")

    @property
    def ratio(self) -> float | None:
        """`ratio_of` of the two numbers; None without a peer or where it divides by zero."""
        num, den = (
            (self.ours, self.peer) if self.ratio_of == "ours/peer" else (self.peer, self.ours)
        )
        if num is None or den is None or den == 0:
            return None
        return _finite(num / den)

    def as_json(self) -> dict[str, Any]:
        """The row's JSON object: ROW_KEYS, non-finite numbers as null."""
        return dict(
            measure=self.measure,
            ours=_finite(self.ours),
            peer=_finite(self.peer),
            ratio=self.ratio,
            ratio_of=self.ratio_of,
            target=_finite(self.target),
            unit=self.unit,
        )


def _finite(x):
    """JSON has no inf/nan: a non-finite number becomes null."""
    return None if isinstance(x, float) and not math.isfinite(x) else x


def json_path(value: str) -> Path:
    """argparse type of `--json PATH`: the file's folder must exist, checked before the bench
    runs (not after minutes of measuring)."""
    path = Path(value)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{value!r} is a directory: give a file path")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(
            f"{value!r}: folder {str(path.parent)!r} does not exist (create it first)"
        )
    return path


def positive(value: str) -> int:
    """argparse type: an integer >= 1, else the flag's error naming the value."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is invalid: a positive integer")
    return n


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        type=json_path,
        metavar="PATH",
        help="also write the rows (measure, ours, peer, ratio, target, unit) "
        "and the run's details here as JSON",
    )


def _commit() -> str | None:
    """The checkout's commit (None outside a git checkout), so runs compare across commits."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def write_json(path: Path, bench: str, rows: list[Row], detail: Any = None) -> dict:
    """Write (and return) the bench's document: its rows in the common shape, the bench's own
    numbers under "detail"."""
    doc = {
        "bench": bench,
        "commit": _commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpus": os.cpu_count(),
        "argv": sys.argv[1:],
        "rows": [r.as_json() for r in rows],
        "detail": detail,
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def _cell(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def table(title: str, rows: list[Row]) -> Table:
    """The rows as a rich table (the same rows `write_json` writes)."""
    out = Table(title=title)
    for col in ("measure", "unit", "ours", "peer", "ratio", "target"):
        out.add_column(col, justify="left" if col == "measure" else "right")
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}x"
        out.add_row(r.measure, r.unit, _cell(r.ours), _cell(r.peer), ratio, _cell(r.target))
    return out
