"""Simulator fidelity: simulated vs real observation metrics, and hygiene of single observations.

Pair metrics (`compare_observations`): exact match, exact match after masking volatile content
(timestamps, PIDs, hex addresses, durations, temp names), return-code agreement, length ratio
and a similarity score in [0, 1]. Hygiene (`observation_hygiene`): cap hit (runaway), think
leak, repetition loop, empty. `summarize_pairs` / `summarize_hygiene` aggregate, and
`summarize_by` splits by a key such as context length (fidelity degrades past the simulator's
training length). `suggest_max_tokens` picks the simulator's token cap from real lengths.
"""

from __future__ import annotations

import difflib
import math
import re
import statistics
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from rl.data.tokenizer import END_THINK, THINK

_MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)"
_DAY = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)"
# Order matters: whole timestamps before their parts, addresses before bare hex.
VOLATILE_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(
            r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?"
        ),
        "<TIME>",
    ),
    (
        re.compile(
            rf"(?:{_DAY},? )?{_MONTH} +\d{{1,2}}(?:,? \d{{4}})?"
            r" +(?:\d{1,2}:\d{2}(?::\d{2})?|\d{4})\b"
        ),
        "<TIME>",
    ),
    (re.compile(r"\b\d{1,2}:\d{2}:\d{2}(?:\.\d+)?\b"), "<TIME>"),
    (re.compile(r"\b\d{4}-\d{2}-\d{2}\b"), "<DATE>"),
    # 8+ digits: pointers (0x7ffd5c3a1b20), not the short constants code prints (0x110000).
    (re.compile(r"\b0x[0-9a-fA-F]{8,}\b"), "<ADDR>"),
    (re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,64}\b"), "<HEX>"),
    (re.compile(r"\b\d+m\d+(?:\.\d+)?s\b"), "<DUR>"),
    (
        re.compile(r"\b\d+(?:\.\d+)?\s?(?:ns|us|µs|ms|s|sec|secs|seconds|minutes|mins)\b(?![-\w])"),
        "<DUR>",
    ),
    (re.compile(r"\b(pid|PID|process|Process)(\s*[:=#]?\s*)\d+\b"), r"\1\2<PID>"),
    (re.compile(r"^\[\d+\]\s+\d+$", re.M), "[<JOB>] <PID>"),
    (re.compile(r"/tmp/tmp[\w.-]+"), "/tmp/<TMP>"),
)


def mask_volatile(text: str) -> str:
    """`text` with content that differs between identical runs replaced by placeholders."""
    for pattern, repl in VOLATILE_PATTERNS:
        text = pattern.sub(repl, text)
    return text


# Words, each carrying the line break that follows it: layout counts, but two unrelated
# outputs do not look alike merely for having many lines.
_TOKEN = re.compile(r"\S+\n?")
_MAX_TOKENS = 1000  # SequenceMatcher is quadratic; head + tail of long outputs suffice


def _tokens(text: str) -> list[str]:
    toks = _TOKEN.findall(text)
    if len(toks) > _MAX_TOKENS:
        half = _MAX_TOKENS // 2
        toks = toks[:half] + ["<CUT>"] + toks[-half:]
    return toks


def similarity(a: str, b: str) -> float:
    """Token-level similarity in [0, 1] (difflib ratio over words, a word ending a line
    differing from the same word mid-line); 1.0 for two blank texts."""
    ta, tb = _tokens(a), _tokens(b)
    if not ta and not tb:
        return 1.0
    return difflib.SequenceMatcher(None, ta, tb, autojunk=False).ratio()


@dataclass(frozen=True)
class PairMetrics:
    """One simulated observation against the real one for the same command and history."""

    exact: bool
    exact_masked: bool
    exit_code_match: bool | None
    """None when either exit code is unknown."""
    length_ratio: float
    """(len(sim) + 1) / (len(real) + 1), in characters."""
    similarity: float
    """`similarity` of the masked outputs."""


def compare_observations(
    sim_output: str,
    real_output: str,
    sim_exit_code: int | None = None,
    real_exit_code: int | None = None,
) -> PairMetrics:
    sim_masked, real_masked = mask_volatile(sim_output), mask_volatile(real_output)
    known = sim_exit_code is not None and real_exit_code is not None
    return PairMetrics(
        exact=sim_output == real_output,
        exact_masked=sim_masked.strip() == real_masked.strip(),
        exit_code_match=(sim_exit_code == real_exit_code) if known else None,
        length_ratio=(len(sim_output) + 1) / (len(real_output) + 1),
        similarity=similarity(sim_masked, real_masked),
    )


