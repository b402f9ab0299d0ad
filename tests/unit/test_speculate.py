"""Speculative decoding by prompt lookup (`EngineConfig.speculate`): the guesses themselves,
and an engine that verifies them makes the tokens of plain decoding, greedy and seeded
sampling alike, with stops, lengths and logprobs as before.

The engines here are told that a verify call costs nothing (so they verify whenever they
have a guess) or a fortune (so they never do): what they decide from their own warm-up
timings depends on the machine, and the tokens must not."""

import asyncio

import numpy as np
import pytest
import pytest_asyncio

from serving.engine import Engine, EngineConfig, SamplingParams
from serving.engine.speculate import Lookup
from tests.unit.test_engine import BASE, TOK, greedy, make_model, prompt, ref_greedy

ASYNC = pytest.mark.asyncio(loop_scope="module")

SEQ = 256
K = 6
CFG = EngineConfig(num_slots=8, max_seq_len=SEQ, prefill_chunk=32, prefill_batch=2, speculate=K)


# ----- the guesses ----------------------------------------------------------------------------


def test_a_repeated_phrase_is_guessed_to_go_on_as_before():
    ctx = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    look = Lookup((3, 2, 1), [])
    assert look.guess(ctx, 0, 4) == [4, 5, 9, 9]  # after the earlier 1 2 3
    assert Lookup((3, 2, 1), []).guess([7, 8, 9], 0, 4) == []  # nothing occurred before


def test_the_longest_suffix_wins_at_its_latest_occurrence():
    # "2 3" was followed by 4 early and by 8 later; the 3-gram "1 2 3" only by 4
    ctx = [1, 2, 3, 4, 0, 2, 3, 8, 8, 8, 8, 0, 1, 2, 3]
    assert Lookup((3, 2, 1), []).guess(ctx, 0, 3) == [4, 0, 2]
    assert Lookup((2, 1), []).guess(ctx, 0, 3) == [8, 8, 8]


def test_a_loop_is_guessed_to_go_on_looping():
    # the copy overlaps itself: a suffix last seen p tokens back repeats the last p tokens
    assert Lookup((3,), []).guess([5, 6] + [7] * 6, 0, 4) == [7, 7, 7, 7]
    assert Lookup((2,), []).guess([9, 1, 2, 1, 2], 0, 5) == [1, 2, 1, 2, 1]


def test_the_index_grows_with_the_completion():
    prompt_ids = [1, 2, 3, 4]
    look = Lookup((2, 1), list(prompt_ids))
    assert look.guess([], 4, 3) == []
    assert look.guess([1, 2], 4, 3) == [3, 4, 1]  # the completion repeats the prompt's start
    assert look.context == [1, 2, 3, 4, 1, 2]


def test_observed_guesses_set_the_expected_keep():
    look = Lookup((1,), [])
    prior = look.expected(4)  # rate 1/2: 1/2 + 1/4 + 1/8 + 1/16
    assert prior == pytest.approx(0.9375)
    assert look.observe([1, 2, 3], [1, 2, 5, 6]) == 2  # two confirmed, then a miss
    assert (look.hits, look.misses) == (2, 1)
    assert look.observe([1, 2], [1]) == 1  # only one token came: no miss seen
    assert (look.hits, look.misses) == (3, 1)
    assert look.expected(4) > prior and look.expected(0) == 0.0


BAD = [("speculate", -1), ("speculate", 33), ("speculate_ngram", 0), ("speculate_ngram", 9)]


@pytest.mark.parametrize("field,value", BAD)
def test_bad_speculation_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"EngineConfig.{field}="):
        EngineConfig(**{field: value})


# ----- the engine -----------------------------------------------------------------------------


async def _started(cfg: EngineConfig, verify_cost: float | None) -> Engine:
    eng = Engine(make_model(0), TOK, cfg)
    await eng.start()
    if verify_cost is not None:
        eng.speculator.verify_cost = dict.fromkeys(eng.speculator.verify_cost, verify_cost)
    return eng


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def eager():
    """Verifies whenever any slot has a guess."""
    eng = await _started(CFG, 0.0)
    yield eng
    await eng.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def plain():
    eng = await _started(
        EngineConfig(num_slots=8, max_seq_len=SEQ, prefill_chunk=32, prefill_batch=2), None
    )
    yield eng
    await eng.stop()


def copying_prompts() -> list[list[int]]:
    """Prompts that repeat a phrase (what the simulator's observations do), and plain ones."""
    rng = np.random.default_rng(5)
    out = []
    for i in range(6):
        phrase = rng.integers(97, 123, 4 + i).tolist()
        out.append(phrase * (3 + i % 3))
    return out + [prompt(40, seed=61), prompt(3, seed=62)]


async def _run(engine: Engine, prompts, params: SamplingParams):
    outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    return [out for (out,) in outs]


@ASYNC
async def test_verified_greedy_tokens_are_plain_decodings(eager):
    prompts = copying_prompts()
    before = dict(eager.stats)
    outs = await _run(eager, prompts, greedy(48, logprobs=3))
    assert [o.token_ids for o in outs] == ref_greedy(BASE, prompts, 48)
    assert eager.stats["spec_steps"] > before["spec_steps"]
    kept = eager.stats["spec_kept"] - before["spec_kept"]
    guessed = eager.stats["spec_guessed"] - before["spec_guessed"]
    assert 0 < kept <= guessed


@ASYNC
async def test_verified_samples_and_logprobs_are_plain_decodings(eager, plain):
    prompts = copying_prompts()
    for params in (
        greedy(40, logprobs=2),
        SamplingParams(temperature=0.7, max_tokens=40, seed=9, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=3, max_tokens=40, seed=4, ignore_eos=True),
    ):
        spec, ref = await _run(eager, prompts, params), await _run(plain, prompts, params)
        for a, b in zip(spec, ref, strict=True):
            assert a.token_ids == b.token_ids
            # chunked vs one-token forwards: f32 sums in another order (~1e-6 relative)
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
            assert [[i for i, _ in t] for t in a.top_logprobs] == [
                [i for i, _ in t] for t in b.top_logprobs
            ]


@ASYNC
async def test_stops_and_lengths_inside_a_verified_call(eager, plain):
    prompts = copying_prompts()
    (ref,) = await plain.generate(prompts[0], greedy(30))
    text = TOK.decode(ref.token_ids)
    stop = text[7:9]  # a stop string within the completion: cut there, as without guesses
    for params in (
        greedy(13),
        greedy(30, stop=[stop]),
        greedy(30, stop_token_ids=[ref.token_ids[11]]),
    ):
        spec, want = await _run(eager, prompts, params), await _run(plain, prompts, params)
        for a, b in zip(spec, want, strict=True):
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)


@ASYNC
async def test_a_slot_near_its_end_decodes_instead(eager):
    # the first call may verify; once fewer than K + 1 keys fit, plain decode steps follow
    p = prompt(SEQ - 10, seed=70)
    (out,) = await eager.generate(p, greedy(10))
    assert out.finish_reason == "length" and len(out.token_ids) == 10
    assert out.token_ids == ref_greedy(BASE, [p], 10)[0]


@ASYNC
async def test_an_engine_that_finds_verifying_dear_never_does():
    eng = await _started(CFG, 1e9)
    try:
        outs = await _run(eng, copying_prompts(), greedy(24))
        assert eng.stats["spec_steps"] == 0 and eng.traces["verify"] == 1  # its warm-up only
        assert [o.token_ids for o in outs] == ref_greedy(BASE, copying_prompts(), 24)
    finally:
        await eng.stop()
