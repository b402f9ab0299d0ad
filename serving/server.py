"""The aiohttp server: the OpenAI/vLLM-compatible HTTP API in front of the JAX engine.

    simloop serve --preset tiny --port 8000
    curl -s localhost:8000/v1/completions -d '{"prompt": "hi", "max_tokens": 8}'

Routes (docs/architecture.md §4): `POST /v1/completions`, `POST /v1/chat/completions` (both
with SSE streaming), `GET /v1/models`, `GET /health`, `GET /metrics`, and the bearer-token
admin routes
`POST /admin/load_weights` and `GET /admin/version`, and the persistent KV sessions
(`/v1/sessions`, `.../{id}/generate`, `.../{id}/rewind`, `DELETE .../{id}`). Every error is
OpenAI-shaped JSON, aiohttp's own answers to malformed requests too (`serving.connections`), a 4xx
wherever the input is at fault, and a field a route does not take is refused by name; a bad
request never takes the server down, and a client that disconnects aborts its request. An
error after a stream started is one last SSE event, `data: {"error": {...}}`, then the end.

Sharing: one client (its API key, else its remote address: `ServerConfig.client_identity`)
holds at most `max_sessions_per_client` sessions, so it cannot lock the others out; with
`session_tokens` a session's calls need its token, so no other client can drive or close it.
A refusal keeps no state, and `/metrics` counts refusals by reason (`simloop_refused_total`).

Hostile clients: a request's head and body must arrive within `header_timeout_s` /
`body_timeout_s`, connections are capped (`max_connections`, kept below the open-file limit;
idle ones make room for new ones) and repeated log lines are rate-limited. If the engine loop
dies, `run_server` stops and raises `EngineDied`, so `simloop serve` exits non-zero and its
supervisor restarts it. Shutdown is bounded by `shutdown_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from rl.data.chat import ChatRenderer
from rl.data.tokenizer import Tokenizer
from serving.config import INT64_MAX, MAX_TTL_S, ServerConfig
from serving.connections import (  # noqa: F401 - RateLimitFilter: part of this module's API
    ApiErrorHandler,
    Connection,
    Connections,
    RateLimitFilter,
    connection_cap,
    limit_logging,
)
from serving.engine import (
    Engine,
    EngineBusy,
    EngineError,
    SequenceOutput,
    SessionError,
    TokenEvent,
)
from serving.metrics import ServerMetrics
from serving.protocol import (
    ApiError,
    CompletionRequest,
    Limits,
    build_response,
    chat_logprobs,
    completion_logprobs,
    new_id,
    parse_chat,
    parse_completion,
    parse_session_generate,
    parse_session_open,
    parse_session_rewind,
    short_repr,
    usage,
)

log = logging.getLogger(__name__)

MAX_PATH_CHARS = 4096
"""Longest `load_weights` path (PATH_MAX)."""


class EngineDied(RuntimeError):
    """The engine loop failed: the server stopped so that its supervisor restarts it."""


@dataclass(frozen=True)
class _Owner:
    """Who opened a session (`Server._client`) and its token (None: session tokens off)."""

    client: str
    token: str | None


class Server:
    """Routes bound to one engine."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, cfg: ServerConfig):
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
        self.renderer = ChatRenderer(tokenizer)
        self.metrics = ServerMetrics()
        self.started = int(time.time())
        self.connections = Connections(cfg, cfg.max_connections, self.metrics)
        self.owners: dict[str, _Owner] = {}
        """The sessions opened here, by id; pruned of those the engine no longer holds at each
        open, so it never outgrows the engine's own `sessions` for long."""
        self.limits = Limits(
            vocab=min(engine.model_cfg.vocab_size, tokenizer.vocab_size),
            context=engine.cfg.max_seq_len,
            max_logprobs=engine.cfg.max_top_logprobs,
        )

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[self._errors])
        app.add_routes(
            [
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.get("/metrics", self.prometheus),
                web.post("/admin/load_weights", self.load_weights),
                web.get("/admin/version", self.version),
                web.post("/v1/sessions", self.open_session),
                web.get("/v1/sessions", self.list_sessions),
                web.post("/v1/sessions/{id}/generate", self.session_generate),
                web.post("/v1/sessions/{id}/rewind", self.rewind_session),
                web.delete("/v1/sessions/{id}", self.close_session),
            ]
        )
        return app

    # ----- plumbing --------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        endpoint = resource.canonical if resource is not None else "unmatched"
        conn = self.connections.get(request.transport)
        if conn is not None:
            conn.begin()
        try:
            response = await handler(request)
        except ApiError as e:
            response = web.json_response(e.body(), status=e.status)
            if e.status == 408:  # the body is half read: the connection cannot be reused
                response.force_close()
        except web.HTTPRequestEntityTooLarge as e:
            err = ApiError(
                413,
                f"request body is over the {self.cfg.max_body_bytes} byte limit "
                f"({e.text or 'too large'})",
            )
            response = web.json_response(err.body(), status=413)
        except web.HTTPException as e:  # 404/405 from routing
            err = ApiError(e.status, f"{request.method} {request.path}: {e.reason}")
            response = web.json_response(err.body(), status=e.status)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug must not take the server down
            log.exception("unhandled error on %s", request.path)
            err = ApiError(500, f"internal error: {e!r}", type="server_error")
            response = web.json_response(err.body(), status=500)
        finally:
            if conn is not None:
                conn.end()
        self.metrics.record_request(endpoint, response.status)
        return response

    async def _json(self, request: web.Request, *, allow_empty: bool = False) -> Any:
        try:
            raw = await asyncio.wait_for(request.read(), self.cfg.body_timeout_s)
        except TimeoutError as e:
            raise ApiError(
                408, f"the request body did not arrive within {self.cfg.body_timeout_s}s"
            ) from e
        except web.RequestPayloadError as e:  # a broken chunked or compressed body
            raise ApiError(
                400, f"the request body cannot be read: {' '.join(str(e).split())}"
            ) from e
        if allow_empty and not raw.strip():
            return None
        try:
            return json.loads(raw)
        except RecursionError as e:
            raise ApiError(400, "malformed JSON body: nested too deeply") from e
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, integers too long
            raise ApiError(400, f"malformed JSON body: {e}") from e

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.cfg.model_name:
            raise ApiError(
                404,
                f"model {name!r} does not exist; this server serves {self.cfg.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def _submit(self, req: CompletionRequest, request_id: str):
        handles = []
        try:
            for i, prompt in enumerate(req.prompts):
                handles.append(
                    self.engine.submit(prompt, req.params, n=req.n, request_id=f"{request_id}-{i}")
                )
        except EngineError as e:
            for h in handles:
                self.engine.abort(h.id)
            raise ApiError(400, str(e), param=e.field) from e
        except EngineBusy as e:
            for h in handles:
                self.engine.abort(h.id)
            status = 503 if self.engine.failure is not None or not self.engine.running else 429
            if status == 429:
                self.metrics.refuse("queue")
            raise ApiError(status, str(e)) from e
        return handles

    # ----- completions -----------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        req = parse_completion(body, self.tokenizer, self.limits)
        return await self._complete(request, req, "cmpl")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        req, _ = parse_chat(body, self.renderer, self.limits)
        return await self._complete(request, req, "chatcmpl")

    async def _complete(self, request, req: CompletionRequest, prefix: str):
        self._check_model(req.model)
        request_id = new_id(prefix)
        started = time.perf_counter()
        handles = self._submit(req, request_id)
        if req.stream:
            return await self._stream(request, req, handles, request_id, started)
        try:
            outputs = await asyncio.gather(*(h.result() for h in handles))
        finally:  # a disconnect cancels us: abort what is left
            for h in handles:
                self.engine.abort(h.id)
        self._record(outputs, started)
        return web.json_response(
            build_response(
                req,
                outputs,
                tokenizer=self.tokenizer,
                model=self.cfg.model_name,
                version=self.engine.version,
                request_id=request_id,
            )
        )

    def _record(self, outputs: list[list[SequenceOutput]], started: float) -> None:
        self.metrics.latency.observe(time.perf_counter() - started)
        for outs in outputs:
            for o in outs:
                self.metrics.queue_wait.observe(o.queue_s)

    async def _stream(
        self, request, req: CompletionRequest, handles, request_id: str, started: float
    ):
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        obj = "chat.completion.chunk" if req.chat else "text_completion"
        created = int(time.time())
        texts: dict[int, _TextStream] = {}
        outputs: list[list[SequenceOutput]] = [[] for _ in handles]
        # Tokens that end a sequence and are cut from its text, as the engine decides.
        eos = set() if req.params.ignore_eos else {self.tokenizer.eos_id}
        stop_ids = frozenset(req.params.stop_token_ids) | eos

        async def send(choice: dict) -> None:
            chunk = {
                "id": request_id,
                "object": obj,
                "created": created,
                "model": self.cfg.model_name,
                "choices": [choice],
            }
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

        queue: asyncio.Queue = asyncio.Queue()

        async def pump(p: int, handle) -> None:
            try:
                async for event in handle.stream():
                    await queue.put((p, event))
            except Exception as e:  # noqa: BLE001 - forwarded to the writer below
                await queue.put((p, e))
            finally:
                await queue.put((p, None))

        pumps = [
            asyncio.create_task(pump(p, h), name=f"{request_id}-pump-{p}")
            for p, h in enumerate(handles)
        ]
        failure: Exception | None = None
        try:
            open_pumps = len(pumps)
            if req.chat:
                for p in range(len(handles)):
                    for j in range(req.n):
                        first = {"role": "assistant", "content": ""}
                        await send(
                            {
                                "index": p * req.n + j,
                                "delta": first,
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        )
            while open_pumps:
                p, event = await queue.get()
                if event is None:
                    open_pumps -= 1
                    continue
                if isinstance(event, Exception):
                    raise event
                index = p * req.n + event.index
                if index not in texts:
                    texts[index] = _TextStream(self.tokenizer, req.params.stop, stop_ids)
                ts = texts[index]
                if isinstance(event, TokenEvent):
                    delta = ts.push(event.token_id)
                    lp = None
                    if req.echo_logprobs:
                        lp = (
                            chat_logprobs(
                                self.tokenizer,
                                [event.token_id],
                                [event.logprob],
                                [event.top_logprobs],
                            )
                            if req.chat
                            else _stream_completion_logprobs(self.tokenizer, event)
                        )
                    if delta or lp:
                        await send(self._delta(req, index, delta, lp, None))
                else:
                    outputs[p].append(event)
                    rest = ts.finish(event.text)
                    choice = self._delta(req, index, rest, None, event.finish_reason)
                    if req.return_token_ids:
                        choice.update(
                            token_ids=event.token_ids,
                            token_versions=event.versions,
                            prompt_token_ids=req.prompts[p],
                        )
                    await send(choice)
            self._record(outputs, started)
            if req.include_usage:
                flat = [o for outs in outputs for o in outs]
                chunk = {
                    "id": request_id,
                    "object": obj,
                    "created": created,
                    "model": self.cfg.model_name,
                    "choices": [],
                    "usage": usage(req.prompts, flat, req.n),
                }
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        except ConnectionError:
            raise  # the client is gone: there is no one to tell
        except Exception as e:  # noqa: BLE001 - headers are out: the error goes in the stream
            log.exception("stream %s failed", request_id)
            failure = e
        finally:
            for t in pumps:
                t.cancel()
            for h in handles:
                self.engine.abort(h.id)
        if failure is not None:  # one error event, then the end: never a second response
            err = ApiError(500, f"generation failed mid-stream: {failure!r}", type="server_error")
            await response.write(f"data: {json.dumps(err.body())}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    @staticmethod
    def _delta(req, index, text, logprobs, finish_reason) -> dict:
        if req.chat:
            delta = {"content": text} if text else {}
            return {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    # ----- sessions --------------------------------------------------------------------------

    def _session_fields(self, session) -> dict:
        return {
            "id": session.id,
            "session_tokens": len(session.tokens),
            "kv_tokens": self.engine.session_kv_tokens(session),
            "compaction": session.compaction.to_json(),
            "compactions": session.compactions,
            "keys_dropped": session.keys_dropped,
            "kv_epoch": self.engine.session_epoch(session),
        }

    def _client(self, request: web.Request) -> str:
        """Who sent `request` (`ServerConfig.client_identity`): `key:<hash of its bearer key>`
        under `api_key` where it sends one, else `peer:<its remote IP address>` (an IPv6 one
        by its /64: one host holds a whole /64)."""
        if self.cfg.client_identity == "api_key":
            header = request.headers.get("Authorization", "")
            key = header[7:].strip() if header.startswith("Bearer ") else ""
            if key:  # hashed: the server keeps no client's secret, and a bounded name
                raw = key.encode("utf-8", "surrogateescape")
                return f"key:{hashlib.sha256(raw).hexdigest()[:32]}"
        remote = request.remote or "unknown"
        with contextlib.suppress(ValueError):  # not an IP address: a unix socket, a proxy's name
            address = ipaddress.ip_address(remote)
            if address.version == 6 and address.ipv4_mapped is None:
                remote = str(ipaddress.ip_network(f"{address}/64", strict=False))
        return f"peer:{remote}"

    def _admit_session(self, client: str) -> None:
        """429 when `client` holds `max_sessions_per_client` sessions (those that expired or
        were evicted are forgotten first, if that makes room). Keeps nothing of a refusal."""
        for sid in [sid for sid in self.owners if sid not in self.engine.sessions]:
            del self.owners[sid]  # closed, or forgotten by the engine
        mine = [sid for sid, owner in self.owners.items() if owner.client == client]
        cap = self.cfg.max_sessions_per_client
        if len(mine) >= cap and self.engine.forget_gone_sessions(mine):
            for sid in [sid for sid in mine if sid not in self.engine.sessions]:
                del self.owners[sid]
                mine.remove(sid)
        if len(mine) >= cap:
            self.metrics.refuse("client_sessions")
            who = "API key" if client.startswith("key:") else "address"
            raise ApiError(
                429,
                f"this client (by its {who}) holds {len(mine)} open sessions: "
                f"the per-client limit is {cap} (ServerConfig.max_sessions_per_client)"
                "; close one first (other clients may still open theirs)",
                code="client_session_limit",
            )

    def _check_token(self, request: web.Request, sid: str) -> None:
        """With session tokens on: the session's own token in `X-Session-Token`, or the 404
        of an unknown session (whether it exists is nobody else's business)."""
        if not self.cfg.session_tokens:
            return
        owner = self.owners.get(sid)
        given = request.headers.get("X-Session-Token", "").encode("utf-8", "surrogateescape")
        if (
            owner is None
            or owner.token is None
            or not hmac.compare_digest(given, owner.token.encode())
        ):
            if sid in self.engine.sessions:
                self.metrics.refuse("session_token")
            raise ApiError(
                404,
                f"session {short_repr(sid)} does not exist, or the "
                "X-Session-Token header does not carry its token",
                param="session_id",
            )

    async def open_session(self, request: web.Request) -> web.Response:
        body = await self._json(request, allow_empty=True)
        opened = parse_session_open(body, MAX_TTL_S, tokens=self.cfg.session_tokens)
        client = self._client(request)
        self._admit_session(client)
        with self._session_call(refusal="sessions"):
            session = self.engine.open_session(opened.ttl_s, opened.compaction)
        token = (opened.token or secrets.token_urlsafe(24)) if self.cfg.session_tokens else None
        self.owners[session.id] = _Owner(client, token)
        return web.json_response(
            {
                "id": session.id,
                "ttl_s": session.ttl_s,
                "compaction": opened.compaction.to_json(),
                **({"token": token} if token else {}),
            }
        )

    async def list_sessions(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        data = [
            {
                **self._session_fields(s),
                "idle_s": round(now - s.last_used, 3),
                "ttl_s": s.ttl_s,
                "busy": s.busy,
                "state": "gone" if s.gone else "open",
                **({"reason": s.gone} if s.gone else {}),
            }
            for s in list(self.engine.sessions.values())
        ]
        return web.json_response({"object": "list", "data": data})

    @contextlib.contextmanager
    def _session_call(self, refusal: str = "queue"):
        """A session call's engine errors as HTTP errors: SessionError keeps its status; a
        429 (the engine is full) counts as a refusal for `refusal`."""
        try:
            yield
        except SessionError as e:
            raise ApiError(e.status, str(e), param=e.field) from e
        except EngineError as e:
            raise ApiError(400, str(e), param=e.field) from e
        except EngineBusy as e:
            if not self.engine.running:
                raise ApiError(503, str(e)) from e
            self.metrics.refuse(refusal)
            raise ApiError(429, str(e)) from e

    async def session_generate(self, request: web.Request) -> web.Response:
        sid = request.match_info["id"]
        self._check_token(request, sid)
        body = await self._json(request)
        step = parse_session_generate(body, self.tokenizer, self.limits)
        self._check_model(step.model)
        started = time.perf_counter()
        with self._session_call():
            handle = await self.engine.session_submit(sid, step.append, step.params)
        try:
            (out,) = await handle.result()
        finally:  # a disconnect cancels us: abort what is left
            self.engine.abort(handle.id)
        self._record([[out]], started)
        session = self.engine.sessions.get(sid)
        fields = self._session_fields(session) if session is not None else {"id": sid}
        return web.json_response(
            {
                "object": "session.generation",
                "session_id": sid,
                "model": self.cfg.model_name,
                "text": out.text,
                "token_ids": out.token_ids,
                "token_versions": out.versions,
                "logprobs": completion_logprobs(self.tokenizer, out)
                if step.echo_logprobs
                else None,
                "finish_reason": out.finish_reason,
                "prompt_tokens": len(step.append),
                "cached_tokens": out.cached_tokens,
                "kv_tokens": fields.get("kv_tokens", 0),
                "session_tokens": fields.get("session_tokens", 0),
                "kv_epoch": fields.get("kv_epoch"),
                "weight_version": self.engine.version,
            }
        )

    async def rewind_session(self, request: web.Request) -> web.Response:
        sid = request.match_info["id"]
        self._check_token(request, sid)
        to = parse_session_rewind(await self._json(request))
        with self._session_call():
            session = self.engine.rewind_session(sid, to)
        return web.json_response(self._session_fields(session))

    async def close_session(self, request: web.Request) -> web.Response:
        sid = request.match_info["id"]
        self._check_token(request, sid)
        with self._session_call():
            self.engine.close_session(sid)
        self.owners.pop(sid, None)
        return web.json_response({"id": sid, "deleted": True})

    # ----- small routes ----------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.cfg.model_name,
                        "object": "model",
                        "created": self.started,
                        "owned_by": "simloop",
                        "max_model_len": self.engine.cfg.max_seq_len,
                    }
                ],
            }
        )

    async def health(self, request: web.Request) -> web.Response:
        if self.engine.failure is not None or not self.engine.running:
            reason = repr(self.engine.failure) if self.engine.failure else "engine not running"
            raise ApiError(503, f"unhealthy: {reason}")
        return web.json_response({"status": "ok", "weight_version": self.engine.version})

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(
            text=self.metrics.render(self.engine), content_type="text/plain", charset="utf-8"
        )

    # ----- admin -----------------------------------------------------------------------------

    def _authorize(self, request: web.Request) -> None:
        if not self.cfg.admin_token:
            raise ApiError(401, "admin routes are disabled: start the server with --admin-token")
        header = request.headers.get("Authorization", "")
        given = header[7:] if header.startswith("Bearer ") else ""
        # Header bytes that are not UTF-8 arrive as surrogate escapes: compare the raw bytes.
        raw = given.encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(raw, self.cfg.admin_token.encode("utf-8")):
            raise ApiError(401, "missing or wrong bearer token for an admin route")

    def _checkpoint_path(self, raw: Any) -> Path:
        if not self.cfg.checkpoint_root:
            raise ApiError(
                400,
                "no checkpoint root is configured: start the server with --checkpoint-root",
                param="path",
            )
        if not isinstance(raw, str) or not raw:
            raise ApiError(
                400, f"'path' must be a non-empty string, got {short_repr(raw)}", param="path"
            )
        if len(raw) > MAX_PATH_CHARS or "\0" in raw or not raw.isprintable():
            raise ApiError(
                400,
                f"'path' {short_repr(raw)} is invalid: at most {MAX_PATH_CHARS} "
                "printable characters",
                param="path",
            )
        root = Path(os.path.realpath(self.cfg.checkpoint_root))
        candidate = Path(raw) if os.path.isabs(raw) else root / raw
        try:
            resolved = Path(os.path.realpath(candidate))  # follows symlinks: no escape
            exists = resolved.exists()
        except (OSError, ValueError) as e:  # a name too long, a surrogate, ...
            raise ApiError(400, f"'path' {short_repr(raw)} is invalid: {e}", param="path") from e
        if resolved != root and root not in resolved.parents:
            raise ApiError(
                400,
                f"path {short_repr(raw)} resolves outside the checkpoint root {str(root)!r}",
                param="path",
            )
        if not exists:
            raise ApiError(404, f"checkpoint {short_repr(raw)} does not exist", param="path")
        return resolved

    async def load_weights(self, request: web.Request) -> web.Response:
        self._authorize(request)
        body = await self._json(request)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        path = self._checkpoint_path(body.get("path"))
        version = body.get("version")
        if (
            isinstance(version, bool)
            or not isinstance(version, int)
            or not 0 <= version <= INT64_MAX
        ):
            raise ApiError(
                400,
                f"'version' must be an integer in [0, {INT64_MAX}], got {short_repr(version)}",
                param="version",
            )
        started = time.perf_counter()
        try:
            await self.engine.load_weights(path, version)
        except EngineError as e:
            raise ApiError(400, str(e), param=e.field) from e
        except FileNotFoundError as e:  # not a checkpoint, or one with files missing
            raise ApiError(
                404,
                f"checkpoint {str(path)!r} cannot be loaded, the served weights are unchanged: {e}",
                param="path",
            ) from e
        except Exception as e:  # noqa: BLE001 - whatever a bad checkpoint raises: keep serving
            log.warning("refused checkpoint %s: %r", path, e)
            raise ApiError(
                422,
                f"checkpoint {str(path)!r} cannot be loaded, the served weights "
                f"are unchanged: {type(e).__name__}: {e}",
                param="path",
            ) from e
        load_s = time.perf_counter() - started
        log.info("serving weights version %d from %s (loaded in %.3f s)", version, path, load_s)
        return web.json_response(
            {"version": self.engine.version, "path": str(path), "load_s": round(load_s, 4)}
        )

    async def version(self, request: web.Request) -> web.Response:
        self._authorize(request)
        return web.json_response({"version": self.engine.version})


def _stream_completion_logprobs(tokenizer, event: TokenEvent) -> dict:
    out = SequenceOutput(
        index=event.index,
        token_ids=[event.token_id],
        logprobs=[event.logprob],
        top_logprobs=[event.top_logprobs],
        versions=[event.version],
        text="",
        finish_reason="",
        prompt_tokens=0,
        cached_tokens=0,
    )
    return completion_logprobs(tokenizer, out)


class _TextStream:
    """Incremental detokenisation for SSE: emits text only once it is final (complete UTF-8,
    and no longer possibly the start of a stop string; never a stop string or stop token)."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...], stop_ids=frozenset()):
        self.tokenizer, self.ids, self.sent = tokenizer, [], 0
        self.stop, self.stop_ids = stop, stop_ids
        self.hold = max((len(s) for s in stop), default=1) - 1

    def push(self, token_id: int) -> str:
        if token_id in self.stop_ids:  # ends the sequence; the engine cuts it from the text
            return ""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        hits = [text.find(s) for s in self.stop if s in text]
        safe = min(hits) if hits else len(text) - self.hold  # a whole stop string: cut there
        if safe <= self.sent:
            return ""
        delta, self.sent = text[self.sent : safe], safe
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the engine's final text (stop strings and tokens already cut)."""
        rest = final_text[self.sent :]
        self.sent = len(final_text)
        return rest


async def run_server(
    engine: Engine,
    tokenizer: Tokenizer,
    cfg: ServerConfig,
    ready=None,
    stop: asyncio.Event | None = None,
    *,
    make_server=Server,
) -> None:
    """Serve until SIGTERM/SIGINT (or `stop` is set), then shut down within
    `cfg.shutdown_timeout_s`. `ready(port)` is called once the socket listens. Raises
    `EngineDied` when the engine loop fails (the process must exit and be restarted).
    `make_server(engine, tokenizer, cfg)` builds the routes (a `Server` subclass: the fake
    vLLM server)."""
    limit_logging()
    await engine.start()
    server = make_server(engine, tokenizer, cfg)
    server.connections.cap = connection_cap(cfg.max_connections)
    grace = cfg.shutdown_timeout_s
    # After an early response (408, 413) the rest of a body is read and dropped for
    # `lingering_time` at most (not aiohttp's 10 s).
    handler_args = dict(
        access_log=None,
        keepalive_timeout=cfg.idle_timeout_s,
        lingering_time=min(1.0, cfg.body_timeout_s),
    )
    runner = web.AppRunner(
        server.app(),
        handler_cancellation=True,
        shutdown_timeout=min(0.25, grace / 8),
        **handler_args,
    )
    await runner.setup()
    loop = asyncio.get_running_loop()

    def connection() -> Connection:  # what `runner.server()` makes, with JSON errors
        return Connection(
            server.connections, ApiErrorHandler(runner.server, loop=loop, **handler_args)
        )

    listener = await loop.create_server(connection, cfg.host, cfg.port, backlog=128)
    port = listener.sockets[0].getsockname()[1]
    stop = stop or asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread: `stop` only
            pass
    if ready is not None:
        ready(port)
    stopping = asyncio.create_task(stop.wait(), name="server-stop")
    watch = asyncio.create_task(engine.wait(), name="server-engine-watch")
    try:
        await asyncio.wait({stopping, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        watch.cancel()
        await _shutdown(engine, runner, listener, grace)
    if engine.failure is not None:
        raise EngineDied(
            f"the engine loop failed: {engine.failure!r}; the server stopped so "
            "that its supervisor restarts it"
        ) from engine.failure


async def _shutdown(engine: Engine, runner: web.AppRunner, listener, grace: float) -> None:
    """Within `grace` seconds: stop listening, let requests in flight finish until about a
    second before the end, abort the rest (streams end with `finish_reason: abort`), close
    every connection."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    listener.close()
    drain = max(0.0, grace - 1.0)
    while engine.in_flight and loop.time() - t0 < drain:
        await asyncio.sleep(0.05)
    await engine.stop(timeout_s=min(0.5, grace / 4))
    await runner.cleanup()  # handlers get `shutdown_timeout` twice, then are cancelled


@contextlib.asynccontextmanager
async def background_server(
    engine: Engine, tokenizer: Tokenizer, cfg: ServerConfig, start_timeout_s: float = 300.0
) -> AsyncIterator[str]:
    """Run a server as a task of the current event loop (tests, benches, single-process demos);
    yields its base URL and shuts it down on exit."""
    port: asyncio.Future = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    task = asyncio.create_task(
        run_server(engine, tokenizer, cfg, ready=port.set_result, stop=stop),
        name="background-server",
    )
    await asyncio.wait({port, task}, timeout=start_timeout_s, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()  # failed to start: raise its error
    if not port.done():
        task.cancel()
        raise TimeoutError(f"the server did not listen within {start_timeout_s}s")
    try:
        yield f"http://{cfg.host}:{port.result()}"
    finally:
        stop.set()
        await asyncio.wait_for(task, cfg.shutdown_timeout_s + 30)
