"""The continuous-batching engine against a plain greedy loop over the full model: chunked
prefill, 64 queued requests, seeded sampling, logprobs, stops, prefix reuse, no recompiles,
aborts, hot weight reload and input validation.

The tiny model is initialised with a wider `initializer_range` than the default: at 0.02 its
logits are nearly flat and greedy decoding repeats one byte whatever the prompt, which would
make every equality below hold vacuously.
"""

import asyncio
import dataclasses
import gc
import sys
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import pytest_asyncio
from flax import nnx

from rl.data import ByteTokenizer
from rl.model import Qwen3, jit_forward, tiny
from rl.model.params_io import save_params
from serving.engine import Engine, EngineConfig, EngineError, SamplingParams, SequenceOutput
from tests.fakes import wait_until

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOK = ByteTokenizer()
V = TOK.vocab_size  # 261 < the model's 512 embedding rows
SEQ = 256
CFG = EngineConfig(num_slots=8, max_seq_len=SEQ, prefill_chunk=32, prefill_batch=2)
# Same shapes, no prefix reuse, and a max_tokens clamp.
CAP = 40
CFG_B = EngineConfig(
    num_slots=8,
    max_seq_len=SEQ,
    prefill_chunk=32,
    prefill_batch=2,
    prefix_reuse=False,
    max_tokens_cap=CAP,
)


def make_model(seed: int = 0, **overrides) -> Qwen3:
    return Qwen3(tiny(initializer_range=0.3, **overrides), rngs=nnx.Rngs(seed))


BASE = make_model(0)
OTHER = make_model(1)
WARM_TRACES: dict[str, dict[str, int]] = {}

# XLA compilations in this process: `engine.traces` counts retraces only, not a recompile of a
# cached trace for differently placed arguments.
COMPILES = [0]


def _count_compiles(event: str, duration_s: float, **_) -> None:
    if "backend_compile" in event:
        COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, length).tolist()


# ----- the reference: full forward passes, no cache -----------------------------------------

_FORWARD: dict[int, object] = {}
REF_ROWS = 8


def _logits(model: Qwen3, seqs: list[list[int]]) -> list[np.ndarray]:
    """Per sequence, the logits [len, V] over the tokenizer's vocabulary (fixed shapes)."""
    if id(model) not in _FORWARD:
        _FORWARD[id(model)] = jit_forward(model)
    forward = _FORWARD[id(model)]
    out = []
    for start in range(0, len(seqs), REF_ROWS):
        group = seqs[start : start + REF_ROWS]
        tokens = np.zeros((REF_ROWS, SEQ), np.int32)
        for i, s in enumerate(group):
            tokens[i, : len(s)] = s
        logits = np.asarray(forward(tokens))
        out += [logits[i, : len(s), :V] for i, s in enumerate(group)]
    return out


def ref_greedy(model: Qwen3, prompts: list[list[int]], steps: int) -> list[list[int]]:
    seqs = [list(p) for p in prompts]
    for _ in range(steps):
        for s, logits in zip(seqs, _logits(model, seqs), strict=True):
            s.append(int(np.argmax(logits[-1])))
    return [s[len(p) :] for s, p in zip(seqs, prompts, strict=True)]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


# ----- engines --------------------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine():
    eng = Engine(make_model(0), TOK, CFG)
    await eng.start()
    WARM_TRACES["engine"] = dict(eng.traces)
    yield eng
    await eng.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine_b():
    eng = Engine(BASE, TOK, CFG_B)  # the engine never modifies the model it serves
    await eng.start()
    WARM_TRACES["engine_b"] = dict(eng.traces)
    yield eng
    await eng.stop()


async def gen(engine: Engine, p: list[int], params: SamplingParams, n: int = 1):
    return await engine.submit(p, params, n=n).result()


# ----- greedy correctness ----------------------------------------------------------------------


