"""The middleware's HTTP server: the agent-facing APIs over one agent server.

    simloop middleware --config configs/demo_cpu.yaml --out runs/mw --middleware.port 8300
    ANTHROPIC_BASE_URL=http://127.0.0.1:8300 ANTHROPIC_API_KEY=<rollout id> <harness>

Routes:
- `POST /v1/messages` (Anthropic Messages) and `POST /v1/chat/completions` (OpenAI chat), both
  with SSE streaming. The API key (`x-api-key`, or `Authorization: Bearer`) names the rollout.
- `GET /rollouts` and `GET /rollouts/{id}`: rollouts in progress, their segments.
- `POST /rollouts/{id}/finish {"reward", "status"?, "reason"?, "task_id"?, "group_id"?,
  "meta"?}`: the rollout's segments become trajectories (handed to `sink`), and it is forgotten.
- `GET /v1/models`, `GET /health`.

A rollout's requests run one at a time (its lock); different rollouts run concurrently. A
harness that disconnects cancels its handler, which cancels the request to the agent server
(that server aborts the generation and frees the slot) before anything is recorded. A stream
starts (`message_start` / the role chunk) once the prompt is ready and sends keep-alives while
the agent server generates; an error after that is one last error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from rl.data.chat import ChatRenderer
from rl.data.tools import parse_assistant
from rl.data.trajectory import STATUSES, Trajectory
from serving.client import ClientError, InferenceClient
from serving.middleware import formats
from serving.middleware.chain import Rollout, SegmentsExceeded
from serving.middleware.config import MiddlewareConfig
from serving.middleware.formats import BadRequest, Call, Conversation, Reply

log = logging.getLogger(__name__)

ROLLOUT_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
KEEPALIVE_S = 5.0

Sink = Callable[[list[Trajectory]], list[str]]
"""Writes a finished rollout's trajectories; returns where they went."""


