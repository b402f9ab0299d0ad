"""Persistent KV sessions of the engine, with compaction (`serving.compaction`).

A session pins a slot to a caller between calls: its KV stays there (no other request takes
the slot over or evicts it), each call prefills only what was appended since, and steps of
different sessions decode in the same device steps as everything else. A session loses its
slot only when it is closed, idles past its TTL, or when a request finds no free slot and it
is the least recently used idle session (memory pressure); its next call is then refused with
the reason.

What a session's slot holds is `kept` (logical positions surviving the last compaction, all
before `tail_start`) followed by every token from `tail_start` on that has been written; the
slot's cache index of a new token plus `shift` is its logical position. Each compaction starts
a new *epoch* `(tail_start, kept)`: the tokens of an epoch saw exactly those keys and their own
run from `tail_start` (`Engine.session_epoch`; the trainer replays it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from serving.compaction import SessionCompaction, plan_keep, ranges
from serving.config import SamplingParams
from serving.engine.errors import EngineBusy, EngineError, SessionError

if TYPE_CHECKING:
    from serving.engine.engine import RequestHandle, _Seq


@dataclass(eq=False)
class Session:
    """A persistent KV session: its logical token stream and the slot that holds its KV."""

    id: str
    ttl_s: float
    compaction: SessionCompaction = field(default_factory=SessionCompaction)
    tokens: list[int] = field(default_factory=list)
    """Everything appended and generated so far (`session_tokens` is its length)."""
    slot: int | None = None
    busy: bool = False
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    gone: str | None = None
    """Why the session can no longer be used (expired, evicted); its next call says so."""
    turn_starts: list[int] = field(default_factory=list)
    """Logical index of each response's first token (turn k starts there)."""
    kept: list[int] = field(default_factory=list)
    """Logical positions the last compaction kept (the slot's first keys)."""
    tail_start: int = 0
    """Logical position of the first key after `kept`; from there on every token is held."""
    compacted: set[int] = field(default_factory=set)
    """Turns `turn` mode has thinned already (each only once)."""
    mass: np.ndarray | None = None
    """`turn` mode: attention mass per held key from the latest response (None: none yet)."""
    scoring: asyncio.Event | None = None
    """Set while the latest response's attention mass is being computed."""
    probes_left: int = 0
    compactions: int = 0
    keys_dropped: int = 0