async def test_greedy_matches_a_plain_loop_over_the_model(engine):
    # 1 token (nothing to prefill), short, exactly one chunk, and several chunks.
    lengths = [1, 2, 9, 31, 32, 33, 65, 150]
    prompts = [prompt(n, seed=100 + n) for n in lengths]
    outs = await asyncio.gather(*(gen(engine, p, greedy(12)) for p in prompts))
    want = ref_greedy(BASE, prompts, 12)
    for p, (out,), ref in zip(prompts, outs, want, strict=True):
        assert out.token_ids == ref, f"prompt of {len(p)} tokens"
        assert out.finish_reason == "length"
        assert out.prompt_tokens == len(p)
        assert out.text == TOK.decode(ref)
    assert len({tuple(r) for r in want}) == len(want)  # the prompts really steer the model


async def test_steps_touch_only_the_live_keys_whatever_the_pool_length(engine):
    """A slot pool four times longer reads the same blocks of held keys for the same live
    lengths: the same tokens, and logprobs equal up to float32 rounding of sums over a few
    hundred terms (slots may sit at other batch rows). A step reads the blocks its longest
    row needs, never the pool's whole length, and the long pool compiles no more programs
    than the short one."""
    from rl.model.transformer import HELD_BLOCK

    def blocks(keys: int) -> int:
        return -(-keys // HELD_BLOCK)

    long = Engine(
        BASE, TOK, EngineConfig(num_slots=8, max_seq_len=4 * SEQ, prefill_chunk=32, prefill_batch=2)
    )
    pool = blocks(4 * SEQ)
    assert pool >= 4 * blocks(242), "the long pool must hold blocks no step here needs"
    await long.start()
    try:
        assert long.traces["decode"] == engine.traces["decode"] == 2  # 1 and 4 steps
        prompts = [prompt(n, seed=900 + n) for n in (20, 100, 230)]
        params = greedy(12, logprobs=2)
        short_outs = await asyncio.gather(*(gen(engine, p, params) for p in prompts))
        long_outs = await asyncio.gather(*(gen(long, p, params) for p in prompts))
        for (a,), (b,) in zip(short_outs, long_outs, strict=True):
            assert a.token_ids == b.token_ids
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        decode = {n for kind, n in long.block_reads if kind == "decode"}
        # the longest row holds 230 prompt keys and at most 11 generated ones
        assert blocks(230) <= max(decode) <= blocks(241) and min(decode) >= 1
        # first chunks read no held keys; later ones at most the 230 prompt keys
        prefill = {n for kind, n in long.block_reads if kind == "prefill"}
        assert 0 in prefill and max(prefill) <= blocks(230)
        long.block_reads.clear()
        (out,) = await gen(long, prompt(600, seed=9), greedy(12))
        assert len(out.token_ids) == 12
        decode = {n for kind, n in long.block_reads if kind == "decode"}
        assert blocks(600) <= max(decode) <= blocks(611) < pool
        last_chunk_held = (600 - 1) // 32 * 32  # the keys before the prompt's last chunk
        prefill = {n for kind, n in long.block_reads if kind == "prefill"}
        assert max(prefill) == blocks(last_chunk_held)
        assert long.traces["decode"] == 2, "a longer context compiled nothing new"
    finally:
        await long.stop()


async def test_64_queued_requests_complete_and_match_their_solo_runs(engine, engine_b):
    rng = np.random.default_rng(7)
    base = prompt(40, seed=3)
    prompts, limits = [], []
    for i in range(64):
        if i % 8 == 0:  # shares a 40-token prefix with a sibling in flight (copied KV)
            p = base + prompt(int(rng.integers(1, 30)), seed=500 + i)
        else:
            p = prompt(int(rng.integers(1, 120)), seed=500 + i)
        prompts.append(p)
        limits.append(int(rng.integers(2, 24)))
    handles = [engine.submit(p, greedy(m)) for p, m in zip(prompts, limits, strict=True)]
    assert engine.queue_depth + engine.active_slots == 64  # 8 slots: most of them wait
    batched = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 120)
    assert engine.active_slots == 0 and engine.queue_depth == 0
    for p, m, (out,) in zip(prompts, limits, batched, strict=True):
        assert out.finish_reason == "length" and len(out.token_ids) == m
        (solo,) = await gen(engine_b, p, greedy(m))  # alone in its engine
        assert out.token_ids == solo.token_ids, f"prompt of {len(p)} tokens"
    assert any(out.cached_tokens >= 40 for (out,) in batched[8::8])


