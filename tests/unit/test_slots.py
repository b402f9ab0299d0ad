"""The engine's slot table and session table on their own, without a model or a device step:
where a new sequence is seated, which prefix copies that queues, and which session gives its
slot up under memory pressure."""

from __future__ import annotations

import time

from serving.compaction import SessionCompaction
from serving.config import EngineConfig, SamplingParams
from serving.engine.sessions import SessionTable
from serving.engine.slots import MIN_COPY_PREFIX, SlotTable
from serving.engine.state import Request, Seq

VERSION = 3
LONG = list(range(100, 100 + 2 * MIN_COPY_PREFIX))


def _seq(prompt: list[int]) -> Seq:
    request = Request("r", SamplingParams(), seed=0, stop_ids=frozenset())
    seq = Seq(request, 0, prompt, max_tokens=8)
    request.seqs = [seq]
    return seq


def _seat(slots: SlotTable, prompt: list[int]) -> Seq:
    """Seat a new sequence where the slot table chooses, as the engine's admission does
    (among the idle slots no session holds)."""
    seq, want = _seq(prompt), prompt[:-1]
    best, best_len = slots.longest_prefix(want, VERSION)
    free = [s for s in slots.idle() if slots.session[s] is None]
    slot, cached = slots.choose(free, best, best_len, len(want))
    slots.seat(seq, slot, want, cached, VERSION)
    return seq


def _held_by(table: SessionTable, slot: int, **kw):
    """A session pinned to `slot`, whose first call there has ended holding `LONG`'s keys."""
    session = table.open(**kw)
    table.pin(session, slot)
    table.slots.seat(_seq(LONG), slot, LONG[:-1], 0, VERSION)
    table.slots.tokens[slot], table.slots.lengths[slot] = LONG[:-1], len(LONG) - 1
    table.slots.release(slot)
    return session


def test_a_finished_sequences_slot_is_taken_over_in_place_without_a_copy():
    slots = SlotTable(4)
    first = _seat(slots, LONG)
    slots.tokens[first.slot] = LONG[:-1]  # its prompt prefilled
    slots.release(first.slot)
    second = _seat(slots, [*LONG, 7, 8])
    assert (second.slot, second.cached) == (first.slot, len(LONG) - 1)
    assert second.pending == [LONG[-1], 7]  # only the new suffix is prefilled
    assert slots.take_copies() == []


def test_a_busy_slots_prefix_is_copied_from_the_first_source_of_a_chain():
    slots = SlotTable(4)
    leader = _seat(slots, LONG)
    slots.tokens[leader.slot] = LONG[:-1]
    follower = _seat(slots, LONG)  # the leader runs: its row is copied into an empty slot
    assert follower.slot != leader.slot and follower.cached == len(LONG) - 1
    # The copy has not run: a third copy of the follower's row must read the leader's.
    slots.tokens[leader.slot] = []  # the leader's row is now useless to a prefix search ...
    third = _seat(slots, LONG)  # ... so the follower's (not yet written) row is the best
    assert third.slot not in (leader.slot, follower.slot)
    assert slots.take_copies() == [(leader.slot, follower.slot), (leader.slot, third.slot)]
    assert slots.take_copies() == []


def test_a_short_shared_prefix_is_prefilled_again_not_copied():
    slots = SlotTable(4)
    busy = _seat(slots, LONG)
    slots.tokens[busy.slot] = LONG[:-1]
    short = MIN_COPY_PREFIX - 1
    other = _seat(slots, [*LONG[:short], 1, 2, 3])
    assert other.cached == 0 and other.pending == [*LONG[:short], 1, 2]
    assert slots.take_copies() == []


def test_kv_of_older_weights_or_of_a_session_is_nobodys_prefix():
    slots = SlotTable(2)
    seq = _seat(slots, LONG)
    slots.tokens[seq.slot] = LONG[:-1]
    slots.release(seq.slot)
    assert slots.longest_prefix(LONG[:-1], VERSION) == (seq.slot, len(LONG) - 1)
    assert slots.longest_prefix(LONG[:-1], VERSION + 1) == (None, 0)
    table = SessionTable(EngineConfig(num_slots=2), slots, {"sessions_opened": 0}, vocab=256)
    table.pin(table.open(), seq.slot)
    assert slots.longest_prefix(LONG[:-1], VERSION) == (None, 0)


def test_memory_pressure_evicts_the_least_recently_used_idle_session():
    slots = SlotTable(3)
    stats = {"sessions_opened": 0, "sessions_evicted": 0}
    table = SessionTable(EngineConfig(num_slots=3), slots, stats, vocab=256)
    older, newer = _held_by(table, 0), _held_by(table, 1)
    older.last_used, newer.last_used = time.monotonic() - 2, time.monotonic() - 1
    busy = _seat(slots, [1, 2, 3])  # the third slot: every slot is now taken
    assert busy.slot == 2 and slots.idle() == [0, 1]
    assert table.evict_for(slots.idle()) == 0
    assert older.slot is None and "memory pressure" in older.gone
    assert newer.slot == 1 and newer.gone is None
    assert slots.session == [None, newer, None] and stats["sessions_evicted"] == 1


def test_a_compacted_sessions_slot_is_forgotten_when_unpinned():
    slots = SlotTable(2)
    stats = {"sessions_opened": 0}
    table = SessionTable(EngineConfig(num_slots=2), slots, stats, vocab=256)
    plain = _held_by(table, 0)
    compacted = _held_by(table, 1, compaction=SessionCompaction(mode="markovian"))
    compacted.compactions = 1  # its slot holds what a compaction kept
    table.close(plain.id)
    table.close(compacted.id)
    assert slots.session == [None, None]
    assert slots.longest_prefix(LONG[:-1], VERSION) == (0, len(LONG) - 1)  # still a prefix
    assert (slots.version[1], slots.tokens[1], slots.lengths[1]) == (-1, [], 0)