def summarize_pairs(metrics: Sequence[PairMetrics]) -> dict[str, float]:
    """Rates and means over pairs; the length ratio as a geometric mean (over- and
    under-length weigh alike)."""
    if not metrics:
        return {"count": 0}
    rc = [m.exit_code_match for m in metrics if m.exit_code_match is not None]
    out = {
        "count": len(metrics),
        "exact": statistics.fmean(m.exact for m in metrics),
        "exact_masked": statistics.fmean(m.exact_masked for m in metrics),
        "length_ratio_geomean": math.exp(
            statistics.fmean(math.log(m.length_ratio) for m in metrics)
        ),
        "similarity": statistics.fmean(m.similarity for m in metrics),
        "similarity_median": statistics.median(m.similarity for m in metrics),
    }
    if rc:
        out["exit_code_agreement"] = statistics.fmean(rc)
    return out


def summarize_by(
    keyed: Iterable[tuple[int, PairMetrics]], edges: Sequence[int]
) -> dict[str, dict[str, float]]:
    """`summarize_pairs` per bucket of an integer key (e.g. prompt tokens): buckets are
    [0, e0), [e0, e1), ..., [e_last, inf)."""
    bounds = [0, *edges, None]
    names = [
        f"{lo}-{'inf' if hi is None else hi}"
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    buckets: dict[str, list[PairMetrics]] = {}
    for key, m in keyed:
        for name, lo, hi in zip(names, bounds[:-1], bounds[1:], strict=True):
            if key >= lo and (hi is None or key < hi):
                buckets.setdefault(name, []).append(m)
                break
    return {name: summarize_pairs(buckets[name]) for name in names if name in buckets}


def line_share(text: str) -> tuple[float, int]:
    """(share of the most common non-blank line among non-blank lines, number of them)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return 0.0, 0
    return Counter(lines).most_common(1)[0][1] / len(lines), len(lines)


def compression_ratio(text: str) -> float:
    """zlib-compressed size / raw size (low: repetitive); 1.0 for empty text."""
    raw = text.encode("utf-8", errors="replace")
    return len(zlib.compress(raw, 6)) / len(raw) if raw else 1.0


def is_repetitive(
    text: str,
    *,
    max_line_share: float = 0.5,
    min_lines: int = 8,
    min_compression: float = 0.08,
    min_bytes: int = 512,
) -> bool:
    """A repetition loop: one line is most of many lines, or a long text compresses too well."""
    share, n = line_share(text)
    if n >= min_lines and share > max_line_share:
        return True
    return len(text) >= min_bytes and compression_ratio(text) < min_compression


def suggest_max_tokens(
    lengths: Sequence[int], *, quantile: float = 0.99, slack: float = 1.25, minimum: int = 32
) -> int:
    """A simulator `max_tokens` near the real observation lengths (in tokens): the `quantile`
    times `slack`. Far above it, a runaway costs much; far below, real outputs get cut."""
    if not lengths:
        raise ValueError("suggest_max_tokens needs at least one observation length")
    if not 0 < quantile <= 1:
        raise ValueError(f"quantile={quantile!r} is invalid: a number in (0, 1]")
    ordered = sorted(lengths)
    at = ordered[min(len(ordered) - 1, math.ceil(quantile * len(ordered)) - 1)]
    return max(minimum, math.ceil(at * slack))


@dataclass(frozen=True)
class Hygiene:
    """Pathologies of one observation (simulated, or real for reference rates)."""

    cap_hit: bool
    """Generation stopped at max_tokens instead of end-of-turn (runaway)."""
    think_leak: bool
    """Reasoning tags appeared in the observation."""
    repetition: bool
    empty: bool
    """No text at all (the simulator's format always has some)."""


def observation_hygiene(
    text: str, *, finish_reason: str | None = None, think_leak: bool | None = None, **repetition
) -> Hygiene:
    """Hygiene of raw text; `think_leak` overrides detection when tags were already stripped;
    `repetition` keywords go to `is_repetitive`."""
    return Hygiene(
        cap_hit=finish_reason == "length",
        think_leak=think_leak if think_leak is not None else (THINK in text or END_THINK in text),
        repetition=is_repetitive(text, **repetition),
        empty=not text.strip(),
    )


def summarize_hygiene(items: Sequence[Hygiene]) -> dict[str, float]:
    """Rate of each pathology."""
    if not items:
        return {"count": 0}
    rates = {k: statistics.fmean(asdict(h)[k] for h in items) for k in asdict(items[0])}
    return {"count": len(items), **rates}
