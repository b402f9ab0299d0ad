"""The async client: parsing simloop and vLLM shapes, retry policy, timeouts, cancellation,
and real requests against a simloop server on 127.0.0.1."""

import asyncio
import copy
import json
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp import web
from flax import nnx

from rl.data import ByteTokenizer
from rl.model import Qwen3, tiny
from serving.client import (
    BadAnswer,
    ClientConfig,
    ClientError,
    ClientTimeout,
    InferenceClient,
    parse_completion_response,
)
from serving.config import EngineConfig, ServerConfig
from serving.engine import Engine
from serving.server import Server

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_parses_vllm_completion_with_token_ids_and_logprobs():
    raw = json.loads((FIXTURES / "vllm_completion.json").read_text())
    first, second = parse_completion_response(raw)
    assert first.token_ids == [27, 689, 1851, 151645] and first.finish_reason == "stop"
    assert first.logprobs == [-0.2, -0.05, -0.3, -0.1]
    assert first.prompt_token_ids == [151644, 872, 198]
    assert first.weight_version is None and first.token_versions is None  # vLLM sends none
    assert second.finish_reason == "length" and second.top_logprobs[2] == {}


def test_parses_vllm_chat_with_top_level_prompt_ids():
    raw = json.loads((FIXTURES / "vllm_chat.json").read_text())
    (out,) = parse_completion_response(raw)
    assert out.text == "```bash\nls\n```" and out.token_ids == [73594, 46216, 151645]
    assert out.prompt_token_ids == [151644, 872, 198, 1] and out.cached_tokens == 8
    assert out.logprobs == [-0.5, -0.01] and out.top_logprobs[0] == {"```": -0.5, "I": -1.2}


def test_response_without_token_ids_is_a_clear_error():
    raw = {"choices": [{"index": 0, "text": "x", "finish_reason": "stop"}]}
    with pytest.raises(ClientError, match="return_token_ids"):
        parse_completion_response(raw)


# ----- a scripted HTTP peer on 127.0.0.1 ----------------------------------------------------


class Scripted:
    """Answers /v1/completions from a list of (status, body) and counts attempts."""

    def __init__(self, script, delay_s=0.0):
        self.script, self.delay_s, self.calls, self.cancelled = list(script), delay_s, 0, 0

    async def handle(self, request):
        self.calls += 1
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        status, body = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        return web.json_response(body, status=status)


@pytest_asyncio.fixture
async def serve_app():
    """Serves an aiohttp app on 127.0.0.1 for the test; -> its root URL."""
    runners = []

    async def start(app: web.Application) -> str:
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    yield start
    for r in runners:
        await r.cleanup()


@pytest_asyncio.fixture
async def scripted_server(serve_app):
    async def start(script, delay_s=0.0):
        peer = Scripted(script, delay_s)
        app = web.Application()
        app.router.add_post("/v1/completions", peer.handle)
        return peer, await serve_app(app)

    return start


OK_BODY = json.loads((FIXTURES / "vllm_completion.json").read_text())
OK_BODY["choices"] = [c for c in OK_BODY["choices"] if c["index"] == 0]
ERROR = {"error": {"message": "boom", "type": "server_error", "param": None, "code": None}}


async def test_retries_5xx_and_429_then_succeeds(scripted_server):
    peer, url = await scripted_server([(503, ERROR), (429, ERROR), (200, OK_BODY)])
    async with InferenceClient(ClientConfig(url, backoff_s=0.01)) as client:
        out = await client.complete([1, 2], max_tokens=4)
    assert peer.calls == 3 and out.attempts == 3 and out.token_ids == [27, 689, 1851, 151645]


async def test_other_4xx_is_not_retried(scripted_server):
    bad = {
        "error": {
            "message": "'top_p'=2 is invalid",
            "type": "invalid_request_error",
            "param": "top_p",
            "code": None,
        }
    }
    peer, url = await scripted_server([(400, bad)])
    async with InferenceClient(ClientConfig(url, backoff_s=0.01)) as client:
        with pytest.raises(ClientError, match="400.*top_p") as info:
            await client.complete([1], max_tokens=4, top_p=2)
    assert peer.calls == 1 and info.value.status == 400 and not info.value.retryable


