"""The Qwen3-family decoder (Flax NNX): training forward and KV-cache decode.

`Qwen3(cfg, rngs=...)` holds the parameters; decoder blocks are stacked along a leading
`layers` axis and run under `jax.lax.scan`, so compile time does not grow with depth.

- `model(tokens_BT, positions_BT=None, segment_ids_BT=None) -> logits_BTV` (float32): the
  training forward, causal within each segment of a packed row.
- `model.decode(tokens_BT, cache, num_new_B) -> (logits_BTV, cache)`: append up to T tokens to
  each slot of a `KVCache` (prefill, a chunk of a long prompt, or one decode step) and attend
  over everything the slot holds. Slots are independent rows: the serving engine resets one
  with `cache.reset_slots` and refills it while the others keep decoding.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rl.model.config import ModelConfig
from rl.model.layers import MLP, RMSNorm, dtype_of, param, project, rope
from rl.model.sharding import constrain

NEG_INF = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: a fully masked row stays NaN-free

CACHE_AXES = ("layers", "cache_batch", "cache_length", "kv_heads", "head_dim")


@partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "lengths"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys/values of every slot: `k`, `v` are [L, B, S, K, H]; `lengths` [B] counts the valid
    positions of each slot (entries at or past it are stale and never attended to)."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @classmethod
    def create(
        cls, cfg: ModelConfig, batch: int, max_len: int, dtype: str | None = None
    ) -> KVCache:
        shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        dt = dtype_of(dtype or cfg.dtype)
        k = constrain(jnp.zeros(shape, dt), CACHE_AXES)
        v = constrain(jnp.zeros(shape, dt), CACHE_AXES)
        return cls(k=k, v=v, lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def reset_slots(self, mask_B: jax.Array) -> KVCache:
        """Empty the slots where `mask_B` is true (their stale keys are masked by length)."""
        return dataclasses.replace(self, lengths=jnp.where(mask_B, 0, self.lengths))


@partial(
    jax.tree_util.register_dataclass,
    data_fields=["epoch_BT", "start_BE", "kept_BES"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class KVVisibility:
    """What each token of a training row could see when a compacting KV session produced it
    (`serving` sessions; `rl.data.trajectory.Trajectory.kv_epochs`). The row's tokens fall in
    epochs (one per session call): a token of epoch e at index i saw the keys `kept_BES[b, e]`
    marks (all before `start_BE[b, e]`) and every token from `start_BE[b, e]` to i. Epoch 0
    starting at 0 with nothing kept is plain causal attention."""

    epoch_BT: jax.Array
    start_BE: jax.Array
    kept_BES: jax.Array

    def mask(self, t: int) -> jax.Array:
        b = self.epoch_BT.shape[0]
        rows_B1 = jnp.arange(b)[:, None]
        start_BT = self.start_BE[rows_B1, self.epoch_BT]
        kept_BTS = self.kept_BES[rows_B1, self.epoch_BT][:, :, :t]
        idx = jnp.arange(t)
        return kept_BTS | (idx[None, None, :] >= start_BT[:, :, None])


def attend(
    q_BTNH: jax.Array,
    k_BSKH: jax.Array,
    v_BSKH: jax.Array,
    mask_BTS: jax.Array,
    mass_valid_BT: jax.Array | None = None,
):
    """Grouped-query softmax attention; scores and softmax in float32. With `mass_valid_BT`,
    also the attention mass each key position received, summed over heads and the valid
    queries: `(out_BTNH, mass_BS)`."""
    b, t, n, h = q_BTNH.shape
    s, kv = k_BSKH.shape[1], k_BSKH.shape[2]
    g = n // kv
    # Heads lead and each group's queries stack into one matrix, so both products are plain
    # batched [G*T, H] x [H, S] matmuls over (B, K); scores in the einsum's natural
    # BKGTS layout cost twice as long on CPU (tiny, 2 cores: 8.1 -> 3.6 ms per layer).
    q_BTNH = q_BTNH * jnp.asarray(1.0 / np.sqrt(h), q_BTNH.dtype)  # T*N products, not T*S*N
    q_BKQH = jnp.transpose(q_BTNH.reshape(b, t, kv, g, h), (0, 2, 3, 1, 4)).reshape(b, kv, g * t, h)
    k_BKSH = jnp.transpose(k_BSKH, (0, 2, 1, 3))
    v_BKSH = jnp.transpose(v_BSKH, (0, 2, 1, 3))
    scores_BKQS = jnp.einsum("BKQH,BKSH->BKQS", q_BKQH, k_BKSH, preferred_element_type=jnp.float32)
    scores_BKGTS = scores_BKQS.reshape(b, kv, g, t, s)
    scores_BKGTS = jnp.where(mask_BTS[:, None, None, :, :], scores_BKGTS, NEG_INF)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1).astype(v_BSKH.dtype)
    out_BKQH = jnp.einsum("BKQS,BKSH->BKQH", probs_BKGTS.reshape(b, kv, g * t, s), v_BKSH)
    out_BTNH = jnp.transpose(out_BKQH.reshape(b, kv, g, t, h), (0, 3, 1, 2, 4)).reshape(b, t, n, h)
    if mass_valid_BT is None:
        return out_BTNH
    mass_BS = jnp.einsum(
        "BKGTS,BT->BS", probs_BKGTS.astype(jnp.float32), mass_valid_BT.astype(jnp.float32)
    )
    return out_BTNH, mass_BS


CAUSAL_BLOCK = 128
"""Query block of `attend_causal`: block i computes scores for the keys up to its end only."""


def attend_causal(
    q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, mask_BTT: jax.Array
) -> jax.Array:
    """`attend` for a row's own tokens under a mask that is causal by index (training):
    queries in blocks of `CAUSAL_BLOCK`, each block scoring only the keys up to its end, which
    skips the masked upper triangle (3/8 of the scores at 512 tokens) and gives the same
    attention, to float rounding."""
    t = q_BTNH.shape[1]
    if t <= CAUSAL_BLOCK:
        return attend(q_BTNH, k_BTKH, v_BTKH, mask_BTT)
    outs = []
    for start in range(0, t, CAUSAL_BLOCK):
        end = min(start + CAUSAL_BLOCK, t)
        outs.append(
            attend(
                q_BTNH[:, start:end], k_BTKH[:, :end], v_BTKH[:, :end], mask_BTT[:, start:end, :end]
            )
        )
    return jnp.concatenate(outs, axis=1)


HELD_BLOCK = 128
"""Held keys per step of `attend_split`'s running softmax: a step reads every row's keys up to
the longest row's, rounded up to whole blocks, so a block much longer than the live keys is
memory traffic for nothing (on CPU, reading K and V is most of a decode step). Measured on 2
CPU cores with the demo's simulator (3 layers, 96 wide), blocks of 64 / 128 / 256 / 512:
- 64 slots x 512 positions, 280-token prompts, 80 greedy tokens each (the demo's simulator
  server in one RL step): 1.43 / 1.37 / 2.09 / 2.17 s; with 8-token prompts 0.40 / 0.44 / - /
  1.31 s;
