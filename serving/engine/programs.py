"""The engine's device programs: the jitted decode, prefill, copy, compaction, probe and
verify functions over the served model's state and its KV cache (`Engine` builds them once,
at construction, and calls them from its scheduler loop). Each function counts its traces in
`traces`, so a test can see that a shape compiled once."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from rl.model.transformer import KVCache, from_bits, write_kv
from serving.engine.sampling import sample


@dataclasses.dataclass(frozen=True)
class Programs:
    """The jitted functions of one engine (`decode` by steps per call; `verify` only when
    the engine speculates)."""

    compact: Callable
    probe: Callable
    decode: dict[int, Callable]
    prefill: Callable
    copy: Callable
    verify: Callable | None


def build_programs(
    graphdef,
    *,
    num_top: int,
    valid_vocab: int,
    decode_steps: int,
    speculate: int,
    traces: dict[str, int],
) -> Programs:
    """The engine's jitted functions for a model of `graphdef`: sampling returns `num_top` top
    logprobs at most and never a token id past `valid_vocab`; decode compiles for 1 and
    `decode_steps` steps per call, verify for `speculate` guesses (0: none)."""

    def decode(
        state,
        cache,
        lengths_B,
        shift_B,
        tokens_B,
        active_B,
        temp_B,
        top_p_B,
        top_k_B,
        seed_B,
        index_B,
        counter_B,
        want_top,
        *,
        steps,
    ):
        """`steps` tokens for every active slot, each step feeding back its own sample.
        Only the blocks of the cache that hold some slot's keys are read. The steps' own
        keys gather in small buffers, written into the cache once at the end (the cache
        itself is never copied)."""
        traces["decode"] += 1
        model = nnx.merge(graphdef, from_bits(state))
        active_i_B = active_B.astype(jnp.int32)
        b = lengths_B.shape[0]
        past = (cache.k, cache.v)
        # An idle slot (a finished sequence kept for reuse, a session between calls) is
        # computed and dropped: it reads no held keys, so it costs no blocks.
        held_B = jnp.where(active_B, lengths_B, 0)
        empty = jnp.zeros((cache.k.shape[0], b, steps, *cache.k.shape[3:]), cache.k.dtype)
        u_U = jnp.arange(steps, dtype=jnp.int32)

        def one(carry, j):
            k_new, v_new, tok_B = carry
            positions_B1 = (lengths_B + j * active_i_B + shift_B)[:, None]
            mask_B1U = jnp.broadcast_to(u_U <= j, (b, 1, steps))
            h_B1D, k_new, v_new = model.extend_kv(
                tok_B[:, None], past, held_B, (k_new, v_new), j[None], mask_B1U, positions_B1
            )
            out = sample(
                model.logits(h_B1D)[:, 0],
                temp_B,
                top_p_B,
                top_k_B,
                seed_B,
                index_B,
                counter_B + j,
                num_top,
                valid_vocab,
                want_top,
            )
            return (k_new, v_new, out[0]), out

        (k_new, v_new, last_B), outs = jax.lax.scan(one, (empty, empty, tokens_B), u_U)
        at_BU = lengths_B[:, None] + u_U[None, :]
        cache = write_kv(
            cache,
            jnp.arange(b, dtype=jnp.int32),
            at_BU,
            k_new,
            v_new,
            jnp.broadcast_to(active_B[:, None], at_BU.shape),
        )
        # The last sampled tokens apart: the next call's inputs when it is dispatched
        # ahead, without an indexing op on the host.
        return cache, (*outs, last_B)

    def rows(cache, slots_P):
        """The listed slots' keys and values (a padding entry, slot B, reads zeros)."""
        return tuple(
            jnp.take(x, slots_P, axis=1, mode="fill", fill_value=0) for x in (cache.k, cache.v)
        )

    def prefill(state, cache, lengths_B, shift_B, slots_P, tokens_PT, num_new_P):
        """Writes the chunks' keys; reads only the blocks of the listed slots' rows that
        hold their keys (a padding entry, slot B, holds none)."""
        traces["prefill"] += 1
        model = nnx.merge(graphdef, from_bits(state))
        held_P = jnp.take(lengths_B, slots_P, mode="fill", fill_value=0)
        shift_P = jnp.take(shift_B, slots_P, mode="fill", fill_value=0)
        _, k_new, v_new, index_PT, valid_PT = model.extend_chunk(
            tokens_PT, (cache.k, cache.v), held_P, num_new_P, shift_P, rows_B=slots_P
        )
        return write_kv(cache, slots_P, index_PT, k_new, v_new, valid_PT)

    def copy(cache, src_P, dst_P):
        traces["copy"] += 1
        k, v = rows(cache, src_P)
        return dataclasses.replace(
            cache,
            k=cache.k.at[:, dst_P].set(k, mode="drop"),
            v=cache.v.at[:, dst_P].set(v, mode="drop"),
        )

    def compact(cache, slots_P, index_PS):
        """Each listed slot keeps the keys at `index_PS` (in that order) at its front."""
        traces["compact"] += 1
        k, v = (
            jnp.take_along_axis(x, index_PS[None, :, :, None, None], axis=2)
            for x in rows(cache, slots_P)
        )
        return dataclasses.replace(
            cache,
            k=cache.k.at[:, slots_P].set(k, mode="drop"),
            v=cache.v.at[:, slots_P].set(v, mode="drop"),
        )

    def probe(state, cache, slots_P, tokens_PT, start_P, num_P, shift_P):
        """Attention mass per key of the slots' tokens at `start_P` (already written)."""
        traces["probe"] += 1
        model = nnx.merge(graphdef, from_bits(state))
        k, v = rows(cache, slots_P)
        sub = KVCache(k=k, v=v, lengths=jnp.zeros(slots_P.shape, jnp.int32))
        return model.attention_mass(tokens_PT, sub, start_P, num_P, shift_P)

    k = speculate + 1  # a verify call's inputs per slot

    def verify(
        state,
        cache,
        lengths_B,
        shift_B,
        tokens_BK,
        active_B,
        temp_B,
        top_p_B,
        top_k_B,
        seed_B,
        index_B,
        counter_B,
        want_top,
    ):
        """Every active slot's input token and its guesses (`tokens_BK`, [B, K]) run as one
        chunk after its held keys; a token is sampled at each position, as decode would
        with the key of the sequence's token `counter + j` (`serving.engine.speculate`).
        -> (tokens, logprobs, top ids, top logprobs [K, B, ...] like a K-step decode, kept
        guesses [B]); the keys of all K inputs are written (those past the kept ones are
        never read: the slot's length moves past the kept ones only)."""
        traces["verify"] += 1
        model = nnx.merge(graphdef, from_bits(state))
        b = lengths_B.shape[0]
        rows_B = jnp.arange(b, dtype=jnp.int32)
        held_B = jnp.where(active_B, lengths_B, 0)
        num_B = jnp.where(active_B, k, 0).astype(jnp.int32)
        h_BKD, k_new, v_new, index_BK, valid_BK = model.extend_chunk(
            tokens_BK, (cache.k, cache.v), held_B, num_B, shift_B, rows_B=rows_B
        )
        logits_NV = model.logits(h_BKD).reshape(b * k, -1)

        def per_position(x_B):
            return jnp.repeat(x_B, k)

        counter_N = (counter_B[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]).reshape(-1)
        token_N, logp_N, top_ids_NT, top_logp_NT = sample(
            logits_NV,
            per_position(temp_B),
            per_position(top_p_B),
            per_position(top_k_B),
            per_position(seed_B),
            per_position(index_B),
            counter_N,
            num_top,
            valid_vocab,
            want_top,
        )
        token_BK = token_N.reshape(b, k)
        hits_BK = (token_BK[:, :-1] == tokens_BK[:, 1:]).astype(jnp.int32)
        kept_B = jnp.sum(jnp.cumprod(hits_BK, axis=1), axis=1)
        cache = write_kv(cache, rows_B, index_BK, k_new, v_new, valid_BK)

        def steps_first(x_N):  # [B*K, ...] -> [K, B, ...], a K-step decode's layout
            return jnp.swapaxes(x_N.reshape(b, k, *x_N.shape[1:]), 0, 1)

        outs = tuple(steps_first(x) for x in (token_N, logp_N, top_ids_NT, top_logp_NT))
        return cache, (*outs, kept_B)

    return Programs(
        compact=jax.jit(compact, donate_argnums=(0,)),
        probe=jax.jit(probe),
        decode={
            k: jax.jit(functools.partial(decode, steps=k), donate_argnums=(1,))
            for k in sorted({1, decode_steps})
        },
        prefill=jax.jit(prefill, donate_argnums=(1,)),
        copy=jax.jit(copy, donate_argnums=(0,)),
        verify=jax.jit(verify, donate_argnums=(1,)) if speculate else None,
    )
