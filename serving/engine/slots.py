"""The slot table: what each of the engine's KV-cache rows holds, who runs in it, and where a
waiting sequence is best seated (a free slot, or one whose cached prefix it shares: prefix
reuse takes the KV over in place or copies it), and when it is better off waiting a step for a
prefix another sequence is prefilling right now.

A slot holds the KV of the last sequence that ran there (`tokens`, of the weights `version`)
until another takes it; a session pins its own (`session`; `serving.engine.sessions` decides
when). Anyone may read the per-slot arrays (the engine copies `lengths` and `shift` into its
device calls); they change through the methods here, except on the engine's hot path: a
device step's prefill chunks and sampled tokens go straight onto `lengths` and `tokens`.
"""

from __future__ import annotations

import time

import numpy as np

from rl.data.tokenizer import common_prefix_len
from serving.engine.state import Seq, Session

MIN_COPY_PREFIX = 16
"""A busy slot's prefix is copied for a new sequence only when this long (or the whole
prompt, as for `n` samples); shorter shared prefixes are cheaper to prefill again."""

Prefilling = dict[tuple[int, ...], list[Seq]]
"""Seated sequences with prompt still to prefill, by their first `MIN_COPY_PREFIX` tokens."""


class SlotTable:
    """Per-slot host state of the KV cache's `num_slots` rows."""

    def __init__(self, num_slots: int):
        b = num_slots
        self.lengths = np.zeros(b, np.int32)
        """Keys each slot holds (its cache index of the next token)."""
        self.shift = np.zeros(b, np.int32)
        """Logical position minus cache index of a slot's next token (compacted sessions)."""
        self.tokens: list[list[int]] = [[] for _ in range(b)]
        """The tokens whose keys a slot holds, in cache order."""
        self.owner: list[Seq | None] = [None] * b
        """The sequence running in a slot (None: idle)."""
        self.used = np.zeros(b, np.float64)
        """When a slot was last taken or given up (`time.perf_counter`)."""
        self.version = np.full(b, -1, np.int64)
        """Weight version a slot's KV was computed with: only the current one is reused."""
        self.session: list[Session | None] = [None] * b
        """The session a slot is pinned to (between its calls too)."""
        self._copies: list[tuple[int, int]] = []

    # ----- reading ----------------------------------------------------------------------------

    def any_idle(self) -> bool:
        """Whether some slot runs no sequence (pinned or not)."""
        return any(o is None for o in self.owner)

    def active(self) -> int:
        """Slots running a sequence."""
        return sum(o is not None for o in self.owner)

    def idle(self) -> list[int]:
        """Slots running no sequence, pinned ones included."""
        return [s for s in range(len(self.owner)) if self.owner[s] is None]

    def longest_prefix(self, want: list[int], version: int) -> tuple[int | None, int]:
        """(slot, length) of the longest prefix of `want` that an unpinned slot holds in KV of
        weights `version`, busy slots included; (None, 0) when none holds any."""
        best, best_len = None, 0
        for slot, tokens in enumerate(self.tokens):
            if self.version[slot] != version or self.session[slot] is not None:
                continue  # KV of older weights, or a session's own
            m = common_prefix_len(tokens, want)
            if m > best_len:
                best, best_len = slot, m
        return best, best_len

    def prefilling_by_head(self) -> Prefilling:
        """Seated sequences with prompt still to prefill, by their first `MIN_COPY_PREFIX`
        tokens."""
        out: Prefilling = {}
        for seq in self.owner:
            if seq is not None:
                index_prefilling(out, seq)
        return out

    def gains_by_waiting(self, seq: Seq, prefilling: Prefilling, version: int) -> bool:
        """Whether a seated sequence's prefill will soon hold more of `seq`'s prompt than any
        slot holds now (then `seq` waits a step or two and copies it instead of prefilling)."""
        if seq.request.session is not None or len(seq.prompt) <= MIN_COPY_PREFIX:
            return False
        want = seq.prompt[:-1]
        soon = 0
        for other in prefilling.get(tuple(want[:MIN_COPY_PREFIX]), ()):
            soon = max(soon, common_prefix_len(other.prompt[:-1], want))
        if soon < MIN_COPY_PREFIX:
            return False
        shared = want[:soon]  # does some slot hold it all already? then no need to wait
        slots = zip(self.tokens, self.version, strict=True)
        return not any(v == version and t[:soon] == shared for t, v in slots)

    # ----- seating ----------------------------------------------------------------------------

    def choose(
        self, free: list[int], best: int | None, best_len: int, want_len: int
    ) -> tuple[int, int]:
        """(slot, cached tokens) for a new sequence: the cached slot `best` taken over in
        place when it is idle, else an empty slot of `free` if any, else its least recently
        used one, into which `best`'s prefix is copied when it is long enough."""
        if best is not None and self.owner[best] is None:
            return best, best_len  # take the cached slot over in place: no copy
        # An empty slot if any, else the least recently used cached one.
        slot = min(free, key=lambda s: (len(self.tokens[s]) > 0, self.used[s]))
        if best is not None and best_len < min(MIN_COPY_PREFIX, want_len):
            best, best_len = None, 0  # too short to be worth a copy
        if best is not None:
            # A copy's destination holds nothing until the copy runs: copy from its source.
            pending = dict((d, s) for s, d in self._copies)
            self._copies.append((pending.get(best, best), slot))
        return slot, best_len

    def seat(self, seq: Seq, slot: int, want: list[int], cached: int, version: int) -> None:
        """Seat `seq` in `slot`, reusing the first `cached` tokens of its KV; the slot's KV is
        of `version` from now on."""
        self.tokens[slot] = want[:cached]
        self.lengths[slot] = cached
        self.shift[slot] = 0
        self.owner[slot] = seq
        self.used[slot] = time.perf_counter()
        self.version[slot] = version
        seq.slot, seq.cached = slot, cached
        seq.pending = want[cached:]
        seq.next_input = seq.prompt[-1]
        seq.admitted_at = time.perf_counter()

    def resume(self, seq: Seq, slot: int, frontier: int, version: int | None) -> None:
        """Seat a session's call `seq` in the session's own `slot`: its prompt from logical
        position `frontier` on (what the slot has not seen) is pending, and its positions go
        on from there; the slot's KV is of `version` from now on (None: it stays as it was)."""
        self.owner[slot] = seq
        self.used[slot] = time.perf_counter()
        if version is not None:
            self.version[slot] = version
        self.shift[slot] = frontier - int(self.lengths[slot])
        seq.slot, seq.cached = slot, frontier
        seq.pending = seq.prompt[frontier:-1]
        seq.next_input = seq.prompt[-1]
        seq.admitted_at = time.perf_counter()

    def release(self, slot: int) -> None:
        """The sequence in `slot` finished: the slot keeps its KV for reuse."""
        self.owner[slot] = None
        self.used[slot] = time.perf_counter()

    # ----- what a slot holds ------------------------------------------------------------------

    def truncate(self, slot: int, held: int) -> None:
        """Keep only the first `held` keys of `slot`."""
        del self.tokens[slot][held:]
        self.lengths[slot] = held

    def keep_rows(self, slot: int, rows: list[int]) -> None:
        """`slot` keeps the keys at `rows`, in that order, at its front (a compaction)."""
        physical = self.tokens[slot]
        self.tokens[slot] = [physical[i] for i in rows]
        self.lengths[slot] = len(rows)

    def pin(self, slot: int, session: Session) -> None:
        """`slot` is `session`'s between its calls too: nobody else is seated there."""
        self.session[slot] = session

    def unpin(self, slot: int, forget: bool) -> None:
        """`slot` is nobody's any more; with `forget`, its KV is nobody's prefix either
        (compacted keys), so it is dropped."""
        self.session[slot] = None
        if forget:
            self.version[slot] = -1
            self.tokens[slot] = []
            self.lengths[slot] = 0
        self.shift[slot] = 0

    def forget_prefixes(self) -> None:
        """No later prompt reuses the KV any slot holds now."""
        self.version[:] = -1

    # ----- copies -----------------------------------------------------------------------------

    def has_copies(self) -> bool:
        return bool(self._copies)

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) slot copies queued since the last call, for the next
        device step."""
        copies, self._copies = self._copies, []
        return copies


def index_prefilling(index: Prefilling, seq: Seq) -> None:
    """File a seated sequence whose prompt is still being prefilled under its first tokens
    (sessions excluded: their KV is their own and is never copied)."""
    if seq.pending and seq.request.session is None and len(seq.prompt) > MIN_COPY_PREFIX:
        index.setdefault(tuple(seq.prompt[:MIN_COPY_PREFIX]), []).append(seq)
