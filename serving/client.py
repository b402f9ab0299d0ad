"""Async client for the completion API, used by the orchestrator and the simulated shell.

    async with InferenceClient(ClientConfig("http://127.0.0.1:8000")) as client:
        out = await client.complete(prompt_ids, max_tokens=64, temperature=1.0, logprobs=0)
        out.token_ids, out.logprobs, out.finish_reason, out.weight_version

It speaks the subset of the OpenAI API that simloop's server and vllm-tpu's OpenAI server
share, so the caller cannot tell them apart: token ids come from `return_token_ids` (vLLM's
extension); simloop's server adds `weight_version` / `token_versions`, which are None from a
server that does not send them. One aiohttp session with a connection limit; each call has a
timeout; connection errors, 5xx and 429 are retried with jittered exponential backoff
(tenacity), other 4xx and timeouts never; cancelling a call closes its connection, which aborts
the request on the server. An answer that is not what was asked for (no choices, no token ids,
or, when `logprobs` was asked, none or not one per token) is a `BadAnswer`, never a silent gap.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from rl import validate
from serving.compaction import SessionCompaction  # also the orchestrator's (via the client)
from serving.token_sessions import TokenSessions

log = logging.getLogger(__name__)
_NO_SESSIONS: set[str] = set()


def _warn_no_sessions(base_url: str) -> None:
    """Once per server: sessions were asked of a server that has none (a server without a
    session API that this client does not keep them for: `client_sessions` off), so its
    caller runs stateless completions, uncompacted. Jobs set `client_sessions` for the vLLM
    servers they know of; this says so for any other."""
    if base_url not in _NO_SESSIONS:
        _NO_SESSIONS.add(base_url)
        log.warning(
            "sessions were asked of %s, which has none (404/405 on /v1/sessions): its "
            "episodes run on stateless completions, uncompacted. For a vLLM server set "
            "serve.backends: {ROLE: vllm} (the client then keeps the sessions)",
            base_url,
        )


@dataclass(frozen=True)
class ClientConfig:
    """Where the server is and how hard to try."""

    base_url: str = "http://127.0.0.1:8000"
    """Server root (without /v1)."""
    model: str | None = None
    """Model name to send; None lets the server use its own."""
    timeout_s: float = 120.0
    """Per attempt, for the whole request including generation."""
    max_retries: int = 3
    """Extra attempts after a connection error, 5xx or 429."""
    backoff_s: float = 0.25
    """First retry delay; doubles per attempt, with full jitter."""
    max_backoff_s: float = 8.0
    max_connections: int = 256
    """Concurrent connections in the shared session."""
    api_key: str | None = None
    """Sent as `Authorization: Bearer` on API calls (vLLM's --api-key)."""
    client_sessions: bool = False
    """Keep sessions here (`serving.token_sessions`), each call one completion of what the
    session may see: for servers without a session API (vLLM). Off: sessions are the
    server's (`simloop serve`), and a server without them makes `open_session` None."""

    def __post_init__(self) -> None:
        validate.require(
            isinstance(self.base_url, str) and self.base_url.startswith(("http://", "https://")),
            self,
            "base_url",
            "an http(s) URL",
        )
        validate.positive(self, "timeout_s", nan_ok=True, allowed="> 0")
        validate.integer(self, "max_retries", low=0, allowed=">= 0")
        validate.integer(self, "max_connections", low=1, allowed=">= 1")


class ClientError(Exception):
    """The server refused the request (or kept failing): status and its error message."""

    def __init__(
        self, message: str, *, status: int | None = None, body: Any = None, attempts: int = 1
    ):
        super().__init__(message)
        self.status, self.body, self.attempts = status, body, attempts

    @property
    def retryable(self) -> bool:
        return self.status is None or self.status == 429 or self.status >= 500


class BadAnswer(ClientError):
    """The server answered (2xx) but not what the request asked for: no choices, no token ids,
    or missing / miscounted logprobs. Not retried: the server would answer the same way."""

    @property
    def retryable(self) -> bool:
        return False


class ClientTimeout(ClientError, TimeoutError):
    """No answer within the timeout (not retried: the generation may still be running). A
    `TimeoutError`, so callers that must not import serving (the orchestrator) catch it as one."""

    @property
    def retryable(self) -> bool:
        return False


@dataclass
class Completion:
    """One choice, as the orchestrator consumes it (token-in, token-out)."""

    text: str
    token_ids: list[int]
    finish_reason: str
    """`stop`, `length` or `abort`."""
    logprobs: list[float] | None = None
    """Logprob of each generated token (None when not requested)."""
    top_logprobs: list[dict[str, float]] | None = None
    prompt_token_ids: list[int] | None = None
    weight_version: int | None = None
    """Version of the weights at the end of the request (simloop servers)."""
    token_versions: list[int] | None = None
    """Version that produced each token (simloop servers; None from vLLM)."""
    cached_tokens: int | None = None
    latency_s: float = 0.0
    attempts: int = 1
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


class InferenceClient:
    """Async client; satisfies `envs.simulated.CompletionClient`."""

    def __init__(
        self,
        config: ClientConfig | str,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        """`sleep` waits between retries (tests pass one that records the delays)."""
        self.cfg = ClientConfig(config) if isinstance(config, str) else config
        self._session: aiohttp.ClientSession | None = None
        self._sleep = sleep
        self._kept = TokenSessions(self.complete, ClientError) if self.cfg.client_sessions else None

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.cfg.max_connections)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    # ----- transport -------------------------------------------------------------------------

    async def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        timeout_s: float | None = None,
        token: str | None = None,
        retries: int | None = None,
    ) -> tuple[Any, int]:
        """-> (parsed JSON, attempts). Retries connection errors, 5xx and 429 only."""
        url = self.cfg.base_url.rstrip("/") + path
        headers = {}
        bearer = token or self.cfg.api_key
        if bearer:
            headers["Authorization"] = f"Bearer {bearer}"
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.cfg.timeout_s)
        async for attempt in self._retrying(retries):
            with attempt:
                n = attempt.retry_state.attempt_number
                try:
                    async with self._get_session().request(
                        method, url, json=json_body, headers=headers, timeout=timeout
                    ) as resp:
                        body = _json_or_text(await resp.text())
                        if resp.status < 400:
                            return body, n
                        message = f"{method} {path} -> {resp.status}: {_message(body)}"
                        raise ClientError(message, status=resp.status, body=body, attempts=n)
                except TimeoutError as e:
                    raise ClientTimeout(
                        f"{method} {path}: no answer within {timeout.total:g}s", attempts=n
                    ) from e
                except aiohttp.ClientError as e:  # connection refused/reset, server gone
                    raise ClientError(
                        f"{method} {path}: {type(e).__name__}: {e}", attempts=n
                    ) from e
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _retrying(self, retries: int | None) -> AsyncRetrying:
        """The retry policy: connection errors, 5xx and 429, `retries` times (None: the
        config's), with full-jitter exponential backoff."""
        retries = self.cfg.max_retries if retries is None else retries
        return AsyncRetrying(
            stop=stop_after_attempt(retries + 1),
            # full jitter: uniform(0, min(max_backoff_s, backoff_s * 2 ** (attempt - 1)))
            wait=wait_random_exponential(multiplier=self.cfg.backoff_s, max=self.cfg.max_backoff_s),
            retry=retry_if_exception(lambda e: isinstance(e, ClientError) and e.retryable),
            sleep=self._sleep,
            reraise=True,
        )

    # ----- API -------------------------------------------------------------------------------

    async def complete(
        self,
        prompt: list[int] | str,
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        seed: int | None = None,
        logprobs: int | None = None,
        timeout_s: float | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Completion:
        """One completion of `prompt` (token ids or text) via `POST /v1/completions`."""
        outs = await self.complete_n(
            prompt,
            n=1,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop=stop,
            stop_token_ids=stop_token_ids,
            seed=seed,
            logprobs=logprobs,
            timeout_s=timeout_s,
            extra=extra,
        )
        if len(outs) != 1:
            raise BadAnswer(
                f"asked for 1 choice, the server returned {len(outs)}",
                body=outs[0].raw if outs else None,
            )
        return outs[0]

    async def complete_n(
        self,
        prompt: list[int] | str,
        *,
        n: int,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        seed: int | None = None,
        logprobs: int | None = None,
        timeout_s: float | None = None,
        extra: dict[str, Any] | None = None,
    ) -> list[Completion]:
        """`n` samples of one prompt (one request; the server shares the prompt's KV)."""
        body: dict[str, Any] = {
            "prompt": prompt,
            "n": n,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "return_token_ids": True,
        }
        if top_k:
            body["top_k"] = top_k
        if stop:
            body["stop"] = list(stop)
        if stop_token_ids:
            body["stop_token_ids"] = list(stop_token_ids)
        if seed is not None:
            body["seed"] = seed
        if logprobs is not None:
            body["logprobs"] = logprobs
        if self.cfg.model:
            body["model"] = self.cfg.model
        body.update(extra or {})
        started = time.perf_counter()
        raw, attempts = await self.request(
            "POST", "/v1/completions", json_body=body, timeout_s=timeout_s
        )
        outs = parse_completion_response(raw)
        if logprobs is not None:
            check_logprobs(outs, f"logprobs={logprobs}")
        for out in outs:
            out.latency_s, out.attempts = time.perf_counter() - started, attempts
        return outs

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        enable_thinking: bool | None = None,
        logprobs: bool = False,
        top_logprobs: int = 0,
        seed: int | None = None,
        stop: list[str] | None = None,
        timeout_s: float | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Completion:
        body: dict[str, Any] = {
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "return_token_ids": True,
        }
        if enable_thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": enable_thinking}
        if logprobs:
            body["logprobs"] = True
            if top_logprobs:
                body["top_logprobs"] = top_logprobs
        if seed is not None:
            body["seed"] = seed
        if stop:
            body["stop"] = list(stop)
        if self.cfg.model:
            body["model"] = self.cfg.model
        body.update(extra or {})
        started = time.perf_counter()
        raw, attempts = await self.request(
            "POST", "/v1/chat/completions", json_body=body, timeout_s=timeout_s
        )
        outs = parse_completion_response(raw)
        if not outs:
            raise BadAnswer(f"the chat answer has no choice: {str(raw)[:200]}", body=raw)
        out = outs[0]
        if logprobs:
            check_logprobs([out], "logprobs=true")
        out.latency_s, out.attempts = time.perf_counter() - started, attempts
        return out

    async def health(self, timeout_s: float = 5.0) -> bool:
        try:
            await self.request("GET", "/health", timeout_s=timeout_s, retries=0)
            return True
        except ClientError:
            return False

    async def wait_healthy(self, timeout_s: float = 120.0, poll_s: float = 0.25) -> None:
        """Poll /health until it answers 200 (a server starting up), or raise ClientTimeout."""
        deadline = time.monotonic() + timeout_s
        while not await self.health(timeout_s=min(5.0, timeout_s)):
            if time.monotonic() > deadline:
                raise ClientTimeout(f"{self.cfg.base_url} not healthy within {timeout_s:g}s")
            await asyncio.sleep(poll_s)

    async def models(self) -> list[str]:
        body, _ = await self.request("GET", "/v1/models")
        return [m["id"] for m in body.get("data", [])]

    async def load_weights(
        self, path: str, version: int, *, token: str, timeout_s: float = 600.0
    ) -> dict[str, Any]:
        """Ask a simloop server to serve the params checkpoint at `path` as `version`."""
        body, _ = await self.request(
            "POST",
            "/admin/load_weights",
            json_body={"path": path, "version": version},
            token=token,
            timeout_s=timeout_s,
            retries=0,
        )
        return body

    async def version(self, *, token: str) -> int:
        body, _ = await self.request("GET", "/admin/version", token=token)
        return int(body["version"])

    # ----- persistent KV sessions (simloop serve; kept here for vLLM: client_sessions) ---------

    async def open_session(
        self, *, ttl_s: float | None = None, compaction: SessionCompaction | dict | None = None
    ) -> str | None:
        """A new session's id, or None when the server has no sessions (404/405: vLLM without
        `client_sessions`), so the caller falls back to stateless completions. `compaction`:
        how the server thins the session's KV (`serving.compaction`; default none)."""
        if self._kept is not None:
            return await self._kept.open_session(ttl_s=ttl_s, compaction=compaction)
        ask: dict[str, Any] = {} if ttl_s is None else {"ttl_s": ttl_s}
        if isinstance(compaction, dict):  # a config's settings
            compaction = SessionCompaction.from_json(compaction or None)
        if compaction is not None and compaction.mode != "none":
            ask["compaction"] = compaction.to_json()
        try:
            body, _ = await self.request("POST", "/v1/sessions", json_body=ask)
        except ClientError as e:
            if e.status in (404, 405):
                _warn_no_sessions(self.cfg.base_url)
                return None
            raise
        return str(body["id"])

    async def session_generate(
        self,
        session_id: str,
        append_token_ids: list[int],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        logprobs: int | None = None,
        stop_token_ids: list[int] | None = None,
        timeout_s: float | None = None,
        rewind_to: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Completion:
        """Append ids to the session and generate (`extra`: more body fields, e.g.
        `{"ignore_eos": true}`).

        A failed call may have appended (and generated) before its answer was lost, so it is
        retried only from a known turn boundary: `rewind_to`, the session's logical length
        before this call. Each retry (connection errors, 5xx, 429, with the client's backoff)
        first rewinds the session there, then appends again, so the session never holds a turn
        twice. Without `rewind_to` nothing is retried. A session the server forgot meanwhile
        (404 / 409 on the rewind) is the caller's to reopen, as on any call."""
        if self._kept is not None:
            return await self._kept.session_generate(
                session_id,
                append_token_ids,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=seed,
                logprobs=logprobs,
                stop_token_ids=stop_token_ids,
                timeout_s=timeout_s,
                rewind_to=rewind_to,
                extra=extra,
            )
        body = {
            "append_token_ids": list(append_token_ids),
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "seed": seed,
            "logprobs": logprobs,
        }
        if stop_token_ids:
            body["stop_token_ids"] = list(stop_token_ids)
        body.update(extra or {})
        started = time.perf_counter()
        path = f"/v1/sessions/{session_id}/generate"
        async for attempt in self._retrying(None if rewind_to is not None else 0):
            with attempt:
                n = attempt.retry_state.attempt_number
                if n > 1:
                    await self.rewind_session(session_id, rewind_to)
                raw, _ = await self.request(
                    "POST", path, json_body=body, timeout_s=timeout_s, retries=0
                )
        if not isinstance(raw, dict) or not isinstance(raw.get("token_ids"), list):
            raise BadAnswer(f"session response has no token_ids: {str(raw)[:200]}", body=raw)
        logprobs_, tops = _parse_logprobs(raw.get("logprobs"))
        out = Completion(
            text=raw.get("text", ""),
            token_ids=list(raw["token_ids"]),
            finish_reason=raw.get("finish_reason") or "",
            logprobs=logprobs_,
            top_logprobs=tops,
            weight_version=raw.get("weight_version"),
            token_versions=raw.get("token_versions"),
            cached_tokens=raw.get("cached_tokens"),
            latency_s=time.perf_counter() - started,
            attempts=n,
            raw=raw,
        )
        if logprobs is not None:
            check_logprobs([out], f"logprobs={logprobs}")
        return out

    async def rewind_session(self, session_id: str, to: int) -> dict[str, Any]:
        if self._kept is not None:
            return await self._kept.rewind_session(session_id, to)
        body, _ = await self.request(
            "POST", f"/v1/sessions/{session_id}/rewind", json_body={"to": to}, retries=0
        )
        return body

    async def close_session(self, session_id: str) -> None:
        if self._kept is not None:
            return await self._kept.close_session(session_id)
        await self.request("DELETE", f"/v1/sessions/{session_id}", retries=0)


# ----- parsing (simloop and vLLM shapes) -------------------------------------------------------


def parse_completion_response(raw: dict[str, Any]) -> list[Completion]:
    """Choices of a /v1/completions or /v1/chat/completions response, in index order."""
    if not isinstance(raw, dict) or not isinstance(raw.get("choices"), list):
        raise BadAnswer(f"response has no 'choices': {str(raw)[:200]}", body=raw)
    version = raw.get("weight_version")
    cached = ((raw.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    outs = []
    for choice in sorted(raw["choices"], key=lambda c: c.get("index", 0)):
        if "message" in choice:
            text = (choice["message"] or {}).get("content") or ""
        else:
            text = choice.get("text", "")
        token_ids = choice.get("token_ids")
        if token_ids is None:
            raise BadAnswer(
                "response carries no token ids: the server must support return_token_ids "
                "(simloop, or vLLM >= 0.10.2)",
                body=raw,
            )
        logprobs, tops = _parse_logprobs(choice.get("logprobs"))
        outs.append(
            Completion(
                text=text,
                token_ids=list(token_ids),
                finish_reason=choice.get("finish_reason") or "",
                logprobs=logprobs,
                top_logprobs=tops,
                prompt_token_ids=choice.get("prompt_token_ids") or raw.get("prompt_token_ids"),
                weight_version=version,
                token_versions=choice.get("token_versions"),
                cached_tokens=cached,
                raw=raw,
            )
        )
    return outs


def check_logprobs(outs: list[Completion], asked: str) -> None:
    """Raise `BadAnswer` unless each choice of an answer to a request that asked for logprobs
    (`asked`, e.g. "logprobs=0") carries one per generated token: a missing or short list would
    reach the trainer as behaviour logprobs of the wrong tokens."""
    for i, out in enumerate(outs):
        got = None if out.logprobs is None else len(out.logprobs)
        if got == len(out.token_ids) or (got is None and not out.token_ids):
            continue
        has = "no logprobs" if got is None else f"{got} logprobs"
        raise BadAnswer(
            f"the server answered without the logprobs asked for ({asked}): choice "
            f"{i} has {has} for {len(out.token_ids)} tokens",
            body=out.raw,
        )


def _parse_logprobs(lp: Any) -> tuple[list[float] | None, list[dict[str, float]] | None]:
    if not lp:
        return None, None
    if "content" in lp:  # chat shape
        entries = lp["content"] or []
        logprobs = [e["logprob"] for e in entries]
        tops = [{t["token"]: t["logprob"] for t in e.get("top_logprobs") or []} for e in entries]
        return logprobs, tops
    return list(lp.get("token_logprobs") or []), [t or {} for t in lp.get("top_logprobs") or []]


def _json_or_text(text: str) -> Any:
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text


def _message(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message"))
    if isinstance(body, dict) and "message" in body:  # vLLM's older error shape
        return str(body["message"])
    return str(body)[:300]