- 8 slots x 4,096 positions, 3,000-token prompts, 80 tokens: 3.61 / 2.81 / 3.25 / 3.44 s;
- 4 slots x 16,384, 12,000-token prompts (prefill in 256-token chunks): - / 13.3 / - / 17.6 s.
(An earlier check at 16,384 positions, one prefill call over ~16,300 held keys: 370 / 381 /
461 / 630 ms in blocks of 256 / 512 / 1,024 / 2,048; 1,376 ms as one softmax.)"""


def held_block_size(length: int) -> int:
    """Keys per block of `attend_split`'s running softmax over `length` held positions."""
    return min(HELD_BLOCK, length)


def as_bits(tree):
    """bfloat16 leaves as their uint16 bit patterns, for the operands of loops, gathers and
    scatters: XLA's CPU backend runs bf16 ones through float32 copies on every call (a whole
    KV cache and every stacked weight, each step), and leaves integers alone. `from_bits`
    undoes it where the values are used, for free (a bitcast)."""
    return jax.tree.map(
        lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype == jnp.bfloat16 else x,
        tree,
    )


def from_bits(tree):
    """`as_bits` undone: uint16 leaves (never a parameter's or a cache's own dtype) as bf16;
    of a tree of ShapeDtypeStructs, the bf16 shapes (nothing is read)."""

    def back(x):
        if x.dtype != jnp.uint16:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return x.update(dtype=jnp.bfloat16)
        return jax.lax.bitcast_convert_type(x, jnp.bfloat16)

    return jax.tree.map(back, tree)


