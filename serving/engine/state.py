"""What the engine keeps per request, per sequence and per session, and what it hands out.

Plain records, no engine logic: a request's sequences (`Seq`, one per sample) with what they
generated so far, the `Session` a caller keeps between calls, a sequence's prompt-lookup index
for speculation (`Lookup`), and what callers receive (`RequestHandle`, `TokenEvent`,
`SequenceOutput`). Every other module of the engine builds on these; they import none of them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import numpy as np

from serving.compaction import SessionCompaction
from serving.config import SamplingParams
from serving.engine.errors import EngineError


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


@dataclass
class Lookup:
    """A sequence's n-gram index over its context (prompt + completion so far: where each
    n-gram last ended) and how often its guesses came true, counted on every step, verified
    or decoded (a decoded step's tokens show what its guess would have kept). The speculator
    (`serving.engine.speculate`) keeps one per decoding sequence."""

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


@dataclass(eq=False)
class Session:
    """A persistent KV session: its logical token stream and the slot that holds its KV
    (`serving.engine.sessions`)."""

    id: str
    ttl_s: float
    compaction: SessionCompaction = field(default_factory=SessionCompaction)
    tokens: list[int] = field(default_factory=list)
    """Everything appended and generated so far (`session_tokens` is its length)."""
    slot: int | None = None
    busy: bool = False
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    gone: str | None = None
    """Why the session can no longer be used (expired, evicted); its next call says so."""
    turn_starts: list[int] = field(default_factory=list)
    """Logical index of each response's first token (turn k starts there)."""
    kept: list[int] = field(default_factory=list)
    """Logical positions the last compaction kept (the slot's first keys)."""
    tail_start: int = 0
    """Logical position of the first key after `kept`; from there on every token is held."""
    compacted: set[int] = field(default_factory=set)
    """Turns `turn` mode has thinned already (each only once)."""
    mass: np.ndarray | None = None
    """`turn` mode: attention mass per held key from the latest response (None: none yet)."""
    scoring: asyncio.Event | None = None
    """Set while the latest response's attention mass is being computed."""
    probes_left: int = 0
    compactions: int = 0
    keys_dropped: int = 0


@dataclass(eq=False)
class Seq:
    """One sample of a request: its prompt, where it sits, and what it generated so far."""

    request: Request
    index: int
    prompt: list[int]
    max_tokens: int
    slot: int | None = None
    pending: list[int] = field(default_factory=list)
    """Prompt tokens still to prefill (the last prompt token is the first decode input)."""
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
class Request:
    """A submitted request: its sampling parameters and its `n` sequences."""

    id: str
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    session: Session | None = None
    seqs: list[Seq] = field(default_factory=list)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    done: asyncio.Future | None = None
    created: float = field(default_factory=time.perf_counter)

    def conclude(self, seq: Seq, text: str) -> bool:
        """Hand out the `SequenceOutput` of `seq`, which just finished (`finish_reason` set)
        with the completion `text`; -> whether that was the request's last sequence (its
        outputs are then the result)."""
        now = time.perf_counter()
        seq.output = SequenceOutput(
            index=seq.index,
            token_ids=list(seq.generated),
            logprobs=seq.logprobs,
            top_logprobs=seq.tops,
            versions=seq.versions,
            text=text,
            finish_reason=seq.finish_reason,
            prompt_tokens=len(seq.prompt),
            cached_tokens=seq.cached,
            queue_s=(seq.admitted_at or now) - self.created,
            total_s=now - self.created,
        )
        self.events.put_nowait(seq.output)
        if any(s.finish_reason is None for s in self.seqs):
            return False
        if not self.done.done():
            self.done.set_result([s.output for s in self.seqs])
        return True


class RequestHandle:
    """What `Engine.submit` returns: stream tokens and/or await the outputs."""

    def __init__(self, request: Request, abort: Callable[[str], None]):
        self._request, self._abort = request, abort

    @property
    def id(self) -> str:
        return self._request.id

    async def result(self) -> list[SequenceOutput]:
        try:
            return await asyncio.shield(self._request.done)
        except asyncio.CancelledError:
            self._abort(self.id)
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
                self._abort(self.id)


def check_ids(ids: list[int], name: str, vocab: int) -> None:
    """EngineError naming `name` unless every id is in [0, vocab). Ids past the tokenizer's
    vocabulary are embedding rows with no token (never sampled)."""
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise EngineError(
            f"{name} token ids {bad[:5]} are outside the vocabulary [0, {vocab})", name
        )
