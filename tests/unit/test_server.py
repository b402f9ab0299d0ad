"""The HTTP server over real sockets: `run_server` on 127.0.0.1 (port 0) in front of a tiny
engine, driven by the official `openai` client and by raw aiohttp requests. Covers completions
and chat (logprobs, SSE streaming equal to the non-streamed text), /v1/models, /health,
/metrics, OpenAI-shaped errors for every bad input, the body size limit, the admin routes
(token, checkpoint root, reload), client disconnects and `return_token_ids`.
"""

import asyncio
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from flax import nnx
from openai import AsyncOpenAI, BadRequestError, NotFoundError

from rl.data import ByteTokenizer
from rl.data.chat import ChatRenderer
from rl.model import Qwen3, tiny
from rl.model.params_io import save_params
from serving.config import ServerConfig
from serving.engine import Engine, EngineConfig, SamplingParams
from serving.server import Server, background_server
from tests.fakes import StepGate, wait_until

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOK = ByteTokenizer()
NAME = "tiny-test"
TOKEN = "admin-token-for-tests"
SEQ = 512
ECFG = EngineConfig(num_slots=8, max_seq_len=SEQ, prefill_chunk=32, prefill_batch=2)


def make_model(seed: int = 0, **overrides) -> Qwen3:
    # A wider init than tiny()'s default: at 0.02 greedy output is one repeated byte.
    return Qwen3(tiny(initializer_range=0.3, **overrides), rngs=nnx.Rngs(seed))


@dataclass
class Served:
    engine: Engine
    url: str
    root: Path
    """--checkpoint-root"""
    outside: Path
    """A directory beside the root holding a valid checkpoint (`v1`)."""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    outside = tmp_path_factory.mktemp("elsewhere")
    save_params(make_model(1), outside / "v1")
    engine = Engine(make_model(0), TOK, ECFG)
    cfg = ServerConfig(
        host="127.0.0.1",
        port=0,
        model_name=NAME,
        admin_token=TOKEN,
        checkpoint_root=str(root),
        shutdown_timeout_s=5.0,
    )
    async with background_server(engine, TOK, cfg, start_timeout_s=180) as url:
        yield Served(engine, url, root, outside)
    assert not engine.running


@pytest_asyncio.fixture(loop_scope="module")
async def http(served):
    async with aiohttp.ClientSession(base_url=served.url) as session:
        yield session


@pytest_asyncio.fixture(loop_scope="module")
async def client(served):
    async with AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