class HTTPFailure(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


class Middleware:
    """The routes and the rollouts; `app()` builds the aiohttp application."""

    def __init__(self, cfg: MiddlewareConfig, client: InferenceClient | Any, renderer: ChatRenderer,
                 sink: Sink, *, tokenizer_name: str | None = None) -> None:  # fmt: skip
        self.cfg, self.client, self.renderer, self.sink = cfg, client, renderer, sink
        self.tokenizer_name = tokenizer_name
        self.rollouts: dict[str, Rollout] = {}
        self._routes: dict[str, Any] = {}
        self._context: int | None = None
        """The agent server's context (`max_model_len` of its /v1/models); None: unknown."""
        self._context_asked = False
        self.finished = 0
        self.unfinished = 0
        """Rollouts written `aborted` at shutdown (`flush_all`)."""
        self._reaper: asyncio.Task | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/messages", self._anthropic)
        app.router.add_post("/v1/messages/count_tokens", self._count_tokens)
        app.router.add_post("/v1/chat/completions", self._openai)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/rollouts", self._list)
        app.router.add_get("/rollouts/{id}", self._show)
        app.router.add_post("/rollouts/{id}/finish", self._finish)
        app.on_startup.append(self._start_reaper)
        app.on_cleanup.append(self._stop_reaper)
        return app

    # ----- generation ----------------------------------------------------------------------

    async def _anthropic(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "anthropic")

    async def _openai(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "openai")

    async def _generate(self, request: web.Request, api: str) -> web.StreamResponse:
        try:
            rollout_id = _rollout_id(request)
            try:
                body = await request.json()
            except ValueError as e:
                raise HTTPFailure(400, f"the request body is not JSON: {e}") from e
            conv = self._parse(body, api)
        except HTTPFailure as e:
            return _error(api, e.status, str(e), e.param)
        except BadRequest as e:
            return _error(api, 400, str(e), e.param)
        rollout = self.rollouts.get(rollout_id)
        if rollout is None:
            rollout = self.rollouts[rollout_id] = Rollout(rollout_id, api=api)
        async with rollout.lock:
            rollout.requests += 1
            rollout.last_used = time.time()
            try:
                plan = rollout.plan(conv, self.renderer, segments_max=self.cfg.segments_max,
                                    enable_thinking=self.cfg.enable_thinking)  # fmt: skip
            except SegmentsExceeded as e:
                return _error(api, 400, str(e), "messages")
            msg_id = ("msg_" if api == "anthropic" else "chatcmpl-") + secrets.token_hex(12)
            work = self._sample(rollout, plan, conv)
            if conv.stream:
                return await self._stream(request, conv, msg_id, len(plan.prompt_ids), work)
            try:
                reply = await work
            except HTTPFailure as e:
                return _error(api, e.status, str(e), e.param)
            rollout.last_used = time.time()
        build = formats.anthropic_message if api == "anthropic" else formats.openai_completion
        return web.json_response(build(reply, msg_id=msg_id, model=conv.model))

    async def _count_tokens(self, request: web.Request) -> web.Response:
        """Anthropic's token counting (Claude Code asks before long requests): the tokens the
        request would render to as a fresh segment. Samples nothing, records nothing."""
        try:
            body = await request.json()
        except ValueError as e:
            return _error("anthropic", 400, f"the request body is not JSON: {e}")
        if isinstance(body, dict):
            body = {"max_tokens": 1, **body}  # count_tokens requests carry none
        try:
            conv = self._parse(body, "anthropic")
        except BadRequest as e:
            return _error("anthropic", 400, str(e), e.param)
        plan = Rollout("count", api="anthropic").plan(
            conv, self.renderer, segments_max=1, enable_thinking=self.cfg.enable_thinking
        )
        return web.json_response({"input_tokens": len(plan.prompt_ids)})

    def _parse(self, body: Any, api: str) -> Conversation:
        if api == "anthropic":
            conv = formats.parse_anthropic(body, default_model=self.cfg.model_name)
        else:
            conv = formats.parse_openai(body, default_model=self.cfg.model_name,
                                        default_max_tokens=self.cfg.default_max_tokens)  # fmt: skip
        return conv

    async def _sample(self, rollout: Rollout, plan, conv: Conversation) -> Reply:
        """Generate from the plan's ids and record the turn (only once it fully arrived)."""
        s = conv.sampling
        max_tokens = min(s.max_tokens, self.cfg.max_tokens_cap or s.max_tokens)
        context = await self._context_limit()
        if context is not None:  # harnesses ask for more than fits (Claude Code: 64,000)
            n = len(plan.prompt_ids)
            if n >= context:
                raise HTTPFailure(400, f"this model's maximum context length is {context} "
                                       f"tokens; the prompt has {n}")  # fmt: skip
            max_tokens = min(max_tokens, context - n)
        client = self._routes.get(rollout.id)
        if client is None:  # a replica pool pins each rollout to one replica (warm prefixes)
            route = getattr(self.client, "session", None)
            client = route(rollout.id) if callable(route) else self.client
            self._routes[rollout.id] = client
        try:
            out = await client.complete(
                plan.prompt_ids, max_tokens=max_tokens, temperature=s.temperature,
                top_p=s.top_p, top_k=s.top_k, stop=list(s.stop) or None, seed=s.seed,
                logprobs=0, timeout_s=self.cfg.request_timeout_s,
            )  # fmt: skip
        except ClientError as e:
            status = e.status if e.status in (400, 413, 422) else 503
            message = f"the agent server refused or failed: {e}"
            if status < 500 and "context" in str(e):
                # OpenAI's phrase, which clients (litellm, hence mini-swe-agent) read as "the
                # prompt is too long": they stop instead of retrying the same request.
                n = len(plan.prompt_ids)
                message = (f"this model's maximum context length was exceeded (the prompt has "
                           f"{n} tokens, max_tokens {max_tokens}): {message}")  # fmt: skip
            raise HTTPFailure(status, message) from e
        if out.finish_reason == "abort" or not out.token_ids:
            raise HTTPFailure(503, "the agent server aborted the generation (shutting down?)")
        ids = list(out.token_ids)
        logprobs = out.logprobs or []
        if len(logprobs) != len(ids):
            raise HTTPFailure(503, f"the agent server returned {len(logprobs)} logprobs for "
                                   f"{len(ids)} tokens")  # fmt: skip
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
        calls = tuple(Call(formats.new_call_id(conv.api), c.name, c.arguments)
                      for c in parsed.tool_calls)  # fmt: skip
        reply = Reply(content=parsed.content, tool_calls=calls, finish=finish,
                      stop_sequence=stop_seq, input_tokens=len(plan.prompt_ids),
                      output_tokens=len(ids))  # fmt: skip
        rollout.commit(plan, reply, token_ids=ids, logprobs=logprobs, versions=versions,
                       text=out.text, eos_id=eos)  # fmt: skip
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

    async def _stream(self, request: web.Request, conv: Conversation, msg_id: str,
                      input_tokens: int, work) -> web.StreamResponse:  # fmt: skip
        api = conv.api
        task = asyncio.ensure_future(work)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})  # fmt: skip
        try:
            await response.prepare(request)
            if api == "anthropic":
                placeholder = Reply("", (), "stop", None, input_tokens, 0)
                first = formats.anthropic_events(placeholder, msg_id=msg_id, model=conv.model)[:2]
                for event, data in first:
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
            except HTTPFailure as e:
                body = formats.error_body(api, e.status, str(e), e.param)
                await response.write(_sse(body, "error" if api == "anthropic" else None))
                if api == "openai":
                    await response.write(b"data: [DONE]\n\n")
                return response
            if api == "anthropic":
                events = formats.anthropic_events(reply, msg_id=msg_id, model=conv.model)[2:]
                for event, data in events:
                    await response.write(_sse(data, event))
            else:
                for chunk in formats.openai_chunks(reply, msg_id=msg_id, model=conv.model,
                                                   include_usage=conv.include_usage):  # fmt: skip
                    await response.write(_sse(chunk))
                await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            if not task.done():  # the harness went away: stop the generation too
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    # ----- rollouts ------------------------------------------------------------------------

    async def _list(self, request: web.Request) -> web.Response:
        rollouts = [r.summary() for r in self.rollouts.values()]
        return web.json_response({"rollouts": rollouts, "finished": self.finished})

    async def _show(self, request: web.Request) -> web.Response:
        rollout = self.rollouts.get(request.match_info["id"])
        if rollout is None:
            return _error("openai", 404, f"no rollout {request.match_info['id']!r} in progress")
        return web.json_response(rollout.summary())

    async def _finish(self, request: web.Request) -> web.Response:
        rollout_id = request.match_info["id"]
        try:
            self._check_admin(request)
            try:
                body = await request.json() if request.can_read_body else {}
            except ValueError as e:
                raise HTTPFailure(400, f"the request body is not JSON: {e}") from e
            if not isinstance(body, dict):
                raise HTTPFailure(400, "the request body must be a JSON object")
            rollout = self.rollouts.get(rollout_id)
            if rollout is None:
                raise HTTPFailure(404, f"no rollout {rollout_id!r} in progress (finished already, "
                                       "or it never sent a request)")  # fmt: skip
            fields = _finish_fields(body)
            try:
                await asyncio.wait_for(rollout.lock.acquire(), self.cfg.request_timeout_s)
            except TimeoutError as e:
                raise HTTPFailure(409, f"rollout {rollout_id!r} is still generating") from e
            try:
                result = self._write(rollout, **fields)
            finally:
                rollout.lock.release()
        except HTTPFailure as e:
            return _error("openai", e.status, str(e), e.param)
        return web.json_response(result)

    def _write(self, rollout: Rollout, **fields: Any) -> dict[str, Any]:
        """The rollout's trajectories to the sink; the rollout is forgotten."""
        try:
            trajs = rollout.trajectories(reward_mode=self.cfg.reward_mode,
                                         tokenizer=self.tokenizer_name, **fields)  # fmt: skip
        except ValueError as e:
            raise HTTPFailure(400, str(e)) from e
        paths = self.sink(trajs) if trajs else []
        self.rollouts.pop(rollout.id, None)
        self._routes.pop(rollout.id, None)
        self.finished += 1
        return {
            "rollout_id": rollout.id, "trajectories": len(trajs), "paths": paths,
            "status": trajs[0].status if trajs else fields["status"],
            "segments": [s.summary() for s in rollout.segments], "plans": dict(rollout.counts),
        }  # fmt: skip

    def _check_admin(self, request: web.Request) -> None:
        token = self.cfg.admin_token
        if token is None:
            return
        got = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(got.encode(), token.encode()):
            raise HTTPFailure(401, "finishing a rollout needs Authorization: Bearer <admin_token>")

    async def _start_reaper(self, app: web.Application) -> None:
        self._reaper = asyncio.create_task(self._reap(), name="middleware-reaper")

    async def _stop_reaper(self, app: web.Application) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper

    async def _reap(self) -> None:
        """Write rollouts idle past `rollout_ttl_s` as `timeout` (a harness that died)."""
        ttl = self.cfg.rollout_ttl_s
        while True:
            await asyncio.sleep(min(ttl / 4, 30.0))
            now = time.time()
            for rollout in list(self.rollouts.values()):
                if now - rollout.last_used > ttl and not rollout.lock.locked():
                    idle = now - rollout.last_used
                    reason = f"no request for {idle:.0f}s (rollout_ttl_s {ttl:g})"
                    try:
                        self._write(rollout, reward=None, status="timeout", reason=reason)
                    except Exception:  # noqa: BLE001 - one bad rollout must not stop the reaper
                        log.exception("could not write expired rollout %s", rollout.id)
                        self.rollouts.pop(rollout.id, None)

    async def flush_all(self, reason: str) -> int:
        """At shutdown: every rollout still open is written `aborted` with `reason`."""
        n = 0
        for rollout in list(self.rollouts.values()):
            with contextlib.suppress(HTTPFailure):
                self._write(rollout, reward=None, status="aborted", reason=reason)
                n += 1
        return n

    # ----- misc ------------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.cfg.model_name, "object": "model", "owned_by": "simloop"}]})  # fmt: skip

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "rollouts": len(self.rollouts),
                                  "finished": self.finished})  # fmt: skip


