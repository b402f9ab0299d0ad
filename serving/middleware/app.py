"""The middleware's HTTP server: the agent-facing APIs over one agent server, and apart from
them the admin routes that finish rollouts.

    simloop middleware --config configs/demo_cpu.yaml --out runs/mw --middleware.port 8300
    ANTHROPIC_BASE_URL=http://127.0.0.1:8300 ANTHROPIC_API_KEY=<rollout id> <harness>

The API listener (`middleware.host:port`, what harnesses reach):
- `POST /v1/messages` (Anthropic Messages), `POST /v1/chat/completions` (OpenAI chat) and
  `POST /v1/responses` (OpenAI Responses, what Codex CLI speaks; `responses.py`), all with SSE
  streaming. The API key (`x-api-key`, or `Authorization: Bearer`) names the rollout.
- `POST /v1/messages/count_tokens`, `GET /v1/models`, `GET /health`, `GET /metrics`
  (Prometheus text: rollouts open and finished, refusals by reason, refused finishes).
- Nothing under `/rollouts`: such a request is a 404 in the API's shape, logged with its key
  and counted as a refused finish (a harness trying to grade itself).

The admin listener (a Unix socket in a fresh private directory by default, or
`middleware.admin_socket`, or TCP `admin_host:admin_port`), every route behind
`Authorization: Bearer <token>` (`middleware.admin_token`, else a secret made at start):
- `GET /rollouts` and `GET /rollouts/{id}`: rollouts in progress, their segments.
- `POST /rollouts/{id}/finish {"reward", "status"?, "reason"?, "task_id"?, "group_id"?,
  "meta"?}`: the rollout's segments become trajectories (handed to `sink`), and it is forgotten.

A rollout exists once a turn of it is recorded: a refused request leaves nothing behind. At most
`max_rollouts` are open; a rollout's requests run one at a time (its lock), at most
`max_waiting_requests` waiting; different rollouts run concurrently. A rollout whose finish
does not come within `rollout_ttl_s` of its last request is written `aborted`, saying so; at
shutdown `flush_all` writes the rest `aborted`. A harness that disconnects cancels its handler,
which cancels the request to the agent server (that server aborts the generation and frees the
slot) before anything is recorded. A stream starts (`message_start` / the role chunk) once the
prompt is ready and sends keep-alives while the agent server generates; an error after that is
one last error event. Every error, expected or not, is a JSON body in the API's own shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import os
import re
import secrets
import shutil
import tempfile
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from rl.data.chat import ChatRenderer
from rl.data.tools import parse_assistant
from rl.data.trajectory import CONTROL_META_KEYS, STATUSES, Trajectory
from serving.client import ClientError, InferenceClient
from serving.middleware import formats, responses
from serving.middleware.chain import Rollout, SegmentsExceeded
from serving.middleware.config import MiddlewareConfig
from serving.middleware.formats import BadRequest, Call, Conversation, Reply

log = logging.getLogger(__name__)

ROLLOUT_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
KEEPALIVE_S = 5.0
ENDED_KEPT = 4096
"""Ended rollouts remembered (id -> how it ended), so a late finish is told, not 404ed."""
STREAMING: Any = (
    web.RequestKey("simloop.streaming", bool) if hasattr(web, "RequestKey") else "simloop.streaming"
)
"""Request key: set once a stream's headers are sent (an error after that is an event)."""

Sink = Callable[[list[Trajectory]], list[str]]
"""Writes a finished rollout's trajectories; returns where they went."""
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

REASONS = {
    400: "invalid_request",
    401: "api_key",
    404: "not_found",
    405: "method",
    409: "conflict",
    413: "too_large",
    429: "rate_limit",
    500: "internal",
    503: "agent_server",
    504: "agent_server",
}
"""`simloop_middleware_refused_total`'s reason for an HTTP status, where none is named."""


class HTTPFailure(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, *, reason: str | None = None
    ):
        super().__init__(message)
        self.status, self.param = status, param
        self.reason = reason or REASONS.get(status, f"http_{status}")


