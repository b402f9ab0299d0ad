"""Where the engine seats a waiting sequence: a free slot, or one whose cached prefix it
shares (prefix reuse: the KV is taken over in place or copied), and when a sequence is better
off waiting a step for a prefix another one is prefilling right now.

Slots hold the KV of the last sequence that ran there (`_slot_tokens`, of the weights
`_slot_version`) until another takes them; sessions pin theirs (`serving.engine.sessions`).
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from rl.data.tokenizer import common_prefix_len

if TYPE_CHECKING:
    from serving.engine.engine import _Seq

MIN_COPY_PREFIX = 16
"""A busy slot's prefix is copied for a new sequence only when this long (or the whole
prompt, as for `n` samples); shorter shared prefixes are cheaper to prefill again."""


def _index_prefilling(index: dict[tuple[int, ...], list[_Seq]], seq: _Seq) -> None:
    """File a seated sequence whose prompt is still being prefilled under its first tokens
    (sessions excluded: their KV is their own and is never copied)."""
    if seq.pending and seq.request.session is None and len(seq.prompt) > MIN_COPY_PREFIX:
        index.setdefault(tuple(seq.prompt[:MIN_COPY_PREFIX]), []).append(seq)


class SlotsMixin:
    """Admission and slot placement of `Engine` (they share its slot tables and queues)."""

    def _admit(self) -> None:
        """Give waiting sequences slots (FIFO). A sibling waits for its leader's prefill, and
        so does a sequence whose prompt starts like one being prefilled (the samples of an RL
        group, arriving together as separate requests): its prefix is then copied."""
        skipped: deque[_Seq] = deque()
        prefilling = self._prefilling_by_head() if self.cfg.prefix_reuse else None
        while self._waiting:
            seq = self._waiting.popleft()
            leader = seq.request.seqs[0]
            if seq is not leader and (leader.slot is None or leader.pending):
                skipped.append(seq)
                continue
            if prefilling is not None and seq is leader and self._gains_by_waiting(seq, prefilling):
                skipped.append(seq)  # a sequence seated before it is prefilling its prefix
                continue
            if not self._place(seq):
                skipped.append(seq)
                skipped.extend(self._waiting)
                self._waiting.clear()
                break
            if prefilling is not None:  # those after it may wait for its prefill
                _index_prefilling(prefilling, seq)
        self._waiting = skipped

    def _prefilling_by_head(self) -> dict[tuple[int, ...], list[_Seq]]:
        """Seated sequences with prompt still to prefill, by their first `MIN_COPY_PREFIX`
        tokens."""
        out: dict[tuple[int, ...], list[_Seq]] = {}
        for seq in self._slot_owner:
            if seq is not None:
                _index_prefilling(out, seq)
        return out

    def _gains_by_waiting(self, seq: _Seq, prefilling: dict[tuple[int, ...], list[_Seq]]) -> bool:
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
        slots = zip(self._slot_tokens, self._slot_version, strict=True)
        return not any(v == self.version and t[:soon] == shared for t, v in slots)

    def _place(self, seq: _Seq) -> bool:
        want = seq.prompt[:-1]
        session = seq.request.session
        if session is not None and session.slot is not None:
            return self._place_session(seq, session)  # its own slot: pinned, idle
        self._expire_sessions()
        pinned = self._slot_session
        best, best_len = None, 0
        if self.cfg.prefix_reuse and want:
            for slot, tokens in enumerate(self._slot_tokens):
                if self._slot_version[slot] != self.version or pinned[slot] is not None:
                    continue  # KV of older weights, or a session's own
                m = common_prefix_len(tokens, want)
                if m > best_len:
                    best, best_len = slot, m
        idle = [s for s in range(self.cfg.num_slots) if self._slot_owner[s] is None]
        free = [s for s in idle if pinned[s] is None]
        if not free:
            slot = self._evict_for(idle)
            if slot is None:
                return False
            free = [slot]
        if best is not None and self._slot_owner[best] is None:
            slot = best  # take the cached slot over in place: no copy
        else:
            # An empty slot if any, else the least recently used cached one.
            slot = min(free, key=lambda s: (len(self._slot_tokens[s]) > 0, self._slot_used[s]))
            if best is not None and best_len < min(MIN_COPY_PREFIX, len(want)):
                best, best_len = None, 0  # too short to be worth a copy
            if best is not None:
                # A copy's destination holds nothing until the copy runs: copy from its source.
                pending = dict((d, s) for s, d in self._pending_copies)
                self._pending_copies.append((pending.get(best, best), slot))
        if session is not None:
            session.slot, pinned[slot] = slot, session
        return self._place_in(seq, slot, want, cached=best_len if best is not None else 0)

    def _place_in(self, seq: _Seq, slot: int, want: list[int], cached: int | None = None) -> bool:
        """Seat `seq` in `slot`, reusing the first `cached` tokens of its KV (None: as many
        as the slot holds of `want`, if its KV is of the current weights)."""
        held = self._slot_tokens[slot]
        if cached is None:
            fresh = self._slot_version[slot] == self.version
            cached = common_prefix_len(held, want) if fresh else 0
        self._slot_tokens[slot] = want[:cached]
        self._lengths[slot] = cached
        self._shift[slot] = 0
        self._slot_owner[slot] = seq
        self._slot_used[slot] = time.perf_counter()
        self._slot_version[slot] = self.version
        seq.slot, seq.cached = slot, cached
        seq.pending = want[cached:]
        seq.next_input = seq.prompt[-1]
        seq.admitted_at = time.perf_counter()
        self.stats["prompt_tokens"] += len(seq.prompt)
        self.stats["cached_tokens"] += cached
        return True
