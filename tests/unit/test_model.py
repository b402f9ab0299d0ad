"""The decoder: KV-cache decode reproduces the training forward; packing; dtypes; jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rl.model import KVCache, Qwen3, jit_decode, jit_forward, tiny
from rl.model.config import ModelConfig


def _model(cfg: ModelConfig | None = None, seed: int = 0) -> Qwen3:
    return Qwen3(cfg or tiny(), rngs=nnx.Rngs(seed))


def _tokens(shape, vocab, seed=1):
    return jax.random.randint(jax.random.key(seed), shape, 0, vocab)


@pytest.mark.parametrize(
    "cfg",
    [
        tiny(),
        tiny(num_heads=6, num_kv_heads=1, head_dim=8, tie_word_embeddings=False),
        tiny(qk_norm=False, qkv_bias=True, architecture="Qwen2ForCausalLM"),
    ],
    ids=["tiny", "mqa-untied", "qwen2"],
)
def test_prefill_then_decode_matches_training_forward(cfg):
    model = _model(cfg)
    forward, decode = jit_forward(model), jit_decode(model)
    lengths = [5, 9, 3]
    steps = 10
    tokens = _tokens((3, max(lengths) + steps + 1), cfg.vocab_size)
    full_BTV = forward(tokens)

    # Prefill: one padded batch, rows of different prompt lengths.
    cache = model.init_cache(batch=3, max_len=32)
    logits_BTV, cache = decode(tokens[:, : max(lengths)], cache, jnp.array(lengths))
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(logits_BTV[b, :n], full_BTV[b, :n], atol=1e-5, rtol=0)

    # Then one token per step; each row continues from its own length.
    for step in range(steps):
        nxt = jnp.stack([tokens[b, n + step] for b, n in enumerate(lengths)])[:, None]
        logits_BTV, cache = decode(nxt, cache)
        for b, n in enumerate(lengths):
            np.testing.assert_allclose(logits_BTV[b, 0], full_BTV[b, n + step], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [n + steps for n in lengths])


def test_chunked_prefill_equals_one_shot_and_idle_rows_are_untouched():
    cfg = tiny()
    model = _model(cfg)
    decode = jit_decode(model)
    tokens = _tokens((2, 12), cfg.vocab_size)
    full_BTV = jit_forward(model)(tokens)

    cache = model.init_cache(batch=2, max_len=16)
    # Row 1 sits idle (num_new 0) while row 0 prefills in chunks of 4.
    for start in range(0, 12, 4):
        logits_BTV, cache = decode(tokens[:, start : start + 4], cache, jnp.array([4, 0]))
        np.testing.assert_allclose(logits_BTV[0], full_BTV[0, start : start + 4], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [12, 0])
    # Now row 1 prefills in one go and must see none of row 0's keys.
    logits_BTV, cache = decode(tokens, cache, jnp.array([0, 12]))
    np.testing.assert_allclose(logits_BTV[1], full_BTV[1], atol=1e-5)


def test_reset_slot_then_refill_gives_fresh_sequence():
    cfg = tiny()
    model = _model(cfg)
    a = _tokens((1, 6), cfg.vocab_size, seed=3)
    b = _tokens((1, 6), cfg.vocab_size, seed=4)
    cache = model.init_cache(batch=1, max_len=8)
    _, cache = model.decode(a, cache)
    cache = cache.reset_slots(jnp.array([True]))
    assert int(cache.lengths[0]) == 0
    logits_BTV, cache = model.decode(b, cache)
    np.testing.assert_allclose(logits_BTV, model(b), atol=1e-5)


def test_tokens_past_cache_capacity_are_dropped_not_wrapped():
    cfg = tiny()
    model = _model(cfg)
    tokens = _tokens((1, 6), cfg.vocab_size)
    cache = model.init_cache(batch=1, max_len=4)
    _, cache = model.decode(tokens[:, :3], cache)
    k_before = np.asarray(cache.k[:, 0, :3])
    _, cache = model.decode(tokens[:, 3:6], cache)  # only position 3 fits
    assert int(cache.lengths[0]) == 4
    np.testing.assert_array_equal(np.asarray(cache.k[:, 0, :3]), k_before)


def test_packed_segments_equal_separate_sequences():
    cfg = tiny()
    model = _model(cfg)
    a = _tokens((1, 5), cfg.vocab_size, seed=5)
    b = _tokens((1, 7), cfg.vocab_size, seed=6)
    packed = jnp.concatenate([a, b], axis=1)
    positions = jnp.concatenate([jnp.arange(5), jnp.arange(7)])[None]
    segments = jnp.array([[1] * 5 + [2] * 7])
    forward = jit_forward(model)
    logits_BTV = forward(packed, positions, segments)
    np.testing.assert_allclose(logits_BTV[:, :5], forward(a), atol=1e-5)
    np.testing.assert_allclose(logits_BTV[:, 5:], forward(b), atol=1e-5)


def test_output_is_float32_under_bfloat16_compute_and_jits_once():
    cfg = tiny(param_dtype="bfloat16", dtype="bfloat16")
    model = _model(cfg)
    for _, var in nnx.to_flat_state(nnx.state(model)):
        assert var.get_value().dtype == jnp.bfloat16
    graphdef, state = nnx.split(model)
    traces = []

    @jax.jit
    def forward(state, tokens_BT):
        traces.append(1)
        return nnx.merge(graphdef, state)(tokens_BT)

    tokens = _tokens((2, 8), cfg.vocab_size)
    logits_BTV = forward(state, tokens)
    forward(state, tokens + 1)
    assert logits_BTV.dtype == jnp.float32 and logits_BTV.shape == (2, 8, cfg.vocab_size)
    assert len(traces) == 1
    # The same (bf16-rounded) weights computed in float32: bf16 compute stays close.
    ref = _model(tiny(), seed=1)
    nnx.update(ref, jax.tree.map(lambda x: x.astype(jnp.float32), state))
    ref_BTV = jit_forward(ref)(tokens)
    err = float(jnp.abs(logits_BTV - ref_BTV).max())
    assert err < 0.05 * float(ref_BTV.std()), (err, float(ref_BTV.std()))


def test_eager_calls_match_jitted_helpers():
    cfg = tiny()
    model = _model(cfg)
    tokens = _tokens((2, 4), cfg.vocab_size)
    np.testing.assert_allclose(model(tokens), jit_forward(model)(tokens), atol=1e-6)
    eager_BTV, eager_cache = model.decode(tokens, KVCache.create(cfg, batch=2, max_len=8))
    jit_BTV, jit_cache = jit_decode(model)(tokens, KVCache.create(cfg, batch=2, max_len=8))
    np.testing.assert_allclose(eager_BTV, jit_BTV, atol=1e-6)
    np.testing.assert_allclose(eager_cache.k, jit_cache.k, atol=1e-6)


def test_param_count_matches_config_formula():
    for cfg in [tiny(), tiny(tie_word_embeddings=False, qkv_bias=True, qk_norm=False)]:
        model = _model(cfg)
        total = sum(v.get_value().size for _, v in nnx.to_flat_state(nnx.state(model)))
        assert total == cfg.num_params()


def test_bfloat16_projection_accumulates_in_float32_and_rounds_once():
    """`project` in bf16: the exact float32 product of the bf16 inputs, rounded once to bf16.
    The float32 sum of D = 2048 products of bf16 numbers (8-bit significands: each product
    is exact in f32) differs from the exact one by at most D * 2**-24 relative to the sum of
    |terms|, far below bf16's half-ulp (2**-9 relative), so the result is the reference's
    rounding or, at a rounding boundary, its neighbour: within one bf16 ulp (2**-7 relative
    to the value's leading power of two; the bound below adds the f32 error for the
    cancelling sums). Partial sums of 64 terms rounded to bf16 miss these by ~300 ulps."""
    from rl.model.layers import project

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 3, 2048)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((2048, 64)) / 45, jnp.bfloat16)
    y = project("BTD,DF->BTF", x, w)
    assert y.dtype == jnp.bfloat16
    x32, w32 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    exact = np.einsum("btd,df->btf", x32, w32)
    magnitude = np.einsum("btd,df->btf", np.abs(x32), np.abs(w32))
    ulp = 2.0 ** (np.floor(np.log2(np.abs(exact))) - 7)
    err = np.abs(np.asarray(y, np.float64) - exact)
    assert np.all(err <= ulp + 2048 * 2.0**-24 * magnitude), float((err / ulp).max())
    # float32 inputs: exactly the plain einsum
    x, w = x.astype(jnp.float32), w.astype(jnp.float32)
    np.testing.assert_array_equal(project("BTD,DF->BTF", x, w), jnp.einsum("BTD,DF->BTF", x, w))


def test_blocked_causal_attention_equals_plain_attention():
    """Training attention skips the scores above the causal diagonal block by block: the same
    as `attend` over the same keys. Bound: an output is a weighted mean of values in [-1, 1]
    whose f32 sums over n <= 300 terms may round in another order, each within n * 2**-24
    (x2: the normaliser and the weighted sum)."""
    from rl.model.transformer import CAUSAL_BLOCK, attend, attend_causal

    b, t, n, kv, h = 2, 2 * CAUSAL_BLOCK + 44, 4, 2, 16
    rng = np.random.default_rng(0)
    q, k, v = (
        jnp.asarray(rng.uniform(-1, 1, (b, t, heads, h)), jnp.float32) for heads in (n, kv, kv)
    )
    idx = np.arange(t)
    segments = (idx >= 100).astype(int)[None, :] + np.array([[0], [1]]) * (idx >= 250)
    mask = jnp.asarray(
        (idx[:, None] >= idx[None, :]) & (segments[:, :, None] == segments[:, None, :])
    )
    tol = 2 * t * 2.0**-24
    np.testing.assert_allclose(
        attend_causal(q, k, v, mask), attend(q, k, v, mask), atol=tol, rtol=0
    )


def test_split_attention_over_held_blocks_equals_plain_attention_and_ignores_other_rows():
    """The engine attends over a read-only cache (row b sees its first `held[b]` keys, read a
    block at a time under a running softmax) plus its own keys held apart: the same as
    `attend` over the keys concatenated. Rows hold different lengths, one nothing; the cache
    is two whole blocks and a partial one. Bound: f32 sums over n terms (held + own <= s + 40)
    may round in another order, each within n * 2**-24 (x2: the normaliser and the weighted
    sum), and each of the <= 4 rescalings of the running sums adds a few ulps (4 * 2**-24
    each, counted as 16 more terms). A row's result is bit for bit the same whatever the
    other rows hold: the blocks past its own keys add exactly nothing to it."""
    from rl.model.transformer import HELD_BLOCK, HeldKeys, attend, attend_split

    b, n, kv, h, own = 3, 4, 2, 16, 40
    s = 2 * HELD_BLOCK + 37
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.uniform(-1, 1, (b, own, n, h)), jnp.float32)
    k, v = (jnp.asarray(rng.uniform(-1, 1, (b, s + own, kv, h)), jnp.float32) for _ in "kv")
    held = np.array([s, HELD_BLOCK + 3, 0], np.int32)
    valid = np.arange(own) < np.array([[own], [own], [7]])  # row 2: 7 real tokens, then padding
    own_mask = np.tril(np.ones((own, own), bool))[None] & valid[:, None, :] & valid[:, :, None]
    got = attend_split(
        q,
        HeldKeys(k[:, :s], v[:, :s]),
        jnp.asarray(held),
        k[:, s:],
        v[:, s:],
        jnp.asarray(own_mask),
    )
    seen = np.concatenate(
        [np.broadcast_to((np.arange(s)[None, :] < held[:, None])[:, None], (b, own, s)), own_mask],
        axis=2,
    )
    want = attend(q, k, v, jnp.asarray(seen))
    tol = 2 * (s + own + 16) * 2.0**-24
    real = valid[:, :, None, None]  # a padding query sees nothing: zeros (attend: any mean)
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), atol=tol, rtol=0)
    assert not np.any(np.asarray(got)[~valid]), "a query that sees no key gets zeros"

    others = held.copy()
    others[0], others[2] = 5, s  # row 1 alone, then with every block read for another row
    split = jax.jit(attend_split)
    cached = HeldKeys(k[:, :s], v[:, :s])
    one = split(q, cached, jnp.asarray(others), k[:, s:], v[:, s:], own_mask)
    others[0] = 0
    two = split(q, cached, jnp.asarray(others), k[:, s:], v[:, s:], own_mask)
    np.testing.assert_array_equal(np.asarray(one)[1], np.asarray(two)[1])
    nothing = attend_split(
        q,
        HeldKeys(k[:, :0], v[:, :0]),
        jnp.zeros(b, jnp.int32),
        k[:, s:],
        v[:, s:],
        jnp.asarray(own_mask),
    )
    np.testing.assert_allclose(
        np.where(real, nothing, 0),
        np.where(real, attend(q, k[:, s:], v[:, s:], own_mask), 0),
        atol=2 * (own + 16) * 2.0**-24,
        rtol=0,
    )


def test_with_dtype_rounds_every_weight_and_serve_dtype_flag_uses_it():
    import argparse

    from launch.config.schema import SimloopConfig
    from launch.jobs import serve
    from rl.model import with_dtype

    model = _model(tiny())
    assert with_dtype(model, "float32") is model
    half = with_dtype(model, "bfloat16")
    assert (half.cfg.param_dtype, half.cfg.dtype) == ("bfloat16", "bfloat16")
    ours = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for key, var in nnx.to_flat_state(nnx.state(half, nnx.Param)):
        assert var.get_value().dtype == jnp.bfloat16
        np.testing.assert_array_equal(var.get_value(), ours[key].get_value().astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="'float16' is not supported: float32 or bfloat16"):
        with_dtype(model, "float16")
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    served, _, _ = serve.build_model(
        parser.parse_args(["--preset", "tiny", "--dtype", "bfloat16"]), SimloopConfig()
    )
    assert served.cfg.dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--preset", "tiny", "--dtype", "float16"])


def test_bfloat16_cache_writes_and_embedding_reads_are_exact_on_bit_patterns():
    """bf16 arrays go through loops, gathers and scatters as uint16 bit patterns (the CPU
    backend would copy them through float32): every value arrives bit for bit."""
    from rl.model.transformer import HeldKeys, as_bits, from_bits, write_kv

    cfg = tiny(param_dtype="bfloat16", dtype="bfloat16")
    model = _model(cfg)
    tokens = _tokens((2, 5), cfg.vocab_size)
    table = np.asarray(model.embed.get_value())
    np.testing.assert_array_equal(
        np.asarray(jax.jit(model.embed_tokens)(tokens)), table[np.asarray(tokens)]
    )
    cache = model.init_cache(3, 16)
    assert cache.k.dtype == jnp.bfloat16
    rng = np.random.default_rng(0)
    shape = (cfg.num_layers, 2, 4, cfg.num_kv_heads, cfg.head_dim)
    k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(2))
    rows, index = jnp.array([2, 0]), jnp.array([[3, 4, 5, 16], [0, 1, 2, 3]])  # 16: dropped
    out = jax.jit(write_kv)(cache, rows, index, k, v)
    assert out.k.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out.k[:, 2, 3:6], k[:, 0, :3])
    np.testing.assert_array_equal(out.v[:, 0, 0:4], v[:, 1])
    assert not np.asarray(out.k[:, 1]).any() and not np.asarray(out.k[:, 2, 6:]).any()
    held = HeldKeys(*as_bits((out.k, out.v)), jnp.int32(1), jnp.array([2, 0]))
    got_k, got_v = jax.jit(lambda start: held.block(start, 4))(jnp.int32(2))
    np.testing.assert_array_equal(got_k, out.k[1, jnp.array([2, 0]), 2:6])
    np.testing.assert_array_equal(from_bits(as_bits(got_v)), out.v[1, jnp.array([2, 0]), 2:6])
