"""Serving settings (no JAX): the engine's slot pool and limits, sampling parameters, and the
HTTP server's bind address, admin token, checkpoint root and per-client limits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
        def bad(field: str, allowed: str) -> ValueError:
            return ValueError(
                f"EngineConfig.{field}={getattr(self, field)!r} is invalid: {allowed}"
            )

        for name in ("num_slots", "max_seq_len", "prefill_batch", "default_max_tokens",
                     "max_waiting", "decode_steps", "max_sessions"):  # fmt: skip
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise bad(name, "a positive integer")
        chunk = self.prefill_chunk
        if not isinstance(chunk, int) or chunk < 16 or chunk & (chunk - 1):
            raise bad("prefill_chunk", "a power of two >= 16")
        if not isinstance(self.speculate, int) or not 0 <= self.speculate <= 32:
            raise bad("speculate", "an integer in [0, 32] (0: off)")
        if not isinstance(self.speculate_ngram, int) or not 1 <= self.speculate_ngram <= 8:
            raise bad("speculate_ngram", "an integer in [1, 8]")
        if self.max_tokens_cap is not None and (
            not isinstance(self.max_tokens_cap, int) or self.max_tokens_cap < 1
        ):
            raise bad("max_tokens_cap", "null or a positive integer")
        if not isinstance(self.max_top_logprobs, int) or not 0 <= self.max_top_logprobs <= 100:
            raise bad("max_top_logprobs", "an integer in [0, 100]")
        if self.max_seq_len < 2:
            raise bad("max_seq_len", ">= 2")
        t = self.session_ttl_s
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t <= MAX_TTL_S:
            raise bad("session_ttl_s", f"seconds in (0, {MAX_TTL_S}]")

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
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens={self.max_tokens!r} is invalid: an integer >= 1")
        # Every bound is what the engine's float32 / int32 device arrays can hold: nothing
        # a request carries may overflow inside the scheduler loop.
        t = self.temperature
        if not isinstance(t, int | float) or not (
            t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE
        ):
            raise ValueError(f"temperature={t!r} is invalid: 0 (greedy) or a number in "
                             f"[{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]")  # fmt: skip
        if not isinstance(self.top_p, int | float) or not MIN_TOP_P <= self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} is invalid: a number in [{MIN_TOP_P}, 1]")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= INT32_MAX:
            raise ValueError(f"top_k={self.top_k!r} is invalid: 0 (off) or a positive integer "
                             f"<= {INT32_MAX}")  # fmt: skip
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed={self.seed!r} is invalid: an integer >= 0")
        if not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 100:
            raise ValueError(f"logprobs={self.logprobs!r} is invalid: an integer in [0, 100]")
        if any(not isinstance(t, int) or not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={list(self.stop_token_ids)!r} is invalid: token "
                             f"ids in [0, {INT32_MAX}]")  # fmt: skip
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop={list(self.stop)!r} is invalid: non-empty strings")

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
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(
                f"ServerConfig.port={self.port!r} is invalid: an integer in [0, 65535]"
            )
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1024:
            raise ValueError(f"ServerConfig.max_body_bytes={self.max_body_bytes!r} is invalid: "
                             "an integer >= 1024")  # fmt: skip
        for name in ("shutdown_timeout_s", "header_timeout_s", "body_timeout_s",
                     "idle_timeout_s"):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v <= 3600:
                raise ValueError(f"ServerConfig.{name}={v!r} is invalid: seconds in (0, 3600]")
        if (isinstance(self.max_connections, bool) or not isinstance(self.max_connections, int)
                or not 1 <= self.max_connections <= 1_000_000):  # fmt: skip
            raise ValueError(f"ServerConfig.max_connections={self.max_connections!r} is "
                             "invalid: an integer in [1, 1000000]")  # fmt: skip
        cap = self.max_sessions_per_client
        if isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= 1_000_000:
            raise ValueError(f"ServerConfig.max_sessions_per_client={cap!r} is invalid: an "
                             "integer in [1, 1000000]")  # fmt: skip
        if self.client_identity not in CLIENT_IDENTITIES:
            raise ValueError(f"ServerConfig.client_identity={self.client_identity!r} is "
                             f"invalid: one of {list(CLIENT_IDENTITIES)}")  # fmt: skip
        if not isinstance(self.session_tokens, bool):
            raise ValueError(f"ServerConfig.session_tokens={self.session_tokens!r} is invalid: "
                             "true or false")  # fmt: skip
        if self.admin_token is not None and len(self.admin_token) < 8:
            raise ValueError("ServerConfig.admin_token is too short: use at least 8 characters")
