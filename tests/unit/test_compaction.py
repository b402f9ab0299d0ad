"""KV compaction of persistent sessions (issue 19): which keys each mode keeps
(`serving.compaction.plan_keep`, pure), and what the engine does with a compacted slot —
fewer keys held, positions that keep counting past the context, rewinds into compacted
history, a compacted slot never reused as a prefix, the `turn` mode's scores."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import pytest_asyncio
from flax import nnx

from rl.data import ByteTokenizer
from rl.model import Qwen3, tiny
from rl.model.transformer import KVVisibility
from serving.compaction import SessionCompaction, plan_keep, ranges
from serving.engine import Engine, EngineConfig, SamplingParams, SessionError

TOK = ByteTokenizer()
SEQ = 256


# ----- plan_keep: a prompt 0..9, turns at 10, 20, 30 (the last one being appended to) ---------

HELD = list(range(35))
TURNS = [10, 20, 30]


def keep(mode: str, **kw) -> list[int]:
    extra = {k: kw.pop(k) for k in ("mass", "incoming", "compacted") if k in kw}
    cfg = SessionCompaction(mode=mode, **kw)
    return plan_keep(
        cfg,
        HELD,
        TURNS,
        40,
        compacted=extra.get("compacted", set()),
        mass=extra.get("mass"),
        incoming=extra.get("incoming", 0),
    )


def test_none_keeps_everything_and_markovian_the_prompt_and_the_last_turns():
    assert keep("none") == HELD
    assert keep("markovian") == list(range(10)) + list(range(30, 35))
    assert keep("markovian", n_protect_turns=2) == list(range(10)) + list(range(20, 35))
    assert keep("markovian", n_protect_turns=9) == HELD  # nothing old enough to drop


def test_turn_keeps_the_most_attended_share_of_each_older_turn_once():
    mass = [0.0] * 35
    for p in (12, 13, 25):
        mass[p] = 1.0
    compacted: set[int] = set()
    kept = keep("turn", keep_ratio=0.2, mass=mass, compacted=compacted)
    # turn 0 (10..19) keeps 2 of 10: the two it attended to; turn 1 (20..29) keeps 25 and the
    # latest of its unscored keys (ties go to the later position); turn 2 is protected
    assert kept == list(range(10)) + [12, 13, 25, 29] + list(range(30, 35))
    assert compacted == {0, 1}
    # thinned once: a later call (no scores at all) leaves them as they are
    again = plan_keep(
        SessionCompaction(mode="turn", keep_ratio=0.2), kept, TURNS, 40, compacted=compacted
    )
    assert again == kept


def test_budget_drops_whole_old_turns_only_when_over_and_only_as_many_as_needed():
    assert keep("budget", kv_budget=100, incoming=10) == HELD  # 35 + 10 fits
    assert keep("budget", kv_budget=40, incoming=10) == list(range(10)) + list(range(20, 35))
    # over by more than two turns can give: the prompt and the protected turn stay
    assert keep("budget", kv_budget=5, incoming=10) == list(range(10)) + list(range(30, 35))


@pytest.mark.parametrize(
    "bad, says",
    [
        ({"mode": "lru"}, "compaction.mode='lru' is invalid"),
        ({"mode": "turn", "n_protect_turns": 0}, "an integer >= 1"),
        ({"mode": "turn", "keep_ratio": 0}, "a number in (0, 1]"),
        ({"mode": "budget"}, "required by mode 'budget'"),
        ({"mode": "budget", "kv_budget": -4}, "an integer >= 1"),
        ({"mode": "none", "extra": 1}, "unknown field(s) ['extra']"),
    ],
)
def test_bad_settings_name_the_field_and_what_is_allowed(bad, says):
    with pytest.raises(ValueError, match=None) as e:
        SessionCompaction.from_json(bad)
    assert says in str(e.value)


def test_ranges_are_half_open_runs():
    assert ranges([0, 1, 2, 5, 7, 8]) == [[0, 3], [5, 6], [7, 9]]
    assert ranges([]) == []


def test_visibility_mask_is_causal_for_one_empty_epoch_and_follows_the_kept_keys():
    t = 6
    plain = KVVisibility(
        np.zeros((1, t), np.int32), np.zeros((1, 1), np.int32), np.zeros((1, 1, t), bool)
    )
    assert np.asarray(plain.mask(t)).all()  # combined with causality by the model
    # epoch 1 from index 3 kept only key 0
    kept = np.zeros((1, 2, t), bool)
    kept[0, 1, 0] = True
    vis = KVVisibility(np.array([[0, 0, 0, 1, 1, 1]], np.int32), np.array([[0, 3]], np.int32), kept)
    m = np.asarray(vis.mask(t))[0]
    assert m[2].all()  # epoch 0 sees everything (causality aside)
    assert m[4].tolist() == [True, False, False, True, True, True]


# ----- the engine (the tests below share one engine on one event loop) ---------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine():
    model = Qwen3(tiny(initializer_range=0.3), rngs=nnx.Rngs(1))
    cfg = EngineConfig(
        num_slots=3, max_seq_len=SEQ, prefill_chunk=32, prefill_batch=2, decode_steps=1
    )
    eng = Engine(model, TOK, cfg)
    await eng.start()
    yield eng
    await eng.stop()


async def _scored(session) -> None:
    if session.scoring is not None:
        await session.scoring.wait()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)


async def turn(engine, sid, text: str, n: int = 8):
    handle = await engine.session_submit(sid, TOK.encode(text), greedy(n))
    (out,) = await handle.result()
    return out


@pytest.mark.asyncio(loop_scope="module")
async def test_markovian_runs_past_the_context_holding_only_the_prompt_and_the_last_turn(engine):
    session = engine.open_session(compaction=SessionCompaction(mode="markovian"))
    await turn(engine, session.id, "p" * 40)
    for i in range(12):  # 12 turns of 30 + 8 tokens: far past the 256-token context
        await turn(engine, session.id, f"{i:02d}" + "o" * 28)
        held = engine.session_kv_tokens(session)
        assert held <= 40 + 8 + 30 + 8, held  # the prompt, the latest turn, the new append
    assert len(session.tokens) > SEQ  # logical length beyond the slot
    assert session.compactions >= 10 and session.keys_dropped > SEQ
    epoch = engine.session_epoch(session)
    assert epoch["kept"][0] == [0, 40]
    engine.close_session(session.id)


@pytest.mark.asyncio(loop_scope="module")
async def test_without_compaction_the_same_session_hits_the_context_limit(engine):
    session = engine.open_session()
    await turn(engine, session.id, "p" * 40)
    with pytest.raises(SessionError) as e:
        for i in range(12):
            await turn(engine, session.id, f"{i:02d}" + "o" * 28)
    assert e.value.status == 413 and "keys" in str(e.value)
    assert engine.session_epoch(session) == {"start": 0, "kept": []}
    engine.close_session(session.id)


@pytest.mark.asyncio(loop_scope="module")
async def test_turn_mode_scores_the_response_and_keeps_its_share(engine):
    session = engine.open_session(compaction=SessionCompaction(mode="turn", keep_ratio=0.5))
    await turn(engine, session.id, "p" * 20)
    await turn(engine, session.id, "a" * 20)
    await _scored(session)
    assert session.mass is not None and session.mass.sum() > 0  # the latest response's scores
    before = engine.session_kv_tokens(session)
    await turn(engine, session.id, "b" * 20)
    # turn 1 (8 generated + 20 appended = 28 keys) was thinned to 14
    assert before + 20 + 8 - engine.session_kv_tokens(session) == 14
    assert engine.stats["session_compactions"] >= 1
    engine.close_session(session.id)


@pytest.mark.asyncio(loop_scope="module")
async def test_rewind_into_compacted_history_starts_a_new_epoch(engine):
    session = engine.open_session(compaction=SessionCompaction(mode="markovian"))
    for text in ("p" * 20, "a" * 20, "b" * 20, "c" * 20):
        await turn(engine, session.id, text)
    epoch = engine.session_epoch(session)
    assert epoch["start"] > 60
    engine.rewind_session(session.id, 50)
    assert engine.session_epoch(session) == {"start": 50, "kept": [[0, 20]]}
    assert engine.session_kv_tokens(session) == 20
    out = await turn(engine, session.id, "d" * 10)  # generates from the rewound state
    assert len(out.token_ids) == 8 and len(session.tokens) == 50 + 10 + 8
    engine.close_session(session.id)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_closed_compacted_slot_is_never_reused_as_a_prefix(engine):
    session = engine.open_session(compaction=SessionCompaction(mode="markovian"))
    for text in ("q" * 20, "a" * 20, "b" * 20):
        await turn(engine, session.id, text)
    tokens = list(session.tokens)
    engine.close_session(session.id)
    # the same prompt as a plain request: nothing cached (the slot's keys are not a prefix)
    (out,) = await engine.generate(tokens + TOK.encode("x"), greedy(4))
    assert out.cached_tokens == 0


@pytest.mark.asyncio(loop_scope="module")
async def test_concurrent_compacting_sessions_share_the_engine(engine):
    sessions = [
        engine.open_session(compaction=SessionCompaction(mode=m, kv_budget=60))
        for m in ("markovian", "turn", "budget")
    ]

    async def run(session):
        for i in range(5):
            await turn(engine, session.id, f"{i}" * 15)
        return engine.session_kv_tokens(session)

    held = await asyncio.gather(*(run(s) for s in sessions))
    assert all(0 < h < 5 * 23 for h in held)
    for s in sessions:
        engine.close_session(s.id)
