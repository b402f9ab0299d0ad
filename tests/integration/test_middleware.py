"""`simloop middleware` driven by the official `anthropic` and `openai` clients over real
sockets, in front of (a) a real simloop server (the JAX engine, a tiny random model) and (b) a
scripted agent server speaking the same `/v1/completions` protocol, whose replies are chosen
tool calls (a random tiny model never writes one).

Covers: both APIs streamed and not; tool calls out (parsed from the Qwen3 format) and back in
(tool results extend the chain); concurrent rollouts; a rewritten history starting a new
segment; every segment's ids equal to the server's prompt + output ids of its requests; a
harness that disconnects aborting the generation and freeing the slot; finish writing
trajectories, on the admin listener only (a Unix socket, its token required; the API listener
has no /rollouts route); refused requests leaving no state, the open-rollout and waiting-request
caps, /metrics; errors in each API's shape, hostile JSON and a handler that raises included."""

import asyncio
import contextlib
import json
import logging
import os
import stat
import time

import aiohttp
import anthropic
import openai
import pytest
import pytest_asyncio
from aiohttp import web
from flax import nnx

from rl.data import ByteTokenizer
from rl.data.chat import ChatRenderer
from rl.data.trajectory import to_json_line
from rl.model import Qwen3, tiny
from serving.config import ServerConfig
from serving.engine import Engine, EngineConfig
from serving.middleware.app import Listening, Middleware, serve
from serving.middleware.config import MiddlewareConfig
from tests.fakes import RecordingClient, StepGate, assert_token_exact, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

TOK = ByteTokenizer()
EOS = TOK.eos_id
BASH = {
    "name": "bash",
    "description": "run a shell command",
    "input_schema": {
        "type": "object",
        "properties": {"cmd": {"type": "string"}},
        "required": ["cmd"],
    },
}
OPENAI_BASH = {
    "type": "function",
    "function": {"name": "bash", "description": "run", "parameters": BASH["input_schema"]},
}
ADMIN = "http://middleware"
"""The admin listener's base URL (its Unix socket is the connector's)."""


class Front:
    """A middleware on a free port, its sink's trajectories and its agent-side client."""

    def __init__(
        self, middleware: Middleware, where: Listening, client: RecordingClient, written: list
    ):
        self.middleware, self.where, self.client, self.written = middleware, where, client, written
        self.url = where.url

    def anthropic(self, rollout: str) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(base_url=self.url, api_key=rollout, max_retries=0)

    def openai(self, rollout: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=rollout, max_retries=0)

    def admin(self, token: str | None = "right") -> aiohttp.ClientSession:
        """A session on the admin listener (its Unix socket): with the token, none or a wrong
        one."""
        headers = {"right": {"Authorization": f"Bearer {self.where.admin_token}"}, None: {}}.get(
            token, {"Authorization": f"Bearer {token}"}
        )
        connector = aiohttp.UnixConnector(path=self.where.admin_socket)
        return aiohttp.ClientSession(connector=connector, headers=headers)

    async def finish(self, rollout: str, **body) -> dict:
        async with self.admin() as http:
            async with http.post(f"{ADMIN}/rollouts/{rollout}/finish", json=body) as r:
                assert r.status == 200, await r.text()
                return await r.json()

    async def metric(self, line: str) -> float:
        """The value of `line` (a metric and its labels) in the API listener's /metrics."""
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{self.url}/metrics") as r:
                text = await r.text()
        values = [x.rsplit(" ", 1)[1] for x in text.splitlines() if x.rsplit(" ", 1)[0] == line]
        return float(values[0]) if values else 0.0


async def _front(agent_url: str, cfg: MiddlewareConfig | None = None):
    client = RecordingClient(agent_url)
    written: list = []

    def sink(trajs):
        for t in trajs:
            to_json_line(t)  # the trajectory validator: what the job's writer runs
        written.extend(trajs)
        return ["memory"]

    mw = Middleware(
        cfg or MiddlewareConfig(port=0), client, ChatRenderer(TOK), sink, tokenizer_name="byte"
    )
    return mw, client, written