async def sse(http: aiohttp.ClientSession, path: str, body: dict) -> list[dict]:
    """The data chunks of a streamed response (after checking it ends with [DONE])."""
    async with http.post(path, json=body) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = await r.text()
    data = [line[len("data: ") :] for line in raw.split("\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def streamed_texts(chunks: list[dict], chat: bool) -> tuple[dict[int, str], dict[int, str]]:
    """-> (text, finish_reason) per choice index."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            piece = c["delta"].get("content", "") if chat else c["text"]
            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
            if c["finish_reason"] is not None:
                assert c["index"] not in reasons
                reasons[c["index"]] = c["finish_reason"]
    return texts, reasons


async def assert_healthy(http: aiohttp.ClientSession) -> None:
    async with http.get("/health") as r:
        assert r.status == 200
        assert (await r.json())["status"] == "ok"


# ----- the openai client -------------------------------------------------------------------


async def test_openai_completions_with_logprobs(served, client):
    text = "ls -la /tmp"
    r = await client.completions.create(
        model=NAME,
        prompt=text,
        max_tokens=12,
        temperature=0,
        logprobs=3,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    (ref,) = await served.engine.generate(TOK.encode(text), greedy(12, ignore_eos=True))
    (c,) = r.choices
    assert r.model == NAME and r.object == "text_completion"
    assert c.finish_reason == "length"
    assert c.text == ref.text
    assert c.token_ids == ref.token_ids
    assert r.usage.prompt_tokens == len(TOK.encode(text)) and r.usage.completion_tokens == 12
    lp = c.logprobs
    assert lp.tokens == [TOK.decode([t]) for t in ref.token_ids]
    assert lp.token_logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    assert len(lp.top_logprobs) == 12
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3  # keys are token texts: bytes >= 0x80 share one
        assert max(top.values()) <= chosen + 1e-6  # greedy: the best token
        if len(top) == 3:
            assert max(top.values()) == pytest.approx(chosen, abs=1e-6)
    assert r.model_extra["weight_version"] == served.engine.version


async def test_openai_chat_with_logprobs(served, client):
    messages = [
        {"role": "system", "content": "You run commands."},
        {"role": "user", "content": "list the files"},
    ]
    r = await client.chat.completions.create(
        model=NAME,
        messages=messages,
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    ids = ChatRenderer(TOK).render(messages, add_generation_prompt=True)
    (ref,) = await served.engine.generate(ids, greedy(10))
    (c,) = r.choices
    assert r.object == "chat.completion"
    assert c.message.role == "assistant" and c.message.content == ref.text
    assert c.finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(ref.token_ids) == len(c.logprobs.content)
    for entry, tok, lp in zip(c.logprobs.content, ref.token_ids, ref.logprobs, strict=True):
        assert entry.token == TOK.decode([tok])
        assert entry.logprob == pytest.approx(lp, abs=1e-5)
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert values[0] == pytest.approx(entry.logprob, abs=1e-6)


@pytest.mark.parametrize("text", ["echo hello", "cat /etc/passwd | wc -l", "x"])
async def test_openai_streaming_equals_non_streaming(client, text):
    kw = dict(model=NAME, prompt=text, max_tokens=24, temperature=0)
    whole = await client.completions.create(**kw)
    pieces, reasons = [], []
    async for chunk in await client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            pieces.append(c.text)
            reasons.append(c.finish_reason)
    assert "".join(pieces) == whole.choices[0].text
    assert [r for r in reasons if r] == [whole.choices[0].finish_reason]

    messages = [{"role": "user", "content": text}]
    kw = dict(model=NAME, messages=messages, max_tokens=24, temperature=0)
    whole = await client.chat.completions.create(**kw)
    pieces, reasons = [], []
    async for chunk in await client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert "".join(pieces) == whole.choices[0].message.content
    assert [r for r in reasons if r] == [whole.choices[0].finish_reason]


async def test_openai_chat_streaming_with_logprobs(client):
    kw = dict(
        model=NAME,
        messages=[{"role": "user", "content": "pwd"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    whole = await client.chat.completions.create(**kw)
    entries = []
    async for chunk in await client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            if c.logprobs is not None:
                entries += c.logprobs.content
    want = whole.choices[0].logprobs.content
    assert [e.token for e in entries] == [e.token for e in want]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in want], abs=1e-5)
    assert all(len(e.top_logprobs) == 2 for e in entries)


# ----- streaming details (raw SSE) ---------------------------------------------------------


def _printable(tok: int) -> bool:
    return 33 <= tok < 127


async def test_streamed_text_equals_the_final_text_with_stops(http):
    base = {"prompt": "grep -rn TODO src/", "max_tokens": 40, "temperature": 0}
    async with http.post(
        "/v1/completions", json={**base, "ignore_eos": True, "return_token_ids": True}
    ) as r:
        ids = (await r.json())["choices"][0]["token_ids"]
    j = next(i for i in range(3, 38) if _printable(ids[i]) and _printable(ids[i + 1]))
    variants = [
        {"stop_token_ids": [ids[6]]},  # a stop token: not in the text
        {"stop": [TOK.decode(ids[j : j + 2])]},  # a stop string: cut from the text
        {"stop": ["\x01\x02\x03", TOK.decode(ids[j : j + 2])]},
        {"stop_token_ids": [ids[2]], "stop": [TOK.decode(ids[j : j + 2])]},
    ]
    for extra in variants:
        body = {**base, **extra}
        async with http.post("/v1/completions", json=body) as r:
            (want,) = (await r.json())["choices"]
        assert want["finish_reason"] == "stop", extra
        chunks = await sse(http, "/v1/completions", {**body, "stream": True})
        texts, reasons = streamed_texts(chunks, chat=False)
        assert texts == {0: want["text"]}, extra
        assert reasons == {0: "stop"}

        chat = {"messages": [{"role": "user", "content": base["prompt"]}], **body}
        del chat["prompt"]
        async with http.post("/v1/chat/completions", json=chat) as r:
            (want,) = (await r.json())["choices"]
        texts, reasons = streamed_texts(
            await sse(http, "/v1/chat/completions", {**chat, "stream": True}), chat=True
        )
        assert texts == {0: want["message"]["content"]}, extra
        assert reasons == {0: want["finish_reason"]}


async def test_streaming_n_seeded_samples(http):
    body = {
        "prompt": "make test",
        "max_tokens": 20,
        "temperature": 1.0,
        "seed": 5,
        "n": 3,
        "return_token_ids": True,
    }
    async with http.post("/v1/completions", json=body) as r:
        whole = await r.json()
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    chunks = await sse(http, "/v1/completions", {**body, **usage})
    texts, reasons = streamed_texts(chunks, chat=False)
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert reasons == {c["index"]: c["finish_reason"] for c in whole["choices"]}
    finals = [c for ch in chunks for c in ch["choices"] if c["finish_reason"]]
    assert sorted(c["index"] for c in finals) == [0, 1, 2]
    for c in finals:  # token ids ride on the last chunk of each choice
        assert c["token_ids"] == whole["choices"][c["index"]]["token_ids"]
    assert chunks[-1]["choices"] == []
    streamed_usage = dict(chunks[-1]["usage"])  # cached tokens differ: the prompt is warm now
    assert streamed_usage.pop("prompt_tokens_details")["cached_tokens"] > 0
    assert streamed_usage == {
        k: v for k, v in whole["usage"].items() if k != "prompt_tokens_details"
    }


# ----- small routes ----------------------------------------------------------------------------


async def test_models_and_health(served, http, client):
    models = await client.models.list()
    assert [m.id for m in models.data] == [NAME]
    async with http.get("/v1/models") as r:
        (m,) = (await r.json())["data"]
    assert m["max_model_len"] == SEQ and m["object"] == "model"
    async with http.get("/health") as r:
        assert r.status == 200
        assert await r.json() == {"status": "ok", "weight_version": served.engine.version}


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


async def test_metrics(http):
    async def scrape() -> str:
        async with http.get("/metrics") as r:
            assert r.status == 200 and r.content_type == "text/plain"
            return await r.text()

    before = await scrape()
    completed = 0
    for i in range(2):
        body = {"prompt": f"job {i}", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        async with http.post("/v1/completions", json=body) as r:
            assert r.status == 200
            completed += (await r.json())["usage"]["completion_tokens"]
    await sse(
        http,
        "/v1/completions",
        {"prompt": "job", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True},
    )
    completed += 5
    async with http.post("/v1/completions", json={"prompt": ""}) as r:
        assert r.status == 400
    after = await scrape()

    ok = 'simloop_requests_total{endpoint="/v1/completions",status="200"}'
    bad = 'simloop_requests_total{endpoint="/v1/completions",status="400"}'
    assert _metric(after, ok) - (_metric(before, ok) if ok in before else 0) == 3
    assert _metric(after, bad) - (_metric(before, bad) if bad in before else 0) == 1
    gen = "simloop_generated_tokens_total"
    assert _metric(after, gen) - _metric(before, gen) == completed
    assert _metric(after, "simloop_queue_depth") == 0
    assert _metric(after, "simloop_slots_active") == 0
    assert _metric(after, "simloop_slots_total") == ECFG.num_slots
    lat = "simloop_request_latency_seconds"
    assert _metric(after, f"{lat}_count") - _metric(before, f"{lat}_count") == 3
    assert _metric(after, f'{lat}_bucket{{le="+Inf"}}') == _metric(after, f"{lat}_count")
    for name in [
        "simloop_requests_total",
        "simloop_generated_tokens_total",
        "simloop_queue_depth",
        "simloop_slots_active",
        lat,
    ]:
        assert f"# TYPE {name} " in after


# ----- bad input ---------------------------------------------------------------------------------

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]

BAD = [
    # (id, path, body (dict, or raw bytes), status, param)
    ("unknown-model", CMPL, {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("unknown-model-chat", CHAT, {"model": "gpt-4", "messages": MSGS}, 404, "model"),
    ("empty-prompt", CMPL, {"prompt": ""}, 400, "prompt"),
    ("empty-prompt-list", CMPL, {"prompt": []}, 400, "prompt"),
    ("no-prompt", CMPL, {"max_tokens": 3}, 400, "prompt"),
    ("id-too-large", CMPL, {"prompt": [1, 2, 512]}, 400, "prompt"),
    ("id-past-tokenizer", CMPL, {"prompt": [1, TOK.vocab_size]}, 400, "prompt"),
    ("id-negative", CMPL, {"prompt": [5, -1]}, 400, "prompt"),
    ("max-tokens-zero", CMPL, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max-tokens-negative", CMPL, {"prompt": "hi", "max_tokens": -4}, 400, "max_tokens"),
    ("max-tokens-beyond-context", CMPL, {"prompt": "hi", "max_tokens": SEQ - 1}, 400,
     "max_tokens"),
    ("max-completion-tokens-zero", CHAT, {"messages": MSGS, "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("chat-max-tokens-beyond-context", CHAT, {"messages": MSGS, "max_tokens": SEQ}, 400,
     "max_tokens"),
    ("temperature-negative", CMPL, {"prompt": "hi", "temperature": -0.1}, 400, "temperature"),
    ("top-p-zero", CMPL, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("top-p-above-one", CMPL, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("top-p-chat", CHAT, {"messages": MSGS, "top_p": 0}, 400, "top_p"),
    ("prompt-too-long", CMPL, {"prompt": "a" * SEQ}, 400, "prompt"),
    ("ids-too-long", CMPL, {"prompt": [97] * (SEQ + 5)}, 400, "prompt"),
    ("chat-too-long", CHAT, {"messages": [{"role": "user", "content": "a" * SEQ}]}, 400,
     "prompt"),
    ("malformed-json", CMPL, b'{"prompt": "hi", "max_tokens": ', 400, None),
    ("not-utf8", CMPL, b'{"prompt": "\xff\xfe"}', 400, None),
    ("body-not-object", CMPL, [1, 2, 3], 400, None),
    ("max-tokens-string", CMPL, {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("max-tokens-float", CMPL, {"prompt": "hi", "max_tokens": 5.5}, 400, "max_tokens"),
    ("temperature-string", CMPL, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("temperature-nan", CMPL, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("top-p-infinity", CMPL, b'{"prompt": "hi", "top_p": Infinity}', 400, "top_p"),
    ("stream-string", CMPL, {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("n-zero", CMPL, {"prompt": "hi", "n": 0}, 400, "n"),
    ("seed-string", CMPL, {"prompt": "hi", "seed": "x"}, 400, "seed"),
    ("logprobs-over-max", CMPL, {"prompt": "hi", "logprobs": ECFG.max_top_logprobs + 1}, 400,
     "logprobs"),
    ("top-logprobs-over-max", CHAT, {"messages": MSGS, "logprobs": True,
                                     "top_logprobs": ECFG.max_top_logprobs + 1}, 400,
     "top_logprobs"),
    ("stop-empty", CMPL, {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("stop-token-ids-strings", CMPL, {"prompt": "hi", "stop_token_ids": ["a"]}, 400,
     "stop_token_ids"),
    ("messages-not-list", CHAT, {"messages": "hello"}, 400, "messages"),
    ("messages-empty", CHAT, {"messages": []}, 400, "messages"),
    ("unknown-role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0]"),
    ("content-not-string", CHAT, {"messages": [{"role": "user", "content": 3}]}, 400,
     "messages[0].content"),
    ("message-not-object", CHAT, {"messages": ["hi"]}, 400, "messages[0]"),
    ("enable-thinking-string", CHAT, {"messages": MSGS,
                                      "chat_template_kwargs": {"enable_thinking": "no"}}, 400,
     "chat_template_kwargs.enable_thinking"),
    # Used to be taken and ignored: a wrong type read as true, parameters that change sampling.
    ("include-usage-nan", CMPL, b'{"prompt": "hi", "stream_options": {"include_usage": NaN}}',
     400, "stream_options.include_usage"),
    ("logit-bias", CMPL, {"prompt": "hi", "logit_bias": {"104": 100}}, 400, "logit_bias"),
    ("best-of", CMPL, {"prompt": "hi", "best_of": 4}, 400, "best_of"),
    ("suffix", CMPL, {"prompt": "hi", "suffix": "end"}, 400, "suffix"),
    ("tools", CHAT, {"messages": MSGS, "tools": [{"type": "function",
                                                  "function": {"name": "ls"}}]}, 400, "tools"),
    ("response-format", CHAT, {"messages": MSGS, "response_format": {"type": "json_object"}},
     400, "response_format"),
]  # fmt: skip


@pytest.mark.parametrize("path,body,status,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
async def test_bad_input_gets_an_openai_error_naming_the_field(http, path, body, status, param):
    if isinstance(body, bytes):
        request = http.post(path, data=body, headers={"Content-Type": "application/json"})
    else:
        request = http.post(path, json=body)
    async with request as r:
        assert r.status == status, await r.text()
        err = await r.json()
    assert set(err) == {"error"}
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["param"] == param
    assert isinstance(err["error"]["message"], str) and err["error"]["message"]
    if param is not None:
        assert param.split(".")[-1].split("[")[0] in err["error"]["message"]
    expected_type = "not_found_error" if status == 404 else "invalid_request_error"
    assert err["error"]["type"] == expected_type
    await assert_healthy(http)


async def test_openai_client_sees_the_errors(client, http):
    with pytest.raises(NotFoundError) as e:
        await client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert e.value.body["param"] == "model"
    with pytest.raises(BadRequestError) as e:
        await client.completions.create(model=NAME, prompt="hi", max_tokens=2, top_p=1.5)
    assert e.value.body["param"] == "top_p"
    await assert_healthy(http)


async def test_unknown_routes_and_methods(http):
    async with http.get("/v1/nothing") as r:
        assert r.status == 404
        assert set((await r.json())["error"]) == {"message", "type", "param", "code"}
    async with http.get("/v1/completions") as r:
        assert r.status == 405
        assert "error" in await r.json()
    await assert_healthy(http)


async def test_body_over_the_size_limit_is_413(served):
    small = Server(served.engine, TOK, ServerConfig(model_name=NAME, max_body_bytes=1024))
    runner = web.AppRunner(small.app(), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as http:
            big = {"prompt": "a" * 2000, "max_tokens": 2}
            async with http.post("/v1/completions", json=big) as r:
                assert r.status == 413
                err = (await r.json())["error"]
            assert "1024" in err["message"] and err["type"] == "invalid_request_error"
            ok = {"prompt": "a" * 500, "max_tokens": 2}
            async with http.post("/v1/completions", json=ok) as r:
                assert r.status == 200
            await assert_healthy(http)
    finally:
        await runner.cleanup()


# ----- admin -------------------------------------------------------------------------------------


def _auth(token: str = TOKEN) -> dict:
    return {"Authorization": f"Bearer {token}"}


async def _admin_error(http, body, status, token=TOKEN):
    headers = _auth(token) if token else {}
    async with http.post("/admin/load_weights", json=body, headers=headers) as r:
        assert r.status == status, await r.text()
        return (await r.json())["error"]


async def test_admin_requires_the_token(served, http):
    version = served.engine.version
    body = {"path": "v1", "version": version + 1}
    for token in [None, "wrong-token-value", TOKEN + "x", ""]:
        err = await _admin_error(http, body, 401, token=token)
        assert err["type"] == "authentication_error"
    async with http.get("/admin/version") as r:
        assert r.status == 401
    async with http.get("/admin/version", headers={"Authorization": TOKEN}) as r:
        assert r.status == 401  # not a bearer header
    async with http.get("/admin/version", headers=_auth()) as r:
        assert r.status == 200 and await r.json() == {"version": version}
    assert served.engine.version == version


async def test_admin_refuses_paths_outside_the_root(served, http):
    version = served.engine.version
    link = served.root / "escape"
    if not link.exists():
        link.symlink_to(served.outside / "v1", target_is_directory=True)
    rel = os.path.relpath(served.outside / "v1", served.root)  # ../elsewhere.../v1
    assert rel.startswith("..")
    for path in [str(served.outside / "v1"), rel, "escape", "./escape/../../" + rel, "/etc", "/"]:
        err = await _admin_error(http, {"path": path, "version": version + 1}, 400)
        assert err["param"] == "path" and "outside" in err["message"], path
    err = await _admin_error(http, {"path": "missing", "version": version + 1}, 404)
    assert err["param"] == "path"
    err = await _admin_error(http, {"path": "", "version": version + 1}, 400)
    assert err["param"] == "path"
    assert served.engine.version == version


async def test_admin_refuses_another_architecture(served, http):
    version = served.engine.version
    if not (served.root / "shallow").exists():
        save_params(make_model(3, num_layers=1), served.root / "shallow")
    err = await _admin_error(http, {"path": "shallow", "version": version + 1}, 422)
    assert "architecture" in err["message"] and err["param"] == "path"
    err = await _admin_error(http, {"path": str(served.root), "version": version + 1}, 404)
    assert err["param"] == "path"  # the root itself holds no checkpoint
    err = await _admin_error(http, {"path": "shallow", "version": "7"}, 400)
    assert err["param"] == "version"
    assert served.engine.version == version
    await assert_healthy(http)


async def test_admin_load_weights_changes_outputs(served, http):
    body = {"prompt": "whoami", "max_tokens": 12, "temperature": 0, "ignore_eos": True}

    async def complete() -> dict:
        async with http.post("/v1/completions", json=body) as r:
            assert r.status == 200
            return await r.json()

    before = await complete()
    v = before["weight_version"]
    assert v == served.engine.version
    shutil.copytree(served.outside / "v1", served.root / f"copy-{v}")
    async with http.post(
        "/admin/load_weights", headers=_auth(), json={"path": f"copy-{v}", "version": v + 1}
    ) as r:
        assert r.status == 200, await r.text()
        assert (await r.json())["version"] == v + 1
    async with http.get("/admin/version", headers=_auth()) as r:
        assert await r.json() == {"version": v + 1}
    after = await complete()
    assert after["weight_version"] == v + 1
    assert after["choices"][0]["text"] != before["choices"][0]["text"]

    err = await _admin_error(http, {"path": f"copy-{v}", "version": v + 1}, 400)
    assert err["param"] == "version"  # not newer

    # Back to the original weights, by absolute path under the root.
    save_params(make_model(0), served.root / f"base-{v}")
    async with http.post(
        "/admin/load_weights",
        headers=_auth(),
        json={"path": str(served.root / f"base-{v}"), "version": v + 2},
    ) as r:
        assert r.status == 200, await r.text()
    restored = await complete()
    assert restored["weight_version"] == v + 2
    assert restored["choices"][0]["text"] == before["choices"][0]["text"]


# ----- disconnects -----------------------------------------------------------------------------


async def _read_lines_granting_steps(response, gate: StepGate, lines: int) -> None:
    """Read `lines` lines of a stream, granting the engine one step whenever it waits for one
    and the client still wants lines (tokens that end mid-character send no chunk, so how many
    steps that takes is not known in advance; a step or two too many is harmless)."""

    async def read():
        for _ in range(lines):
            assert await response.content.readline()

    reading = asyncio.create_task(read())
    while not reading.done():
        waits = asyncio.create_task(gate.engine_waits())
        await asyncio.wait({reading, waits}, return_when=asyncio.FIRST_COMPLETED)
        if waits.done():
            waits.result()
            gate.grant()
        else:
            waits.cancel()
    reading.result()


async def _disconnect(served, http, body: dict, read_chunks: int) -> None:
    engine = served.engine
    assert engine.active_slots == 0
    aborted, generated = engine.stats["aborted"], engine.stats["generated_tokens"]
    asked = asyncio.Event()  # the server asked the engine to abort (it saw the disconnect)

    def abort(request_id: str, real_abort=engine.abort) -> None:
        real_abort(request_id)
        asked.set()

    with pytest.MonkeyPatch.context() as mp:  # undone on exit: the engine is shared
        mp.setattr(engine, "abort", abort)
        gate = StepGate(engine, mp)
        try:
            if read_chunks:
                async with http.post("/v1/completions", json=body) as r:
                    await _read_lines_granting_steps(r, gate, read_chunks)
                # leaving the block closes the connection mid-stream, the engine held
            else:
                post = asyncio.create_task(
                    http.post(
                        "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=0.5)
                    )
                )
                await gate.engine_waits()  # the engine took the request, held before a step
                # ... and takes no step until the client gave up: its 0.5 s timeout fires
                # however fast the machine.
                with pytest.raises(asyncio.TimeoutError):
                    await post
            await asyncio.wait_for(asked.wait(), 60)
            # Held, the engine still has the request: the abort happens when it steps again.
            assert engine.active_slots > 0 and engine.stats["aborted"] == aborted
        finally:
            gate.open()
        assert await wait_until(lambda: engine.active_slots == 0, timeout_s=60.0)
    assert engine.stats["aborted"] == aborted + 1
    n, max_tokens = body.get("n", 1), body["max_tokens"]
    assert engine.stats["generated_tokens"] - generated < n * max_tokens


async def test_a_client_that_disconnects_aborts_its_request(served, http):
    body = {"prompt": "yes", "max_tokens": SEQ - 8, "n": 8, "ignore_eos": True}
    await _disconnect(served, http, body, read_chunks=0)
    await _disconnect(served, http, {**body, "stream": True}, read_chunks=6)
    await assert_healthy(http)


# ----- token ids ---------------------------------------------------------------------------------


async def test_return_token_ids(served, http):
    prompt = "tail -n 5 log.txt"
    body = {"prompt": prompt, "max_tokens": 9, "n": 2, "seed": 3, "return_token_ids": True}
    async with http.post("/v1/completions", json=body) as r:
        out = await r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for c in out["choices"]:
        assert c["prompt_token_ids"] == TOK.encode(prompt)
        assert 1 <= len(c["token_ids"]) <= 9
        assert len(c["token_versions"]) == len(c["token_ids"])
        assert set(c["token_versions"]) == {out["weight_version"]}
        if c["finish_reason"] == "length":
            assert len(c["token_ids"]) == 9 and c["text"] == TOK.decode(c["token_ids"])
    total = sum(len(c["token_ids"]) for c in out["choices"])
    assert out["usage"]["completion_tokens"] == total

    # Several prompts in one request: choice index = prompt index * n + sample index.
    body = {
        "prompt": [[1, 2, 3], "ab"],
        "max_tokens": 4,
        "n": 2,
        "temperature": 0,
        "return_token_ids": True,
    }
    async with http.post("/v1/completions", json=body) as r:
        out = await r.json()
    by_index = {c["index"]: c for c in out["choices"]}
    assert sorted(by_index) == [0, 1, 2, 3]
    assert by_index[0]["prompt_token_ids"] == [1, 2, 3] == by_index[1]["prompt_token_ids"]
    assert by_index[2]["prompt_token_ids"] == TOK.encode("ab") == by_index[3]["prompt_token_ids"]
    assert by_index[0]["token_ids"] == by_index[1]["token_ids"]  # greedy

    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "return_token_ids": True,
        "seed": 1,
    }
    async with http.post("/v1/chat/completions", json=chat) as r:
        out = await r.json()
    (c,) = out["choices"]
    ids = ChatRenderer(TOK).render(chat["messages"], add_generation_prompt=True)
    assert c["prompt_token_ids"] == ids
    assert len(c["token_versions"]) == len(c["token_ids"]) == out["usage"]["completion_tokens"]