class HeldKeys(NamedTuple):
    """Keys and values a step only reads, for `attend_split`: either one layer's own arrays
    ([B, S, K, H], `layer` None), or a whole KV cache ([L, C, S, K, H]) read at `layer`, row b
    of the batch at cache row `rows[b]` (None: row b; an out-of-range row reads zeros). Only
    the blocks a step reads are gathered: the cache itself is never copied."""

    k: jax.Array
    v: jax.Array
    layer: jax.Array | None = None
    rows: jax.Array | None = None

    @property
    def length(self) -> int:
        return self.k.shape[-3]

    def block(self, start: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
        """Positions `start...start + size` of every batch row: ([B, size, K, H],) * 2."""
        return from_bits(self._block(start, size))  # k and v may be `as_bits`

    def _block(self, start: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
        if self.layer is None:
            return tuple(
                jax.lax.dynamic_slice_in_dim(x, start, size, axis=1) for x in (self.k, self.v)
            )
        if self.rows is None:
            _, c, _, k, h = self.k.shape
            at, shape = (self.layer, 0, start, 0, 0), (1, c, size, k, h)
            return tuple(jax.lax.dynamic_slice(x, at, shape)[0] for x in (self.k, self.v))
        index_1S = (start + jnp.arange(size, dtype=jnp.int32))[None, :]
        return tuple(
            x.at[self.layer, self.rows[:, None], index_1S].get(mode="fill", fill_value=0)
            for x in (self.k, self.v)
        )


def attend_split(
    q_BTNH: jax.Array,
    held: HeldKeys,
    held_B: jax.Array,
    knew_BUKH: jax.Array,
    vnew_BUKH: jax.Array,
    mask_BTU: jax.Array,
) -> jax.Array:
    """`attend` over two key sets held apart: keys that are only read (`held`: S positions;
    row b's queries see its first `held_B[b]`) and the few keys of this call (U, under
    `mask_BTU`), so no step copies a cache to append to it. The same attention as over the
    keys concatenated, to float rounding; a query that sees no key gets zeros.

    The held keys are read `HELD_BLOCK` at a time under a running softmax (the max and the
    denominator carried from block to block, the weighted sum rescaled when the max grows),
    and only the blocks up to the longest row's `held_B`: the cost follows the keys held, not
    the cache's length. A block past a row's own keys adds exactly nothing to it (weight 1,
    terms 0), so a row's result does not depend on the other rows or on S."""
    b, t, n, h = q_BTNH.shape
    kv = knew_BUKH.shape[2]
    q_BTKGH = q_BTNH.reshape(b, t, kv, n // kv, h)
    scale = 1.0 / jnp.sqrt(jnp.float32(h))
    dt = q_BTNH.dtype
    held_B = held_B.astype(jnp.int32)

    def fold(carry, keys_BSKH, values_BSKH, mask_BTS):
        top_BKGT1, total_BKGT1, acc_BKGTH = carry
        mask_B11TS = mask_BTS[:, None, None]
        scores = (
            jnp.einsum(
                "BTKGH,BSKH->BKGTS",
                q_BTKGH,
                keys_BSKH.astype(q_BTKGH.dtype),
                preferred_element_type=jnp.float32,
            )
            * scale
        )
        scores = jnp.where(mask_B11TS, scores, NEG_INF)
        new_top = jnp.maximum(top_BKGT1, jnp.max(scores, axis=-1, keepdims=True))
        weight = jnp.exp(top_BKGT1 - new_top)
        e_BKGTS = jnp.where(mask_B11TS, jnp.exp(scores - new_top), 0.0)
        part = jnp.einsum(
            "BKGTS,BSKH->BKGTH",
            e_BKGTS.astype(dt),
            values_BSKH.astype(dt),
            preferred_element_type=jnp.float32,
        )
        return (
            new_top,
            total_BKGT1 * weight + jnp.sum(e_BKGTS, axis=-1, keepdims=True),
            acc_BKGTH * weight + part,
        )

    carry = (
        jnp.full((b, kv, n // kv, t, 1), NEG_INF, jnp.float32),
        jnp.zeros((b, kv, n // kv, t, 1), jnp.float32),
        jnp.zeros((b, kv, n // kv, t, h), jnp.float32),
    )
    s = held.length
    if s:
        size = held_block_size(s)

        def step(i, carry):
            # The last block of a cache that is not a whole number of blocks starts early:
            # its positions before `first` were read by the block before, and are masked.
            first = i * size
            start = jnp.minimum(first, s - size)
            index_S = start + jnp.arange(size, dtype=jnp.int32)
            seen_BS = (index_S[None, :] >= first) & (index_S[None, :] < held_B[:, None])
            keys, values = held.block(start, size)
            return fold(carry, keys, values, jnp.broadcast_to(seen_BS[:, None], (b, t, size)))

        blocks = jnp.minimum((jnp.max(held_B) + size - 1) // size, -(-s // size))
        carry = jax.lax.fori_loop(0, blocks, step, carry)
    carry = fold(carry, knew_BUKH, vnew_BUKH, mask_BTU)
    _, total_BKGT1, acc_BKGTH = carry
    out_BKGTH = acc_BKGTH * jnp.where(total_BKGT1 > 0, 1.0 / total_BKGT1, 0.0)
    return jnp.transpose(out_BKGTH, (0, 3, 1, 2, 4)).reshape(b, t, n, h).astype(dt)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.q = param(rngs, (d, n, h), ("embed", "q_heads", "head_dim"), cfg)
        self.k = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), cfg)
        self.v = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), cfg)
        self.o = param(rngs, (n, h, d), ("q_heads", "head_dim", "embed"), cfg)
        if cfg.qkv_bias:
            self.q_bias = param(rngs, (n, h), ("q_heads", "head_dim"), cfg, init="zeros")
            self.k_bias = param(rngs, (k, h), ("kv_heads", "head_dim"), cfg, init="zeros")
            self.v_bias = param(rngs, (k, h), ("kv_heads", "head_dim"), cfg, init="zeros")
        else:
            self.q_bias = self.k_bias = self.v_bias = None
        self.o_bias = param(rngs, (d,), ("embed",), cfg, init="zeros") if cfg.o_bias else None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(h, cfg, axis_name="head_dim")
            self.k_norm = RMSNorm(h, cfg, axis_name="head_dim")
        else:
            self.q_norm = self.k_norm = None

    def _project(self, x_BTD: jax.Array, w: nnx.Param, b: nnx.Param | None) -> jax.Array:
        dt = x_BTD.dtype
        y = project("BTD,DNH->BTNH", x_BTD, w.get_value())
        return y if b is None else y + b.get_value().astype(dt)

    def qkv(self, x_BTD: jax.Array, positions_BT: jax.Array):
        q_BTNH = self._project(x_BTD, self.q, self.q_bias)
        k_BTKH = self._project(x_BTD, self.k, self.k_bias)
        v_BTKH = self._project(x_BTD, self.v, self.v_bias)
        if self.q_norm is not None:
            q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
        q_BTNH = rope(q_BTNH, positions_BT, self.cfg.rope_theta)
        k_BTKH = rope(k_BTKH, positions_BT, self.cfg.rope_theta)
        q_BTNH = constrain(q_BTNH, ("act_batch", "act_length", "act_heads", None))
        return q_BTNH, k_BTKH, v_BTKH

    def out(self, attn_BTNH: jax.Array) -> jax.Array:
        dt = attn_BTNH.dtype
        y_BTD = project("BTNH,NHD->BTD", attn_BTNH, self.o.get_value())
        return y_BTD if self.o_bias is None else y_BTD + self.o_bias.get_value().astype(dt)


class Block(nnx.Module):
    """Pre-norm decoder block: x + attn(norm(x)); x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(
        self,
        x_BTD: jax.Array,
        positions_BT: jax.Array,
        mask_BTS: jax.Array,
        kv_cache: tuple[jax.Array, jax.Array] | None = None,
        mass_valid_BT: jax.Array | None = None,
    ):
        """Without `kv_cache`, a row's own tokens, causally (training): attend over this
        call's keys. With it, tokens whose keys the cache already holds: attend over the
        cache, and with `mass_valid_BT` also return the attention mass per key (`attend`)."""
        q_BTNH, k_BTKH, v_BTKH = self.attn.qkv(self.attn_norm(x_BTD), positions_BT)
        if kv_cache is None:
            attn = attend_causal(q_BTNH, k_BTKH, v_BTKH, mask_BTS)
            k_BSKH, v_BSKH = k_BTKH, v_BTKH
        else:
            k_BSKH, v_BSKH = kv_cache
            attn = attend(
                q_BTNH,
                k_BSKH.astype(q_BTNH.dtype),
                v_BSKH.astype(q_BTNH.dtype),
                mask_BTS,
                mass_valid_BT,
            )
        attn_BTNH, mass_BS = attn if mass_valid_BT is not None else (attn, None)
        x_BTD = x_BTD + self.attn.out(attn_BTNH)
        x_BTD = x_BTD + self.mlp(self.mlp_norm(x_BTD))
        x_BTD = constrain(x_BTD, ("act_batch", "act_length", "act_embed"))
        if mass_valid_BT is not None:
            return x_BTD, (k_BSKH, v_BSKH), mass_BS
        return x_BTD, (k_BSKH, v_BSKH)

    def extend(
        self,
        x_BTD: jax.Array,
        positions_BT: jax.Array,
        past: HeldKeys,
        held_B: jax.Array,
        new: tuple[jax.Array, jax.Array],
        new_at_T: jax.Array,
        new_mask_BTU: jax.Array,
    ):
        """The block on tokens whose keys go to slots `new_at_T` of the small buffers `new`
        ([B, U, K, H]: this call's keys), attending to the first `held_B` read-only `past`
        keys and the buffers' -> (x, new buffers). `past` is never written, so it is never
        copied."""
        q_BTNH, k_BTKH, v_BTKH = self.attn.qkv(self.attn_norm(x_BTD), positions_BT)
        k_BUKH, v_BUKH = new
        k_BUKH = k_BUKH.at[:, new_at_T].set(k_BTKH.astype(k_BUKH.dtype))
        v_BUKH = v_BUKH.at[:, new_at_T].set(v_BTKH.astype(v_BUKH.dtype))
        dt = q_BTNH.dtype
        attn_BTNH = attend_split(
            q_BTNH, past, held_B, k_BUKH.astype(dt), v_BUKH.astype(dt), new_mask_BTU
        )
        x_BTD = x_BTD + self.attn.out(attn_BTNH)
        x_BTD = x_BTD + self.mlp(self.mlp_norm(x_BTD))
        x_BTD = constrain(x_BTD, ("act_batch", "act_length", "act_embed"))
        return x_BTD, (k_BUKH, v_BUKH)


def _is_var(x: object) -> bool:
    return isinstance(x, nnx.Variable)


def stack_blocks(blocks: list[Block]) -> Block:
    """One Block whose every parameter gains a leading `layers` axis."""
    graphdef = nnx.graphdef(blocks[0])
    states = [nnx.state(b) for b in blocks]
    stacked = jax.tree.map(
        lambda *vs: vs[0].replace(
            jnp.stack([v.get_value() for v in vs]),
            logical_axes=("layers", *vs[0].logical_axes),
        ),
        *states,
        is_leaf=_is_var,
    )
    return nnx.merge(graphdef, stacked)


class Qwen3(nnx.Module):
    """Decoder-only LM of the Qwen3 family (Qwen2/2.5 with `qk_norm=False, qkv_bias=True`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg)
        self.layers = stack_blocks([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg)

    # ----- pieces --------------------------------------------------------------------------

    def embed_tokens(self, tokens_BT: jax.Array) -> jax.Array:
        # on bit patterns: XLA's CPU backend would gather from a float32 copy of a bf16 table
        x_BTD = from_bits(jnp.take(as_bits(self.embed.get_value()), tokens_BT, axis=0))
        x_BTD = x_BTD.astype(dtype_of(self.cfg.dtype))
        return constrain(x_BTD, ("act_batch", "act_length", "act_embed"))

    def logits(self, h_BTD: jax.Array) -> jax.Array:
        """Final norm + LM head; float32 logits."""
        h_BTD = self.final_norm(h_BTD)
        dt = h_BTD.dtype
        if self.lm_head is None:
            w_VD = self.embed.get_value().astype(dt)
            logits_BTV = jnp.einsum("BTD,VD->BTV", h_BTD, w_VD, preferred_element_type=jnp.float32)
        else:
            w_DV = self.lm_head.get_value().astype(dt)
            logits_BTV = jnp.einsum("BTD,DV->BTV", h_BTD, w_DV, preferred_element_type=jnp.float32)
        return constrain(logits_BTV, ("act_batch", "act_length", "act_vocab"))

    def _scan_blocks(self, x_BTD, positions_BT, mask_BTS, cache=None, mass_valid_BT=None):
        """The blocks in turn: training (no cache), or with `cache` and `mass_valid_BT` the
        attention mass per layer of tokens the cache holds."""
        graphdef, stacked = nnx.split(self.layers)

        def body(x_BTD, xs):
            layer_state, kv = xs
            block = nnx.merge(graphdef, layer_state)
            if mass_valid_BT is not None:
                x_BTD, _, mass_BS = block(x_BTD, positions_BT, mask_BTS, kv, mass_valid_BT)
                return x_BTD, mass_BS
            x_BTD, _ = block(x_BTD, positions_BT, mask_BTS)
            return x_BTD, None

        kv_xs = None if cache is None else (cache.k, cache.v)
        return jax.lax.scan(body, x_BTD, (stacked, kv_xs))

    # ----- training forward ----------------------------------------------------------------

    def hidden_states(
        self,
        tokens_BT: jax.Array,
        positions_BT: jax.Array | None = None,
        segment_ids_BT: jax.Array | None = None,
        kv_visibility: KVVisibility | None = None,
    ) -> jax.Array:
        """Final-block activations [B, T, D] before the final norm (for chunked losses)."""
        b, t = tokens_BT.shape
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        idx = jnp.arange(t)
        mask_BTS = jnp.broadcast_to(idx[:, None] >= idx[None, :], (b, t, t))
        if segment_ids_BT is not None:
            mask_BTS = mask_BTS & (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])
        if kv_visibility is not None:
            mask_BTS = mask_BTS & kv_visibility.mask(t)
        h_BTD, _ = self._scan_blocks(self.embed_tokens(tokens_BT), positions_BT, mask_BTS)
        return h_BTD

    def __call__(
        self,
        tokens_BT: jax.Array,
        positions_BT: jax.Array | None = None,
        segment_ids_BT: jax.Array | None = None,
        kv_visibility: KVVisibility | None = None,
    ) -> jax.Array:
        """Logits [B, T, V] in float32. Positions default to 0..T-1; with `segment_ids_BT`,
        tokens attend only within their own segment (packed rows); with `kv_visibility`, only
        what a compacted KV session let them see when they were sampled."""
        return self.logits(
            self.hidden_states(tokens_BT, positions_BT, segment_ids_BT, kv_visibility)
        )

    # ----- decode with a KV cache ------------------------------------------------------------

    def init_cache(self, batch: int, max_len: int, dtype: str | None = None) -> KVCache:
        return KVCache.create(self.cfg, batch, max_len, dtype)

    def decode(
        self,
        tokens_BT: jax.Array,
        cache: KVCache,
        num_new_B: jax.Array | None = None,
        shift_B: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """Append `num_new_B[b]` tokens (a left-aligned prefix of row b; default all T) to slot
        b and return their logits [B, T, V] and the updated cache. Rows with `num_new_B == 0`
        are left untouched (their logits are meaningless). Tokens that would run past the
        cache's `max_len` are not stored: keep `lengths + num_new <= max_len`. A token's
        position (RoPE) is its cache index plus `shift_B[b]` (default 0): a compacted session
        holds fewer keys than the tokens it has seen, and its new tokens keep counting on."""
        h_BTD, new_cache = self._extend(tokens_BT, cache, num_new_B, shift_B)
        return self.logits(h_BTD), new_cache

    def prefill(
        self,
        tokens_BT: jax.Array,
        cache: KVCache,
        num_new_B: jax.Array | None = None,
        shift_B: jax.Array | None = None,
    ) -> KVCache:
        """`decode` without the LM head: only writes keys/values (prompt chunks whose logits
        nobody samples from)."""
        return self._extend(tokens_BT, cache, num_new_B, shift_B)[1]

    def attention_mass(
        self,
        tokens_BT: jax.Array,
        cache: KVCache,
        start_B: jax.Array,
        num_B: jax.Array,
        shift_B: jax.Array | None = None,
    ) -> jax.Array:
        """How much attention every held key received from `num_B[b]` tokens already in slot b
        at cache indices `start_B[b]...` (the tokens themselves, re-run without writing):
        [B, S] float32, summed over layers, heads and those queries. Session compaction
        keeps the keys a turn's response attended to most."""
        _, mass_LBS = self._run(tokens_BT, cache, num_B, shift_B, start_B=start_B)
        return jnp.sum(mass_LBS, axis=0)

    def _extend(self, tokens_BT, cache, num_new_B, shift_B=None):
        b, t = tokens_BT.shape
        if num_new_B is None:
            num_new_B = jnp.full((b,), t, jnp.int32)
        h_BTD, k_new, v_new, index_BT, valid_BT = self.extend_chunk(
            tokens_BT, (cache.k, cache.v), cache.lengths, num_new_B, shift_B
        )
        new_cache = write_kv(
            cache, jnp.arange(b, dtype=jnp.int32), index_BT, k_new, v_new, valid_BT
        )
        new_len_B = jnp.minimum(cache.lengths + num_new_B.astype(jnp.int32), cache.max_len)
        return h_BTD, dataclasses.replace(new_cache, lengths=new_len_B)

    def extend_chunk(self, tokens_BT, past, start_B, num_new_B, shift_B=None, rows_B=None):
        """A chunk of `num_new_B[b]` new tokens per row (a left-aligned prefix of row b) after
        the first `start_B[b]` keys of `past` (a KV cache's (k, v), row b at cache row
        `rows_B[b]`, default b) -> (hidden, keys, values [L, B, T, K, H], the cache index of
        each token `start + offset` [B, T], which of them are real [B, T]). Each token sees
        the held keys and the chunk's real tokens up to itself; its position is its index
        plus `shift_B[b]`. Nothing is written: see `write_kv`."""
        b, t = tokens_BT.shape
        start_B = start_B.astype(jnp.int32)
        offsets_T = jnp.arange(t, dtype=jnp.int32)
        index_BT = start_B[:, None] + offsets_T[None, :]
        positions_BT = index_BT if shift_B is None else index_BT + shift_B[:, None]
        valid_BT = offsets_T[None, :] < num_new_B.astype(jnp.int32)[:, None]
        # token i sees the chunk's real tokens j <= i
        mask_BTT = (offsets_T[None, None, :] <= offsets_T[None, :, None]) & valid_BT[:, None, :]
        shape = (self.cfg.num_layers, b, t, self.cfg.num_kv_heads, self.cfg.head_dim)
        empty = jnp.zeros(shape, past[0].dtype)
        h_BTD, k_new, v_new = self.extend_kv(
            tokens_BT,
            past,
            start_B,
            (empty, empty),
            offsets_T,
            mask_BTT,
            positions_BT,
            rows_B,
        )
        return h_BTD, k_new, v_new, index_BT, valid_BT

    def extend_kv(
        self,
        tokens_BT: jax.Array,
        past: tuple[jax.Array, jax.Array],
        past_len_B: jax.Array,
        new: tuple[jax.Array, jax.Array],
        new_at_T: jax.Array,
        new_mask_BTU: jax.Array,
        positions_BT: jax.Array,
        rows_B: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Run `tokens_BT` on top of keys held elsewhere -> (hidden [B, T, D], the buffers
        `new` with these tokens' keys and values at `new_at_T`: [L, B, U, K, H] each).

        Each token attends to the first `past_len_B[b]` keys of cache row `rows_B[b]`
        (default b) of `past` ((k, v) [L, C, S, K, H], only read: a KV cache) and to the
        buffers' keys `new_mask_BTU` allows (its own included). Only the blocks of held keys
        that some row needs are read; the caller writes the buffers wherever the keys live;
        nothing here copies `past`."""
        graphdef, stacked = nnx.split(self.layers)
        layers = jnp.arange(self.cfg.num_layers, dtype=jnp.int32)
        past_bits = as_bits(past)

        def body(x_BTD, xs):
            layer_state, layer, nk, nv = from_bits(xs)
            block = nnx.merge(graphdef, layer_state)
            held = HeldKeys(past_bits[0], past_bits[1], layer, rows_B)  # read as bf16 per block
            x_BTD, kv = block.extend(
                from_bits(x_BTD), positions_BT, held, past_len_B, (nk, nv), new_at_T, new_mask_BTU
            )
            return as_bits(x_BTD), as_bits(kv)

        h_BTD, (k_new, v_new) = from_bits(
            jax.lax.scan(
                body, as_bits(self.embed_tokens(tokens_BT)), as_bits((stacked, layers, *new))
            )
        )
        return h_BTD, k_new, v_new

    def _run(self, tokens_BT, cache, num_B, shift_B, *, start_B):
        """The attention mass of tokens already held at `start_B...` (nothing written)."""
        b, t = tokens_BT.shape
        num_B = num_B.astype(jnp.int32)
        start_B = start_B.astype(jnp.int32)
        offsets_T = jnp.arange(t, dtype=jnp.int32)
        index_BT = start_B[:, None] + offsets_T[None, :]  # where each token's key lives
        positions_BT = index_BT if shift_B is None else index_BT + shift_B[:, None]
        valid_BT = offsets_T[None, :] < num_B[:, None]
        end_B = start_B + num_B
        s_idx = jnp.arange(cache.max_len, dtype=jnp.int32)
        mask_BTS = (s_idx[None, None, :] <= index_BT[:, :, None]) & (
            s_idx[None, None, :] < end_B[:, None, None]
        )
        x_BTD = self.embed_tokens(tokens_BT)
        return self._scan_blocks(x_BTD, positions_BT, mask_BTS, cache, valid_BT)


def write_kv(
    cache: KVCache,
    rows_B: jax.Array,
    index_BU: jax.Array,
    k_LBUKH: jax.Array,
    v_LBUKH: jax.Array,
    valid_BU: jax.Array | None = None,
) -> KVCache:
    """Keys and values of a call written into `cache` rows `rows_B` at `index_BU`, those
    `valid_BU` allows (default all; indices past the cache and rows past its batch are
    dropped too): one scatter, in place when the cache is donated."""
    if valid_BU is not None:
        index_BU = jnp.where(valid_BU, index_BU, cache.max_len)
    rows_BU = jnp.broadcast_to(rows_B[:, None], index_BU.shape)
    # on bit patterns: XLA's CPU backend would scatter a bf16 cache through a float32 copy
    k, v = from_bits(
        tuple(
            as_bits(c).at[:, rows_BU, index_BU].set(as_bits(x.astype(c.dtype)), mode="drop")
            for c, x in ((cache.k, k_LBUKH), (cache.v, v_LBUKH))
        )
    )
    return KVCache(k=constrain(k, CACHE_AXES), v=constrain(v, CACHE_AXES), lengths=cache.lengths)


def jit_forward(model: Qwen3):
    """`forward(tokens_BT, positions_BT=None, segment_ids_BT=None) -> logits_BTV`, jitted over
    a snapshot of the model's parameters (re-create it after the weights change)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, tokens_BT, positions_BT, segment_ids_BT):
        return nnx.merge(graphdef, state)(tokens_BT, positions_BT, segment_ids_BT)

    return lambda tokens_BT, positions_BT=None, segment_ids_BT=None: forward(
        state, tokens_BT, positions_BT, segment_ids_BT
    )


def jit_decode(model: Qwen3, *, donate_cache: bool = True):
    """`decode(tokens_BT, cache, num_new_B) -> (logits_BTV, cache)`, jitted (the cache donated
    by default: do not reuse the one passed in)."""
    graphdef, state = nnx.split(model)

    def decode(state, tokens_BT, cache, num_new_B):
        return nnx.merge(graphdef, state).decode(tokens_BT, cache, num_new_B)

    jitted = jax.jit(decode, donate_argnums=(2,) if donate_cache else ())

    def call(tokens_BT, cache, num_new_B=None):
        if num_new_B is None:  # numpy: an eager jnp.full costs more than a tiny model's step
            num_new_B = np.full((tokens_BT.shape[0],), tokens_BT.shape[1], np.int32)
        return jitted(state, tokens_BT, cache, num_new_B)

    return call


def with_dtype(model: Qwen3, dtype: str) -> Qwen3:
    """`model` with parameters and compute in `dtype` ("float32" / "bfloat16"; every weight
    rounded to nearest, as `load_hf(..., dtype=)` reads a checkpoint): `model` itself when it
    already is. On a CPU without bf16 arithmetic, serve float32: a bf16 decode step of the
    50M bench model takes 47 ms against 32 ms (2 cores)."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype {dtype!r} is not supported: float32 or bfloat16")
    if dtype == model.cfg.dtype == model.cfg.param_dtype:
        return model
    cfg = dataclasses.replace(model.cfg, param_dtype=dtype, dtype=dtype)
    out = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)))  # shapes only: no random init
    nnx.update(out, jax.tree.map(lambda x: x.astype(dtype), nnx.state(model, nnx.Param)))
    return out