@dataclass(frozen=True)
class Listening:
    """Where a served middleware listens: `url` for harnesses; the admin listener (a Unix
    socket, or a URL) and its token for whoever finishes rollouts, never for a sandbox."""

    url: str
    admin_token: str = field(repr=False)
    admin_socket: str | None = None
    admin_url: str | None = None


class Middleware:
    """The routes and the rollouts; `api_app()` and `admin_app()` build the two aiohttp
    applications (`serve` runs both)."""

    def __init__(
        self,
        cfg: MiddlewareConfig,
        client: InferenceClient | Any,
        renderer: ChatRenderer,
        sink: Sink,
        *,
        tokenizer_name: str | None = None,
    ) -> None:
        self.cfg, self.client, self.renderer, self.sink = cfg, client, renderer, sink
        self.tokenizer_name = tokenizer_name
        self.admin_token = cfg.admin_token or secrets.token_urlsafe(32)
        """What the admin listener asks for: `admin_token`, or this run's own secret."""
        self.rollouts: dict[str, Rollout] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()
        self._routes: dict[str, Any] = {}
        self._context: int | None = None
        """The agent server's context (`max_model_len` of its /v1/models); None: unknown."""
        self._context_asked = False
        self.finished = 0
        self.unfinished = 0
        """Rollouts written `aborted` at shutdown (`flush_all`)."""
        self.written: Counter[str] = Counter()
        """Rollouts written, by status."""
        self.requests: Counter[str] = Counter()
        """Requests, by API (`anthropic`, `openai`, `responses`; `count_tokens`: Anthropic's
        token counting, which samples nothing)."""
        self.refused: Counter[str] = Counter()
        """Requests answered with an error, by reason."""
        self.timing: Counter[str] = Counter()
        """Sampled requests (`sampled`), their seconds in the middleware (`request_s`: from
        arrival to the last byte sent, less any wait behind the rollout's other requests) and
        in the agent server's call (`agent_s`); the difference is the middleware's overhead."""
        self.refused_finishes: Counter[str] = Counter()
        """Finish calls refused, by listener: `api` (sent where harnesses talk), `admin` (without
        the right token)."""
        self._reaper: asyncio.Task | None = None

    def api_app(self) -> web.Application:
        """What harnesses reach: the two APIs, models, health, metrics; no admin route."""
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._errors])
        app.router.add_post("/v1/messages", self._anthropic)
        app.router.add_post("/v1/messages/count_tokens", self._count_tokens)
        app.router.add_post("/v1/chat/completions", self._openai)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/rollouts", self._admin_elsewhere)
        app.router.add_route("*", "/rollouts/{tail:.*}", self._admin_elsewhere)
        app.on_startup.append(self._start_reaper)
        app.on_cleanup.append(self._stop_reaper)
        return app

    def admin_app(self) -> web.Application:
        """What only the job that started the middleware reaches: the rollouts, finishing them.
        Every route needs the token."""
        app = web.Application(
            client_max_size=16 * 1024 * 1024, middlewares=[self._errors, self._admin_auth]
        )
        app.router.add_get("/rollouts", self._list)
        app.router.add_get("/rollouts/{id}", self._show)
        app.router.add_post("/rollouts/{id}/finish", self._finish)
        app.router.add_get("/health", self._health)
        return app

    # ----- errors --------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every error as a JSON body in the API's shape, counted by reason; an unexpected
        exception too (logged), never aiohttp's plain-text 500."""
        try:
            return await handler(request)
        except HTTPFailure as e:
            failure = e
        except BadRequest as e:
            failure = HTTPFailure(400, str(e), e.param)
        except web.HTTPException as e:  # aiohttp's own: no such route, method, body too large
            if e.status < 400:
                raise
            detail = f" ({e.text})" if e.status == 413 else ""
            failure = HTTPFailure(e.status, f"{e.reason}: {request.method} {request.path}{detail}")
        except Exception as e:
            if request.get(STREAMING):  # the stream's own error event went out, or it is gone
                raise
            log.exception("middleware: %s %s failed", request.method, request.path)
            failure = HTTPFailure(500, f"the middleware failed: {type(e).__name__}: {e}")
        return self._refuse(_api_of(request), failure)

    def _refuse(self, api: str, e: HTTPFailure) -> web.Response:
        self.refused[e.reason] += 1
        return _error(api, e.status, str(e), e.param)

    @web.middleware
    async def _admin_auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        got = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(got.encode(), self.admin_token.encode()):
            if request.path.endswith("/finish"):
                self.refused_finishes["admin"] += 1
                log.warning(
                    "refused finish %s on the admin listener: %s token",
                    request.path,
                    "a wrong" if got else "no",
                )
            raise HTTPFailure(
                401,
                "the admin routes need Authorization: Bearer <token> (the "
                "middleware's admin token)",
                reason="admin_token",
            )
        return await handler(request)

    async def _admin_elsewhere(self, request: web.Request) -> web.Response:
        """`/rollouts...` asked where harnesses talk: refused, logged with the key, counted."""
        key = request.headers.get("x-api-key") or request.headers.get("Authorization", "")
        key = key.removeprefix("Bearer ").strip()
        self.refused_finishes["api"] += 1
        log.warning(
            "refused %s %s on the API listener (API key %r, from %s): admin routes are "
            "not served there",
            request.method,
            request.path,
            key[:128],
            request.remote,
        )
        raise HTTPFailure(
            404,
            "admin routes (/rollouts...) are not served here: rollouts are "
            "finished by whoever started the middleware, on its admin "
            "listener",
            reason="admin_route",
        )

    # ----- generation ----------------------------------------------------------------------

    async def _anthropic(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "anthropic")

    async def _openai(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "openai")

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "responses")

    async def _generate(self, request: web.Request, api: str) -> web.StreamResponse:
        arrived = time.perf_counter()
        waited: list[float] = []  # behind the rollout's lock (another request of the rollout)
        sampled: list[float] = []  # the agent server's call, when one was made
        try:
            return await self._generate_timed(request, api, waited, sampled)
        finally:
            if sampled:
                self.timing["sampled"] += 1
                self.timing["request_s"] += time.perf_counter() - arrived - sum(waited)
                self.timing["agent_s"] += sum(sampled)

    async def _generate_timed(
        self, request: web.Request, api: str, waited: list[float], sampled: list[float]
    ) -> web.StreamResponse:
        self.requests[api] += 1
        rollout_id = _rollout_id(request)
        conv = self._parse(formats.loads(await request.read()), api)
        rollout = self.rollouts.get(rollout_id)
        if rollout is None:
            if len(self.rollouts) >= self.cfg.max_rollouts:
                raise HTTPFailure(
                    429,
                    f"{len(self.rollouts)} rollouts are open, the most "
                    f"middleware.max_rollouts={self.cfg.max_rollouts} allows: "
                    "finish some first",
                    reason="max_rollouts",
                )
            rollout = self.rollouts[rollout_id] = Rollout(rollout_id, api=api)
        elif rollout.inflight > self.cfg.max_waiting_requests:
            raise HTTPFailure(
                429,
                f"rollout {rollout_id!r} has {rollout.inflight - 1} requests "
                "waiting behind the one running, the most "
                "middleware.max_waiting_requests="
                f"{self.cfg.max_waiting_requests} allows",
                reason="max_waiting_requests",
            )
        rollout.inflight += 1
        try:
            queued = time.perf_counter()
            async with rollout.lock:
                waited.append(time.perf_counter() - queued)
                if self.rollouts.get(rollout_id) is not rollout:
                    raise HTTPFailure(
                        409,
                        f"rollout {rollout_id!r} was finished while this request waited",
                        reason="finished",
                    )
                rollout.requests += 1
                rollout.last_used = time.time()
                try:
                    plan = rollout.plan(
                        conv,
                        self.renderer,
                        segments_max=self.cfg.segments_max,
                        enable_thinking=self.cfg.enable_thinking,
                    )
                except SegmentsExceeded as e:
                    raise HTTPFailure(400, str(e), "messages", reason="segments_max") from e
                prefix = {"anthropic": "msg_", "responses": "resp_"}.get(api, "chatcmpl-")
                msg_id = prefix + secrets.token_hex(12)
                work = self._sample(rollout, plan, conv, sampled)
                if conv.stream:
                    return await self._stream(request, conv, msg_id, len(plan.prompt_ids), work)
                reply = await work
                rollout.last_used = time.time()
        finally:
            rollout.inflight -= 1
            self._forget_if_empty(rollout)
        if api == "responses":
            body = responses.response_object(reply, response_id=msg_id, model=conv.model)
            return web.json_response(body)
        build = formats.anthropic_message if api == "anthropic" else formats.openai_completion
        return web.json_response(build(reply, msg_id=msg_id, model=conv.model))

    def _forget_if_empty(self, rollout: Rollout) -> None:
        """A rollout none of whose turns was recorded is dropped once its last request ends:
        refused requests leave no state."""
        if rollout.inflight or rollout.segments or rollout.failure:
            return
        if self.rollouts.get(rollout.id) is rollout:
            del self.rollouts[rollout.id]
            self._routes.pop(rollout.id, None)

    async def _count_tokens(self, request: web.Request) -> web.Response:
        """Anthropic's token counting (Claude Code asks before long requests): the tokens the
        request would render to as a fresh segment. Samples nothing, records nothing."""
        self.requests["count_tokens"] += 1
        body = formats.loads(await request.read())
        if isinstance(body, dict):
            body = {"max_tokens": 1, **body}  # count_tokens requests carry none
        conv = self._parse(body, "anthropic")
        plan = Rollout("count", api="anthropic").plan(
            conv, self.renderer, segments_max=1, enable_thinking=self.cfg.enable_thinking
        )
        return web.json_response({"input_tokens": len(plan.prompt_ids)})

    def _parse(self, body: Any, api: str) -> Conversation:
        if api == "anthropic":
            conv = formats.parse_anthropic(body, default_model=self.cfg.model_name)
        elif api == "responses":
            conv = responses.parse_responses(
                body,
                default_model=self.cfg.model_name,
                default_max_tokens=self.cfg.default_max_tokens,
            )
        else:
            conv = formats.parse_openai(
                body,
                default_model=self.cfg.model_name,
                default_max_tokens=self.cfg.default_max_tokens,
            )
        return conv

    async def _sample(
        self, rollout: Rollout, plan, conv: Conversation, sampled: list[float] | None = None
    ) -> Reply:
        """Generate from the plan's ids and record the turn (only once it fully arrived);
        the agent server's call's seconds go to `sampled`."""
        s = conv.sampling
        max_tokens = min(s.max_tokens, self.cfg.max_tokens_cap or s.max_tokens)
        context = await self._context_limit()
        if context is not None:  # harnesses ask for more than fits (Claude Code: 64,000)
            n = len(plan.prompt_ids)
            if n >= context:
                raise HTTPFailure(
                    400,
                    f"this model's maximum context length is {context} tokens; the prompt has {n}",
                    reason="context_length",
                )
            max_tokens = min(max_tokens, context - n)
        client = self._routes.get(rollout.id)
        if client is None:  # a replica pool pins each rollout to one replica (warm prefixes)
            route = getattr(self.client, "session", None)
            client = route(rollout.id) if callable(route) else self.client
            self._routes[rollout.id] = client
        called = time.perf_counter()
        try:
            out = await client.complete(
                plan.prompt_ids,
                max_tokens=max_tokens,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                stop=list(s.stop) or None,
                seed=s.seed,
                logprobs=0,
                timeout_s=self.cfg.request_timeout_s,
            )
        except ClientError as e:
            if sampled is not None:
                sampled.append(time.perf_counter() - called)
            status = e.status if e.status in (400, 413, 422) else 503
            message = f"the agent server refused or failed: {e}"
            if status < 500 and "context" in str(e):
                # OpenAI's phrase, which clients (litellm, hence mini-swe-agent) read as "the
                # prompt is too long": they stop instead of retrying the same request.
                n = len(plan.prompt_ids)
                message = (
                    f"this model's maximum context length was exceeded (the prompt has "
                    f"{n} tokens, max_tokens {max_tokens}): {message}"
                )
            raise HTTPFailure(status, message) from e
        if sampled is not None:
            sampled.append(time.perf_counter() - called)
        if out.finish_reason == "abort" or not out.token_ids:
            raise HTTPFailure(503, "the agent server aborted the generation (shutting down?)")
        ids = list(out.token_ids)
        logprobs = out.logprobs or []
        if len(logprobs) != len(ids):
            raise HTTPFailure(
                503, f"the agent server returned {len(logprobs)} logprobs for {len(ids)} tokens"
            )
        versions = out.token_versions
        if versions is None or len(versions) != len(ids):
            versions = [out.weight_version or 0] * len(ids)
        eos = self.renderer.im_end_id
        finish, stop_seq = out.finish_reason, None
        if finish == "stop" and ids[-1] != eos and s.stop:
            full = self.renderer.tokenizer.decode(ids)
            hits = [(full.find(x), x) for x in s.stop if x in full]
            if hits:
                finish, stop_seq = "stop_sequence", min(hits)[1]
        parsed = parse_assistant(out.text)
        calls = tuple(
            Call(formats.new_call_id(conv.api), c.name, c.arguments) for c in parsed.tool_calls
        )
        reply = Reply(
            content=parsed.content,
            tool_calls=calls,
            finish=finish,
            stop_sequence=stop_seq,
            input_tokens=len(plan.prompt_ids),
            output_tokens=len(ids),
        )
        rollout.commit(
            plan,
            reply,
            token_ids=ids,
            logprobs=logprobs,
            versions=versions,
            text=out.text,
            eos_id=eos,
        )
        return reply

    async def _context_limit(self) -> int | None:
        """`max_model_len` the agent server reports (simloop's engine and vLLM both do), asked
        once; None when it says nothing."""
        if not self._context_asked:
            self._context_asked = True
            try:
                raw, _ = await self.client.request("GET", "/v1/models", timeout_s=30.0)
                lengths = [m.get("max_model_len") for m in raw.get("data", [])]
                known = [n for n in lengths if isinstance(n, int) and n > 0]
                self._context = min(known) if known else None
            except Exception as e:  # noqa: BLE001 - without it the server's own check decides
                log.info("the agent server's context is unknown (%s): max_tokens unclamped", e)
        return self._context

    async def _stream(
        self, request: web.Request, conv: Conversation, msg_id: str, input_tokens: int, work
    ) -> web.StreamResponse:
        api = conv.api
        task = asyncio.ensure_future(work)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        try:
            await response.prepare(request)
            request[STREAMING] = True
            if api == "anthropic":
                placeholder = Reply("", (), "stop", None, input_tokens, 0)
                first = formats.anthropic_events(placeholder, msg_id=msg_id, model=conv.model)[:2]
                for event, data in first:
                    await response.write(_sse(data, event))
            elif api == "responses":
                for event, data in responses.start_events(response_id=msg_id, model=conv.model):
                    await response.write(_sse(data, event))
            else:
                await response.write(b": generating\n\n")
            while True:
                done, _ = await asyncio.wait({task}, timeout=KEEPALIVE_S)
                if done:
                    break
                keepalive = _sse({"type": "ping"}, "ping") if api == "anthropic" else b": ping\n\n"
                await response.write(keepalive)
            try:
                reply = task.result()
            except Exception as e:
                if isinstance(e, HTTPFailure):
                    failure = e
                else:  # not a plain-text 500 either: one error event in the API's shape
                    log.exception("middleware: a streamed generation failed")
                    failure = HTTPFailure(500, f"the middleware failed: {type(e).__name__}: {e}")
                self.refused[failure.reason] += 1
                if api == "responses":
                    event = responses.error_event(failure.status, str(failure), 2)
                    await response.write(_sse(event, "error"))
                    return response
                body = formats.error_body(api, failure.status, str(failure), failure.param)
                await response.write(_sse(body, "error" if api == "anthropic" else None))
                if api == "openai":
                    await response.write(b"data: [DONE]\n\n")
                return response
            if api == "anthropic":
                events = formats.anthropic_events(reply, msg_id=msg_id, model=conv.model)[2:]
                for event, data in events:
                    await response.write(_sse(data, event))
            elif api == "responses":
                events = responses.response_events(reply, response_id=msg_id, model=conv.model)
                for event, data in events[2:]:
                    await response.write(_sse(data, event))
            else:
                for chunk in formats.openai_chunks(
                    reply, msg_id=msg_id, model=conv.model, include_usage=conv.include_usage
                ):
                    await response.write(_sse(chunk))
                await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            if not task.done():  # the harness went away: stop the generation too
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    # ----- rollouts (the admin listener) ---------------------------------------------------

    async def _list(self, request: web.Request) -> web.Response:
        rollouts = [r.summary() for r in self.rollouts.values() if r.segments]
        return web.json_response({"rollouts": rollouts, "finished": self.finished})

    async def _show(self, request: web.Request) -> web.Response:
        rollout_id = request.match_info["id"]
        rollout = self.rollouts.get(rollout_id)
        if rollout is None or not rollout.segments:
            raise HTTPFailure(404, self._missing(rollout_id))
        return web.json_response(rollout.summary())

    def _missing(self, rollout_id: str) -> str:
        ended = self._ended.get(rollout_id)
        if ended is not None:
            return f"rollout {rollout_id!r} is not in progress: it was written {ended}"
        return (
            f"no rollout {rollout_id!r} in progress: none of its requests recorded a turn "
            "(it never called the model, or every call was refused)"
        )

    async def _finish(self, request: web.Request) -> web.Response:
        rollout_id = request.match_info["id"]
        raw = await request.read()
        body = formats.loads(raw) if raw.strip() else {}
        if not isinstance(body, dict):
            raise HTTPFailure(400, "the request body must be a JSON object")
        fields = _finish_fields(body)
        rollout = self.rollouts.get(rollout_id)
        if rollout is None:
            status = 409 if rollout_id in self._ended else 404
            raise HTTPFailure(status, self._missing(rollout_id))
        try:
            await asyncio.wait_for(rollout.lock.acquire(), self.cfg.request_timeout_s)
        except TimeoutError as e:
            raise HTTPFailure(409, f"rollout {rollout_id!r} is still generating") from e
        try:
            if self.rollouts.get(rollout_id) is not rollout or not rollout.segments:
                status = 409 if rollout_id in self._ended else 404  # ended while this waited
                raise HTTPFailure(status, self._missing(rollout_id))
            result = self._write(rollout, **fields)
        finally:
            rollout.lock.release()
        return web.json_response(result)

    def _write(self, rollout: Rollout, **fields: Any) -> dict[str, Any]:
        """The rollout's trajectories to the sink; the rollout is forgotten."""
        try:
            trajs = rollout.trajectories(
                reward_mode=self.cfg.reward_mode, tokenizer=self.tokenizer_name, **fields
            )
        except ValueError as e:
            raise HTTPFailure(400, str(e)) from e
        paths = self.sink(trajs) if trajs else []
        self.rollouts.pop(rollout.id, None)
        self._routes.pop(rollout.id, None)
        status = trajs[0].status if trajs else fields["status"]
        reason = trajs[0].reason if trajs else fields.get("reason")
        self._ended[rollout.id] = status + (f" ({reason})" if reason else "")
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)
        self.finished += 1
        self.written[status] += 1
        return {
            "rollout_id": rollout.id,
            "trajectories": len(trajs),
            "paths": paths,
            "status": status,
            "segments": [s.summary() for s in rollout.segments],
            "plans": dict(rollout.counts),
        }

    async def _start_reaper(self, app: web.Application) -> None:
        self._reaper = asyncio.create_task(self._reap(), name="middleware-reaper")

    async def _stop_reaper(self, app: web.Application) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper

    async def _reap(self) -> None:
        ttl = self.cfg.rollout_ttl_s
        while True:
            await asyncio.sleep(min(ttl / 4, 30.0))
            self.reap(time.time())

    def reap(self, now: float) -> int:
        """Write every rollout whose finish has not come `rollout_ttl_s` after its last request
        as `aborted`, saying no grade arrived (its harness or grader died, or its finish was
        refused): never dropped unrecorded. Returns how many."""
        ttl, n = self.cfg.rollout_ttl_s, 0
        for rollout in list(self.rollouts.values()):
            idle = now - rollout.last_used
            if idle <= ttl or rollout.inflight or rollout.lock.locked() or not rollout.segments:
                continue
            reason = (
                f"no finish (its grade) arrived within rollout_ttl_s={ttl:g}s of its last "
                f"request ({idle:.0f}s ago)"
            )
            log.warning("rollout %s: %s; written aborted", rollout.id, reason)
            try:
                self._write(rollout, reward=None, status="aborted", reason=reason)
                n += 1
            except Exception:  # noqa: BLE001 - one bad rollout must not stop the reaper
                log.exception("could not write expired rollout %s", rollout.id)
                self.rollouts.pop(rollout.id, None)
        return n

    async def flush_all(self, reason: str) -> int:
        """At shutdown: every rollout still open is written `aborted` with `reason`."""
        n = 0
        for rollout in list(self.rollouts.values()):
            if not rollout.segments:
                continue
            with contextlib.suppress(HTTPFailure):
                self._write(rollout, reward=None, status="aborted", reason=reason)
                n += 1
        return n

    # ----- misc ------------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.cfg.model_name, "object": "model", "owned_by": "simloop"}],
            }
        )

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"status": "ok", "rollouts": len(self.rollouts), "finished": self.finished}
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.render_metrics(), content_type="text/plain", charset="utf-8")

    def render_metrics(self) -> str:
        """Prometheus text: counts only, no rollout id (a label per id would grow forever)."""
        open_now = sum(1 for r in self.rollouts.values() if r.segments)
        lines = [
            "# HELP simloop_middleware_rollouts_open rollouts with a recorded turn, not finished",
            "# TYPE simloop_middleware_rollouts_open gauge",
            f"simloop_middleware_rollouts_open {open_now}",
        ]
        for name, help_text, label, counts in [
            ("rollouts_finished_total", "rollouts written, by status", "status", self.written),
            ("requests_total", "requests by API (count_tokens: unsampled)", "api", self.requests),
            ("refused_total", "requests answered with an error, by reason", "reason", self.refused),
            (
                "refused_finishes_total",
                "finish calls refused: on the API listener, or on the "
                "admin listener without its token",
                "listener",
                self.refused_finishes,
            ),
        ]:
            metric = f"simloop_middleware_{name}"
            lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} counter"]
            lines += [f'{metric}{{{label}="{key}"}} {n}' for key, n in sorted(counts.items())]
        for name, key, help_text in [
            ("request_seconds", "request_s", "a sampled request's time in the middleware"),
            ("agent_seconds", "agent_s", "a sampled request's agent-server call"),
        ]:
            metric = f"simloop_middleware_{name}"
            lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} summary"]
            lines += [f"{metric}_sum {self.timing[key]:.6f}"]
            lines += [f"{metric}_count {self.timing['sampled']}"]
        return "\n".join(lines) + "\n"