# ----- (a) a real simloop server -------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def real():
    from serving.server import background_server

    model = Qwen3(tiny(initializer_range=0.3), rngs=nnx.Rngs(0))
    engine = Engine(
        model, TOK, EngineConfig(num_slots=8, max_seq_len=1024, prefill_chunk=64, prefill_batch=4)
    )
    cfg = ServerConfig(host="127.0.0.1", port=0, model_name="tiny", shutdown_timeout_s=5.0)
    async with background_server(engine, TOK, cfg, start_timeout_s=180) as agent_url:
        mw, client, written = await _front(agent_url)
        async with serve(mw, "127.0.0.1", 0) as where:
            front = Front(mw, where, client, written)
            front.engine = engine
            yield front
        await client.close()


async def test_concurrent_rollouts_extend_and_diverge_token_exact(real):
    async def harness(rollout: str, stream: bool) -> None:
        c = real.anthropic(rollout)
        first = [{"role": "user", "content": f"task {rollout}: list the files"}]
        m1 = await c.messages.create(
            model="tiny", max_tokens=12, system="You are terse.", tools=[BASH], messages=first
        )
        assert m1.stop_reason in ("end_turn", "max_tokens") and m1.usage.output_tokens >= 1
        history = [
            *first,
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m1.content]},
            {"role": "user", "content": "go on"},
        ]
        if stream:
            async with c.messages.stream(
                model="tiny", max_tokens=12, system="You are terse.", tools=[BASH], messages=history
            ) as s:
                m2 = await s.get_final_message()
        else:
            m2 = await c.messages.create(
                model="tiny", max_tokens=12, system="You are terse.", tools=[BASH], messages=history
            )
        assert m2.usage.input_tokens > m1.usage.input_tokens
        if rollout.endswith("-0"):  # the harness compacts: one summary message instead
            compacted = [{"role": "user", "content": "summary of the task so far"}]
            await c.messages.create(
                model="tiny",
                max_tokens=12,
                system="You are terse.",
                tools=[BASH],
                messages=compacted,
            )
        await c.close()

    names = [f"rollout-{i}" for i in range(4)]
    await asyncio.gather(*(harness(n, stream=i % 2 == 1) for i, n in enumerate(names)))
    async with real.admin() as http:
        async with http.get(f"{ADMIN}/rollouts/rollout-0") as r:
            shown = await r.json()
    assert shown["plans"] == {"new": 2, "extend": 1, "retry": 0}
    for i, name in enumerate(names):
        result = await real.finish(name, reward=float(i), task_id=f"t{i}", group_id="g")
        assert result["trajectories"] == (2 if i == 0 else 1)
    by_rollout = {}
    for t in real.written:
        by_rollout.setdefault(t.rollout_id, []).append(t)
    assert sorted(by_rollout) == names
    for name, trajs in by_rollout.items():
        assert trajs[0].reward == float(name[-1]) and trajs[0].task_id == f"t{name[-1]}"
        assert [len(t.turns) for t in trajs] == ([2, 1] if name.endswith("-0") else [2])
        for t in trajs:
            assert_token_exact(real.client.calls, t)
    # the compacted segment starts over: its prompt is the summary, nothing before is trained
    compacted = by_rollout["rollout-0"][1]
    assert compacted.prompt[-1]["content"] == "summary of the task so far"
    assert (
        sum(compacted.loss_mask)
        == compacted.turns[0].token_span[1] - compacted.turns[0].token_span[0]
    )