async def test_decode_calls_dispatched_ahead_change_no_token(engine):
    prompts = [prompt(5 + 7 * i, seed=300 + i) for i in range(6)]
    kinds = (
        greedy(40),
        SamplingParams(temperature=1.0, max_tokens=37, seed=77, logprobs=2, ignore_eos=True),
    )

    async def run() -> list[SequenceOutput]:
        outs = await asyncio.gather(*(gen(engine, p, q) for p in prompts for q in kinds))
        return [out for (out,) in outs]

    before = engine.stats["ahead_steps"]
    ahead = await run()
    assert engine.stats["ahead_steps"] > before  # calls really went ahead of their delivery
    engine.cfg = dataclasses.replace(engine.cfg, overlap=False)
    try:
        before = engine.stats["ahead_steps"]
        in_turn = await run()
        assert engine.stats["ahead_steps"] == before
    finally:
        engine.cfg = dataclasses.replace(engine.cfg, overlap=True)
    for a, b in zip(ahead, in_turn, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert [[i for i, _ in t] for t in a.top_logprobs] == [
            [i for i, _ in t] for t in b.top_logprobs
        ]
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert [o.token_ids for o in ahead[::2]] == ref_greedy(BASE, prompts, 40)


async def test_n_greedy_samples_are_identical(engine):
    p = prompt(45, seed=8)
    (ref,) = ref_greedy(BASE, [p], 10)
    outs = await gen(engine, p, greedy(10), n=5)
    assert [o.index for o in outs] == list(range(5))
    assert all(o.token_ids == ref for o in outs)


# ----- sampling ---------------------------------------------------------------------------------


async def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(engine):
    p = prompt(20, seed=11)
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=123, ignore_eos=True)
    (first,) = await gen(engine, p, params)
    (again,) = await gen(engine, p, params)
    assert again.token_ids == first.token_ids
    assert again.logprobs == pytest.approx(first.logprobs, abs=1e-5)

    noise = [
        SamplingParams(temperature=0.0, max_tokens=30),
        SamplingParams(temperature=1.3, top_k=5, max_tokens=30),
        SamplingParams(temperature=0.8, top_p=0.7, max_tokens=30, seed=5),
        SamplingParams(temperature=1.0, max_tokens=30),
    ]
    crowd = [engine.submit(prompt(7 + 9 * i, seed=i), q, n=2) for i, q in enumerate(noise)]
    mine = engine.submit(p, params)
    crowd.append(engine.submit(prompt(70, seed=12), noise[1]))
    (busy,) = await mine.result()
    await asyncio.gather(*(h.result() for h in crowd))
    assert busy.token_ids == first.token_ids

    (other,) = await gen(
        engine, p, SamplingParams(temperature=1.0, max_tokens=24, seed=124, ignore_eos=True)
    )
    assert other.token_ids != first.token_ids


async def test_n_seeded_samples_are_distinct_and_reproducible(engine):
    p = prompt(30, seed=13)
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=7, ignore_eos=True)
    outs = await gen(engine, p, params, n=3)
    samples = [tuple(o.token_ids) for o in outs]
    assert len(set(samples)) == 3
    assert [tuple(o.token_ids) for o in await gen(engine, p, params, n=3)] == samples