def _api_of(request: web.Request) -> str:
    """Which API's error shape a request gets: its route's, else its headers' guess."""
    if request.path.startswith("/v1/messages"):
        return "anthropic"
    if request.path.startswith("/v1/"):
        return "openai"
    if request.headers.get("x-api-key") or request.headers.get("anthropic-version"):
        return "anthropic"
    return "openai"


def _rollout_id(request: web.Request) -> str:
    key = request.headers.get("x-api-key") or ""
    if not key:
        auth = request.headers.get("Authorization", "")
        key = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
    if not key:
        raise HTTPFailure(
            401,
            "no API key: the key names the rollout (set ANTHROPIC_API_KEY or "
            "OPENAI_API_KEY to a rollout id)",
        )
    if not ROLLOUT_ID.match(key):
        raise HTTPFailure(
            401, "the API key names the rollout and must be 1-128 characters of A-Z a-z 0-9 . _ : -"
        )
    return key


def _finish_fields(body: dict[str, Any]) -> dict[str, Any]:
    reward = body.get("reward")
    if reward is not None and (
        not isinstance(reward, int | float) or isinstance(reward, bool) or not math.isfinite(reward)
    ):
        raise HTTPFailure(400, f"reward={reward!r} is invalid: a finite number or null", "reward")
    status = body.get("status", "ok")
    if status not in STATUSES:
        raise HTTPFailure(400, f"status={status!r} is invalid: one of {list(STATUSES)}", "status")
    if status == "ok" and reward is None:
        raise HTTPFailure(400, "reward is required when status is 'ok'", "reward")
    reason = body.get("reason")
    if status != "ok" and not (isinstance(reason, str) and reason.strip()):
        reason = f"the harness runner finished the rollout as {status!r}"
    fields: dict[str, Any] = {
        "reward": None if reward is None else float(reward),
        "status": status,
        "reason": reason,
    }
    for name in ("task_id", "group_id"):
        value = body.get(name)
        if value is not None and not (isinstance(value, str) and value):
            raise HTTPFailure(400, f"{name}={value!r} is invalid: a non-empty string", name)
        if value is not None:
            fields[name] = value
    meta = body.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise HTTPFailure(400, "meta must be a JSON object", "meta")
    control = sorted(set(meta or ()) & set(CONTROL_META_KEYS))
    if control:
        raise HTTPFailure(
            400,
            f"meta[{control[0]!r}] is invalid: meta is provenance only; the "
            f"trajectory's control fields ({', '.join(CONTROL_META_KEYS)}) are "
            "not the harness's to set",
            "meta",
        )
    if meta:
        fields["meta"] = meta
    return fields


