"""Serving settings (no JAX): the engine's slot pool and limits, sampling parameters, and the
HTTP server's bind address, admin token, checkpoint root and per-client limits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rl import validate

MAX_N = 64
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
"""Weight versions are stored as int64 (per KV slot and per token)."""
MIN_TEMPERATURE = 1e-2
"""Smallest positive temperature: logits / temperature stays finite in float32. Requests ask
for less at their own risk: the server raises it to this (as vLLM does)."""
MAX_TEMPERATURE = 100.0
"""Largest temperature: beyond it the distribution is uniform to float32 precision anyway."""
MIN_TOP_P = 1e-6
"""Smallest top_p: a float32 normal number. Any top_p at or below 1/vocab keeps only the most
likely token, so the server raises smaller ones to this without changing what is sampled."""


MAX_TTL_S = 86_400.0
"""The longest a session may stay idle (a day)."""
CLIENT_IDENTITIES = ("peer", "api_key")


@dataclass(frozen=True)
class EngineConfig:
    """The continuous-batching engine's fixed shapes and limits."""

    num_slots: int = 16
    """Sequences decoded together; each owns one row of the KV cache."""
    max_seq_len: int = 2048
    """Context per slot (prompt + completion), the KV cache length."""
    prefill_chunk: int = 256
    """Most prompt tokens one sequence prefills per engine step (long prompts are chunked and
    interleave with decode steps). A power of two >= 16."""
    prefill_batch: int = 4
    """Sequences prefilled together in one step."""
    decode_steps: int = 4
    """Tokens per device call while the batch is stable (no prefill pending, nobody waiting
    for a free slot); amortises per-call overhead. Tokens past a stop are computed and
    dropped. 1 disables it."""
    overlap: bool = True
    """Dispatch the next decode call before the current one's tokens reach the host, when the
    batch stays as it is (decode only, nobody waiting, no session work): the host's
    bookkeeping of one call runs while the device computes the next, and the device does not
    wait for it. Its tokens are the ones the call would have made anyway; a sequence that
    stopped meanwhile has its extra tokens dropped, as past a stop within a call."""
    speculate: int = 0
    """Guessed tokens per verify call (speculative decoding by prompt lookup,
    `serving.engine.speculate`): a decoding sequence whose last tokens occurred earlier in its
    context is guessed to continue as it did, and one call checks the guesses of every slot,
    keeping those the model samples itself (the same tokens as plain decoding). 0 disables it.
    The engine verifies only when its warm-up timings say it pays."""
    speculate_ngram: int = 3
    """Longest context suffix looked up for a guess (then shorter ones, down to 1)."""
    max_tokens_cap: int | None = None
    """Server-wide clamp on every request's max_tokens (the simulator's runaway guard)."""
    default_max_tokens: int = 256
    """max_tokens when a request does not say."""
    max_top_logprobs: int = 20
    """Largest `logprobs` / `top_logprobs` a request may ask for (a static shape)."""
    prefix_reuse: bool = True
    """Reuse the KV of a cached prompt+completion that the new prompt extends."""
    max_waiting: int = 4096
    """Sequences allowed to wait for a slot; beyond it requests are refused (HTTP 429)."""
    max_sessions: int = 1024
    """Open persistent KV sessions allowed (each pins a slot while it holds KV)."""
    session_ttl_s: float = 600.0
    """A session idle this long is closed (its next call is told so); per session `ttl_s`."""

    def __post_init__(self) -> None:
        validate.positive_int(
            self,
            "num_slots",
            "max_seq_len",
            "prefill_batch",
            "default_max_tokens",
            "max_waiting",
            "decode_steps",
            "max_sessions",
        )
        chunk = self.prefill_chunk
        validate.require(
            validate.is_int(chunk) and chunk >= 16 and not chunk & (chunk - 1),
            self,
            "prefill_chunk",
            "a power of two >= 16",
        )
        validate.integer(
            self, "speculate", low=0, high=32, allowed="an integer in [0, 32] (0: off)"
        )
        validate.integer(self, "speculate_ngram", low=1, high=8)
        validate.positive_int(
            self, "max_tokens_cap", optional=True, allowed="null or a positive integer"
        )
        validate.integer(self, "max_top_logprobs", low=0, high=100)
        validate.integer(self, "max_seq_len", low=2, allowed=">= 2")
        validate.number(
            self,
            "session_ttl_s",
            low=0,
            high=MAX_TTL_S,
            low_open=True,
            allowed=f"seconds in (0, {MAX_TTL_S}]",
        )

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        """Padded chunk lengths the prefill step is compiled for."""
        out, t = [], 16
        while t <= self.prefill_chunk:
            out.append(t)
            t *= 2
        return tuple(out)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (validated; the server maps errors to HTTP 400)."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0: no top-k truncation."""
    seed: int | None = None
    """Same seed, same prompt, same weights -> same tokens, whatever else is in the batch."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends when the text contains one (it is cut from the text)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop tokens besides the tokenizer's end-of-turn (kept in token_ids)."""
    ignore_eos: bool = False
    logprobs: int = 0
    """Alternatives to return per token besides the sampled one's logprob."""

    def __post_init__(self) -> None:
        # A request's fields, named as the API names them: no class in the message.
        where = ""
        validate.integer(
            self, "max_tokens", low=1, optional=True, allowed="an integer >= 1", owner=where
        )
        # Every bound is what the engine's float32 / int32 device arrays can hold: nothing
        # a request carries may overflow inside the scheduler loop.
        t = self.temperature
        validate.require(
            validate.is_number(t) and (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE),
            self,
            "temperature",
            f"0 (greedy) or a number in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]",
            owner=where,
        )
        validate.number(self, "top_p", low=MIN_TOP_P, high=1, owner=where)
        validate.integer(
            self,
            "top_k",
            low=0,
            high=INT32_MAX,
            allowed=f"0 (off) or a positive integer <= {INT32_MAX}",
            owner=where,
        )
        validate.integer(self, "seed", low=0, optional=True, allowed="an integer >= 0", owner=where)
        validate.integer(self, "logprobs", low=0, high=100, owner=where)
        validate.require(
            all(validate.is_int(t) and 0 <= t <= INT32_MAX for t in self.stop_token_ids),
            self,
            "stop_token_ids",
            f"token ids in [0, {INT32_MAX}]",
            value=list(self.stop_token_ids),
            owner=where,
        )
        validate.require(
            all(isinstance(s, str) and s for s in self.stop),
            self,
            "stop",
            "non-empty strings",
            value=list(self.stop),
            owner=where,
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class ServerConfig:
    """HTTP-side settings of `simloop serve` (imports no JAX)."""

    host: str = "127.0.0.1"
    """Bind address; loopback unless you mean to expose the server."""
    port: int = 8000
    """0 picks a free port (printed at start)."""
    model_name: str = "simloop"
    """Name in /v1/models; requests naming another model get 404."""
    admin_token: str | None = None
    """Bearer token for /admin/*; unset disables the admin routes."""
    checkpoint_root: str | None = None
    """`/admin/load_weights` paths must resolve (symlinks too) under this directory."""
    max_body_bytes: int = 8 * 2**20
    """Larger request bodies are refused with 413."""
    shutdown_timeout_s: float = 10.0
    """Shutdown (SIGTERM/SIGINT) finishes within this: in-flight requests may finish until
    about a second before it, then are aborted (`finish_reason: abort`, streams closed)."""
    header_timeout_s: float = 10.0
    """A request's head (request line and headers) must arrive within this of its first byte;
    else the connection is closed."""
    body_timeout_s: float = 30.0
    """A request's body must arrive within this once its head is read; else 408, closed."""
    idle_timeout_s: float = 60.0
    """An open connection without a request (new, or kept alive) is closed after this."""
    max_connections: int = 2048
    """Open connections at most (also kept below the process's open-file limit). Beyond it
    the oldest connection that is not in a request is closed for the new one; when all are in
    requests, the new one gets 503 and is closed."""
    max_sessions_per_client: int = 256
    """Open sessions (`/v1/sessions`) one client may hold: its next open gets 429 naming this
    limit, while other clients still open theirs. Sessions that expired or were evicted count
    until their client calls them, closes them or needs their place. A quarter of
    `EngineConfig.max_sessions` by default: one client cannot take every session."""
    client_identity: Literal["peer", "api_key"] = "api_key"
    """Who a client is, for `max_sessions_per_client`. `api_key` (the default, as clients of
    an OpenAI-style API are told apart): the key of `Authorization: Bearer <key>` where a
    request sends one, else the remote address. This server checks no API keys, so a client
    that makes up keys gets a cap per key; `max_sessions` still bounds them all. `peer`: the
    connection's remote IP address (all its ports; clients behind one proxy, or every process
    on one host, share it)."""
    session_tokens: bool = False
    """Sessions need their secret: opening one returns `token` (the client may choose it,
    `{"token": ...}`, 16 to 256 visible ASCII characters), and its generate, rewind and DELETE
    need the header `X-Session-Token: <token>`; without it, or with another, they get the 404
    of an unknown session, so no other client can drive or close it."""

    def __post_init__(self) -> None:
        validate.integer(self, "port", low=0, high=65535)
        validate.integer(self, "max_body_bytes", low=1024)
        validate.number(
            self,
            "shutdown_timeout_s",
            "header_timeout_s",
            "body_timeout_s",
            "idle_timeout_s",
            low=0,
            high=3600,
            low_open=True,
            allowed="seconds in (0, 3600]",
        )
        validate.integer(
            self,
            "max_connections",
            "max_sessions_per_client",
            low=1,
            high=1_000_000,
            allowed="an integer in [1, 1000000]",
        )
        validate.one_of(self, "client_identity", CLIENT_IDENTITIES)
        validate.boolean(self, "session_tokens")
        if self.admin_token is not None and len(self.admin_token) < 8:
            raise ValueError("ServerConfig.admin_token is too short: use at least 8 characters")