async def test_logprobs_are_the_models_log_softmax(engine):
    for length, seed in [(10, 21), (40, 22)]:
        p = prompt(length, seed=seed)
        params = SamplingParams(
            temperature=1.0, max_tokens=16, seed=seed, logprobs=5, ignore_eos=True
        )
        (out,) = await gen(engine, p, params)
        (logits,) = _logits(BASE, [p + out.token_ids])
        ref = log_softmax(logits[len(p) - 1 : -1])  # the distribution of each generated token
        for j, tok in enumerate(out.token_ids):
            assert tok < V
            assert out.logprobs[j] == pytest.approx(ref[j, tok], abs=1e-4)
            ids = [i for i, _ in out.top_logprobs[j]]
            values = [lp for _, lp in out.top_logprobs[j]]
            assert values == sorted(values, reverse=True)
            assert ids == np.argsort(-ref[j])[:5].tolist()
            np.testing.assert_allclose(values, ref[j, ids], atol=1e-4)

    # Greedy: the argmax with the untempered logprob; temperature 0.5: logits / 0.5.
    p = prompt(25, seed=23)
    (g,) = await gen(engine, p, greedy(8, logprobs=2))
    (logits,) = _logits(BASE, [p + g.token_ids])
    ref = log_softmax(logits[len(p) - 1 : -1])
    np.testing.assert_allclose(g.logprobs, ref.max(axis=-1), atol=1e-4)
    params = SamplingParams(temperature=0.5, max_tokens=8, seed=1, ignore_eos=True)
    (t,) = await gen(engine, p, params)
    (logits,) = _logits(BASE, [p + t.token_ids])
    ref = log_softmax(logits[len(p) - 1 : -1] / 0.5)
    np.testing.assert_allclose(t.logprobs, ref[np.arange(8), t.token_ids], atol=1e-4)


async def test_top_k_one_and_tiny_top_p_decode_greedily(engine):
    p = prompt(18, seed=31)
    (ref,) = ref_greedy(BASE, [p], 12)
    for q in [dict(top_k=1), dict(top_p=1e-6), dict(top_k=1, temperature=2.0)]:
        q = dict(dict(temperature=1.0, seed=9, max_tokens=12, ignore_eos=True), **q)
        (out,) = await gen(engine, p, SamplingParams(**q))
        assert out.token_ids == ref, q
        assert out.logprobs == pytest.approx([0.0] * 12, abs=1e-6)  # renormalised: 1 token
    params = SamplingParams(
        temperature=1.0, top_k=3, seed=4, max_tokens=12, logprobs=3, ignore_eos=True
    )
    (out,) = await gen(engine, p, params)
    for top in out.top_logprobs:  # the alternatives are exactly the kept set
        assert sum(np.exp(lp) for _, lp in top) == pytest.approx(1.0, abs=1e-5)


# ----- stopping ---------------------------------------------------------------------------------


def _printable(tok: int) -> bool:
    return 33 <= tok < 127


async def test_stop_token_ids_and_stop_strings(engine):
    p = prompt(12, seed=41)
    (full,) = await gen(engine, p, greedy(60))
    ids, text = full.token_ids, full.text
    assert full.finish_reason == "length" and len(ids) == 60

    # A stop token ends generation at its first occurrence; it stays in token_ids only.
    stop_tok = ids[5]
    first = ids.index(stop_tok)
    (out,) = await gen(engine, p, greedy(60, stop_token_ids=(stop_tok,)))
    assert out.finish_reason == "stop"
    assert out.token_ids == ids[: first + 1]
    assert out.text == TOK.decode(ids[:first])

    # A stop string (two printable bytes): cut from the text, the tokens up to it kept.
    j = next(i for i in range(3, 58) if _printable(ids[i]) and _printable(ids[i + 1]))
    stop = TOK.decode(ids[j : j + 2])
    cut = text.index(stop)
    k = next(m for m in range(1, 61) if stop in TOK.decode(ids[:m]))
    (out,) = await gen(engine, p, greedy(60, stop=("\x00never", stop)))
    assert out.finish_reason == "stop"
    assert out.text == text[:cut]
    assert out.token_ids == ids[:k]

    # max_tokens: "length" after exactly that many.
    (out,) = await gen(engine, p, greedy(7))
    assert out.finish_reason == "length" and out.token_ids == ids[:7]


