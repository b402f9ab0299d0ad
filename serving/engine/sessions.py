"""The session table: persistent KV sessions of the engine, their compaction planning
(`serving.compaction`) and their eviction.

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

The table changes slots only through the engine's `SlotTable`; the device work it plans
(gathers of kept keys, `turn`-mode scoring probes) waits here until the engine's next step
takes it (`take_compactions`, `take_probes`, `step_args`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time

import numpy as np

from serving.compaction import SessionCompaction, plan_keep, ranges
from serving.config import EngineConfig, SamplingParams
from serving.engine.errors import EngineBusy, EngineError, SessionError
from serving.engine.slots import SlotTable
from serving.engine.state import Seq, Session, check_ids

Probe = tuple[Session, int, int, list[int]]
"""A `turn` session's scoring probe: (session, slot, first position, tokens there)."""


class SessionTable:
    """The open sessions (`sessions`, by id) and the session work waiting for a device step.
    Counts `sessions_opened`, `sessions_evicted` and `session_compactions` in `stats`."""

    def __init__(self, cfg: EngineConfig, slots: SlotTable, stats: dict[str, int], vocab: int):
        self.cfg, self.slots, self.stats, self.vocab = cfg, slots, stats, vocab
        self.sessions: dict[str, Session] = {}
        self._compactions: list[tuple[int, list[int]]] = []
        self._probes: list[Probe] = []

    # ----- the API (`Engine` passes these on) -------------------------------------------------

    def open(
        self, ttl_s: float | None = None, compaction: SessionCompaction | None = None
    ) -> Session:
        """A new, empty session (its slot is taken at its first call). At the limit, sessions
        that expired or were evicted are forgotten first to make room."""
        if len(self.sessions) >= self.cfg.max_sessions:
            self.forget_gone()
        else:
            self.expire()
        if len(self.sessions) >= self.cfg.max_sessions:
            raise EngineBusy(
                f"{len(self.sessions)} sessions are open (the limit is "
                f"{self.cfg.max_sessions}); close one first"
            )
        sid = f"sess-{os.urandom(8).hex()}"
        session = Session(
            sid,
            float(ttl_s if ttl_s is not None else self.cfg.session_ttl_s),
            compaction or SessionCompaction(),
        )
        self.sessions[sid] = session
        self.stats["sessions_opened"] += 1
        return session

    def forget_gone(self, session_ids=None) -> int:
        """Forget the sessions (of `session_ids`, else all) that expired or were evicted: they
        are kept only to tell their next call why (409), and that call gets 404 instead.
        Returns how many were forgotten."""
        self.expire()
        ids = list(self.sessions if session_ids is None else session_ids)
        gone = [sid for sid in ids if sid in self.sessions and self.sessions[sid].gone is not None]
        for sid in gone:
            session = self.sessions.pop(sid)
            if session.scoring is not None:
                session.scoring.set()
        return len(gone)

    def get(self, session_id: str) -> Session:
        """The open session `session_id`; SessionError 404 if unknown, 409 (once, then it is
        forgotten) if it expired or was evicted."""
        self.expire()
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionError(
                404,
                f"session {session_id!r} does not exist (closed, or never opened): open a new one",
                "session_id",
            )
        if session.gone is not None:
            del self.sessions[session_id]
            raise SessionError(
                409,
                f"session {session_id!r} is gone: {session.gone}; open a "
                "new one and send its whole context",
                "session_id",
            )
        return session

    async def ready(self, session_id: str) -> Session:
        """The idle session `session_id`, once the scores of its latest response (`turn`
        compaction) are in."""
        session = self._idle(session_id, "generate")
        if session.scoring is not None:  # `turn`: the last response's scores are on their way
            session.busy = True
            try:
                await session.scoring.wait()
            finally:
                session.busy = False
            session = self._idle(session_id, "generate")
        return session

    def prepare_call(
        self, session: Session, append: list[int], params: SamplingParams
    ) -> tuple[list[int], SamplingParams, int]:
        """Check a call appending `append` and compact the session first (its mode) ->
        (the call's prompt, its params with `max_tokens` clamped where the client cannot know
        the room, the room left to generate)."""
        if not append and not session.tokens:
            raise EngineError(
                "the first call of a session must append at least one token", "append_token_ids"
            )
        check_ids(append, "append_token_ids", self.vocab)
        tokens = session.tokens + append
        if session.slot is not None:
            self._compact(session, tokens, params)
        s = self.cfg.max_seq_len
        held = self.kv_tokens(session)
        keys = held + len(tokens) - self._frontier(session)  # the prompt's keys after this call
        if keys >= s:
            raise SessionError(
                413,
                f"the session would hold {keys} keys ({held} held + "
                f"{keys - held} appended and not yet held); a slot holds at most "
                f"{s - 1} (the context, less one token to generate): rewind, "
                "compact or open a new session",
                "append_token_ids",
            )
        room = s - keys
        compacting = session.compaction.mode != "none"
        if compacting and params.max_tokens is not None and params.max_tokens > room:
            # The client of a compacting session cannot know what the compaction left (it
            # happens here, on arrival): its max_tokens is a cap, clamped to the slot's room;
            # an answer that reaches it ends with finish_reason "length".
            params = dataclasses.replace(params, max_tokens=room)
        if params.max_tokens is not None and params.max_tokens > room:
            raise EngineError(
                f"max_tokens={params.max_tokens} is beyond the context: the "
                f"session's slot would hold {keys} keys of {s}, so at most "
                f"{room}",
                "max_tokens",
            )
        return tokens, params, room

    def rewind(self, session_id: str, to: int) -> Session:
        """Drop everything after logical position `to` (a retry from a turn boundary); the
        slot keeps the keys of the first `to` tokens that it holds."""
        session = self._idle(session_id, "rewind")
        if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to <= len(session.tokens):
            raise EngineError(
                f"to={to!r} is invalid: an integer in [0, {len(session.tokens)}] "
                "(the session's length)",
                "to",
            )
        del session.tokens[to:]
        session.turn_starts = [t for t in session.turn_starts if t < to]
        session.compacted = {k for k in session.compacted if k < len(session.turn_starts)}
        session.mass = None
        if session.slot is not None:
            if to < session.tail_start:  # back into compacted history: a new epoch from `to`
                session.kept = [p for p in session.kept if p < to]
                session.tail_start = to
                held = len(session.kept)
            else:
                held = len(session.kept) + min(self._frontier(session), to) - session.tail_start
            self.slots.truncate(session.slot, held)
        session.last_used = time.monotonic()
        return session

    def close(self, session_id: str) -> Session:
        """Forget the session and free its slot (the caller aborts a call in flight)."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            raise SessionError(404, f"session {session_id!r} does not exist", "session_id")
        self._unpin(session, None)
        if session.scoring is not None:
            session.scoring.set()
        return session

    def kv_tokens(self, session: Session) -> int:
        """Keys the session's slot holds (0 without a slot)."""
        return 0 if session.slot is None else int(self.slots.lengths[session.slot])

    @staticmethod
    def epoch(session: Session) -> dict:
        """What the session's next tokens see: `{"start": s, "kept": [[a, b), ...]}` — the
        kept positions (all before s) and every token from s on. `{"start": 0, "kept": []}`
        is plain causal attention (no compaction yet)."""
        return {"start": session.tail_start, "kept": ranges(session.kept)}

    # ----- seating, eviction and the end of a call (the engine's scheduler calls these) -------

    def seat(self, seq: Seq, session: Session, version: int) -> None:
        """Seat a session's call in its own (pinned, idle) slot: only the tokens past what the
        slot has seen are pending; positions continue from the session's logical length."""
        slot = session.slot
        fresh = self.slots.version[slot] == version
        if not fresh and not session.compactions:
            # Never compacted: its KV can be recomputed under the new weights, as any prefix.
            self.slots.truncate(slot, 0)
        # Of the current weights from now on, unless compacted KV of older ones stays on.
        current = fresh or not session.compactions
        self.slots.resume(seq, slot, self._frontier(session), version if current else None)

    def pin(self, session: Session, slot: int) -> None:
        """`slot` is the session's from now on (its first call was seated there)."""
        session.slot = slot
        self.slots.pin(slot, session)

    def expire(self) -> None:
        """Unpin the sessions idle past their TTL."""
        now = time.monotonic()
        for session in list(self.sessions.values()):
            idle_s = now - session.last_used
            if session.gone is None and not session.busy and idle_s > session.ttl_s:
                self._unpin(session, f"it was idle for more than its ttl_s={session.ttl_s:g}")

    def evict_for(self, idle: list[int]) -> int | None:
        """Memory pressure: of the `idle` slots, the least recently used idle session's,
        unpinned (None when no session holds one)."""
        pinned = self.slots.session
        held = [s for s in idle if pinned[s] is not None]
        if not held:
            return None
        slot = min(held, key=lambda s: pinned[s].last_used)
        self._unpin(
            pinned[slot],
            "its slot was taken for another request (memory pressure: every KV slot was in use)",
        )
        self.stats["sessions_evicted"] += 1
        return slot

    def finished(self, seq: Seq, reason: str) -> bool:
        """A call ended: the stream goes on from what was generated (even if cut); a `turn`
        session scores the response's keys for its next compaction. -> whether that queued
        probes (device work for the next step)."""
        session = seq.request.session
        appended = len(seq.prompt) > len(session.tokens)  # else it continued its last turn
        session.tokens = seq.prompt + seq.generated
        if seq.generated and (appended or not session.turn_starts):
            session.turn_starts.append(len(seq.prompt))
        session.busy, session.last_used = False, time.monotonic()
        if session.compaction.mode != "turn" or session.slot is None or reason == "abort":
            return False
        slot = session.slot
        written = seq.generated[:-1]  # the last token is not in the KV until the next call
        held = int(self.slots.lengths[slot])
        session.mass = np.zeros(held, np.float32)
        if not written:  # an empty region: nothing to score with
            return False
        chunk = self.cfg.prefill_chunk
        start = held - len(written)
        parts = [(start + i, written[i : i + chunk]) for i in range(0, len(written), chunk)]
        session.scoring, session.probes_left = asyncio.Event(), len(parts)
        for begin, part in parts:
            self._probes.append((session, slot, begin, part))
        return True

    # ----- device work ------------------------------------------------------------------------

    def has_work(self) -> bool:
        """Whether compactions or probes wait for a device step."""
        return bool(self._compactions or self._probes)

    def take_compactions(self) -> list[tuple[int, list[int]]]:
        """Every queued compaction: (slot, the rows it keeps)."""
        compactions, self._compactions = self._compactions, []
        return compactions

    def take_probes(self, limit: int) -> list[Probe]:
        """Up to `limit` queued probes (one device step's worth)."""
        probes, self._probes = self._probes[:limit], self._probes[limit:]
        return probes

    def step_args(self, compactions: list[tuple[int, list[int]]], probes: list[Probe]):
        """Host inputs of a device step's session work: compactions (gathers of kept keys, in
        groups of `prefill_batch`) and `turn`-mode scoring probes (one bucket-padded batch)
        -> (gathers, probes, probe args or None)."""
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
                shift[i] = self.slots.shift[slot]
            probe_args = (slots, tokens, start, num, shift)
        return gathers, probes, probe_args

    @staticmethod
    def probe_done(session: Session, mass_S: np.ndarray) -> None:
        """A probe's attention mass per held key, added to the session's scores."""
        if session.mass is not None:
            n = len(session.mass)
            session.mass += mass_S[:n]
        session.probes_left -= 1
        if session.probes_left <= 0 and session.scoring is not None:
            session.scoring.set()
            session.scoring = None

    # ----- inside the table -------------------------------------------------------------------

    def _idle(self, session_id: str, what: str) -> Session:
        session = self.get(session_id)
        if session.busy:
            raise SessionError(
                409,
                f"session {session_id!r} is already generating: {what} "
                "after its call finishes (one step at a time per session)",
                "session_id",
            )
        return session

    def _frontier(self, session: Session) -> int:
        """Logical tokens whose keys were written to the slot (kept or dropped since)."""
        if session.slot is None:
            return 0
        return session.tail_start + int(self.slots.lengths[session.slot]) - len(session.kept)

    def _compact(self, session: Session, tokens: list[int], params: SamplingParams) -> None:
        """Plan the session's compaction before a call over `tokens` (held + appended): the
        slot's bookkeeping changes now, its keys at the next device step."""
        cfg = session.compaction
        if cfg.mode == "none" or not session.turn_starts:
            return
        slot, frontier = session.slot, self._frontier(session)
        held = session.kept + list(range(session.tail_start, frontier))
        max_tokens = params.max_tokens or self.cfg.default_max_tokens
        keep = plan_keep(
            cfg,
            held,
            session.turn_starts,
            len(tokens),
            compacted=session.compacted,
            mass=None if session.mass is None else session.mass[: len(held)].tolist(),
            incoming=len(tokens) - frontier + max_tokens,
        )
        session.mass = None
        if len(keep) == len(held):
            return
        index = {p: i for i, p in enumerate(held)}
        rows = [index[p] for p in keep]
        self._compactions.append((slot, rows))
        self.slots.keep_rows(slot, rows)
        session.keys_dropped += len(held) - len(keep)
        session.kept, session.tail_start = keep, frontier
        session.compactions += 1
        self.stats["session_compactions"] += 1

    def _unpin(self, session: Session, gone: str | None) -> None:
        slot = session.slot
        if slot is not None and self.slots.session[slot] is session:
            # Compacted keys are no prefix of any prompt: nobody may reuse them.
            self.slots.unpin(slot, forget=bool(session.compactions))
        session.slot, session.gone = None, gone
