"""The HTTP server against hostile input, over real sockets: numbers that would overflow the
engine's int32 / float32 arrays, non-finite logprobs, errors after a stream started, slow and
idle clients, inputs that used to be 500s (lone surrogates, deep JSON, odd headers and paths,
broken checkpoints, bodies that do not decompress), answers that used to be plain text (HTTP
the parser refuses, errors outside the handlers, the connection cap's 503), a dying engine
loop, bounded shutdown, and a property-based test: for arbitrary JSON bodies the server
answers 2xx/4xx/429 only and keeps its greedy output.
"""

import asyncio
import dataclasses
import json
import logging
import math
import shutil
import socket
import time
from http.client import HTTPConnection
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launch.config.schema import SimloopConfig
from launch.jobs import serve as serve_job
from rl.model.params_io import save_params
from serving.config import INT32_MAX, ServerConfig
from serving.engine import Engine, EngineConfig, SequenceOutput
from serving.protocol import LOGPROB_FLOOR, chat_logprobs, completion_logprobs
from serving.server import EngineDied, RateLimitFilter, background_server, run_server
from tests.fakes import wait_until
from tests.unit.test_server import TOK, StepGate, assert_healthy, make_model

pytestmark = pytest.mark.asyncio(loop_scope="module")

NAME = "tiny-hostile"
TOKEN = "admin-token-for-tests"
CAP = 16
# default_max_tokens / max_tokens_cap keep arbitrary requests short; one prefill bucket and one
# decode shape keep the compiles of the extra engines below short.
ECFG = EngineConfig(
    num_slots=8,
    max_seq_len=256,
    prefill_chunk=16,
    prefill_batch=2,
    decode_steps=1,
    default_max_tokens=8,
    max_tokens_cap=8,
)
CFG = ServerConfig(
    host="127.0.0.1",
    port=0,
    model_name=NAME,
    admin_token=TOKEN,
    shutdown_timeout_s=5.0,
    header_timeout_s=0.5,
    body_timeout_s=0.5,
    idle_timeout_s=30.0,
    max_connections=CAP,
)
PROMPT = {"prompt": "ls -la", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    save_params(make_model(1), root / "good")
    engine = Engine(make_model(0), TOK, ECFG)
    cfg = dataclasses.replace(CFG, checkpoint_root=str(root))
    async with background_server(engine, TOK, cfg, start_timeout_s=180) as url:
        yield engine, url, root


@pytest_asyncio.fixture(loop_scope="module")
async def http(served):
    async with aiohttp.ClientSession(base_url=served[1]) as session:
        yield session


async def post(http, path: str, body, headers=None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    async with http.post(path, data=data, headers=headers) as r:
        return r.status, await r.json()


async def greedy_text(http) -> str:
    status, out = await post(http, "/v1/completions", PROMPT)
    assert status == 200, out
    return out["choices"][0]["text"]


def _addr(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


# ----- numbers the engine's arrays cannot hold -----------------------------------------------


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("top_k", 2**31, f"[-1, {INT32_MAX}]"),
        ("top_k", -2, f"[-1, {INT32_MAX}]"),
        ("seed", 2**64, "[-9223372036854775808, 18446744073709551615]"),
        ("max_tokens", 2**40, "[1, 256]"),
        ("logprobs", 10**6, "[0, 20]"),
        ("n", 10**9, "[1, 64]"),
        ("temperature", 1e308, "[0.0, 100.0]"),
        ("temperature", -1e-300, "[0.0, 100.0]"),
        ("top_p", 0.0, "(0.0, 1.0]"),
        ("stop_token_ids", [2**40], "[0, 261)"),
    ],
)
async def test_out_of_range_numbers_are_400_naming_the_field_and_range(http, field, value, allowed):
    status, out = await post(http, "/v1/completions", {**PROMPT, field: value})
    assert status == 400, out
    assert out["error"]["param"] == field and allowed in out["error"]["message"]
    await assert_healthy(http)


async def test_numbers_at_the_edges_are_bounded_and_served(served, http):
    """What used to kill the engine loop (int32 overflow) or sample garbage (float32 overflow,
    underflow) is clamped at parse time; the engine keeps serving and its output is sane."""
    greedy = await greedy_text(http)
    vocab = TOK.vocab_size
    for extra in [
        {"top_k": INT32_MAX},
        {"seed": 2**63 - 1},
        {"seed": -(2**63)},
        {"temperature": 1e-300},
        {"top_p": 1e-300},
        {"top_k": -1},
    ]:
        body = {**PROMPT, "temperature": 1.0, "logprobs": 2, **extra}
        status, out = await post(http, "/v1/completions", {**body, "return_token_ids": True})
        assert status == 200, (extra, out)
        (choice,) = out["choices"]
        assert all(0 <= t < vocab for t in choice["token_ids"]), extra
        assert all(math.isfinite(x) for x in choice["logprobs"]["token_logprobs"]), extra
    # Below float32's range, a temperature or top_p keeps exactly the most likely token: greedy
    # output (the bug sampled NUL tokens). Other sampled tokens are random draws from a random
    # model, where any id, NUL included, is legitimate.
    for extra in [{"temperature": 1e-300}, {"top_p": 1e-300}]:
        status, out = await post(http, "/v1/completions", {**PROMPT, "temperature": 1.0, **extra})
        assert status == 200 and out["choices"][0]["text"] == greedy, extra
    assert served[0].running and await greedy_text(http) == greedy


async def test_admin_version_past_int64_is_400_and_the_engine_lives(served, http):
    engine = served[0]
    version = engine.version
    for v in [2**63, -1, 10**40]:
        status, out = await post(
            http,
            "/admin/load_weights",
            {"path": "good", "version": v},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert status == 400 and out["error"]["param"] == "version", out
        assert str(2**63 - 1) in out["error"]["message"]
    assert engine.version == version
    await greedy_text(http)
    await assert_healthy(http)


# ----- logprobs --------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::pytest.PytestWarning")
def test_non_finite_logprobs_are_never_reported_as_numbers():
    nan, inf = math.nan, math.inf
    out = SequenceOutput(
        index=0,
        token_ids=[104, 105, 106],
        logprobs=[nan, -inf, -2.5],
        top_logprobs=[[(104, nan)], [(105, -inf)], [(106, -2.5), (107, -inf)]],
        versions=[0, 0, 0],
        text="hij",
        finish_reason="length",
        prompt_tokens=1,
        cached_tokens=0,
    )
    lp = completion_logprobs(TOK, out)
    # A sampled token's logprob is never -inf legitimately: both NaN and -inf are null.
    assert lp["token_logprobs"] == [None, None, -2.5]
    # An alternative outside the top-k / top-p set is impossible: the floor, as OpenAI reports.
    floor = LOGPROB_FLOOR
    assert lp["top_logprobs"] == [{"h": None}, {"i": floor}, {"j": -2.5, "k": floor}]
    chat = chat_logprobs(TOK, out.token_ids, out.logprobs, out.top_logprobs)["content"]
    assert [e["logprob"] for e in chat] == [None, None, -2.5]
    assert [[t["logprob"] for t in e["top_logprobs"]] for e in chat] == [
        [None],
        [LOGPROB_FLOOR],
        [-2.5, LOGPROB_FLOOR],
    ]
    json.dumps([lp, chat], allow_nan=False)  # valid JSON: no NaN / Infinity literals


# ----- 500s that were the client's fault -------------------------------------------------------


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", b'{"prompt": "ls \\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": "ls", "stop": ["\\udfff"], "max_tokens": 2}', "stop"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
     "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", '
     b'"text": "\\udc00"}]}]}', "messages[0].content"),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, None),
    ("/v1/completions", b'{"prompt": "ls", "seed": 1' + b"0" * 5000 + b"}", None),
])  # fmt: skip
async def test_bad_text_and_json_are_400(http, path, raw, param):
    status, out = await post(http, path, raw)
    assert status == 400, out
    assert out["error"]["param"] == param
    # A valid surrogate pair (what json.dumps writes for an emoji) is text like any other.
    status, _ = await post(
        http, "/v1/completions", b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}'
    )
    assert status == 200