async def test_eos_stops_unless_ignored(engine):
    # Seeded samples are reproducible, so the same request with and without ignore_eos draws
    # the same tokens up to the first end of turn.
    p = prompt(12, seed=42)
    q = dict(temperature=1.0, max_tokens=200, seed=3)
    free = await gen(engine, p, SamplingParams(ignore_eos=True, **q), n=8)
    stopped = await gen(engine, p, SamplingParams(**q), n=8)
    eos = TOK.eos_id
    assert any(eos in o.token_ids for o in free)
    for f, s in zip(free, stopped, strict=True):
        if eos in f.token_ids:
            end = f.token_ids.index(eos)
            assert s.finish_reason == "stop"
            assert s.token_ids == f.token_ids[: end + 1]
            assert s.text == TOK.decode(f.token_ids[:end])
        else:
            assert s.finish_reason == "length" and s.token_ids == f.token_ids


async def test_max_tokens_cap_clamps(engine_b):
    p = prompt(10, seed=51)
    (out,) = await gen(engine_b, p, greedy(CAP + 50))
    assert out.finish_reason == "length" and len(out.token_ids) == CAP
    (out,) = await gen(engine_b, p, SamplingParams(temperature=0.0, ignore_eos=True))
    assert len(out.token_ids) == CAP  # the default (256) is clamped too
    (out,) = await gen(engine_b, p, greedy(5))
    assert len(out.token_ids) == 5


# ----- prefix reuse -----------------------------------------------------------------------------


async def test_prefix_reuse_of_a_finished_turn(engine, engine_b):
    p1 = prompt(45, seed=61)  # two prefill chunks
    (c1,) = await gen(engine, p1, greedy(10))
    p2 = p1 + c1.token_ids + prompt(20, seed=62)
    (out,) = await gen(engine, p2, greedy(12))
    assert out.cached_tokens == len(p1) + len(c1.token_ids) - 1
    (cold,) = await gen(engine_b, p2, greedy(12))
    assert cold.cached_tokens == 0
    assert out.token_ids == cold.token_ids == ref_greedy(BASE, [p2], 12)[0]


async def test_prefix_reuse_from_a_busy_slot(engine, engine_b):
    p1 = prompt(50, seed=63)
    generated = engine.stats["generated_tokens"]
    long = engine.submit(p1, greedy(150))
    assert await wait_until(lambda: engine.stats["generated_tokens"] > generated)  # prefilled
    assert engine.active_slots == 1
    (first_token,) = ref_greedy(BASE, [p1], 1)[0]
    p3 = p1 + [(first_token + 1) % 256] + prompt(9, seed=64)  # leaves the busy slot at p1
    (out,) = await gen(engine, p3, greedy(12))
    assert out.cached_tokens == len(p1)
    (cold,) = await gen(engine_b, p3, greedy(12))
    assert out.token_ids == cold.token_ids
    (first,) = await long.result()
    (solo,) = await gen(engine_b, p1, greedy(CAP))
    assert first.token_ids[:CAP] == solo.token_ids  # the source slot was not disturbed


async def test_a_group_arriving_together_prefills_its_prompt_once(engine, engine_b):
    """An RL group's samples are separate requests with one prompt, sent at once: the first
    is prefilled, the others wait for it and copy its KV, and all match a cold run."""
    engine.reset_prefix_cache()
    group = prompt(70, seed=65)  # three prefill chunks of 32
    others = [prompt(50, seed=66 + i) for i in range(2)]
    chunks = sum(engine.block_reads[k] for k in engine.block_reads if k[0] == "prefill")
    handles = [engine.submit(p, greedy(6)) for p in [group, *others, group, group, group]]
    outs = [out for (out,) in await asyncio.gather(*(h.result() for h in handles))]
    prefills = sum(engine.block_reads[k] for k in engine.block_reads if k[0] == "prefill") - chunks
    assert [o.cached_tokens for o in outs] == [0, 0, 0, 69, 69, 69]
    # prefill_batch 2: the group's 3 chunks and the others' 2 each, paired up (copies aside)
    assert prefills <= 4, prefills
    (cold,) = await gen(engine_b, group, greedy(6))
    assert all(o.token_ids == cold.token_ids for o in (outs[0], *outs[3:]))