def _rollout_id(request: web.Request) -> str:
    key = request.headers.get("x-api-key") or ""
    if not key:
        auth = request.headers.get("Authorization", "")
        key = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
    if not key:
        raise HTTPFailure(401, "no API key: the key names the rollout (set ANTHROPIC_API_KEY or "
                               "OPENAI_API_KEY to a rollout id)")  # fmt: skip
    if not ROLLOUT_ID.match(key):
        raise HTTPFailure(401, "the API key names the rollout and must be 1-128 characters of "
                               "A-Z a-z 0-9 . _ : -")  # fmt: skip
    return key


def _finish_fields(body: dict[str, Any]) -> dict[str, Any]:
    reward = body.get("reward")
    if reward is not None and (not isinstance(reward, int | float) or isinstance(reward, bool)):
        raise HTTPFailure(400, f"reward={reward!r} is invalid: a number or null", "reward")
    status = body.get("status", "ok")
    if status not in STATUSES:
        raise HTTPFailure(400, f"status={status!r} is invalid: one of {list(STATUSES)}", "status")
    if status == "ok" and reward is None:
        raise HTTPFailure(400, "reward is required when status is 'ok'", "reward")
    reason = body.get("reason")
    if status != "ok" and not (isinstance(reason, str) and reason.strip()):
        reason = f"the harness runner finished the rollout as {status!r}"
    fields: dict[str, Any] = {"reward": None if reward is None else float(reward),
                              "status": status, "reason": reason}  # fmt: skip
    for name in ("task_id", "group_id"):
        value = body.get(name)
        if value is not None and not (isinstance(value, str) and value):
            raise HTTPFailure(400, f"{name}={value!r} is invalid: a non-empty string", name)
        if value is not None:
            fields[name] = value
    meta = body.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise HTTPFailure(400, "meta must be a JSON object", "meta")
    if meta:
        fields["meta"] = meta
    return fields


def _sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def _error(api: str, status: int, message: str, param: str | None = None) -> web.Response:
    return web.json_response(formats.error_body(api, status, message, param), status=status)


@contextlib.asynccontextmanager
async def serve(middleware: Middleware, host: str, port: int) -> AsyncIterator[str]:
    """Serve `middleware` on `host:port` (0: a free port) as part of this event loop; yields
    the base URL. Handlers are cancelled when their client disconnects."""
    runner = web.AppRunner(middleware.app(), handler_cancellation=True, access_log=None,
                           shutdown_timeout=1.0)  # fmt: skip
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        await runner.cleanup()
