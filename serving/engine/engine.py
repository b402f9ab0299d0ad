"""The continuous-batching JAX inference engine.

The `Engine` keeps the scheduler loop and the jitted device functions, and owns three
components it calls through their methods (none of them calls the engine or another's
private state):
- `SlotTable` (`serving.engine.slots`): what each of the `num_slots` KV-cache rows holds
  (`rl.model.KVCache`), who runs in it, and where a new sequence is best seated;
- `SessionTable` (`serving.engine.sessions`): persistent sessions pinned to slots, their
  compaction planning and their eviction, through the slot table;
- `Speculator` (`serving.engine.speculate`, when `speculate` > 0): guesses and whether a
  step verifies them.
Requests, sequences and sessions are plain records (`serving.engine.state`).

The jitted device functions have static shapes: `decode` (one token for every slot, with
sampling fused in), `prefill` (up to `prefill_batch` prompt chunks, padded to a bucket),
`copy` (clone slot rows, for prefix reuse and `n` samples), `compact` and `probe` (a
session's gather of kept keys and its `turn` scoring) and `verify` (guesses, checked in one
call). The scheduler runs in the asyncio event loop: between device steps it admits waiting
sequences into slots, picks prefill chunks, applies aborts and weight swaps, and delivers
tokens. Device work runs in a worker thread so the loop keeps serving HTTP meanwhile.

A prompt's last token is never prefilled: it is the first decode step's input, so prefill
needs no LM head, every first token is sampled by the same decode step as all later ones, and
`n` samples of one prompt share its prefilled KV (the siblings copy the leader's row).

Prefix reuse: a slot keeps the tokens whose keys it holds after its sequence finishes. A new
prompt that extends them (the next turn of an episode) takes that slot over and only prefills
the new suffix; a prompt sharing a prefix with a busy slot copies its row instead.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
import os
import random
import time
from collections import deque
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from rl.data.tokenizer import Tokenizer
from rl.model.integrity import check_finite
from rl.model.params_io import abstract, load_params_like
from rl.model.state_tree import pure_dict, with_values
from rl.model.transformer import KVCache, Qwen3, as_bits, from_bits, held_block_size
from serving.compaction import SessionCompaction
from serving.config import INT64_MAX, MAX_N, EngineConfig, SamplingParams
from serving.engine.errors import EngineBusy, EngineError
from serving.engine.programs import build_programs
from serving.engine.sessions import SessionTable
from serving.engine.slots import SlotTable, index_prefilling
from serving.engine.speculate import Speculator
from serving.engine.state import (
    Request,
    RequestHandle,
    Seq,
    SequenceOutput,
    Session,
    TokenEvent,
    check_ids,
)

log = logging.getLogger(__name__)

LAST = 4
"""Index, in a decode call's outputs (tokens, logprobs, top ids, top logprobs, last), of every
slot's last sampled token: the next call's input when it is dispatched ahead."""


class Engine:
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
        self._vocab = min(self.model_cfg.vocab_size, self.tokenizer.vocab_size)
        """Ids past the tokenizer's vocabulary are embedding rows with no token."""
        self._waiting: deque[Seq] = deque()
        self._requests: dict[str, Request] = {}
        self._aborts: set[str] = set()
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closing = False
        self.failure: BaseException | None = None
        """Set when the loop died; every request in flight was failed with it."""
        self._rng = random.Random(int.from_bytes(os.urandom(4), "little"))
        self.traces: dict[str, int] = {
            "decode": 0,
            "prefill": 0,
            "copy": 0,
            "compact": 0,
            "probe": 0,
            "verify": 0,
        }
        self.stats = dict.fromkeys(
            (
                "requests",
                "generated_tokens",
                "prompt_tokens",
                "steps",
                "cached_tokens",
                "ahead_steps",
                "aborted",
                "sessions_opened",
                "sessions_evicted",
                "session_compactions",
                "spec_steps",
                "spec_guessed",
                "spec_kept",
            ),
            0,
        )
        self.block_reads: collections.Counter[tuple[str, int]] = collections.Counter()
        """Device calls per (step kind, blocks of held keys read): how much of the cache the
        steps touched (`HELD_BLOCK` positions a block; 0: none, e.g. a prompt's first chunk)."""
        self.slots = SlotTable(cfg.num_slots)
        self.session_table = SessionTable(cfg, self.slots, self.stats, self._vocab)
        self.speculator = Speculator(cfg, self.stats) if cfg.speculate else None
        self._build_functions()

    # ----- device functions ------------------------------------------------------------------

    def _build_functions(self) -> None:
        p = build_programs(
            self._graphdef,
            num_top=self.cfg.max_top_logprobs,
            valid_vocab=self._vocab,
            decode_steps=self.cfg.decode_steps,
            speculate=self.cfg.speculate,
            traces=self.traces,
        )
        self._compact_fn, self._probe_fn, self._decode = p.compact, p.probe, p.decode
        self._prefill, self._copy, self._verify = p.prefill, p.copy, p.verify

    def warmup(self) -> None:
        """Compile every shape a request uses, so no request triggers a compile. A compacting
        session's gather and `turn` scoring compile at their first use (most servers never
        compact: their start-up does not pay for it)."""
        b, p = self.cfg.num_slots, self.cfg.prefill_batch
        zeros_b = np.zeros(b, np.int32)
        for t in self.cfg.prefill_buckets:
            self._cache = self._prefill(
                self._state,
                self._cache,
                zeros_b,
                zeros_b,
                np.full(p, b, np.int32),
                np.zeros((p, t), np.int32),
                np.zeros(p, np.int32),
            )
        self._cache = self._copy(self._cache, np.full(p, b, np.int32), np.full(p, b, np.int32))
        idle = (
            np.zeros(b, bool),
            np.zeros(b, np.float32),
            np.ones(b, np.float32),
            zeros_b,
            zeros_b,
            zeros_b,
            zeros_b,
            np.bool_(False),
        )
        for decode in self._decode.values():
            tokens = zeros_b
            for _ in range(2 if self.cfg.overlap else 1):  # then fed its own device tokens
                self._cache, out = decode(self._state, self._cache, zeros_b, zeros_b, tokens, *idle)
                tokens = out[LAST]
        if self.speculator is not None:
            self.speculator.calibrate(*self._time_verify((zeros_b, zeros_b, zeros_b, *idle)))
        jax.block_until_ready(self._cache.k)
        # The finiteness check every weight reload runs (rl.model.integrity), compiled now.
        check_finite(self._served_params(), "the served weights")

    def _time_verify(self, decode_args: tuple) -> tuple[float, dict[int, float]]:
        """Compile `verify`, then time it and each decode call (the fastest of five each,
        every slot active and holding a quarter of its room, up to 256 keys, of no one's
        tokens: the host's lengths stay 0, so nothing reads them) -> (verify seconds, decode
        seconds by steps)."""
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
        return best[0], dict(zip(self._decode, best[1:], strict=True))

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
        check_ids(prompt, "prompt", self._vocab)
        if len(prompt) >= s:
            raise EngineError(
                f"prompt has {len(prompt)} tokens; the context is {s} tokens and "
                "at least one must be left to generate",
                "prompt",
            )
        room = s - len(prompt)
        if params.max_tokens is not None and params.max_tokens > room:
            raise EngineError(
                f"max_tokens={params.max_tokens} is beyond the context: the prompt "
                f"has {len(prompt)} tokens of {s}, so at most {room}",
                "max_tokens",
            )
        return self._enqueue(prompt, params, n=n, room=room, request_id=request_id)

    def _enqueue(
        self,
        prompt: list[int],
        params: SamplingParams,
        *,
        n: int,
        room: int,
        request_id: str | None = None,
        session: Session | None = None,
    ) -> RequestHandle:
        if self.failure is not None:
            raise EngineBusy(f"engine failed: {self.failure!r}")
        if self._closing or not self.running:
            raise EngineBusy("engine is not running")
        if not isinstance(n, int) or not 1 <= n <= MAX_N:
            raise EngineError(f"n={n!r} is invalid: an integer in [1, {MAX_N}]", "n")
        if params.logprobs > self.cfg.max_top_logprobs:
            raise EngineError(
                f"logprobs={params.logprobs} is invalid: at most {self.cfg.max_top_logprobs}",
                "logprobs",
            )
        max_tokens = min(params.max_tokens or self.cfg.default_max_tokens, room)
        if self.cfg.max_tokens_cap is not None:
            max_tokens = min(max_tokens, self.cfg.max_tokens_cap)
        if len(self._waiting) + n > self.cfg.max_waiting:
            raise EngineBusy(f"{len(self._waiting)} sequences are already waiting for a slot")

        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.add(self.tokenizer.eos_id)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(31)
        request = Request(
            id=request_id or f"req-{next(self._ids)}",
            params=params,
            seed=seed % (2**31),
            stop_ids=frozenset(stop_ids),
            session=session,
            done=asyncio.get_running_loop().create_future(),
        )
        if request.id in self._requests:
            raise EngineError(f"request id {request.id!r} is already in flight", "request_id")
        request.seqs = [Seq(request, i, prompt, max_tokens) for i in range(n)]
        self._requests[request.id] = request
        self._waiting.extend(request.seqs)
        self.stats["requests"] += 1
        self._wake.set()
        return RequestHandle(request, self.abort)

    async def generate(
        self, prompt: Sequence[int], params: SamplingParams, *, n: int = 1
    ) -> list[SequenceOutput]:
        return await self.submit(prompt, params, n=n).result()

    def abort(self, request_id: str) -> None:
        """Finish the request with `abort`; its slots are freed at the next step."""
        if request_id in self._requests:
            self._aborts.add(request_id)
            self._wake.set()

    # ----- sessions: `SessionTable`'s API, as the server calls it ----------------------------

    @property
    def sessions(self) -> dict[str, Session]:
        """The open sessions by id (and those gone, until their next call hears why)."""
        return self.session_table.sessions

    def open_session(
        self, ttl_s: float | None = None, compaction: SessionCompaction | None = None
    ) -> Session:
        return self.session_table.open(ttl_s, compaction)

    def forget_gone_sessions(self, session_ids=None) -> int:
        return self.session_table.forget_gone(session_ids)

    def session(self, session_id: str) -> Session:
        return self.session_table.get(session_id)

    async def session_submit(
        self, session_id: str, append: Sequence[int], params: SamplingParams
    ) -> RequestHandle:
        """Append `append` to the session and generate from it: the session is compacted
        first (its mode), then only tokens whose KV the slot does not hold are prefilled.
        One call at a time per session."""
        session = await self.session_table.ready(session_id)
        append = [int(t) for t in append]
        tokens, params, room = self.session_table.prepare_call(session, append, params)
        handle = self._enqueue(tokens, params, n=1, room=room, session=session)
        session.busy, session.last_used = True, time.monotonic()
        return handle

    def rewind_session(self, session_id: str, to: int) -> Session:
        return self.session_table.rewind(session_id, to)

    def close_session(self, session_id: str) -> None:
        """Forget the session and free its slot (a call in flight is aborted)."""
        session = self.session_table.close(session_id)
        for request in list(self._requests.values()):
            if request.session is session:
                self.abort(request.id)

    def session_kv_tokens(self, session: Session) -> int:
        return self.session_table.kv_tokens(session)

    def session_epoch(self, session: Session) -> dict:
        return self.session_table.epoch(session)

    # ----- weights ---------------------------------------------------------------------------

    async def load_weights(self, path: str | os.PathLike, version: int) -> int:
        """Load a params checkpoint (rl.model.params_io) and serve it as `version`, which must
        exceed the current one. Sequences in flight continue on the new weights; every token
        records the version that produced it."""
        if (
            isinstance(version, bool)
            or not isinstance(version, int)
            or not self.version < version <= INT64_MAX
        ):
            raise EngineError(
                f"version={version!r} is invalid: an integer greater than the "
                f"current version {self.version}, at most {INT64_MAX}",
                "version",
            )
        # Trainers seal what they publish (`rl.model.integrity`): an unsealed, altered or
        # non-finite checkpoint is refused and the served weights stay as they are.
        # Only shapes, dtypes and shardings go to the reading thread: nothing there can keep
        # the served arrays alive once they are replaced.
        params = await asyncio.to_thread(
            load_params_like, path, self.model_cfg, self._served_shapes(), require_manifest=True
        )
        return self.install_params(params, version)

    def install_params(self, params: dict, version: int) -> int:
        """Serve `params` (the `nnx.to_pure_dict` tree of the parameters, host or device
        arrays) as `version`, placed and typed like the served ones. Call from the event loop;
        `load_weights` reads a checkpoint and ends here, the fake vLLM server's workers too."""
        if version <= self.version:  # another load won the race while this one read
            raise EngineError(
                f"version {version} is no longer newer than {self.version}", "version"
            )
        served = self._served_shapes()

        def place(new, old):
            if tuple(new.shape) != tuple(old.shape):
                raise EngineError(
                    f"a parameter of shape {tuple(new.shape)} does not fit the "
                    f"served one's {tuple(old.shape)}",
                    "params",
                )
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
        self.slots.forget_prefixes()

    # ----- metrics ---------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def active_slots(self) -> int:
        return self.slots.active()

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
        return tuple(
            None if x is None else np.asarray(x).tolist()
            for x in (token_SB, logprob_SB, *tops, kept)
        )

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

    def _admit(self) -> None:
        """Give waiting sequences slots (FIFO). A sibling waits for its leader's prefill, and
        so does a sequence whose prompt starts like one being prefilled (the samples of an RL
        group, arriving together as separate requests): its prefix is then copied."""
        skipped: deque[Seq] = deque()
        prefilling = self.slots.prefilling_by_head() if self.cfg.prefix_reuse else None
        while self._waiting:
            seq = self._waiting.popleft()
            leader = seq.request.seqs[0]
            if seq is not leader and (leader.slot is None or leader.pending):
                skipped.append(seq)
                continue
            if (
                prefilling is not None
                and seq is leader
                and self.slots.gains_by_waiting(seq, prefilling, self.version)
            ):
                skipped.append(seq)  # a sequence seated before it is prefilling its prefix
                continue
            if not self._place(seq):
                skipped.append(seq)
                skipped.extend(self._waiting)
                self._waiting.clear()
                break
            if prefilling is not None:  # those after it may wait for its prefill
                index_prefilling(prefilling, seq)
        self._waiting = skipped

    def _place(self, seq: Seq) -> bool:
        """Seat `seq`: a session's call in its own slot, else the slot the slot table picks
        (taking the least recently used idle session's when every slot is taken). False when
        no slot is free."""
        session = seq.request.session
        if session is not None and session.slot is not None:
            self.session_table.seat(seq, session, self.version)  # its own: pinned, idle
        else:
            self.session_table.expire()
            want = seq.prompt[:-1]
            best, best_len = None, 0
            if self.cfg.prefix_reuse and want:
                best, best_len = self.slots.longest_prefix(want, self.version)
            idle = self.slots.idle()
            free = [s for s in idle if self.slots.session[s] is None]
            if not free:
                slot = self.session_table.evict_for(idle)
                if slot is None:
                    return False
                free = [slot]
            slot, cached = self.slots.choose(free, best, best_len, len(want))
            if session is not None:
                self.session_table.pin(session, slot)
            self.slots.seat(seq, slot, want, cached, self.version)
        self.stats["prompt_tokens"] += len(seq.prompt)
        self.stats["cached_tokens"] += seq.cached
        return True

    def _plan(self):
        """Host-side inputs of the next device step, or None when there is nothing to do."""
        b, p, chunk = self.cfg.num_slots, self.cfg.prefill_batch, self.cfg.prefill_chunk
        owner, lengths, shift = self.slots.owner, self.slots.lengths, self.slots.shift
        copies = self.slots.take_copies()
        compactions = self.session_table.take_compactions()
        probes = self.session_table.take_probes(p)
        prefilling = [s for s in owner if s is not None and s.pending][:p]
        decoding = [s for s in owner if s is not None and not s.pending]
        if not copies and not compactions and not probes and not prefilling and not decoding:
            return None

        copy_args = []  # fixed-size groups of `prefill_batch` (one compiled shape)
        for start in range(0, len(copies), p):
            src, dst = np.full(p, b, np.int32), np.full(p, b, np.int32)
            for i, (s, d) in enumerate(copies[start : start + p]):
                src[i], dst[i] = s, d
            copy_args.append((src, dst))
        side = self.session_table.step_args(compactions, probes)

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
            prefill_args = (lengths.copy(), shift.copy(), slots, tokens, num_new)
            for seq, part in chunks:  # lengths after the prefill, before the decode
                lengths[seq.slot] += len(part)

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
            if self.speculator is not None:  # a verify call's inputs and tokens, if it pays
                tokens, steps = self.speculator.inputs(decoding, tokens, steps, lengths)
            decode_args = (
                lengths.copy(),
                shift.copy(),
                tokens,
                active,
                temp,
                top_p,
                top_k,
                seed,
                index,
                counter,
                want_top,
            )
        return copy_args, side, prefill_args, chunks, decode_args, decoding, steps

    def _count_reads(self, kind: str, held: np.ndarray) -> None:
        """Counts a `kind` step whose rows hold `held` keys in `block_reads`: it reads the
        blocks up to its longest row's keys (`attend_split`)."""
        size = held_block_size(self.cfg.max_seq_len)
        self.block_reads[kind, -(-int(held.max(initial=0)) // size)] += 1

    def _steps(self, decoding: list[Seq], busy: bool) -> int:
        """Decode several tokens per device call while the batch is stable: nothing to
        prefill or copy, nobody waiting for a free slot, and room in every active slot."""
        k = self.cfg.decode_steps
        if k == 1 or busy or not decoding:
            return 1
        if self._waiting and self.slots.any_idle():
            return 1
        room, lengths = self.cfg.max_seq_len, self.slots.lengths
        if any(lengths[s.slot] + k > room for s in decoding):
            return 1
        return k

    def _device_step(
        self, state, copy_args, side, prefill_args, chunks, decode_args, decoding, steps
    ):
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
        if decode_args[2].ndim == 2:  # a verify call
            return None
        if self.speculator is not None and not self.speculator.ahead_ok():  # one may pay
            return None
        if self.slots.has_copies() or self.session_table.has_work():
            return None
        if self._waiting or self._aborts or self._closing:
            return None
        owners = [o for o in self.slots.owner if o is not None]
        if len(owners) != len(decoding) or any(
            o.finish_reason is not None or o.pending for o in owners
        ):
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
        args = (lengths, shift, tokens, active, temp, top_p, top_k, seed, index, counter, want_top)
        return [], ([], [], None), None, [], args, decoding, k

    def _deliver(self, plan, result, version: int) -> None:
        _, (_, probes, _), _, chunks, _, decoding, steps = plan
        out, mass = result
        held, lengths = self.slots.tokens, self.slots.lengths
        for i, (session, *_) in enumerate(probes):
            self.session_table.probe_done(session, mass[i])
        for seq, part in chunks:
            held[seq.slot].extend(part)
            del seq.pending[: len(part)]
        if out is None:
            return
        token_SB, logprob_SB, top_ids_SBK, top_logp_SBK, kept_B = out  # host lists (`_fetch`)
        start = None  # where each sequence's tokens of this step begin, for the speculator
        if self.speculator is not None:
            start = {seq: len(seq.generated) for seq in decoding}
        for seq in decoding:
            i = seq.slot
            k = seq.request.params.logprobs
            # tokens past a stop (or past a verify call's kept guesses) are dropped here
            for j in range(steps if kept_B is None else kept_B[i] + 1):
                if seq.finish_reason is not None:  # finished, or aborted while the step ran
                    break
                lengths[i] += 1
                held[i].append(seq.next_input)
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
        if self.speculator is not None:
            self.speculator.observe(decoding, start, kept_B is not None)

    def _stop_reason(self, seq: Seq, tok: int) -> str | None:
        if tok in seq.request.stop_ids:
            return "stop"
        if seq.request.params.stop and self._stop_string_at(seq) is not None:
            return "stop"
        if len(seq.generated) >= seq.max_tokens:
            return "length"
        if self.slots.lengths[seq.slot] + 1 > self.cfg.max_seq_len:
            return "length"
        return None

    def _stop_string_at(self, seq: Seq) -> int | None:
        text = self.tokenizer.decode(seq.generated)
        hits = [text.find(s) for s in seq.request.params.stop if s in text]
        return min(hits) if hits else None

    def _finish(self, seq: Seq, reason: str) -> None:
        seq.finish_reason = reason
        if seq.slot is not None:
            self.slots.release(seq.slot)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        if seq.request.session is not None and self.session_table.finished(seq, reason):
            self._wake.set()  # its `turn` scoring probes wait for a step
        ids = seq.generated
        body = ids[:-1] if ids and reason == "stop" and ids[-1] in seq.request.stop_ids else ids
        text = self.tokenizer.decode(body)
        if reason == "stop" and seq.request.params.stop:
            cut = self._stop_string_at(seq)
            if cut is not None:
                text = text[:cut]
        if seq.request.conclude(seq, text):
            self._requests.pop(seq.request.id, None)