# ----- compilation ------------------------------------------------------------------------------


async def test_no_recompiles_after_warmup(engine, engine_b):
    compiles = COMPILES[0]
    lengths = [1, 2, 15, 16, 17, 31, 32, 33, 64, 100, 200, 254]
    reqs = []
    for i, n in enumerate(lengths):
        p = prompt(n, seed=700 + i)
        room = SEQ - n
        q = SamplingParams(
            temperature=[0.0, 1.0, 0.7][i % 3],
            top_k=[0, 3][i % 2],
            top_p=[1.0, 0.8, 0.5][i % 3],
            seed=i,
            logprobs=[0, 3, 20][i % 3],
            max_tokens=min(room, 3 + i),
            stop=("zz",),
        )
        reqs.append(engine.submit(p, q, n=[1, 2, 3, 6][i % 4]))
    reqs.append(engine.submit(prompt(40, seed=9), greedy(20), n=8))
    await asyncio.gather(*(r.result() for r in reqs))
    await asyncio.gather(
        *(gen(engine_b, prompt(n, seed=n), greedy(min(4, SEQ - n)), n=3) for n in lengths)
    )
    assert engine.traces == WARM_TRACES["engine"]
    assert engine_b.traces == WARM_TRACES["engine_b"]
    assert COMPILES[0] == compiles


# ----- aborts -----------------------------------------------------------------------------------