def _sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def _error(api: str, status: int, message: str, param: str | None = None) -> web.Response:
    return web.json_response(formats.error_body(api, status, message, param), status=status)


@contextlib.asynccontextmanager
async def serve(middleware: Middleware, host: str, port: int) -> AsyncIterator[Listening]:
    """Serve `middleware` as part of this event loop: its APIs on `host:port` (0: a free port),
    its admin routes on their own listener (`middleware.cfg`: a Unix socket in a fresh private
    directory unless `admin_socket` or `admin_port` say otherwise). Yields where they listen.
    Handlers are cancelled when their client disconnects."""
    cfg = middleware.cfg
    api = web.AppRunner(
        middleware.api_app(), handler_cancellation=True, access_log=None, shutdown_timeout=1.0
    )
    admin = web.AppRunner(
        middleware.admin_app(), handler_cancellation=True, access_log=None, shutdown_timeout=1.0
    )
    private: str | None = None
    socket_path: str | None = None
    try:
        await api.setup()
        await web.TCPSite(api, host, port).start()
        url = f"http://{host}:{api.addresses[0][1]}"
        await admin.setup()
        if cfg.admin_port is not None:
            await web.TCPSite(admin, cfg.admin_host, cfg.admin_port).start()
            bound = admin.addresses[0][1]
            listening = Listening(
                url, middleware.admin_token, admin_url=f"http://{cfg.admin_host}:{bound}"
            )
        else:
            if cfg.admin_socket is None:  # mode 0700: no other uid reaches the socket inside
                private = tempfile.mkdtemp(prefix="simloop-middleware-")
                socket_path = os.path.join(private, "admin.sock")
            else:
                socket_path = cfg.admin_socket
            await web.UnixSite(admin, socket_path).start()
            os.chmod(socket_path, 0o600)
            listening = Listening(url, middleware.admin_token, admin_socket=socket_path)
        yield listening
    finally:
        await admin.cleanup()
        await api.cleanup()
        if socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(socket_path)
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)