async def _raw_request(url: str, request: bytes, timeout_s: float = 10.0) -> bytes:
    reader, writer = await asyncio.open_connection(*_addr(url))
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()


def _reply(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """A raw HTTP reply -> (status, headers with lower-case names, body)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines if ": " in line)
    return int(status_line.split()[1]), {k.lower(): v for k, v in headers.items()}, body


def _api_error(raw: bytes, status: int) -> dict:
    got, headers, body = _reply(raw)
    assert got == status, raw[:300]
    assert headers["content-type"].startswith("application/json"), raw[:300]
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
_BODY = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()


def _encoded(encoding: bytes, body: bytes) -> bytes:
    return (
        _HEAD
        + b"Content-Type: application/json\r\nContent-Encoding: "
        + encoding
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


@pytest.mark.parametrize(
    "request_bytes, status",
    [
        (b"GARBAGE\r\n\r\n", 400),
        (_HEAD + b"Transfer-Encoding: chunked\r\n\r\nZZ\r\nabc\r\n0\r\n\r\n", 400),
        (_HEAD + b"".join(b"X-%d: y\r\n" % i for i in range(200)) + b"\r\n", 400),
        (_HEAD + b"X-Long: " + b"a" * 20_000 + b"\r\n\r\n", 400),
        (_HEAD + b"Expect: 100-continue-please\r\nContent-Length: 2\r\n\r\n{}", 417),
        # A body that does not decompress was a 500 (the client's fault, so a 400).
        (_encoded(b"gzip", b"not gzip at all"), 400),
        (_encoded(b"deflate", _BODY), 400),
    ],
    ids=["method", "chunk-size", "headers", "header-line", "expect", "gzip", "deflate"],
)
async def test_malformed_requests_get_api_errors_not_plain_text(
    served, http, request_bytes, status
):
    error = _api_error(await _raw_request(served[1], request_bytes), status)
    assert error["type"] == "invalid_request_error"
    await assert_healthy(http)


async def test_an_error_outside_the_handlers_is_a_logged_json_500(http, monkeypatch, caplog):
    """An exception that escapes the routes' error middleware (here: in its own bookkeeping)
    used to be aiohttp's plain-text 500."""

    def broken(*args):
        raise RuntimeError("injected bookkeeping failure")

    monkeypatch.setattr("serving.metrics.ServerMetrics.record_request", broken)
    async with http.get("/health") as r:
        assert r.status == 500 and r.content_type == "application/json"
        error = (await r.json())["error"]
    assert error["type"] == "server_error" and "the server log has it" in error["message"]
    assert "injected" not in error["message"]  # internals stay in the log
    assert any(
        "from outside the request handlers" in rec.getMessage() and rec.levelno == logging.ERROR
        for rec in caplog.records
    )
    monkeypatch.undo()
    await assert_healthy(http)


def _refused_connections(metrics: str) -> float:
    line = next(
        x
        for x in metrics.splitlines()
        if x.startswith('simloop_refused_total{reason="connections"}')
    )
    return float(line.split()[-1])


async def test_a_connection_past_the_cap_gets_a_json_503_and_is_counted(served, http, monkeypatch):
    engine, url, _ = served
    async with http.get("/metrics") as r:
        before = _refused_connections(await r.text())
    gate = StepGate(engine, monkeypatch)  # every request stays in its handler until opened
    body = json.dumps(PROMPT).encode()
    request = (
        _HEAD
        + b"Content-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    busy = [asyncio.create_task(_raw_request(url, request, timeout_s=60)) for _ in range(CAP)]
    assert await wait_until(lambda: engine.in_flight >= CAP, timeout_s=30)
    error = _api_error(await _raw_request(url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"), 503)
    assert error["type"] == "service_unavailable" and str(CAP) in error["message"]
    gate.open()
    assert all(_reply(raw)[0] == 200 for raw in await asyncio.gather(*busy))
    async with http.get("/metrics") as r:
        assert _refused_connections(await r.text()) == before + 1


async def test_a_non_ascii_bearer_header_is_401(served):
    body = b'{"path": "good", "version": 99}'
    request = (
        b"POST /admin/load_weights HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nAuthorization: Bearer \xff\xfe\xc3\xa9t\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    reply = await _raw_request(served[1], request)
    assert reply.startswith(b"HTTP/1.1 401"), reply[:200]
    assert served[0].version == 0


def _break(root: Path, name: str, how: str) -> str:
    """A copy of the good checkpoint, broken one way."""
    dst = root / name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(root / "good", dst)
    files = sorted(
        (p for p in dst.rglob("*") if p.is_file() and p.name != "model_config.json"),
        key=lambda p: p.stat().st_size,
    )
    config = dst / "model_config.json"
    if how == "truncated":
        for f in files:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif how == "deleted":
        files[-1].unlink()
        files[0].unlink()
    elif how == "extra_key":
        config.write_text(json.dumps({**json.loads(config.read_text()), "bogus": 1}))
    elif how == "misconfigured":
        config.write_text(json.dumps({**json.loads(config.read_text()), "num_layers": "two"}))
    elif how == "torn_config":
        config.write_text(config.read_text()[:20])
    return name


@pytest.mark.parametrize(
    "how", ["truncated", "deleted", "extra_key", "misconfigured", "torn_config"]
)
async def test_broken_checkpoints_and_paths_are_4xx(served, http, how):
    engine, _, root = served
    version = engine.version
    auth = {"Authorization": f"Bearer {TOKEN}"}
    name = _break(root, f"broken-{how}", how)
    status, out = await post(
        http, "/admin/load_weights", {"path": name, "version": 5}, headers=auth
    )
    assert status in (400, 404, 422), out
    assert out["error"]["param"] == "path" and "cannot be loaded" in out["error"]["message"]
    for bad in ["good\0", "x" * 5000, "/".join(["x" * 200] * 30)]:
        status, out = await post(
            http, "/admin/load_weights", {"path": bad, "version": 5}, headers=auth
        )
        assert status == 400 and out["error"]["param"] == "path", out
    assert engine.version == version
    await assert_healthy(http)


# ----- slow and idle clients --------------------------------------------------------------------


async def test_a_half_sent_head_is_closed_after_the_header_timeout(served):
    t0 = time.perf_counter()
    reply = await _raw_request(served[1], b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    assert reply == b"" and time.perf_counter() - t0 < 5  # closed, not answered
    # A half-sent body: 408, and the connection is closed.
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"prompt"'
    )
    reply = await _raw_request(served[1], request)
    assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.5s" in reply, reply


async def test_idle_sockets_past_the_cap_do_not_lock_the_server_out(served, http):
    host, port = _addr(served[1])
    socks = []
    for i in range(3 * CAP):
        s = socket.create_connection((host, port))
        if i % 2:
            s.sendall(b"GET /health HTTP/1.1\r\n")  # half a head
        socks.append(s)
    try:
        for _ in range(3):
            await assert_healthy(http)
        # The oldest idle sockets made room: the server holds at most CAP connections.
        await asyncio.sleep(0.2)
        closed = 0
        for s in socks:
            s.setblocking(False)
            try:
                closed += s.recv(1) == b""
            except BlockingIOError:
                pass
            except ConnectionResetError:
                closed += 1
        assert closed >= 2 * CAP - 1
    finally:
        for s in socks:
            s.close()
    await assert_healthy(http)


@pytest.mark.filterwarnings("ignore::pytest.PytestWarning")
def test_repeated_log_lines_are_rate_limited():
    logger = logging.getLogger("test.ratelimit")
    logger.propagate = False
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    now = [0.0]
    logger.addFilter(RateLimitFilter(burst=5, window_s=10.0, clock=lambda: now[0]))
    try:
        for i in range(10_000):
            logger.warning("accept failed: %s", i)
        logger.warning("another message")
        assert len(records) == 6
        now[0] = 10.0
        logger.warning("accept failed: %s", "again")
        assert "[9995 similar messages dropped]" in records[-1].getMessage()
    finally:
        logger.removeHandler(handler)


# ----- engine death, streams, shutdown -----------------------------------------------------------


async def _start(engine: Engine, cfg: ServerConfig, stop: asyncio.Event):
    port = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(run_server(engine, TOK, cfg, ready=port.set_result, stop=stop))
    await asyncio.wait({port, task}, timeout=180, return_when=asyncio.FIRST_COMPLETED)
    return task, f"http://127.0.0.1:{port.result()}"


async def test_an_engine_failure_mid_stream_ends_the_stream_and_the_server(monkeypatch):
    engine = Engine(make_model(0), TOK, ECFG)
    stop = asyncio.Event()
    task, url = await _start(engine, CFG, stop)
    gate = StepGate(engine, monkeypatch)
    body = {"prompt": "yes", "max_tokens": 8, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession(base_url=url) as http:
        async with http.post("/v1/completions", json=body) as r:
            assert r.status == 200
            for _ in range(2):  # two tokens streamed
                await gate.engine_waits()
                gate.grant()
            await gate.engine_waits()

            def fail(*args):
                raise RuntimeError("injected device failure")

            monkeypatch.setattr(gate, "_step", fail)
            gate.open()
            raw = (await r.read()).decode()
    assert "HTTP/1.1" not in raw  # never a second response inside the stream
    events = [line[6:] for line in raw.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "injected device failure" in error["message"]
    assert all("choices" in json.loads(e) for e in events[:-2])
    # The engine loop is dead for good: the server exits with an error, without being asked.
    with pytest.raises(EngineDied, match="injected device failure"):
        await asyncio.wait_for(task, 30)
    assert not stop.is_set()


@pytest.mark.filterwarnings("ignore::pytest.PytestWarning")
def test_simloop_serve_exits_non_zero_when_the_engine_dies(monkeypatch, capsys):
    async def dies(*args, **kwargs):
        raise EngineDied("the engine loop failed: RuntimeError('boom')")

    monkeypatch.setattr("serving.server.run_server", dies)
    parser = __import__("argparse").ArgumentParser()
    serve_job.add_arguments(parser)
    assert serve_job.run(parser.parse_args(["--preset", "tiny"]), SimloopConfig()) == 1
    assert "engine loop failed" in capsys.readouterr().err


async def test_shutdown_with_a_stream_in_flight_is_bounded(monkeypatch):
    grace = 2.0
    engine = Engine(make_model(0), TOK, dataclasses.replace(ECFG, max_tokens_cap=None))
    cfg = dataclasses.replace(CFG, shutdown_timeout_s=grace)
    stop = asyncio.Event()
    task, url = await _start(engine, cfg, stop)
    step = engine._device_step

    def slow(*args):  # a stream that would take ~25 s
        time.sleep(0.1)
        return step(*args)

    monkeypatch.setattr(engine, "_device_step", slow)
    body = {"prompt": "yes", "max_tokens": 240, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession(base_url=url) as http:
        async with http.post("/v1/completions", json=body) as r:
            assert r.status == 200
            assert await r.content.readline()
            t0 = time.perf_counter()
            stop.set()
            raw = (await r.read()).decode()
            await asyncio.wait_for(task, grace + 5)
            took = time.perf_counter() - t0
    assert took < grace + 0.75, took
    events = [line[6:] for line in raw.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"


# ----- property: arbitrary bodies ----------------------------------------------------------------

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
_fields = [
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "seed",
    "stop",
    "stop_token_ids",
    "logprobs",
    "top_logprobs",
    "stream",
    "stream_options",
    "return_token_ids",
    "ignore_eos",
    "model",
    "echo",
    "chat_template_kwargs",
    "presence_penalty",
]
_numbers = st.integers() | st.floats() | st.sampled_from([2**31, 2**63, -1, 0, 1e-300, 1e308])
_messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant", "tool", "robot"]),
            "content": st.text(max_size=30) | _json_values,
        }
    ),
    max_size=3,
)
_bodies = st.one_of(
    _json_values,
    st.dictionaries(st.sampled_from(_fields), _numbers | _json_values, max_size=6),
    st.fixed_dictionaries(
        {"prompt": st.text(max_size=30) | st.lists(st.integers(-5, 300), max_size=8)},
        optional={k: _numbers | _json_values for k in _fields[2:]},
    ),
    st.fixed_dictionaries(
        {"messages": _messages}, optional={k: _numbers | _json_values for k in _fields[2:]}
    ),
)


async def test_arbitrary_bodies_get_2xx_or_4xx_and_change_nothing(served, http):
    before = await greedy_text(http)
    host, port = _addr(served[1])

    @settings(
        max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
    )
    @given(body=_bodies, chat=st.booleans())
    def check(body, chat):
        conn = HTTPConnection(host, port, timeout=60)
        try:
            path = "/v1/chat/completions" if chat else "/v1/completions"
            conn.request(
                "POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            r = conn.getresponse()
            raw = r.read()
            assert r.status < 300 or 400 <= r.status < 500, (r.status, raw[:300])
            if r.status == 200 and r.getheader("Content-Type", "").startswith("text/event"):
                assert b'"error"' not in raw and raw.endswith(b"data: [DONE]\n\n")
        finally:
            conn.close()

    await asyncio.to_thread(check)
    await assert_healthy(http)
    assert served[0].running and await greedy_text(http) == before
