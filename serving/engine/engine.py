"""The continuous-batching JAX inference engine.

Components:
- a pool of `num_slots` sequence slots, one KV-cache row each (`rl.model.KVCache`);
- three jitted device functions with static shapes: `decode` (one token for every slot, with
  sampling fused in), `prefill` (up to `prefill_batch` prompt chunks, padded to a bucket), and
  `copy` (clone slot rows, for prefix reuse and `n` samples);
- a scheduler that runs in the asyncio event loop: between device steps it admits waiting
  sequences into slots, picks prefill chunks, applies aborts and weight swaps, and delivers
  tokens. Device work runs in a worker thread so the loop keeps serving HTTP meanwhile.

A prompt's last token is never prefilled: it is the first decode step's input, so prefill
needs no LM head, every first token is sampled by the same decode step as all later ones, and
`n` samples of one prompt share its prefilled KV (the siblings copy the leader's row).

Prefix reuse: a slot keeps the tokens whose keys it holds after its sequence finishes. A new
prompt that extends them (the next turn of an episode) takes that slot over and only prefills
the new suffix; a prompt sharing a prefix with a busy slot copies its row instead.

Sessions (`serving.engine.sessions`) pin a slot to a caller between calls and compact it;
speculative decoding (`serving.engine.speculate`) verifies guessed tokens in one call.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import itertools
import logging
import os
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rl.data.tokenizer import Tokenizer
from rl.model.integrity import check_finite
from rl.model.params_io import abstract, load_params_like
from rl.model.state_tree import pure_dict, with_values
from rl.model.transformer import KVCache, Qwen3, as_bits, from_bits, held_block_size, write_kv
from serving.config import INT64_MAX, MAX_N, EngineConfig, SamplingParams
from serving.engine.errors import EngineBusy, EngineError
from serving.engine.sampling import sample
from serving.engine.sessions import Session, SessionsMixin
from serving.engine.slots import SlotsMixin
from serving.engine.speculate import Lookup, SpeculateMixin

log = logging.getLogger(__name__)

LAST = 4
"""Index, in a decode call's outputs (tokens, logprobs, top ids, top logprobs, last), of every
slot's last sampled token: the next call's input when it is dispatched ahead."""


@dataclass
class SequenceOutput:
    """One finished (or aborted) sample."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    versions: list[int]
    """Weight version that produced each token."""
    text: str
    finish_reason: str
    """`stop`, `length` or `abort`."""
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens whose KV was reused rather than prefilled."""
    queue_s: float = 0.0
    total_s: float = 0.0


@dataclass
class TokenEvent:
    """A token as it is generated (for streaming)."""

    index: int
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]
    version: int


@dataclass(eq=False)
class _Seq:
    request: _Request
    index: int
    prompt: list[int]
    max_tokens: int
    slot: int | None = None
    pending: list[int] = field(default_factory=list)
    next_input: int = 0
    cached: int = 0
    admitted_at: float = 0.0
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    output: SequenceOutput | None = None
    lookup: Lookup | None = None
    guess: list[int] | None = None
    """Its guessed next tokens at the step now running (`serving.engine.speculate`)."""


@dataclass(eq=False)
class _Request:
    id: str
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    session: Session | None = None
    seqs: list[_Seq] = field(default_factory=list)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    done: asyncio.Future | None = None
    created: float = field(default_factory=time.perf_counter)


class RequestHandle:
    """What `Engine.submit` returns: stream tokens and/or await the outputs."""

    def __init__(self, engine: Engine, request: _Request):
        self._engine, self._request = engine, request

    @property
    def id(self) -> str:
        return self._request.id

    async def result(self) -> list[SequenceOutput]:
        try:
            return await asyncio.shield(self._request.done)
        except asyncio.CancelledError:
            self._engine.abort(self.id)
            raise

    async def stream(self) -> AsyncIterator[TokenEvent | SequenceOutput]:
        """Token events as they come, then each sequence's `SequenceOutput` as it finishes;
        ends after the last sequence. Cancelling the consumer aborts the request."""
        remaining = len(self._request.seqs)
        try:
            while remaining:
                event = await self._request.events.get()
                if isinstance(event, BaseException):
                    remaining = 0
                    raise event
                if isinstance(event, SequenceOutput):
                    remaining -= 1
                yield event
        finally:
            if remaining:
                self._engine.abort(self.id)


class Engine(SlotsMixin, SessionsMixin, SpeculateMixin):
    """`engine = Engine(model, tokenizer, EngineConfig()); await engine.start()`, then
    `await engine.submit(prompt_ids, SamplingParams(...)).result()`."""

    def __init__(self, model: Qwen3, tokenizer: Tokenizer, cfg: EngineConfig, *, version: int = 0):
        self.cfg, self.tokenizer, self.model = cfg, tokenizer, model
        self.model_cfg = model.cfg
        self.version = version
        self._graphdef, state = nnx.split(model)
        # Committed where they live, as `load_weights` restores parameters and as the steps
        # return the cache: otherwise differently placed arguments compile the steps again.
        commit = functools.partial(jax.tree.map, lambda x: jax.device_put(x, x.sharding))
        # bf16 held as uint16 bits (`as_bits`): XLA:CPU copies bf16 arguments at every call
        self._state = commit(as_bits(state))
        self._cache = commit(KVCache.create(self.model_cfg, cfg.num_slots, cfg.max_seq_len))
        b = cfg.num_slots
        self._lengths = np.zeros(b, np.int32)
        self._shift = np.zeros(b, np.int32)
        """Logical position minus cache index of a slot's next token (compacted sessions)."""
        self._slot_tokens: list[list[int]] = [[] for _ in range(b)]
        self._slot_owner: list[_Seq | None] = [None] * b
        self._slot_used = np.zeros(b, np.float64)
        self._slot_version = np.full(b, -1, np.int64)
        """Weight version a slot's KV was computed with: only the current one is reused."""
        self._waiting: deque[_Seq] = deque()
        self._pending_copies: list[tuple[int, int]] = []
        self._pending_compactions: list[tuple[int, list[int]]] = []
        self._pending_probes: list[tuple[Session, int, int, list[int]]] = []
        self._requests: dict[str, _Request] = {}
        self._aborts: set[str] = set()
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closing = False
        self.failure: BaseException | None = None
        """Set when the loop died; every request in flight was failed with it."""
        self._rng = random.Random(int.from_bytes(os.urandom(4), "little"))
        self.traces: dict[str, int] = {"decode": 0, "prefill": 0, "copy": 0, "compact": 0,
                                       "probe": 0, "verify": 0}  # fmt: skip
        self.stats = dict.fromkeys(("requests", "generated_tokens", "prompt_tokens", "steps",
                                    "cached_tokens", "ahead_steps", "aborted", "sessions_opened",
                                    "sessions_evicted", "session_compactions", "spec_steps",
                                    "spec_guessed", "spec_kept"), 0)  # fmt: skip
        self.block_reads: collections.Counter[tuple[str, int]] = collections.Counter()
        """Device calls per (step kind, blocks of held keys read): how much of the cache the
        steps touched (`HELD_BLOCK` positions a block; 0: none, e.g. a prompt's first chunk)."""
        self._slot_session: list[Session | None] = [None] * b
        """The session a slot is pinned to (between its calls too)."""
        self.sessions: dict[str, Session] = {}
        self._build_functions()

    # ----- device functions ------------------------------------------------------------------

    def _build_functions(self) -> None:
        graphdef, num_top = self._graphdef, self.cfg.max_top_logprobs
        valid_vocab = min(self.model_cfg.vocab_size, self.tokenizer.vocab_size)

        def decode(state, cache, lengths_B, shift_B, tokens_B, active_B, temp_B, top_p_B,
                   top_k_B, seed_B, index_B, counter_B, want_top, *, steps):  # fmt: skip
            """`steps` tokens for every active slot, each step feeding back its own sample.
            Only the blocks of the cache that hold some slot's keys are read. The steps' own
            keys gather in small buffers, written into the cache once at the end (the cache
            itself is never copied)."""
            self.traces["decode"] += 1
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
                h_B1D, k_new, v_new = model.extend_kv(tok_B[:, None], past, held_B,
                                                      (k_new, v_new), j[None], mask_B1U,
                                                      positions_B1)  # fmt: skip
                out = sample(model.logits(h_B1D)[:, 0], temp_B, top_p_B, top_k_B, seed_B,
                             index_B, counter_B + j, num_top, valid_vocab, want_top)  # fmt: skip
                return (k_new, v_new, out[0]), out

            (k_new, v_new, last_B), outs = jax.lax.scan(one, (empty, empty, tokens_B), u_U)
            at_BU = lengths_B[:, None] + u_U[None, :]
            cache = write_kv(cache, jnp.arange(b, dtype=jnp.int32), at_BU, k_new, v_new,
                             jnp.broadcast_to(active_B[:, None], at_BU.shape))  # fmt: skip
            # The last sampled tokens apart: the next call's inputs when it is dispatched
            # ahead, without an indexing op on the host.
            return cache, (*outs, last_B)

        def rows(cache, slots_P):
            """The listed slots' keys and values (a padding entry, slot B, reads zeros)."""
            return tuple(jnp.take(x, slots_P, axis=1, mode="fill", fill_value=0)
                         for x in (cache.k, cache.v))  # fmt: skip

        def prefill(state, cache, lengths_B, shift_B, slots_P, tokens_PT, num_new_P):
            """Writes the chunks' keys; reads only the blocks of the listed slots' rows that
            hold their keys (a padding entry, slot B, holds none)."""
            self.traces["prefill"] += 1
            model = nnx.merge(graphdef, from_bits(state))
            held_P = jnp.take(lengths_B, slots_P, mode="fill", fill_value=0)
            shift_P = jnp.take(shift_B, slots_P, mode="fill", fill_value=0)
            _, k_new, v_new, index_PT, valid_PT = model.extend_chunk(
                tokens_PT, (cache.k, cache.v), held_P, num_new_P, shift_P, rows_B=slots_P
            )
            return write_kv(cache, slots_P, index_PT, k_new, v_new, valid_PT)

        def copy(cache, src_P, dst_P):
            self.traces["copy"] += 1
            k, v = rows(cache, src_P)
            return dataclasses.replace(
                cache,
                k=cache.k.at[:, dst_P].set(k, mode="drop"),
                v=cache.v.at[:, dst_P].set(v, mode="drop"),
            )

        def compact(cache, slots_P, index_PS):
            """Each listed slot keeps the keys at `index_PS` (in that order) at its front."""
            self.traces["compact"] += 1
            k, v = (jnp.take_along_axis(x, index_PS[None, :, :, None, None], axis=2)
                    for x in rows(cache, slots_P))  # fmt: skip
            return dataclasses.replace(
                cache,
                k=cache.k.at[:, slots_P].set(k, mode="drop"),
                v=cache.v.at[:, slots_P].set(v, mode="drop"),
            )

        def probe(state, cache, slots_P, tokens_PT, start_P, num_P, shift_P):
            """Attention mass per key of the slots' tokens at `start_P` (already written)."""
            self.traces["probe"] += 1
            model = nnx.merge(graphdef, from_bits(state))
            k, v = rows(cache, slots_P)
            sub = KVCache(k=k, v=v, lengths=jnp.zeros(slots_P.shape, jnp.int32))
            return model.attention_mass(tokens_PT, sub, start_P, num_P, shift_P)

        self._compact_fn = jax.jit(compact, donate_argnums=(0,))
        self._probe_fn = jax.jit(probe)
        self._decode = {
            k: jax.jit(functools.partial(decode, steps=k), donate_argnums=(1,))
            for k in sorted({1, self.cfg.decode_steps})
        }
        self._prefill = jax.jit(prefill, donate_argnums=(1,))
        self._copy = jax.jit(copy, donate_argnums=(0,))
        self._build_verify(graphdef, num_top, valid_vocab)

    def warmup(self) -> None:
        """Compile every shape a request uses, so no request triggers a compile. A compacting
        session's gather and `turn` scoring compile at their first use (most servers never
        compact: their start-up does not pay for it)."""
        b, p = self.cfg.num_slots, self.cfg.prefill_batch
        zeros_b = np.zeros(b, np.int32)
        for t in self.cfg.prefill_buckets:
            self._cache = self._prefill(self._state, self._cache, zeros_b, zeros_b,
                                        np.full(p, b, np.int32), np.zeros((p, t), np.int32),
                                        np.zeros(p, np.int32))  # fmt: skip
        self._cache = self._copy(self._cache, np.full(p, b, np.int32), np.full(p, b, np.int32))
        idle = (np.zeros(b, bool), np.zeros(b, np.float32), np.ones(b, np.float32), zeros_b,
                zeros_b, zeros_b, zeros_b, np.bool_(False))  # fmt: skip
        for decode in self._decode.values():
            tokens = zeros_b
            for _ in range(2 if self.cfg.overlap else 1):  # then fed its own device tokens
                self._cache, out = decode(self._state, self._cache, zeros_b, zeros_b, tokens, *idle)
                tokens = out[LAST]
        self._warm_verify((zeros_b, zeros_b, zeros_b, *idle))
        jax.block_until_ready(self._cache.k)
        # The finiteness check every weight reload runs (rl.model.integrity), compiled now.
        check_finite(self._served_params(), "the served weights")

    # ----- lifecycle -------------------------------------------------------------------------

    async def start(self, *, warmup: bool = True) -> None:
        if warmup:
            await asyncio.to_thread(self.warmup)
        self._task = asyncio.create_task(self._run(), name="engine-loop")

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Abort everything in flight and stop the loop (bounded)."""
        self._closing = True
        for rid in list(self._requests):
            self.abort(rid)
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout_s)  # cancels it on timeout
            except TimeoutError:
                pass
            except Exception:  # noqa: BLE001 - the loop died earlier: it is in self.failure
                assert self.failure is not None
            self._task = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def wait(self) -> None:
        """Until the loop ends: returns when it stopped, raises what killed it (a server exits
        on that, so that its supervisor restarts it)."""
        if self._task is not None:
            await asyncio.shield(self._task)

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet finished."""
        return len(self._requests)

    # ----- requests --------------------------------------------------------------------------

    def submit(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        n: int = 1,
        request_id: str | None = None,
    ) -> RequestHandle:
        """Queue `n` samples of `prompt` (token ids). Raises EngineError for bad input."""
        prompt = [int(t) for t in prompt]
        s = self.cfg.max_seq_len
        if not prompt:
            raise EngineError("prompt is empty: give at least one token", "prompt")
        self._check_ids(prompt, "prompt")
        if len(prompt) >= s:
            raise EngineError(f"prompt has {len(prompt)} tokens; the context is {s} tokens and "
                              "at least one must be left to generate", "prompt")  # fmt: skip
        room = s - len(prompt)
        if params.max_tokens is not None and params.max_tokens > room:
            raise EngineError(f"max_tokens={params.max_tokens} is beyond the context: the prompt "
                              f"has {len(prompt)} tokens of {s}, so at most {room}",
                              "max_tokens")  # fmt: skip
        return self._enqueue(prompt, params, n=n, room=room, request_id=request_id)

    def _check_ids(self, ids: list[int], name: str) -> None:
        # Ids past the tokenizer's vocabulary are embedding rows with no token (never sampled).
        vocab = min(self.model_cfg.vocab_size, self.tokenizer.vocab_size)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise EngineError(f"{name} token ids {bad[:5]} are outside the vocabulary "
                              f"[0, {vocab})", name)  # fmt: skip

    def _enqueue(self, prompt: list[int], params: SamplingParams, *, n: int, room: int,
                 request_id: str | None = None,
                 session: Session | None = None) -> RequestHandle:  # fmt: skip
        if self.failure is not None:
            raise EngineBusy(f"engine failed: {self.failure!r}")
        if self._closing or not self.running:
            raise EngineBusy("engine is not running")
        if not isinstance(n, int) or not 1 <= n <= MAX_N:
            raise EngineError(f"n={n!r} is invalid: an integer in [1, {MAX_N}]", "n")
        if params.logprobs > self.cfg.max_top_logprobs:
            raise EngineError(f"logprobs={params.logprobs} is invalid: at most "
                              f"{self.cfg.max_top_logprobs}", "logprobs")  # fmt: skip
        max_tokens = min(params.max_tokens or self.cfg.default_max_tokens, room)
        if self.cfg.max_tokens_cap is not None:
            max_tokens = min(max_tokens, self.cfg.max_tokens_cap)
        if len(self._waiting) + n > self.cfg.max_waiting:
            raise EngineBusy(f"{len(self._waiting)} sequences are already waiting for a slot")

        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.add(self.tokenizer.eos_id)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(31)
        request = _Request(
            id=request_id or f"req-{next(self._ids)}",
            params=params,
            seed=seed % (2**31),
            stop_ids=frozenset(stop_ids),
            session=session,
            done=asyncio.get_running_loop().create_future(),
        )
        if request.id in self._requests:
            raise EngineError(f"request id {request.id!r} is already in flight", "request_id")
        request.seqs = [_Seq(request, i, prompt, max_tokens) for i in range(n)]
        self._requests[request.id] = request
        self._waiting.extend(request.seqs)
        self.stats["requests"] += 1
        self._wake.set()
        return RequestHandle(self, request)

    async def generate(
        self, prompt: Sequence[int], params: SamplingParams, *, n: int = 1
    ) -> list[SequenceOutput]:
        return await self.submit(prompt, params, n=n).result()

    def abort(self, request_id: str) -> None:
        """Finish the request with `abort`; its slots are freed at the next step."""
        if request_id in self._requests:
            self._aborts.add(request_id)
            self._wake.set()

    async def load_weights(self, path: str | os.PathLike, version: int) -> int:
        """Load a params checkpoint (rl.model.params_io) and serve it as `version`, which must
        exceed the current one. Sequences in flight continue on the new weights; every token
        records the version that produced it."""
        if (isinstance(version, bool) or not isinstance(version, int)
                or not self.version < version <= INT64_MAX):  # fmt: skip
            raise EngineError(f"version={version!r} is invalid: an integer greater than the "
                              f"current version {self.version}, at most {INT64_MAX}",
                              "version")  # fmt: skip
        # Trainers seal what they publish (`rl.model.integrity`): an unsealed, altered or
        # non-finite checkpoint is refused and the served weights stay as they are.
        # Only shapes, dtypes and shardings go to the reading thread: nothing there can keep
        # the served arrays alive once they are replaced.
        params = await asyncio.to_thread(load_params_like, path, self.model_cfg,
                                         self._served_shapes(), require_manifest=True)  # fmt: skip
        return self.install_params(params, version)

    def install_params(self, params: dict, version: int) -> int:
        """Serve `params` (the `nnx.to_pure_dict` tree of the parameters, host or device
        arrays) as `version`, placed and typed like the served ones. Call from the event loop;
        `load_weights` reads a checkpoint and ends here, the fake vLLM server's workers too."""
        if version <= self.version:  # another load won the race while this one read
            raise EngineError(f"version {version} is no longer newer than {self.version}",
                              "version")  # fmt: skip
        served = self._served_shapes()

        def place(new, old):
            if tuple(new.shape) != tuple(old.shape):
                raise EngineError(f"a parameter of shape {tuple(new.shape)} does not fit the "
                                  f"served one's {tuple(old.shape)}", "params")  # fmt: skip
            return jax.device_put(new, old.sharding).astype(old.dtype)

        params = as_bits(jax.tree.map(place, params, served))
        # A fresh State (new Variable objects): a step running right now keeps the old one.
        self._state, self.version = with_values(self._state, params), version
        return version

    def _served_params(self) -> dict:
        """The served parameters as a pure dict, free of flax's cycles (`rl.model.state_tree`)."""
        return from_bits(pure_dict(self._state))

    def _served_shapes(self) -> dict:
        """`_served_params` as ShapeDtypeStructs with shardings (no bf16 bits are copied)."""
        return from_bits(abstract(pure_dict(self._state)))

    def reset_prefix_cache(self) -> None:
        """Forget every slot's cached prefix: no later prompt reuses KV computed so far."""
        self._slot_version[:] = -1

    # ----- metrics ---------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def active_slots(self) -> int:
        return sum(o is not None for o in self._slot_owner)

    # ----- the loop --------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._loop()
        except Exception as e:
            # Surface it: fail every request (streams and futures) instead of hanging them.
            log.exception("engine loop failed")
            self.failure = e
            for request in list(self._requests.values()):
                request.events.put_nowait(e)
                if not request.done.done():
                    request.done.set_exception(e)
            self._requests.clear()
            raise

    async def _loop(self) -> None:
        ahead = None  # a decode call dispatched before its predecessor's tokens were delivered
        while True:
            self._apply_aborts()
            if ahead is not None:
                plan, version, out, mass = ahead
            else:
                if self._closing and not self._requests:
                    return
                self._admit()
                plan = self._plan()
                if plan is None:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                version = self.version
                out, mass = await asyncio.to_thread(self._device_step, self._state, *plan)
            ahead = self._plan_ahead(plan, out) if self.cfg.overlap else None
            if ahead is not None:  # dispatched before `out` is fetched: the device never waits
                self.stats["ahead_steps"] += 1
                ahead_version = self.version
                # One hop to the worker thread: dispatch the next call, then wait for this one.
                (ahead_out, ahead_mass), out = await asyncio.to_thread(
                    self._step_then_fetch, self._state, ahead, plan, out
                )
                ahead = (ahead, ahead_version, ahead_out, ahead_mass)
            elif out is not None:
                out = await asyncio.to_thread(self._fetch, plan, out)
            self._deliver(plan, (out, mass), version)
            self.stats["steps"] += 1

    def _fetch(self, plan, out) -> tuple[list, list, list | None, list | None]:
        """A decode call's tokens and logprobs as host lists [steps][slots] (blocks until the
        device has them), and its top alternatives only when some sequence asked for them."""
        _, _, _, _, decode_args, _, _ = plan
        want_top = decode_args[-1]
        token_SB, logprob_SB, top_ids_SBK, top_logp_SBK, last = out
        tops = (top_ids_SBK, top_logp_SBK) if want_top else (None, None)
        kept = last if decode_args[2].ndim == 2 else None  # a verify call's: its kept guesses
        return tuple(None if x is None else np.asarray(x).tolist()
                     for x in (token_SB, logprob_SB, *tops, kept))  # fmt: skip

    def _step_then_fetch(self, state, ahead, plan, out):
        return self._device_step(state, *ahead), self._fetch(plan, out)

    def _apply_aborts(self) -> None:
        for rid in list(self._aborts):
            request = self._requests.get(rid)
            if request is not None:
                for seq in request.seqs:
                    if seq.finish_reason is None:
                        self._finish(seq, "abort")
                self.stats["aborted"] += 1
        self._aborts.clear()

    def _plan(self):
        """Host-side inputs of the next device step, or None when there is nothing to do."""
        b, p, chunk = self.cfg.num_slots, self.cfg.prefill_batch, self.cfg.prefill_chunk
        copies, self._pending_copies = self._pending_copies, []
        compactions, self._pending_compactions = self._pending_compactions, []
        probes, self._pending_probes = self._pending_probes[:p], self._pending_probes[p:]
        prefilling = [s for s in self._slot_owner if s is not None and s.pending][:p]
        decoding = [s for s in self._slot_owner if s is not None and not s.pending]
        if not copies and not compactions and not probes and not prefilling and not decoding:
            return None

        copy_args = []  # fixed-size groups of `prefill_batch` (one compiled shape)
        for start in range(0, len(copies), p):
            src, dst = np.full(p, b, np.int32), np.full(p, b, np.int32)
            for i, (s, d) in enumerate(copies[start : start + p]):
                src[i], dst[i] = s, d
            copy_args.append((src, dst))
        side = self._session_step_args(compactions, probes)

        plan = bool(copies or compactions or probes or prefilling)  # busy: keep the step short
        prefill_args, chunks = None, []
        if prefilling:
            longest = max(min(len(s.pending), chunk) for s in prefilling)
            t = next(x for x in self.cfg.prefill_buckets if x >= longest)
            slots = np.full(p, b, np.int32)
            tokens = np.zeros((p, t), np.int32)
            num_new = np.zeros(p, np.int32)
            for i, seq in enumerate(prefilling):
                part = seq.pending[:chunk]
                slots[i], num_new[i] = seq.slot, len(part)
                tokens[i, : len(part)] = part
                chunks.append((seq, part))
            prefill_args = (self._lengths.copy(), self._shift.copy(), slots, tokens, num_new)
            for seq, part in chunks:  # lengths after the prefill, before the decode
                self._lengths[seq.slot] += len(part)

        decode_args, steps = None, self._steps(decoding, plan)
        if decoding:
            tokens, active = np.zeros(b, np.int32), np.zeros(b, bool)
            temp, top_p = np.zeros(b, np.float32), np.ones(b, np.float32)
            top_k, seed = np.zeros(b, np.int32), np.zeros(b, np.int32)
            index, counter = np.zeros(b, np.int32), np.zeros(b, np.int32)
            for seq in decoding:
                i, prm = seq.slot, seq.request.params
                tokens[i], active[i] = seq.next_input, True
                temp[i], top_p[i], top_k[i] = prm.temperature, prm.top_p, prm.top_k
                seed[i], index[i], counter[i] = seq.request.seed, seq.index, len(seq.generated)
            want_top = np.bool_(any(s.request.params.logprobs for s in decoding))
            tokens, steps = self._speculated(decoding, tokens, steps)  # or a verify call's
            decode_args = (self._lengths.copy(), self._shift.copy(), tokens, active, temp, top_p,
                           top_k, seed, index, counter, want_top)  # fmt: skip
        return copy_args, side, prefill_args, chunks, decode_args, decoding, steps

    def _count_reads(self, kind: str, held: np.ndarray) -> None:
        """Counts a `kind` step whose rows hold `held` keys in `block_reads`: it reads the
        blocks up to its longest row's keys (`attend_split`)."""
        size = held_block_size(self.cfg.max_seq_len)
        self.block_reads[kind, -(-int(held.max(initial=0)) // size)] += 1

    def _steps(self, decoding: list[_Seq], busy: bool) -> int:
        """Decode several tokens per device call while the batch is stable: nothing to
        prefill or copy, nobody waiting for a free slot, and room in every active slot."""
        k = self.cfg.decode_steps
        if k == 1 or busy or not decoding:
            return 1
        if self._waiting and any(o is None for o in self._slot_owner):
            return 1
        room = self.cfg.max_seq_len
        if any(self._lengths[s.slot] + k > room for s in decoding):
            return 1
        return k

    def _device_step(self, state, copy_args, side, prefill_args, chunks, decode_args, decoding,
                     steps):  # fmt: skip
        """Runs in a worker thread: the only place device work happens."""
        cache = self._cache
        for src, dst in copy_args:
            cache = self._copy(cache, src, dst)
        gathers, _, probe_args = side
        for slots, index in gathers:
            cache = self._compact_fn(cache, slots, index)
        mass = None
        if probe_args is not None:
            mass = jax.device_get(self._probe_fn(state, cache, *probe_args))
        if prefill_args is not None:
            lengths, _, slots, *_ = prefill_args
            self._count_reads("prefill", lengths[slots[slots < len(lengths)]])
            cache = self._prefill(state, cache, *prefill_args)
        out = None
        if decode_args is not None:
            lengths, _, _, active, *_ = decode_args
            self._count_reads("decode", lengths[active])
            call = self._verify if decode_args[2].ndim == 2 else self._decode[steps]
            cache, out = call(state, cache, *decode_args)
        self._cache = cache
        return out, mass  # `out` still on the device: the caller fetches it

    def _plan_ahead(self, plan, out):
        """The plan of the next decode call, to dispatch before `out` reaches the host, when
        the batch will be the same: `plan` was decode only, nothing else is pending and every
        sequence of it still runs. Its inputs are what `plan`'s tokens will make of the host
        state: lengths and sample counters `steps` further on, and the last sampled tokens,
        still on the device. None when the next call has to be planned after the delivery."""
        copy_args, side, prefill_args, _, decode_args, decoding, steps = plan
        if out is None or copy_args or prefill_args is not None or side[0] or side[1]:
            return None
        if decode_args[2].ndim == 2 or not self._ahead_ok():  # a verify call, or one may pay
            return None
        if self._pending_copies or self._pending_compactions or self._pending_probes:
            return None
        if self._waiting or self._aborts or self._closing:
            return None
        owners = [o for o in self._slot_owner if o is not None]
        if len(owners) != len(decoding) or any(o.finish_reason is not None or o.pending
                                               for o in owners):  # fmt: skip
            return None
        if not any(len(s.generated) + steps < s.max_tokens for s in decoding):
            return None  # every one of them ends within `plan`: nothing to compute ahead
        lengths, shift, _, active, temp, top_p, top_k, seed, index, counter, want_top = decode_args
        moved = steps * active.astype(np.int32)
        lengths, counter = lengths + moved, counter + moved
        k = self._steps(decoding, False)
        if k != steps or any(lengths[s.slot] + k > self.cfg.max_seq_len for s in decoding):
            return None
        tokens = out[LAST]  # every slot's last sampled token, on the device
        args = (lengths, shift, tokens, active, temp, top_p, top_k, seed, index, counter,
                want_top)  # fmt: skip
        return [], ([], [], None), None, [], args, decoding, k

    def _deliver(self, plan, result, version: int) -> None:
        _, (_, probes, _), _, chunks, _, decoding, steps = plan
        out, mass = result
        for i, (session, *_) in enumerate(probes):
            self._probe_done(session, mass[i])
        for seq, part in chunks:
            self._slot_tokens[seq.slot].extend(part)
            del seq.pending[: len(part)]
        if out is None:
            return
        token_SB, logprob_SB, top_ids_SBK, top_logp_SBK, kept_B = out  # host lists (`_fetch`)
        start = {seq: len(seq.generated) for seq in decoding} if self._verify else None
        for seq in decoding:
            i = seq.slot
            k = seq.request.params.logprobs
            # tokens past a stop (or past a verify call's kept guesses) are dropped here
            for j in range(steps if kept_B is None else kept_B[i] + 1):
                if seq.finish_reason is not None:  # finished, or aborted while the step ran
                    break
                self._lengths[i] += 1
                self._slot_tokens[i].append(seq.next_input)
                tok = token_SB[j][i]
                top = []
                if k:
                    top = list(zip(top_ids_SBK[j][i][:k], top_logp_SBK[j][i][:k], strict=True))
                seq.generated.append(tok)
                seq.logprobs.append(logprob_SB[j][i])
                seq.tops.append(top)
                seq.versions.append(version)
                seq.next_input = tok
                self.stats["generated_tokens"] += 1
                event = TokenEvent(seq.index, tok, seq.logprobs[-1], top, version)
                seq.request.events.put_nowait(event)
                reason = self._stop_reason(seq, tok)
                if reason is not None:
                    self._finish(seq, reason)
        self._observe_guesses(decoding, start, kept_B is not None)

    def _stop_reason(self, seq: _Seq, tok: int) -> str | None:
        if tok in seq.request.stop_ids:
            return "stop"
        if seq.request.params.stop and self._stop_string_at(seq) is not None:
            return "stop"
        if len(seq.generated) >= seq.max_tokens:
            return "length"
        if self._lengths[seq.slot] + 1 > self.cfg.max_seq_len:
            return "length"
        return None

    def _stop_string_at(self, seq: _Seq) -> int | None:
        text = self.tokenizer.decode(seq.generated)
        hits = [text.find(s) for s in seq.request.params.stop if s in text]
        return min(hits) if hits else None

    def _finish(self, seq: _Seq, reason: str) -> None:
        seq.finish_reason = reason
        if seq.slot is not None:
            self._slot_owner[seq.slot] = None
            self._slot_used[seq.slot] = time.perf_counter()
        elif seq in self._waiting:
            self._waiting.remove(seq)
        if seq.request.session is not None:
            self._session_finished(seq, reason)
        ids = seq.generated
        body = ids[:-1] if ids and reason == "stop" and ids[-1] in seq.request.stop_ids else ids
        text = self.tokenizer.decode(body)
        if reason == "stop" and seq.request.params.stop:
            cut = self._stop_string_at(seq)
            if cut is not None:
                text = text[:cut]
        now = time.perf_counter()
        created = seq.request.created
        output = SequenceOutput(
            index=seq.index, token_ids=list(ids), logprobs=seq.logprobs, top_logprobs=seq.tops,
            versions=seq.versions, text=text, finish_reason=reason,
            prompt_tokens=len(seq.prompt), cached_tokens=seq.cached,
            queue_s=(seq.admitted_at or now) - created, total_s=now - created,
        )  # fmt: skip
        seq.output = output
        request = seq.request
        request.events.put_nowait(output)
        if all(s.finish_reason is not None for s in request.seqs):
            self._requests.pop(request.id, None)
            if not request.done.done():
                request.done.set_result([s.output for s in request.seqs])