async def test_an_answer_without_the_logprobs_asked_for_is_an_error(scripted_server, serve_app):
    none = copy.deepcopy(OK_BODY)
    none["choices"][0]["logprobs"] = None
    short = copy.deepcopy(OK_BODY)
    short["choices"][0]["logprobs"]["token_logprobs"] = [-0.2, -0.05, -0.3]
    peer, url = await scripted_server([(200, none), (200, none), (200, short)])
    async with InferenceClient(ClientConfig(url, backoff_s=0.01)) as client:
        assert (await client.complete([1], max_tokens=4)).logprobs is None  # none asked for
        with pytest.raises(
            BadAnswer,
            match=r"without the logprobs asked for \(logprobs=0\): "
            "choice 0 has no logprobs for 4 tokens",
        ) as info:
            await client.complete([1], max_tokens=4, logprobs=0)
        assert not info.value.retryable and peer.calls == 2  # the same answer again: not retried
        with pytest.raises(BadAnswer, match="choice 0 has 3 logprobs for 4 tokens"):
            await client.complete([1], max_tokens=4, logprobs=2)
    # Chat: one logprob per token too (the chat fixture has 2 for its 3 tokens).
    chat = json.loads((FIXTURES / "vllm_chat.json").read_text())

    async def answer(request):
        return web.json_response(chat)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    async with InferenceClient(ClientConfig(await serve_app(app))) as client:
        assert (await client.chat([{"role": "user", "content": "hi"}], max_tokens=3)).token_ids
        with pytest.raises(BadAnswer, match=r"\(logprobs=true\): choice 0 has 2 logprobs for 3"):
            await client.chat([{"role": "user", "content": "hi"}], max_tokens=3, logprobs=True)


async def test_gives_up_after_max_retries(scripted_server):
    peer, url = await scripted_server([(500, ERROR)])
    async with InferenceClient(ClientConfig(url, backoff_s=0.01, max_retries=2)) as client:
        with pytest.raises(ClientError, match="500: boom") as info:
            await client.complete([1], max_tokens=4)
    assert peer.calls == 3 and info.value.attempts == 3


async def test_connection_refused_is_retried_then_reported():
    async with InferenceClient(
        ClientConfig("http://127.0.0.1:9", backoff_s=0.01, max_retries=2)
    ) as client:
        with pytest.raises(ClientError, match="Connect") as info:
            await client.complete([1], max_tokens=4)
    assert info.value.attempts == 3 and info.value.status is None


async def test_backoff_is_full_jitter_capped_at_max_backoff(scripted_server):
    peer, url = await scripted_server([(503, ERROR)])
    sleeps = []

    async def record(seconds):
        sleeps.append(seconds)

    cfg = ClientConfig(url, backoff_s=1.0, max_backoff_s=3.0, max_retries=4)
    async with InferenceClient(cfg, sleep=record) as client:
        with pytest.raises(ClientError, match="503: boom") as info:
            await client.complete([1], max_tokens=4)
    assert peer.calls == 5 and info.value.attempts == 5 and len(sleeps) == 4
    assert all(0 <= s <= cap for s, cap in zip(sleeps, [1, 2, 3, 3], strict=True)), sleeps


async def test_timeout_is_not_retried(scripted_server):
    peer, url = await scripted_server([(200, OK_BODY)], delay_s=5.0)
    async with InferenceClient(ClientConfig(url, timeout_s=0.3)) as client:
        with pytest.raises(ClientTimeout, match="within 0.3s"):
            await client.complete([1], max_tokens=4)
    assert peer.calls == 1 and not ClientTimeout("x").retryable
    assert isinstance(ClientTimeout("x"), TimeoutError)


async def test_cancelling_a_call_cancels_the_server_handler(scripted_server):
    peer, url = await scripted_server([(200, OK_BODY)], delay_s=5.0)
    async with InferenceClient(ClientConfig(url)) as client:
        task = asyncio.create_task(client.complete([1], max_tokens=4), name="doomed")
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(50):
            if peer.cancelled:
                break
            await asyncio.sleep(0.05)
    assert peer.cancelled == 1


