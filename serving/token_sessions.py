"""Sessions kept by the client, for servers that keep none (vLLM): the session API of
`InferenceClient` (`open_session`, `session_generate`, `rewind_session`, `close_session`) over
plain completions.

The client holds each session's tokens and, on every call, sends what the session may see as
one prompt of token ids: everything (`none`), or the prompt and the last `n_protect_turns`
turns (`markovian`, the turns as `serving.compaction` splits them). The server computes each
call afresh; with prefix caching on (vLLM's `--enable-prefix-caching`) and the calls of one
episode routed to one replica (a pool pins an episode's requests, `serving.pool.pinned`), the
part of the prompt the previous call already computed comes from the cache, so an append costs
what the appended tokens cost.

What the server computed is not what simloop's engine computes for a compacted session: kept
turns are recomputed at new positions with the dropped ones out of view. Every call whose
prompt is not the previous call's sequence extended is reported as a context reset
(`raw["context_reset"] = {"start": s, "context": [[a, b], ...]}`, in the session's logical
positions), which the trajectory records (`Trajectory.context_resets`) and training replays
as its own segment of the row, so the trainer's logprobs are the server's.

`turn` and `budget` compaction thin the KV cache itself, which a completions API cannot ask
for: opening such a session is refused (config validation refuses it earlier,
`launch.config.schema.check_session_backends`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from serving.compaction import SessionCompaction, plan_keep, ranges

TOKEN_LEVEL_MODES = ("none", "markovian")
"""Compaction a client-kept session can do: which tokens are re-sent."""


@dataclass
class _Held:
    compaction: SessionCompaction
    ids: list[int] = field(default_factory=list)
    """Every token appended or generated, in order (the session's logical stream)."""
    turn_starts: list[int] = field(default_factory=list)
    """Where each response began (`serving.compaction.plan_keep`'s turns)."""
    sequence: list[int] = field(default_factory=list)
    """Logical positions of the sequence the server last computed (prompt sent + generated)."""


class TokenSessions:
    """Client-kept sessions whose calls are `complete(prompt_ids, **sampling)` (an
    `InferenceClient`'s, which keeps them when `ClientConfig.client_sessions` is on); `error`
    builds its errors (`ClientError(message, status=...)`: 404 for a session it does not hold,
    as a server answers)."""

    def __init__(self, complete: Callable[..., Awaitable[Any]], error: Callable[..., Exception]):
        self._complete, self._error = complete, error
        self._sessions: dict[str, _Held] = {}
        self._ids = itertools.count(1)

    async def open_session(
        self, *, ttl_s: float | None = None, compaction: SessionCompaction | dict | None = None
    ) -> str:
        """A new session's id (`ttl_s` is ignored: nothing is held on the server).
        ValueError for compaction a completions API cannot do (`turn`, `budget`)."""
        if isinstance(compaction, dict):
            compaction = SessionCompaction.from_json(compaction or None)
        compaction = compaction or SessionCompaction()
        if compaction.mode not in TOKEN_LEVEL_MODES:
            raise ValueError(
                f"compaction mode {compaction.mode!r} thins a server's KV cache, which this "
                f"server (vLLM: completions only) does not keep; allowed here "
                f"{list(TOKEN_LEVEL_MODES)} (simloop's engine does all of "
                "none, markovian, turn, budget)"
            )
        sid = f"tok-{next(self._ids)}"
        self._sessions[sid] = _Held(compaction)
        return sid

    def _held(self, session_id: str) -> _Held:
        s = self._sessions.get(session_id)
        if s is None:
            raise self._error(f"no session {session_id!r} (closed or never opened)", status=404)
        return s

    async def session_generate(
        self,
        session_id: str,
        append_token_ids: list[int],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        logprobs: int | None = None,
        stop_token_ids: list[int] | None = None,
        timeout_s: float | None = None,
        rewind_to: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Any:
        """Append and generate: one completion of what the session may see. The session
        changes only when the completion succeeded, so a failed call leaves nothing to rewind
        (`rewind_to`, when given, must be the session's length)."""
        s = self._held(session_id)
        if rewind_to is not None and rewind_to != len(s.ids):
            self._rewind(s, rewind_to)
        tokens = [*s.ids, *append_token_ids]
        end = len(tokens)
        keep = plan_keep(s.compaction, range(end), s.turn_starts, end, compacted=set())
        out = await self._complete(
            [tokens[p] for p in keep],
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            logprobs=logprobs,
            stop_token_ids=stop_token_ids,
            timeout_s=timeout_s,
            extra=extra,
        )
        raw = dict(out.raw) if isinstance(out.raw, dict) else {}
        extends = s.sequence + list(range(s.sequence[-1] + 1 if s.sequence else 0, end))
        if keep != extends:
            raw["context_reset"] = {"start": end, "context": ranges(keep)}
        raw["session_context"] = ranges(keep)
        s.ids = tokens + list(out.token_ids)
        s.turn_starts.append(end)
        s.sequence = keep + list(range(end, len(s.ids)))
        return dataclasses.replace(out, raw=raw)

    def _rewind(self, s: _Held, to: int) -> None:
        if not 0 <= to <= len(s.ids):
            raise self._error(f"rewind to {to}: the session holds {len(s.ids)} tokens", status=400)
        s.ids = s.ids[:to]
        s.turn_starts = [t for t in s.turn_starts if t < to]
        s.sequence = [p for p in s.sequence if p < to]

    async def rewind_session(self, session_id: str, to: int) -> dict[str, Any]:
        s = self._held(session_id)
        self._rewind(s, to)
        return {"id": session_id, "length": len(s.ids)}

    async def close_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