async def test_cancelling_the_task_aborts_and_frees_the_slot(engine):
    aborted = engine.stats["aborted"]
    handle = engine.submit(prompt(20, seed=81), greedy(200))
    task = asyncio.create_task(handle.result())
    generated = engine.stats["generated_tokens"]
    assert await wait_until(lambda: engine.stats["generated_tokens"] >= generated + 2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    steps = engine.stats["steps"]
    assert await wait_until(lambda: engine.active_slots == 0, timeout_s=2.0)
    # Freed before the step after the ones in flight: the call running and the one the loop
    # dispatched ahead of its delivery (`EngineConfig.overlap`); nothing goes ahead of an abort.
    assert engine.stats["steps"] <= steps + 2
    (out,) = await handle.result()
    assert out.finish_reason == "abort"
    assert 2 <= len(out.token_ids) < 200
    assert engine.stats["aborted"] == aborted + 1


async def test_engine_abort_ends_a_stream(engine):
    handle = engine.submit(prompt(20, seed=82), greedy(200), n=2)
    seen, finished, steps = 0, [], None
    async for event in handle.stream():
        if isinstance(event, SequenceOutput):
            finished.append(event)
            continue
        seen += 1
        if seen == 3:
            engine.abort(handle.id)
            steps = engine.stats["steps"]
    assert sorted(o.index for o in finished) == [0, 1]
    assert all(o.finish_reason == "abort" and len(o.token_ids) < 200 for o in finished)
    assert await wait_until(lambda: engine.active_slots == 0, timeout_s=2.0)
    assert engine.stats["steps"] <= steps + 2  # the calls in flight, as above


async def test_abort_while_waiting_for_a_slot(engine):
    busy = engine.submit(prompt(10, seed=83), greedy(200), n=8)
    assert await wait_until(lambda: engine.active_slots == 8)
    waiting = engine.submit(prompt(10, seed=84), greedy(10))
    await asyncio.sleep(0.05)
    assert engine.queue_depth == 1
    engine.abort(waiting.id)
    (out,) = await waiting.result()
    assert out.finish_reason == "abort" and out.token_ids == []
    assert engine.queue_depth == 0
    engine.abort(busy.id)
    outs = await busy.result()
    assert [o.finish_reason for o in outs] == ["abort"] * 8
    assert await wait_until(lambda: engine.active_slots == 0, timeout_s=2.0)


# ----- weights ----------------------------------------------------------------------------------


async def test_hot_weight_reload(engine, tmp_path):
    p = prompt(15, seed=91)
    (before,) = await gen(engine, p, greedy(16))
    v0 = engine.version
    save_params(OTHER, tmp_path / "v1")
    compiles = COMPILES[0]

    # A reload while a sequence decodes: its tokens say which weights made them.
    long = engine.submit(p, greedy(200))
    generated = engine.stats["generated_tokens"]
    assert await wait_until(lambda: engine.stats["generated_tokens"] >= generated + 3)
    assert await engine.load_weights(tmp_path / "v1", v0 + 1) == v0 + 1
    assert engine.version == v0 + 1
    (mixed,) = await long.result()
    (after,) = await gen(engine, p, greedy(16))
    chunked = await gen(engine, prompt(70, seed=92), greedy(8), n=3)
    assert engine.traces == WARM_TRACES["engine"]
    assert COMPILES[0] == compiles  # new weights, the same compiled steps

    k = mixed.versions.count(v0)
    assert 3 <= k < 200
    assert mixed.versions == [v0] * k + [v0 + 1] * (200 - k)
    (ref,) = ref_greedy(BASE, [p], 20)
    assert mixed.token_ids[: min(k, 20)] == ref[: min(k, 20)]  # the old weights' tokens
    assert after.token_ids != before.token_ids
    assert after.token_ids == ref_greedy(OTHER, [p], 16)[0]
    assert after.cached_tokens == 0  # no KV computed by the old weights is reused
    assert after.versions == [v0 + 1] * 16
    (ref,) = ref_greedy(OTHER, [prompt(70, seed=92)], 8)
    assert [o.token_ids for o in chunked] == [ref] * 3

    # Refused: an old or equal version, a missing checkpoint, another architecture.
    for version in (v0, v0 + 1):
        with pytest.raises(EngineError) as err:
            await engine.load_weights(tmp_path / "v1", version)
        assert err.value.field == "version"
    with pytest.raises(FileNotFoundError):
        await engine.load_weights(tmp_path / "missing", v0 + 2)
    save_params(make_model(2, num_layers=1), tmp_path / "shallow")
    with pytest.raises(ValueError, match="architecture") as err:
        await engine.load_weights(tmp_path / "shallow", v0 + 2)
    assert not isinstance(err.value, EngineError)
    assert engine.version == v0 + 1
    (still,) = await gen(engine, p, greedy(16))
    assert still.token_ids == after.token_ids

    # Back to the original weights (other tests share this engine).
    save_params(BASE, tmp_path / "v2")
    await engine.load_weights(tmp_path / "v2", v0 + 2)
    (restored,) = await gen(engine, p, greedy(16))
    assert restored.token_ids == before.token_ids


def _holders(obj, depth: int = 3) -> list:
    """What refers to `obj`, a few levels up (types and frames), for a failure message."""
    out = []
    for r in gc.get_referrers(obj):
        if isinstance(r, type(sys._getframe())):
            out.append(f"frame {r.f_code.co_name} {r.f_code.co_filename}:{r.f_lineno}")
        elif isinstance(r, list) and any(x is obj for x in r) and len(r) < 100:
            out.append(f"list[{len(r)}]" + (f" <- {_holders(r, depth - 1)}" if depth else ""))
        else:
            out.append(type(r).__name__ + (f" <- {_holders(r, depth - 1)}" if depth else ""))
    return out[:8]


async def test_a_replaced_version_is_freed_at_once_not_by_the_cyclic_gc(engine, tmp_path):
    """Reloading leaves no reference cycle holding the replaced weights: a server that
    publishes every step would otherwise hold versions (and, on a CPU device, the host
    buffers they alias) until the cyclic GC happens to run."""
    save_params(OTHER, tmp_path / "other")
    save_params(BASE, tmp_path / "base")
    gc.collect()
    gc.disable()
    try:
        await engine.load_weights(tmp_path / "other", engine.version + 1)
        replaced = [weakref.ref(x) for x in jax.tree.leaves(engine._state)]
        await engine.load_weights(tmp_path / "base", engine.version + 1)  # back to BASE
        alive = [r() for r in replaced if r() is not None]
        assert not alive, f"{len(alive)} replaced arrays alive, held by {_holders(alive[0])}"
    finally:
        gc.enable()


# ----- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens,params,n,field",
    [
        ([], greedy(4), 1, "prompt"),
        ([1, 2, -1], greedy(4), 1, "prompt"),
        ([1, 2, 512], greedy(4), 1, "prompt"),
        ([1, V], greedy(4), 1, "prompt"),  # an embedding row the tokenizer has no token for
        ([7] * SEQ, greedy(4), 1, "prompt"),
        ([7] * 300, greedy(4), 1, "prompt"),
        ([7] * 10, greedy(SEQ - 9), 1, "max_tokens"),
        ([7] * 10, greedy(4, logprobs=CFG.max_top_logprobs + 1), 1, "logprobs"),
        ([7] * 10, greedy(4), 0, "n"),
        ([7] * 10, greedy(4), 65, "n"),
    ],
)
async def test_submit_rejects_bad_input_naming_the_field(engine, tokens, params, n, field):
    with pytest.raises(EngineError) as err:
        engine.submit(tokens, params, n=n)
    assert err.value.field == field
    assert field in str(err.value)
    assert engine.queue_depth == 0 and engine.active_slots == 0