async def test_a_session_call_is_retried_only_from_its_turn_boundary(serve_app):
    # A session peer whose generate answers 502 while `failures` lasts (as when an answer was
    # lost after the server appended), then 200; the client must rewind before every retry.
    calls, failures, rewind_answers = [], [0], []

    async def generate(request):
        calls.append(("generate", (await request.json())["append_token_ids"]))
        if failures[0] > 0:
            failures[0] -= 1
            return web.json_response(ERROR, status=502)
        return web.json_response({"text": "ok", "token_ids": [7, 8], "finish_reason": "stop"})

    async def rewind(request):
        calls.append(("rewind", (await request.json())["to"]))
        status, body = rewind_answers.pop(0) if rewind_answers else (200, {"id": "s"})
        return web.json_response(body, status=status)

    app = web.Application()
    app.router.add_post("/v1/sessions/s/generate", generate)
    app.router.add_post("/v1/sessions/s/rewind", rewind)
    url = await serve_app(app)
    async with InferenceClient(ClientConfig(url, backoff_s=0.01)) as client:
        failures[0] = 1
        with pytest.raises(ClientError, match="502"):  # no boundary given: never retried
            await client.session_generate("s", [1, 2], max_tokens=4)
        assert calls == [("generate", [1, 2])]
        calls.clear()
        failures[0] = 2
        out = await client.session_generate("s", [3], max_tokens=4, rewind_to=40)
        assert out.token_ids == [7, 8] and out.attempts == 3
        assert calls == [
            ("generate", [3]),
            ("rewind", 40),
            ("generate", [3]),
            ("rewind", 40),
            ("generate", [3]),
        ]
        # The server forgot the session meanwhile: the rewind's 404 is the caller's (it
        # reopens), and nothing is appended to a session that is not there.
        calls.clear()
        failures[0] = 1
        rewind_answers.append((404, {"error": {"message": "session 's' does not exist"}}))
        with pytest.raises(ClientError, match="404") as info:
            await client.session_generate("s", [4], max_tokens=4, rewind_to=43)
        assert info.value.status == 404
        assert calls == [("generate", [4]), ("rewind", 43)]


# ----- against a real simloop server ------------------------------------------------------


@pytest_asyncio.fixture
async def simloop_url():
    tok = ByteTokenizer()
    engine = Engine(
        Qwen3(tiny(), rngs=nnx.Rngs(0)),
        tok,
        EngineConfig(num_slots=4, max_seq_len=128, prefill_chunk=32),
    )
    await engine.start()
    runner = web.AppRunner(
        Server(engine, tok, ServerConfig(model_name="tiny")).app(), handler_cancellation=True
    )
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", engine
    await runner.cleanup()
    await engine.stop()


async def test_round_trip_with_a_simloop_server(simloop_url):
    url, engine = simloop_url
    async with InferenceClient(ClientConfig(url, model="tiny")) as client:
        await client.wait_healthy(timeout_s=10)
        assert await client.models() == ["tiny"]
        prompt = ByteTokenizer().encode("hello")
        out = await client.complete(prompt, max_tokens=6, temperature=0, logprobs=2)
        assert len(out.token_ids) == len(out.logprobs) == len(out.token_versions) == 6
        assert out.prompt_token_ids == prompt and out.weight_version == 0
        assert out.finish_reason == "length"
        again = await client.complete(prompt, max_tokens=6, temperature=0)
        assert again.token_ids == out.token_ids
        many = await client.complete_n(prompt, n=3, max_tokens=4, temperature=1.0, seed=1)
        assert len(many) == 3 and len({tuple(m.token_ids) for m in many}) > 1
        chat = await client.chat(
            [{"role": "user", "content": "hi"}], max_tokens=3, enable_thinking=False, logprobs=True
        )
        assert len(chat.token_ids) == 3 and len(chat.logprobs) == 3
        with pytest.raises(ClientError) as info:
            await client.complete([10_000], max_tokens=2)
        assert info.value.status == 400 and info.value.attempts == 1
