"""Batched token sampling with per-row parameters, inside the jitted decode step.

Each row has its own temperature, top_p, top_k and RNG stream. The key for a row's t-th token
is `fold_in(fold_in(key(seed), sample_index), t)`, so a seeded request draws the same tokens
whatever else shares the batch.

Returned logprobs come from the distribution the token was drawn from:
- temperature > 0: log-softmax of logits / temperature, restricted to the top-k / top-p set
  and renormalised over it (tokens outside the set have logprob -inf and cannot be drawn).
  With temperature 1, top_p 1 and top_k 0 this is exactly the model's log-softmax.
- temperature == 0 (greedy): the argmax token, with the model's untempered log-softmax.
The top-`K` alternatives are taken from the same distribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


def _truncate(logp_BV: jax.Array, top_p_B: jax.Array, top_k_B: jax.Array) -> jax.Array:
    """Mask (to -inf) tokens outside each row's top-k / top-p set; renormalise."""
    vocab = logp_BV.shape[-1]
    order_BV = jnp.argsort(-logp_BV, axis=-1)
    sorted_BV = jnp.take_along_axis(logp_BV, order_BV, axis=-1)
    rank_V = jnp.arange(vocab)
    k_B = jnp.where(top_k_B > 0, top_k_B, vocab)
    keep_k_BV = rank_V[None, :] < k_B[:, None]
    # Keep a token while the mass strictly before it is < top_p: the smallest set reaching p.
    # The mass is the top-k set's, renormalised (top-k, then top-p, as HF and vLLM apply them).
    probs_BV = jax.nn.softmax(jnp.where(keep_k_BV, sorted_BV, NEG_INF), axis=-1)
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    keep_p_BV = mass_before_BV < top_p_B[:, None]
    keep_sorted_BV = keep_k_BV & keep_p_BV
    rows_B1 = jnp.arange(logp_BV.shape[0])[:, None]
    keep_BV = jnp.zeros_like(keep_sorted_BV).at[rows_B1, order_BV].set(keep_sorted_BV)
    masked_BV = jnp.where(keep_BV, logp_BV, NEG_INF)
    return masked_BV - jax.nn.logsumexp(masked_BV, axis=-1, keepdims=True)


def sample(
    logits_BV: jax.Array,
    temperature_B: jax.Array,
    top_p_B: jax.Array,
    top_k_B: jax.Array,
    seed_B: jax.Array,
    sample_index_B: jax.Array,
    counter_B: jax.Array,
    num_top: int,
    valid_vocab: int | None = None,
    want_top: jax.Array | bool = True,
):
    """-> (token_B, logprob_B, top_ids_BK, top_logprobs_BK) with K = max(num_top, 1).

    Ids at or past `valid_vocab` (embedding rows the tokenizer has no token for) are never
    drawn and carry no probability mass. With `want_top` false (no row asked for
    alternatives) the top-K is not computed: its ids are 0 and its logprobs -inf."""
    logits_BV = logits_BV.astype(jnp.float32)
    if valid_vocab is not None and valid_vocab < logits_BV.shape[-1]:
        in_vocab_V = jnp.arange(logits_BV.shape[-1]) < valid_vocab
        logits_BV = jnp.where(in_vocab_V[None, :], logits_BV, NEG_INF)
    greedy_B = temperature_B <= 0

    def greedy(logits_BV):
        # An all-greedy batch (the simulator's, every evaluation's): no tempering, truncation or
        # draws. The same ops as the mixed path's greedy rows: tokens and logprobs are equal.
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), jax.nn.log_softmax(logits_BV)

    def mixed(logits_BV):
        raw_logp_BV = jax.nn.log_softmax(logits_BV, axis=-1)
        temp_B = jnp.where(greedy_B, 1.0, temperature_B)
        tempered_BV = jax.nn.log_softmax(logits_BV / temp_B[:, None], axis=-1)
        needs_trunc = jnp.any(((top_p_B < 1.0) | (top_k_B > 0)) & ~greedy_B)
        dist_BV = jax.lax.cond(
            needs_trunc,
            lambda x: _truncate(x, top_p_B, top_k_B),
            lambda x: x,
            tempered_BV,
        )

        def draw(seed, index, counter, logp_V):
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), index), counter)
            return jax.random.categorical(key, logp_V)

        drawn_B = jax.vmap(draw)(seed_B, sample_index_B, counter_B, dist_BV)
        token_B = jnp.where(greedy_B, jnp.argmax(logits_BV, axis=-1), drawn_B).astype(jnp.int32)
        return token_B, jnp.where(greedy_B[:, None], raw_logp_BV, dist_BV)

    token_B, used_BV = jax.lax.cond(jnp.all(greedy_B), greedy, mixed, logits_BV)
    logprob_B = jnp.take_along_axis(used_BV, token_B[:, None], axis=-1)[:, 0]
    k = max(num_top, 1)

    def no_top(used_BV):
        rows = used_BV.shape[0]
        return jnp.full((rows, k), NEG_INF, jnp.float32), jnp.zeros((rows, k), jnp.int32)

    top_logp_BK, top_ids_BK = jax.lax.cond(
        want_top, lambda x: tuple(jax.lax.top_k(x, k)), no_top, used_BV
    )
    return token_B, logprob_B, top_ids_BK.astype(jnp.int32), top_logp_BK