async def test_the_largest_request_that_fits_is_served(engine):
    (out,) = await gen(engine, [7] * 10, greedy(SEQ - 10))
    assert out.finish_reason == "length" and len(out.token_ids) == SEQ - 10


async def test_a_bfloat16_engine_holds_its_weights_as_bit_patterns_and_computes_the_same():
    """bf16 weights are held as uint16 bits (XLA:CPU copies bf16 arguments at every call) and
    read back inside each step: the same tokens and logprobs, bit for bit, as the same engine
    holding them as bf16, and a weight reload round-trips them exactly."""
    from rl.model import with_dtype

    half = with_dtype(make_model(0), "bfloat16")
    cfg = EngineConfig(num_slots=4, max_seq_len=64, prefill_chunk=16, prefill_batch=2)
    bits, raw = Engine(half, TOK, cfg), Engine(half, TOK, cfg)
    raw._state = jax.tree.map(
        lambda x: x.view(jnp.bfloat16) if x.dtype == jnp.uint16 else x, raw._state
    )  # as given: from_bits leaves bf16 alone
    assert {x.dtype for x in jax.tree.leaves(bits._state)} == {jnp.dtype(jnp.uint16)}
    assert {x.dtype for x in jax.tree.leaves(raw._state)} == {jnp.dtype(jnp.bfloat16)}
    prompts = [prompt(5 + 9 * i, seed=400 + i) for i in range(4)]
    kinds = (
        greedy(12, logprobs=2),
        SamplingParams(temperature=1.0, max_tokens=12, seed=3, ignore_eos=True),
    )
    outs = []
    for eng in (bits, raw):
        await eng.start()
        try:
            outs.append(await asyncio.gather(*(gen(eng, p, q) for p in prompts for q in kinds)))
        finally:
            await eng.stop()
    for (a,), (b,) in zip(*outs, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    served = bits._served_params()
    assert {x.dtype for x in jax.tree.leaves(served)} == {jnp.dtype(jnp.bfloat16)}
    bits.install_params(served, 1)
    for x, y in zip(jax.tree.leaves(served), jax.tree.leaves(bits._served_params()), strict=True):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint16), np.asarray(y).view(np.uint16))