class SessionsMixin:
    """The session methods of `Engine` (they share its slots, queues and device steps)."""

    # ----- the API ----------------------------------------------------------------------------

    def open_session(
        self, ttl_s: float | None = None, compaction: SessionCompaction | None = None
    ) -> Session:
        """A new, empty session (its slot is taken at its first call). At the limit, sessions
        that expired or were evicted are forgotten first to make room."""
        if len(self.sessions) >= self.cfg.max_sessions:
            self.forget_gone_sessions()
        else:
            self._expire_sessions()
        if len(self.sessions) >= self.cfg.max_sessions:
            raise EngineBusy(f"{len(self.sessions)} sessions are open (the limit is "
                             f"{self.cfg.max_sessions}); close one first")  # fmt: skip
        sid = f"sess-{os.urandom(8).hex()}"
        session = Session(sid, float(ttl_s if ttl_s is not None else self.cfg.session_ttl_s),
                          compaction or SessionCompaction())  # fmt: skip
        self.sessions[sid] = session
        self.stats["sessions_opened"] += 1
        return session

    def forget_gone_sessions(self, session_ids=None) -> int:
        """Forget the sessions (of `session_ids`, else all) that expired or were evicted: they
        are kept only to tell their next call why (409), and that call gets 404 instead.
        Returns how many were forgotten."""
        self._expire_sessions()
        ids = list(self.sessions if session_ids is None else session_ids)
        gone = [sid for sid in ids if sid in self.sessions and self.sessions[sid].gone is not None]
        for sid in gone:
            session = self.sessions.pop(sid)
            if session.scoring is not None:
                session.scoring.set()
        return len(gone)

    def session(self, session_id: str) -> Session:
        """The open session `session_id`; SessionError 404 if unknown, 409 (once, then it is
        forgotten) if it expired or was evicted."""
        self._expire_sessions()
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionError(404, f"session {session_id!r} does not exist (closed, or never "
                               "opened): open a new one", "session_id")  # fmt: skip
        if session.gone is not None:
            del self.sessions[session_id]
            raise SessionError(409, f"session {session_id!r} is gone: {session.gone}; open a "
                               "new one and send its whole context", "session_id")  # fmt: skip
        return session

    async def session_submit(self, session_id: str, append: Sequence[int],
                             params: SamplingParams) -> RequestHandle:  # fmt: skip
        """Append `append` to the session and generate from it: the session is compacted
        first (its mode), then only tokens whose KV the slot does not hold are prefilled.
        One call at a time per session."""
        session = self._idle_session(session_id, "generate")
        if session.scoring is not None:  # `turn`: the last response's scores are on their way
            session.busy = True
            try:
                await session.scoring.wait()
            finally:
                session.busy = False
            session = self._idle_session(session_id, "generate")
        append = [int(t) for t in append]
        if not append and not session.tokens:
            raise EngineError("the first call of a session must append at least one token",
                              "append_token_ids")  # fmt: skip
        self._check_ids(append, "append_token_ids")
        tokens = session.tokens + append
        if session.slot is not None:
            self._compact(session, tokens, params)
        s = self.cfg.max_seq_len
        held = self.session_kv_tokens(session)
        keys = held + len(tokens) - self._frontier(session)  # the prompt's keys after this call
        if keys >= s:
            raise SessionError(413, f"the session would hold {keys} keys ({held} held + "
                               f"{keys - held} appended and not yet held); a slot holds at most "
                               f"{s - 1} (the context, less one token to generate): rewind, "
                               "compact or open a new session", "append_token_ids")  # fmt: skip
        room = s - keys
        compacting = session.compaction.mode != "none"
        if compacting and params.max_tokens is not None and params.max_tokens > room:
            # The client of a compacting session cannot know what the compaction left (it
            # happens here, on arrival): its max_tokens is a cap, clamped to the slot's room;
            # an answer that reaches it ends with finish_reason "length".
            params = dataclasses.replace(params, max_tokens=room)
        if params.max_tokens is not None and params.max_tokens > room:
            raise EngineError(f"max_tokens={params.max_tokens} is beyond the context: the "
                              f"session's slot would hold {keys} keys of {s}, so at most "
                              f"{room}", "max_tokens")  # fmt: skip
        handle = self._enqueue(tokens, params, n=1, room=room, session=session)
        session.busy, session.last_used = True, time.monotonic()
        return handle

    def rewind_session(self, session_id: str, to: int) -> Session:
        """Drop everything after logical position `to` (a retry from a turn boundary); the
        slot keeps the keys of the first `to` tokens that it holds."""
        session = self._idle_session(session_id, "rewind")
        if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to <= len(session.tokens):
            raise EngineError(f"to={to!r} is invalid: an integer in [0, {len(session.tokens)}] "
                              "(the session's length)", "to")  # fmt: skip
        del session.tokens[to:]
        session.turn_starts = [t for t in session.turn_starts if t < to]
        session.compacted = {k for k in session.compacted if k < len(session.turn_starts)}
        session.mass = None
        if session.slot is not None:
            slot = session.slot
            if to < session.tail_start:  # back into compacted history: a new epoch from `to`
                session.kept = [p for p in session.kept if p < to]
                session.tail_start = to
                held = len(session.kept)
            else:
                held = len(session.kept) + min(self._frontier(session), to) - session.tail_start
            del self._slot_tokens[slot][held:]
            self._lengths[slot] = held
        session.last_used = time.monotonic()
        return session

    def close_session(self, session_id: str) -> None:
        """Forget the session and free its slot (a call in flight is aborted)."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            raise SessionError(404, f"session {session_id!r} does not exist", "session_id")
        for request in list(self._requests.values()):
            if request.session is session:
                self.abort(request.id)
        self._unpin(session, None)
        if session.scoring is not None:
            session.scoring.set()

    def session_kv_tokens(self, session: Session) -> int:
        """Keys the session's slot holds (0 without a slot)."""
        return 0 if session.slot is None else int(self._lengths[session.slot])

    def session_epoch(self, session: Session) -> dict:
        """What the session's next tokens see: `{"start": s, "kept": [[a, b), ...]}` — the
        kept positions (all before s) and every token from s on. `{"start": 0, "kept": []}`
        is plain causal attention (no compaction yet)."""
        return {"start": session.tail_start, "kept": ranges(session.kept)}

    # ----- inside the engine ------------------------------------------------------------------

    def _idle_session(self, session_id: str, what: str) -> Session:
        session = self.session(session_id)
        if session.busy:
            raise SessionError(409, f"session {session_id!r} is already generating: {what} "
                               "after its call finishes (one step at a time per session)",
                               "session_id")  # fmt: skip
        return session

    def _frontier(self, session: Session) -> int:
        """Logical tokens whose keys were written to the slot (kept or dropped since)."""
        if session.slot is None:
            return 0
        return session.tail_start + int(self._lengths[session.slot]) - len(session.kept)

    def _compact(self, session: Session, tokens: list[int], params: SamplingParams) -> None:
        """Apply the session's compaction before a call over `tokens` (held + appended)."""
        cfg = session.compaction
        if cfg.mode == "none" or not session.turn_starts:
            return
        slot, frontier = session.slot, self._frontier(session)
        held = session.kept + list(range(session.tail_start, frontier))
        max_tokens = params.max_tokens or self.cfg.default_max_tokens
        keep = plan_keep(
            cfg, held, session.turn_starts, len(tokens), compacted=session.compacted,
            mass=None if session.mass is None else session.mass[: len(held)].tolist(),
            incoming=len(tokens) - frontier + max_tokens,
        )  # fmt: skip
        session.mass = None
        if len(keep) == len(held):
            return
        index = {p: i for i, p in enumerate(held)}
        rows = [index[p] for p in keep]
        self._pending_compactions.append((slot, rows))
        physical = self._slot_tokens[slot]
        self._slot_tokens[slot] = [physical[i] for i in rows]
        self._lengths[slot] = len(rows)
        session.keys_dropped += len(held) - len(keep)
        session.kept, session.tail_start = keep, frontier
        session.compactions += 1
        self.stats["session_compactions"] += 1

    def _place_session(self, seq: _Seq, session: Session) -> bool:
        """Seat a session's call in its own (pinned, idle) slot: only the tokens past what the
        slot has seen are pending; positions continue from the session's logical length."""
        slot = session.slot
        fresh = self._slot_version[slot] == self.version
        if not fresh and not session.compactions:
            # Never compacted: its KV can be recomputed under the new weights, as any prefix.
            del self._slot_tokens[slot][:]
            self._lengths[slot] = 0
        frontier = self._frontier(session)
        self._slot_owner[slot] = seq
        self._slot_used[slot] = time.perf_counter()
        if fresh or not session.compactions:
            self._slot_version[slot] = self.version
        self._shift[slot] = frontier - int(self._lengths[slot])
        seq.slot, seq.cached = slot, frontier
        seq.pending = seq.prompt[frontier:-1]
        seq.next_input = seq.prompt[-1]
        seq.admitted_at = time.perf_counter()
        self.stats["prompt_tokens"] += len(seq.prompt)
        self.stats["cached_tokens"] += frontier
        return True

    def _session_finished(self, seq: _Seq, reason: str) -> None:
        """A call ended: the stream goes on from what was generated (even if cut); a `turn`
        session scores the response's keys for its next compaction."""
        session = seq.request.session
        appended = len(seq.prompt) > len(session.tokens)  # else it continued its last turn
        session.tokens = seq.prompt + seq.generated
        if seq.generated and (appended or not session.turn_starts):
            session.turn_starts.append(len(seq.prompt))
        session.busy, session.last_used = False, time.monotonic()
        if session.compaction.mode != "turn" or session.slot is None or reason == "abort":
            return
        slot = session.slot
        written = seq.generated[:-1]  # the last token is not in the KV until the next call
        held = int(self._lengths[slot])
        session.mass = np.zeros(held, np.float32)
        if not written:  # an empty region: nothing to score with
            return
        chunk = self.cfg.prefill_chunk
        start = held - len(written)
        parts = [(start + i, written[i : i + chunk]) for i in range(0, len(written), chunk)]
        session.scoring, session.probes_left = asyncio.Event(), len(parts)
        for begin, part in parts:
            self._pending_probes.append((session, slot, begin, part))
        self._wake.set()

    def _probe_done(self, session: Session, mass_S: np.ndarray) -> None:
        if session.mass is not None:
            n = len(session.mass)
            session.mass += mass_S[:n]
        session.probes_left -= 1
        if session.probes_left <= 0 and session.scoring is not None:
            session.scoring.set()
            session.scoring = None

    def _session_step_args(self, compactions, probes):
        """Host inputs of a device step's session work: compactions (gathers of kept keys, in
        groups of `prefill_batch`) and `turn`-mode scoring probes (one bucket-padded batch)."""
        b, p, s = self.cfg.num_slots, self.cfg.prefill_batch, self.cfg.max_seq_len
        gathers = []
        for start in range(0, len(compactions), p):
            slots, index = np.full(p, b, np.int32), np.zeros((p, s), np.int32)
            for i, (slot, rows) in enumerate(compactions[start : start + p]):
                slots[i], index[i, : len(rows)] = slot, rows
            gathers.append((slots, index))
        probe_args = None
        if probes:
            longest = max(len(part) for _, _, _, part in probes)
            t = next(x for x in self.cfg.prefill_buckets if x >= longest)
            slots, tokens = np.full(p, b, np.int32), np.zeros((p, t), np.int32)
            start, num, shift = (np.zeros(p, np.int32) for _ in range(3))
            for i, (_, slot, begin, part) in enumerate(probes):
                slots[i], start[i], num[i] = slot, begin, len(part)
                tokens[i, : len(part)] = part
                shift[i] = self._shift[slot]
            probe_args = (slots, tokens, start, num, shift)
        return gathers, probes, probe_args

    def _unpin(self, session: Session, gone: str | None) -> None:
        slot = session.slot
        if slot is not None and self._slot_session[slot] is session:
            self._slot_session[slot] = None
            if session.compactions:
                # Compacted keys are no prefix of any prompt: nobody may reuse them.
                self._slot_version[slot] = -1
                self._slot_tokens[slot] = []
                self._lengths[slot] = 0
            self._shift[slot] = 0
        session.slot, session.gone = None, gone

    def _expire_sessions(self) -> None:
        now = time.monotonic()
        for session in list(self.sessions.values()):
            idle_s = now - session.last_used
            if session.gone is None and not session.busy and idle_s > session.ttl_s:
                self._unpin(session, f"it was idle for more than its ttl_s={session.ttl_s:g}")

    def _evict_for(self, free: list[int]) -> int | None:
        """Memory pressure: the slot of the least recently used idle session, unpinned."""
        idle = [s for s in free if self._slot_session[s] is not None]
        if not idle:
            return None
        slot = min(idle, key=lambda s: self._slot_session[s].last_used)
        session = self._slot_session[slot]
        self._unpin(session, "its slot was taken for another request (memory pressure: every "
                             "KV slot was in use)")  # fmt: skip
        self.stats["sessions_evicted"] += 1
        return slot