async def test_openai_client_streamed_and_not_over_the_real_server(real):
    count = "simloop_middleware_request_seconds_count"
    timed = (count, *(f"simloop_middleware_{x}_seconds_sum" for x in ("request", "agent")))
    before = {m: await real.metric(m) for m in timed}
    c = real.openai("oa-1")
    r = await c.chat.completions.create(
        model="tiny",
        max_tokens=10,
        tools=[OPENAI_BASH],
        messages=[{"role": "user", "content": "hi"}],
    )
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
    stream = await c.chat.completions.create(
        model="tiny",
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
        tools=[OPENAI_BASH],
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "more"},
        ],
    )
    chunks = [ch async for ch in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens >= 1
    await c.close()
    result = await real.finish("oa-1", reward=0.0)
    assert result["plans"]["extend"] == 1 and result["trajectories"] == 1
    assert_token_exact(real.client.calls, real.written[-1])
    # Both requests were timed, in the middleware and in their agent-server call (overhead:
    # the difference, never negative).
    after = {m: await real.metric(m) for m in before}
    assert after[count] - before[count] == 2
    spent = {m: after[m] - before[m] for m in before if m.endswith("_sum")}
    agent = spent["simloop_middleware_agent_seconds_sum"]
    assert 0 < agent <= spent["simloop_middleware_request_seconds_sum"]


async def test_a_harness_that_disconnects_aborts_the_generation(real):
    engine = real.engine
    aborted = engine.stats["aborted"]
    asked = asyncio.Event()

    def abort(request_id: str, real_abort=engine.abort) -> None:
        real_abort(request_id)
        asked.set()

    body = {"model": "tiny", "max_tokens": 300, "messages": [{"role": "user", "content": "x"}]}
    headers = {"x-api-key": "gone-1", "anthropic-version": "2023-06-01"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine, "abort", abort)
        gate = StepGate(engine, mp)
        try:
            async with aiohttp.ClientSession() as http:
                post = asyncio.create_task(
                    http.post(
                        f"{real.url}/v1/messages",
                        json=body,
                        headers=headers,
                        timeout=aiohttp.ClientTimeout(total=0.5),
                    )
                )
                await gate.engine_waits()  # the engine holds the request before a step ...
                with pytest.raises(asyncio.TimeoutError):  # ... until the harness gave up
                    await post
            await asyncio.wait_for(asked.wait(), 60)
        finally:
            gate.open()
        assert await wait_until(lambda: engine.active_slots == 0, timeout_s=60.0)
    assert engine.stats["aborted"] == aborted + 1
    assert "gone-1" not in real.middleware.rollouts  # nothing recorded, so nothing kept
    # The same harness, back, is served normally.
    c = real.anthropic("gone-1")
    m = await c.messages.create(model="tiny", max_tokens=4, messages=body["messages"])
    assert m.usage.output_tokens >= 1
    await c.close()


async def test_count_tokens_counts_what_a_new_segment_would_render(real):
    c = real.anthropic("count-1")
    messages = [{"role": "user", "content": "how long is this?"}]
    counted = await c.messages.count_tokens(model="tiny", messages=messages, tools=[BASH])
    calls = len(real.client.calls)
    m = await c.messages.create(model="tiny", max_tokens=2, messages=messages, tools=[BASH])
    assert counted.input_tokens == m.usage.input_tokens == len(real.client.calls[calls][0])
    await c.close()


async def test_errors_come_back_in_each_apis_shape(real):
    c = real.anthropic("bad-1")
    with pytest.raises(anthropic.BadRequestError, match="image"):
        await c.messages.create(
            model="tiny",
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
                        }
                    ],
                }
            ],
        )
    with pytest.raises(anthropic.AuthenticationError, match="names the rollout"):
        await real.anthropic("no spaces allowed").messages.create(
            model="tiny", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
    # longer than the agent server's context (its /v1/models says 1024): named, in the phrase
    # clients read as "too long" (litellm stops instead of retrying)
    with pytest.raises(anthropic.BadRequestError, match="maximum context length is 1024"):
        await c.messages.create(
            model="tiny", max_tokens=4, messages=[{"role": "user", "content": "y" * 1500}]
        )
    # more max_tokens than fit (Claude Code asks for 64,000): clamped to what is left
    async with c.messages.stream(
        model="tiny", max_tokens=64_000, messages=[{"role": "user", "content": "z"}]
    ) as s:
        m = await s.get_final_message()
    assert m.usage.input_tokens + m.usage.output_tokens <= 1024
    o = real.openai("bad-2")
    with pytest.raises(openai.BadRequestError, match="n=3"):
        await o.chat.completions.create(
            model="tiny", n=3, messages=[{"role": "user", "content": "x"}]
        )
    async with real.admin() as http:
        async with http.post(f"{ADMIN}/rollouts/never/finish", json={"reward": 1}) as r:
            assert r.status == 404 and "never" in (await r.json())["error"]["message"]
        async with http.post(f"{ADMIN}/rollouts/bad-1/finish", json={"status": "ok"}) as r:
            assert r.status == 400 and "reward is required" in (await r.json())["error"]["message"]
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{real.url}/v1/messages", data=b"{nope", headers={"x-api-key": "bad-3"}
        ) as r:
            err = await r.json()
            assert r.status == 400 and err["type"] == "error"
            assert err["error"]["type"] == "invalid_request_error"
        async with http.get(f"{real.url}/health") as r:
            assert (await r.json())["status"] == "ok"
    # refused requests (bad input, a prompt past the context) leave no rollout behind
    assert not {"bad-2", "bad-3"} & set(real.middleware.rollouts)


async def _raw(http: aiohttp.ClientSession, url: str, data: bytes | str, **headers) -> tuple:
    async with http.post(
        url, data=data, headers={"Content-Type": "application/json", **headers}
    ) as r:
        assert r.content_type == "application/json", await r.text()  # never plain text
        return r.status, await r.json()


async def test_hostile_input_gets_a_4xx_in_the_apis_shape_never_a_plain_500(real):
    anth, oai = f"{real.url}/v1/messages", f"{real.url}/v1/chat/completions"
    key = {"x-api-key": "hostile-1"}
    user = {"role": "user", "content": "x"}
    async with aiohttp.ClientSession() as http:
        status, err = await _raw(http, anth, "[" * 100_000, **key)  # RecursionError in json
        assert status == 400 and err["error"]["type"] == "invalid_request_error"
        assert "nested deeper" in err["error"]["message"]
        deep = {"max_tokens": 4, "messages": [user], "metadata": {"a": [[[[[[[[[[1]]]]]]]]]]}}
        for _ in range(60):
            deep["metadata"] = {"a": deep["metadata"]}
        status, err = await _raw(http, anth, json.dumps(deep), **key)
        assert status == 400 and "nested deeper than 64" in err["error"]["message"]
        lone = '{"max_tokens": 4, "messages": [{"role": "user", "content": "a\\ud800b"}]}'
        status, err = await _raw(http, oai, lone, Authorization="Bearer hostile-2")
        assert status == 400 and err["error"]["code"] == 400  # OpenAI's shape
        assert "lone surrogate (\\ud800)" in err["error"]["message"]
        status, err = await _raw(
            http,
            anth,
            '{"max_tokens": 4, "temperature": NaN, "messages": [{"role": "user", "content": "x"}]}',
            **key,
        )
        assert status == 400 and "NaN is not a JSON value" in err["error"]["message"]
        body = {"max_tokens": 4, "top_k": 1e999, "messages": [user]}  # inf: int(inf) raised
        status, err = await _raw(http, anth, json.dumps(body).replace("Infinity", "1e999"), **key)
        assert status == 400 and "top_k" in err["error"]["message"]
        async with http.get(f"{real.url}/v1/messages") as r:  # wrong method: JSON 405
            assert r.status == 405 and (await r.json())["type"] == "error"
        async with http.get(f"{real.url}/nowhere") as r:
            assert r.status == 404 and "nowhere" in (await r.json())["error"]["message"]
    async with real.admin() as http:
        for reward in ("NaN", "Infinity", "-Infinity", "1e999"):
            status, err = await _raw(
                http, f"{ADMIN}/rollouts/any/finish", f'{{"reward": {reward}}}'
            )
            message = err["error"]["message"]
            assert status == 400 and reward.strip("-") in message or "reward=inf" in message, err
    c = real.anthropic("hostile-3")
    bot_msg = [user, {"role": "bot", "content": "obey"}, user]
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[1\]\.role='bot'.*or system"):
        await c.messages.create(model="tiny", max_tokens=4, messages=bot_msg)
    with pytest.raises(anthropic.BadRequestError, match="stop is a parameter of the OpenAI"):
        await c.messages.create(
            model="tiny", max_tokens=4, messages=[user], extra_body={"stop": ["x"]}
        )
    with pytest.raises(openai.BadRequestError, match="top_k is a parameter of the Anthropic"):
        await real.openai("hostile-4").chat.completions.create(
            model="tiny", messages=[user], extra_body={"top_k": 5}
        )
    await c.close()
    assert not {f"hostile-{i}" for i in range(1, 5)} & set(real.middleware.rollouts)


async def test_an_unexpected_exception_is_a_json_500_in_the_apis_shape(real, caplog):
    def boom(*args, **kwargs):
        raise KeyError("a bug")

    msgs = [{"role": "user", "content": "x"}]
    with pytest.MonkeyPatch.context() as mp, caplog.at_level(logging.ERROR):
        mp.setattr(real.middleware, "_parse", boom)
        with pytest.raises(anthropic.InternalServerError, match="KeyError") as e:
            await real.anthropic("boom-1").messages.create(
                model="tiny", max_tokens=4, messages=msgs
            )
        assert e.value.body["error"]["type"] == "api_error"
        with pytest.raises(openai.InternalServerError, match="KeyError"):
            await real.openai("boom-2").chat.completions.create(model="tiny", messages=msgs)
    assert "POST /v1/messages failed" in caplog.text
    assert await real.metric('simloop_middleware_refused_total{reason="internal"}') >= 2


async def test_admin_routes_live_on_the_admin_socket_behind_its_token(real, caplog):
    where = real.where
    assert where.admin_socket and where.admin_url is None and len(where.admin_token) >= 32
    assert stat.S_IMODE(os.stat(os.path.dirname(where.admin_socket)).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(where.admin_socket).st_mode) == 0o600
    c = real.anthropic("self-grader")
    await c.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    await c.close()
    refused = await real.metric('simloop_middleware_refused_finishes_total{listener="api"}')
    # The API listener (what a harness reaches) serves no /rollouts route at all.
    with caplog.at_level(logging.WARNING, logger="serving.middleware.app"):
        async with aiohttp.ClientSession() as http:
            for method, path in [
                ("POST", "/rollouts/self-grader/finish"),
                ("GET", "/rollouts"),
                ("GET", "/rollouts/self-grader"),
            ]:
                async with http.request(
                    method,
                    f"{real.url}{path}",
                    json={"reward": 1.0},
                    headers={"x-api-key": "self-grader"},
                ) as r:
                    err = await r.json()
                    assert r.status == 404 and err["type"] == "error", err  # Anthropic's shape
                    assert "not served here" in err["error"]["message"]
    assert (
        "refused POST /rollouts/self-grader/finish on the API listener (API key "
        "'self-grader'" in caplog.text
    )
    assert (
        await real.metric('simloop_middleware_refused_finishes_total{listener="api"}')
        == refused + 3
    )
    # The admin listener: no token or a wrong one is a 401 (logged, counted) ...
    for token in (None, "self-grader", where.admin_token + "x"):
        async with real.admin(token) as http:
            async with http.post(f"{ADMIN}/rollouts/self-grader/finish", json={"reward": 1.0}) as r:
                assert r.status == 401 and "admin token" in (await r.json())["error"]["message"]
            async with http.get(f"{ADMIN}/rollouts") as r:
                assert r.status == 401
    assert await real.metric('simloop_middleware_refused_finishes_total{listener="admin"}') >= 3
    assert "self-grader" in real.middleware.rollouts
    # ... and the token finishes it, once: a second finish is told how it ended.
    done = await real.finish("self-grader", reward=0.25)
    assert done["trajectories"] == 1 and real.written[-1].reward == 0.25
    async with real.admin() as http:
        async with http.post(f"{ADMIN}/rollouts/self-grader/finish", json={"reward": 1.0}) as r:
            assert r.status == 409 and "written ok" in (await r.json())["error"]["message"]


async def test_a_rollout_whose_grade_never_came_is_written_aborted_saying_so(real):
    c = real.anthropic("orphan-1")
    await c.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    await c.close()
    ttl, before = real.middleware.cfg.rollout_ttl_s, len(real.written)
    assert real.middleware.reap(time.time()) == 0  # not yet idle past the ttl
    n = real.middleware.reap(time.time() + ttl + 1)  # (other tests' open rollouts go too)
    reaped = {t.rollout_id: t for t in real.written[before:]}
    assert n == len(reaped) and all(t.status == "aborted" for t in reaped.values())
    t = reaped["orphan-1"]
    assert t.reward is None and "no finish (its grade) arrived within rollout_ttl_s" in t.reason
    assert "orphan-1" not in real.middleware.rollouts


# ----- (b) a scripted agent server: tool calls -----------------------------------------------


class Scripted:
    """`POST /v1/completions` answering each request with the next scripted reply, as simloop's
    server would: the reply's byte ids + `<|im_end|>`, logprobs, token versions. With `gate`,
    each request is held (`arrived` set) until the gate opens."""

    def __init__(self, replies: list[str], gate: asyncio.Event | None = None):
        self.replies = list(replies)
        self.gate, self.arrived = gate, asyncio.Event()

    async def complete(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.gate is not None:
            self.arrived.set()
            await self.gate.wait()
        ids = TOK.encode_text(self.replies.pop(0)) + [EOS]
        n = len(ids)
        return web.json_response(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "model": "scripted",
                "choices": [
                    {
                        "index": 0,
                        "text": TOK.decode(ids[:-1]),
                        "token_ids": ids,
                        "prompt_token_ids": body["prompt"],
                        "token_versions": [7] * n,
                        "logprobs": {"token_logprobs": [-0.25] * n, "top_logprobs": [{}] * n},
                        "finish_reason": "stop",
                        "stop_reason": None,
                    }
                ],
                "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n},
                "weight_version": 7,
            }
        )


@contextlib.asynccontextmanager
async def scripted_front(script: Scripted, cfg: MiddlewareConfig | None = None):
    app = web.Application()
    app.router.add_post("/v1/completions", script.complete)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    agent_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    mw, client, written = await _front(agent_url, cfg)
    try:
        async with serve(mw, "127.0.0.1", 0) as where:
            front = Front(mw, where, client, written)
            front.script = script
            yield front
    finally:
        await client.close()
        await runner.cleanup()


@pytest_asyncio.fixture(loop_scope="module")
async def scripted():
    call = '<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls -l"}}\n</tool_call>'
    async with scripted_front(Scripted([f"Let me look.\n{call}", "There is one file."] * 2)) as f:
        yield f


async def test_anthropic_tool_use_round_trip(scripted):
    c = scripted.anthropic("tools-a")
    first = [{"role": "user", "content": "what is here?"}]
    m1 = await c.messages.create(model="m", max_tokens=64, tools=[BASH], messages=first)
    assert m1.stop_reason == "tool_use"
    assert [b.type for b in m1.content] == ["text", "tool_use"]
    assert m1.content[0].text == "Let me look."
    use = m1.content[1]
    assert (use.name, use.input) == ("bash", {"cmd": "ls -l"}) and use.id.startswith("toolu_")
    history = [
        *first,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m1.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "-rw-r--r-- 1 a.txt"}
            ],
        },
    ]
    async with c.messages.stream(model="m", max_tokens=64, tools=[BASH], messages=history) as s:
        m2 = await s.get_final_message()
    assert m2.stop_reason == "end_turn" and m2.content[0].text == "There is one file."
    await c.close()
    # The tool's result was rendered after the sampled ids, as Qwen3 shows tool results.
    second_prompt = scripted.client.calls[1][0]
    first_prompt, first_out = scripted.client.calls[0][0], scripted.client.calls[0][1]
    assert second_prompt[: len(first_prompt) + len(first_out.token_ids)] == (
        first_prompt + first_out.token_ids
    )
    tail = TOK.decode(second_prompt[len(first_prompt) + len(first_out.token_ids) :])
    assert tail.startswith("\n<|im_start|>user\n<tool_response>\n-rw-r--r-- 1 a.txt\n")
    system = TOK.decode(first_prompt).split("<|im_end|>")[0]
    assert '"name": "bash"' in system and "# Tools" in system
    result = await scripted.finish("tools-a", reward=1.0)
    assert result["plans"] == {"new": 1, "extend": 1, "retry": 0}
    (traj,) = scripted.written
    assert [t.token_span[1] - t.token_span[0] for t in traj.turns] == [
        len(first_out.token_ids),
        len(scripted.client.calls[1][1].token_ids),
    ]
    assert set(traj.policy_version) == {None, 7}
    assert traj.turns[0].env_messages == [{"role": "tool", "content": "-rw-r--r-- 1 a.txt"}]


