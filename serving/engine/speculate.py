"""Speculative decoding by prompt lookup (`EngineConfig.speculate`): a decoding sequence whose
last few tokens occurred earlier in its context (its prompt or its own completion) is guessed
to go on as it did then. One device call, `verify`, runs every slot's last token and its
guessed continuation at once, like a prompt chunk, samples at each position and keeps the
guesses up to the first one the model did not sample itself. A call then yields 1 to
`speculate + 1` tokens per slot for the weight reads of one decode step (on 2 CPU cores a 50M
model's 8 x 9-token verify costs two one-token steps: 58 vs 30 ms). It pays where outputs copy
their context (a file shown before, a command echoed, a loop).

The tokens are the ones plain decoding makes: position j of a call is sampled from the
logits after the tokens before it, with the key of the sequence's token `counter + j`
(`serving.engine.sampling`), and a guess is kept only when it is that sampled token, so the KV
written for it is the KV of the real next token. That holds for sampled requests too, not only
greedy ones (a sampled one's guesses are kept less often). Logits come from a chunked forward
instead of one token at a time: equal to float rounding.

Whether a step verifies or decodes is a cost estimate: the engine times `verify` against each
of its decode calls at warm-up (all slots active), and verifies when the tokens the active
slots are expected to yield per unit of cost beat the decode call's. A sequence's guesses are
scored on every planned step, decoded ones too, and each guessed token is expected to hold
with the rate of its sequence's confirmed guesses so far (prior one half), given those before
it held (`Lookup.expected`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rl.model.transformer import from_bits, write_kv
from serving.engine.sampling import sample

if TYPE_CHECKING:
    from serving.engine.engine import _Seq


@dataclass
class Lookup:
    """A sequence's n-gram index over its context (prompt + completion so far: where each
    n-gram last ended) and how often its guesses came true, counted on every step, verified
    or decoded (a decoded step's tokens show what its guess would have kept)."""

    sizes: tuple[int, ...]
    """n-gram lengths tried, longest first."""
    context: list[int]
    seen: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0
    """Context positions whose n-grams ending there are in `seen`."""
    hits: int = 0
    misses: int = 0

    def guess(self, generated: list[int], prompt_len: int, k: int) -> list[int]:
        """`k` tokens that followed the latest earlier occurrence of the context's longest
        suffix that occurred before, or [] when none did. `generated`: the completion so far.
        The copy may overlap itself (as LZ77's does): after a suffix last seen `p` tokens
        back, the guess repeats the last `p` tokens, so a loop is guessed to go on looping."""
        context = self.context
        context += generated[len(context) - prompt_len :]
        end = len(context)
        for e in range(max(self.indexed, 1), end):  # n-grams ending before the suffix's end
            for n in self.sizes:
                if e >= n:
                    self.seen[tuple(context[e - n : e])] = e
        self.indexed = end
        for n in self.sizes:
            if end <= n:
                continue
            at = self.seen.get(tuple(context[end - n :]))
            if at is not None:
                out: list[int] = []
                for i in range(at, at + k):
                    out.append(context[i] if i < end else out[i - end])
                return out
        return []

    def observe(self, guess: list[int], new: list[int]) -> int:
        """Count a guess against the tokens that came -> the guessed tokens they confirm."""
        m = min(len(guess), len(new))
        kept = next((j for j in range(m) if guess[j] != new[j]), m)
        self.hits += kept
        self.misses += kept < m
        return kept

    def expected(self, guess_len: int) -> float:
        """Guessed tokens a verify call is expected to keep: each with this sequence's rate
        of confirmed guesses (prior one half), given the ones before it were."""
        rate = (self.hits + 1) / (self.hits + self.misses + 2)
        return sum(rate**j for j in range(1, guess_len + 1))


class SpeculateMixin:
    """`Engine`'s verify call, its guesses and the choice between verifying and decoding."""

    def _build_verify(self, graphdef, num_top: int, valid_vocab: int) -> None:
        k = self.cfg.speculate + 1

        def verify(state, cache, lengths_B, shift_B, tokens_BK, active_B, temp_B, top_p_B,
                   top_k_B, seed_B, index_B, counter_B, want_top):  # fmt: skip
            """Every active slot's input token and its guesses (`tokens_BK`, [B, K]) run as one
            chunk after its held keys; a token is sampled at each position, as decode would
            with the key of the sequence's token `counter + j`. -> (tokens, logprobs, top ids,
            top logprobs [K, B, ...] like a K-step decode, kept guesses [B]); the keys of all K
            inputs are written (those past the kept ones are never read: the slot's length
            moves past the kept ones only)."""
            self.traces["verify"] += 1
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
                logits_NV, per_position(temp_B), per_position(top_p_B), per_position(top_k_B),
                per_position(seed_B), per_position(index_B), counter_N, num_top, valid_vocab,
                want_top,
            )  # fmt: skip
            token_BK = token_N.reshape(b, k)
            hits_BK = (token_BK[:, :-1] == tokens_BK[:, 1:]).astype(jnp.int32)
            kept_B = jnp.sum(jnp.cumprod(hits_BK, axis=1), axis=1)
            cache = write_kv(cache, rows_B, index_BK, k_new, v_new, valid_BK)

            def steps_first(x_N):  # [B*K, ...] -> [K, B, ...], a K-step decode's layout
                return jnp.swapaxes(x_N.reshape(b, k, *x_N.shape[1:]), 0, 1)

            outs = tuple(steps_first(x) for x in (token_N, logp_N, top_ids_NT, top_logp_NT))
            return cache, (*outs, kept_B)

        self._verify = jax.jit(verify, donate_argnums=(1,)) if self.cfg.speculate else None
        self._spec_hot, self._ahead_run = False, 0
        self._verify_cost: dict[int, float] = {}
        """Per decode call (its steps), seconds of a verify call per second of it."""

    def _warm_verify(self, decode_args: tuple) -> None:
        """Compile `verify`, then time it against each decode call (the fastest of five
        each, every slot active and holding a quarter of its room, up to 256 keys, of no
        one's tokens: the host's lengths stay 0, so nothing reads them)."""
        if self._verify is None:
            return
        _, shift, tokens_B, active, *rest = decode_args
        k = self.cfg.speculate + 1
        room = self.cfg.max_seq_len - max(k, *self._decode)
        lengths = np.full(len(tokens_B), max(0, min(256, room // 4)), np.int32)
        tokens_BK = np.zeros((len(tokens_B), k), np.int32)
        rest = (np.ones_like(active), *rest)

        calls = [(self._verify, tokens_BK), *((d, tokens_B) for d in self._decode.values())]
        best = [float("inf")] * len(calls)
        for round_ in range(6):  # in turn, so a slow spell falls on all; round 0 compiles
            for i, (fn, tokens) in enumerate(calls):
                start = time.perf_counter()
                self._cache, out = fn(self._state, self._cache, lengths, shift, tokens, *rest)
                jax.block_until_ready(out)
                if round_:
                    best[i] = min(best[i], time.perf_counter() - start)
        for steps, t in zip(self._decode, best[1:], strict=True):
            self._verify_cost[steps] = best[0] / max(t, 1e-9)

    def _guesses(self, decoding: list[_Seq], steps: int) -> np.ndarray | None:
        """Guess every decoding sequence's next tokens; [B, K] verify inputs (each slot's
        next input, then its guess) when the tokens the slots are expected to keep per unit
        of cost beat a `steps`-step decode's, else None."""
        self._spec_hot, self._ahead_run = False, 0
        if self._verify is None or not decoding:
            return None
        k = self.cfg.speculate
        tokens = np.zeros((self.cfg.num_slots, k + 1), np.int32)
        expected = 0.0
        for seq in decoding:
            if seq.lookup is None:
                sizes = tuple(range(self.cfg.speculate_ngram, 0, -1))
                seq.lookup = Lookup(sizes, list(seq.prompt))
            seq.guess = seq.lookup.guess(seq.generated, len(seq.prompt), k)
            tokens[seq.slot, 0] = seq.next_input
            tokens[seq.slot, 1 : 1 + len(seq.guess)] = seq.guess
            expected += 1 + seq.lookup.expected(len(seq.guess))
        bar = steps * len(decoding) * self._verify_cost.get(steps, 1.0)
        # Worth looking again next step, not dispatching a decode ahead blind (`_ahead_ok`).
        self._spec_hot = expected > bar / 2
        if expected <= bar:
            return None
        if any(self._lengths[s.slot] + k + 1 > self.cfg.max_seq_len for s in decoding):
            return None
        return tokens

    def _speculated(self, decoding: list[_Seq], tokens: np.ndarray, steps: int):
        """(inputs, steps) of the next call: a verify call's [B, K] inputs and its K tokens
        when verifying pays (`_guesses`), else the decode call's as given."""
        guesses = self._guesses(decoding, steps)
        return (tokens, steps) if guesses is None else (guesses, guesses.shape[1])

    def _ahead_ok(self) -> bool:
        """Whether a decode call may be dispatched ahead: never while guessing pays nearly
        enough, and at most 4 in a row (then a step is planned, and its guesses counted)."""
        if self._verify is None:
            return True
        self._ahead_run += 1
        return not self._spec_hot and self._ahead_run <= 4

    def _observe_guesses(self, decoding: list[_Seq], start: dict, verified: bool) -> None:
        """Each sequence's guess of this step against the tokens it got (from `start`)."""
        if self._verify is None:
            return
        for seq in decoding:
            if seq.guess is not None:  # set, with its lookup, by `_guesses`
                kept = seq.lookup.observe(seq.guess, seq.generated[start[seq] :])
                if verified:
                    self.stats["spec_guessed"] += len(seq.guess)
                    self.stats["spec_kept"] += kept
                seq.guess = None
        self.stats["spec_steps"] += verified
