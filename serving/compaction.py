"""KV compaction of persistent sessions: the wire settings and which keys a session keeps.

A session's logical stream is split into a *prompt* (everything before its first generated
token) and *turns*: turn k is the k-th response plus whatever was appended after it, up to the
next response (for an agent: its command and the observation that followed; for a simulator:
its observation and the next command). Compaction runs when a call arrives, before its
appended tokens are prefilled, so the response that just ended (whose last token is not in
the KV yet) and the new append are the latest turn:

- `none`: every key is kept (the session is a plain KV cache);
- `markovian`: only the prompt and the last `n_protect_turns` turns are kept; older turns are
  deleted outright;
- `turn`: a turn that leaves the protected window keeps the `keep_ratio` share of its keys that
  the latest response's tokens attended to most (summed over layers, heads and those tokens;
  ties go to the later key), once; an empty latest response (only its end token) gives no
  scores, and the latest keys of the turn are kept;
- `budget`: nothing is touched until the call would hold more than `kv_budget` keys (what is
  held, plus the append, plus `max_tokens`); then whole turns are deleted, oldest first, until
  it fits or only the prompt and the protected turns are left.

Kept keys keep the positions (RoPE) they were computed at and new tokens keep counting from the
session's logical length, so what a token saw is fully described by the kept positions at the
time (`rl.model.transformer.KVVisibility` replays exactly that in training).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from rl import validate

MODES = ("none", "markovian", "turn", "budget")


@dataclass(frozen=True)
class SessionCompaction:
    """`{"mode": ..., "n_protect_turns"?, "keep_ratio"?, "kv_budget"?}` of `POST /v1/sessions`."""

    mode: str = "none"
    n_protect_turns: int = 1
    """The latest turns every mode keeps whole (at least 1: the turn being appended to)."""
    keep_ratio: float = 0.5
    """`turn`: the share of an older turn's keys kept, in (0, 1]."""
    kv_budget: int | None = None
    """`budget`: the most keys a call may hold (required for that mode)."""

    def __post_init__(self) -> None:
        # Named as the request's JSON object names it (`compaction`), not by this class.
        where = "compaction"
        validate.one_of(self, "mode", MODES, owner=where)
        validate.integer(self, "n_protect_turns", low=1, owner=where)
        validate.number(self, "keep_ratio", low=0, high=1, low_open=True, owner=where)
        validate.integer(
            self,
            "kv_budget",
            low=1,
            optional=True,
            allowed="an integer >= 1 (keys a call may hold)",
            owner=where,
        )
        validate.require(
            self.mode != "budget" or self.kv_budget is not None,
            self,
            "kv_budget",
            "required by mode 'budget': the most keys a call may hold",
            owner=where,
        )

    @classmethod
    def from_json(cls, obj: object) -> SessionCompaction:
        """From the request's `compaction` object (None: `none`); ValueError names the field."""
        if obj is None:
            return cls()
        if not isinstance(obj, dict):
            raise ValueError(
                f'compaction must be an object like {{"mode": "markovian"}}, got '
                f"{type(obj).__name__}"
            )
        unknown = sorted(set(obj) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"compaction has unknown field(s) {unknown}: allowed "
                f"{list(cls.__dataclass_fields__)}"
            )
        return cls(**obj)

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def turn_spans(turn_starts: Sequence[int], end: int) -> list[tuple[int, int]]:
    """Logical `[start, stop)` of every turn, the last one running to `end`."""
    bounds = [*turn_starts, end]
    return [(bounds[i], bounds[i + 1]) for i in range(len(turn_starts))]


def plan_keep(
    cfg: SessionCompaction,
    held: Sequence[int],
    turn_starts: Sequence[int],
    end: int,
    *,
    compacted: set[int],
    mass: Sequence[float] | None = None,
    incoming: int = 0,
) -> list[int]:
    """The logical positions to keep, a subsequence of `held` (the positions the KV holds, in
    order). `turn_starts[k]` is where turn k begins (its response's first token); `end` is the
    session's length with the new append. `compacted` (updated in place) lists the turns `turn`
    mode has already thinned; `mass[i]` scores `held[i]` (`turn`); `incoming` is what this call
    will add (`budget`: the append's unheld tokens plus `max_tokens`)."""
    if cfg.mode == "none" or not turn_starts:
        return list(held)
    spans = turn_spans(turn_starts, end)
    protected_from = spans[max(len(spans) - cfg.n_protect_turns, 0)][0]
    older = [k for k, (_, stop) in enumerate(spans) if stop <= protected_from]
    if cfg.mode == "markovian":
        first = turn_starts[0]
        return [p for p in held if p < first or p >= protected_from]
    if cfg.mode == "budget":
        keep = list(held)
        for k in older:
            if len(keep) + incoming <= cfg.kv_budget:
                break
            lo, hi = spans[k]
            keep = [p for p in keep if not lo <= p < hi]
        return keep
    # turn: each older turn is thinned once, to the keys the latest response attended to most
    score = dict(zip(held, mass, strict=True)) if mass is not None else {}
    drop: set[int] = set()
    for k in older:
        if k in compacted:
            continue
        compacted.add(k)
        lo, hi = spans[k]
        mine = [p for p in held if lo <= p < hi]
        n_keep = math.ceil(cfg.keep_ratio * (hi - lo))
        if len(mine) <= n_keep:
            continue
        ranked = sorted(mine, key=lambda p: (score.get(p, 0.0), p), reverse=True)
        drop.update(ranked[n_keep:])
    return [p for p in held if p not in drop]


def ranges(positions: Sequence[int]) -> list[list[int]]:
    """Sorted positions as half-open `[start, stop)` runs: `[0, 1, 2, 5]` -> `[[0, 3], [5, 6]]`."""
    out: list[list[int]] = []
    for p in positions:
        if out and out[-1][1] == p:
            out[-1][1] = p + 1
        else:
            out.append([p, p + 1])
    return out