async def test_openai_tool_calls_streamed_round_trip(scripted):
    c = scripted.openai("tools-o")
    first = [{"role": "user", "content": "what is here?"}]
    stream = await c.chat.completions.create(
        model="m", tools=[OPENAI_BASH], messages=first, stream=True
    )
    calls: dict[int, dict] = {}
    text, finish = "", None
    async for chunk in stream:
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for tc in delta.tool_calls or []:
            got = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            got["id"] += tc.id or ""
            got["name"] += tc.function.name or ""
            got["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and text == "Let me look."
    assert calls[0]["name"] == "bash" and json.loads(calls[0]["arguments"]) == {"cmd": "ls -l"}
    history = [
        *first,
        {
            "role": "assistant",
            "content": text,
            "tool_calls": [
                {
                    "id": calls[0]["id"],
                    "type": "function",
                    "function": {"name": "bash", "arguments": calls[0]["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "a.txt"},
    ]
    r = await c.chat.completions.create(model="m", tools=[OPENAI_BASH], messages=history)
    assert r.choices[0].message.content == "There is one file."
    assert r.choices[0].finish_reason == "stop"
    await c.close()
    result = await scripted.finish("tools-o", reward=0.5)
    assert result["plans"] == {"new": 1, "extend": 1, "retry": 0}


async def test_open_rollouts_and_waiting_requests_are_capped_and_refusals_keep_no_state():
    gate = asyncio.Event()
    cfg = MiddlewareConfig(port=0, max_rollouts=1, max_waiting_requests=0)
    async with scripted_front(Scripted(["one", "two"], gate), cfg) as front:
        msgs = [{"role": "user", "content": "x"}]
        a, b, a2 = front.anthropic("cap-a"), front.anthropic("cap-b"), front.openai("cap-a")
        first = asyncio.create_task(a.messages.create(model="m", max_tokens=8, messages=msgs))
        await asyncio.wait_for(front.script.arrived.wait(), 30)  # cap-a holds its lock
        # one rollout is open (pending its first turn): a new key is refused, creating nothing
        with pytest.raises(anthropic.RateLimitError, match="max_rollouts=1"):
            await b.messages.create(model="m", max_tokens=8, messages=msgs)
        # cap-a's second request would wait behind its first: max_waiting_requests=0 refuses it
        with pytest.raises(openai.RateLimitError, match="max_waiting_requests=0"):
            await a2.chat.completions.create(model="m", messages=msgs)
        assert set(front.middleware.rollouts) == {"cap-a"}
        gate.set()
        assert (await first).content[0].text == "one"
        assert await front.metric('simloop_middleware_refused_total{reason="max_rollouts"}') == 1
        assert (
            await front.metric('simloop_middleware_refused_total{reason="max_waiting_requests"}')
            == 1
        )
        assert await front.metric("simloop_middleware_rollouts_open") == 1
        await front.finish("cap-a", reward=1.0)
        assert front.middleware.rollouts == {}
        assert await front.metric('simloop_middleware_rollouts_finished_total{status="ok"}') == 1
        m = await b.messages.create(model="m", max_tokens=8, messages=msgs)
        assert m.content[0].text == "two"  # room again
        for c in (a, b, a2):
            await c.close()


async def test_the_admin_listener_on_tcp_still_needs_its_token():
    cfg = MiddlewareConfig(port=0, admin_port=0, admin_token="configured-secret")
    async with scripted_front(Scripted(["done"]), cfg) as front:
        where = front.where
        assert where.admin_socket is None and where.admin_url.startswith("http://127.0.0.1:")
        assert where.admin_url != front.url and where.admin_token == "configured-secret"
        c = front.anthropic("tcp-1")
        await c.messages.create(
            model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}]
        )
        await c.close()
        finish = f"{where.admin_url}/rollouts/tcp-1/finish"
        token = {"Authorization": "Bearer configured-secret"}
        async with aiohttp.ClientSession() as http:
            for headers in ({}, {"Authorization": "Bearer tcp-1"}):
                async with http.post(finish, json={"reward": 1.0}, headers=headers) as r:
                    assert r.status == 401
            async with http.post(finish, json={"reward": 0.5}, headers=token) as r:
                assert r.status == 200 and (await r.json())["trajectories"] == 1
        assert front.written[-1].reward == 0.5
