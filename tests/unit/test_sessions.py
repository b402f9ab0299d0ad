"""Persistent KV sessions (issue 19, part 1) over real sockets: `run_server` on 127.0.0.1 in
front of a tiny engine. A session keeps its slot's KV between calls, so each call prefills only
what was appended; its greedy output equals a stateless completion of the same tokens; rewind
drops the tail; steps of different sessions share device steps; every misuse is an OpenAI-shaped
error with its status (404 unknown, 409 busy / expired / evicted, 413 over-long, 400 malformed);
a TTL or memory pressure ends a session with a reason its next call is told.

Sharing (a second `Server` front over the same engine, with its own config): one client at its
session cap gets 429 while others open theirs, session tokens keep others out of a session,
refusals keep no state and are counted in /metrics; a step refuses fields it does not take."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from flax import nnx

from rl.data import ByteTokenizer
from rl.model import Qwen3, tiny
from serving.config import ServerConfig
from serving.engine import Engine, EngineConfig

pytestmark = pytest.mark.asyncio(loop_scope="module")
TOK = ByteTokenizer()
SEQ, SLOTS, MAX_SESSIONS = 256, 4, 8
ECFG = EngineConfig(
    num_slots=SLOTS, max_seq_len=SEQ, prefill_chunk=32, prefill_batch=2, max_sessions=MAX_SESSIONS
)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served():
    from serving.server import background_server

    model = Qwen3(tiny(initializer_range=0.3), rngs=nnx.Rngs(0))
    engine = Engine(model, TOK, ECFG)
    cfg = ServerConfig(host="127.0.0.1", port=0, model_name="tiny", shutdown_timeout_s=5.0)
    async with background_server(engine, TOK, cfg, start_timeout_s=180) as url:
        yield engine, url


@pytest_asyncio.fixture(loop_scope="module")
async def http(served):
    engine, url = served
    for sid in list(engine.sessions):  # each test starts with every slot free
        engine.close_session(sid)
    async with aiohttp.ClientSession(base_url=url) as session:
        yield session


async def call(http, method: str, path: str, body=None, status: int = 200) -> dict:
    async with http.request(method, path, json=body) as r:
        data = await r.json()
        assert r.status == status, data
        return data


async def open_session(http, **body) -> str:
    return (await call(http, "POST", "/v1/sessions", body))["id"]


def step(append, max_tokens: int = 8, **kw) -> dict:
    key = "append_text" if isinstance(append, str) else "append_token_ids"
    return {key: append, "max_tokens": max_tokens, "temperature": 0.0, **kw}


async def test_each_call_prefills_only_what_was_appended_and_matches_a_stateless_completion(http):
    sid = await open_session(http)
    first = await call(http, "POST", f"/v1/sessions/{sid}/generate", step("ls -la\n"))
    assert first["prompt_tokens"] == 7 and first["cached_tokens"] == 0
    assert first["session_tokens"] == 7 + len(first["token_ids"])
    # The KV of every token but the last sampled one (it is the next step's input).
    assert first["kv_tokens"] == first["session_tokens"] - 1
    history = TOK.encode("ls -la\n") + first["token_ids"]
    second = await call(http, "POST", f"/v1/sessions/{sid}/generate", step("pwd\n"))
    assert second["prompt_tokens"] == 4
    assert second["cached_tokens"] == len(history) - 1  # only the appended tokens prefilled
    assert second["session_tokens"] == len(history) + 4 + len(second["token_ids"])
    stateless = await call(
        http,
        "POST",
        "/v1/completions",
        {
            "prompt": history + TOK.encode("pwd\n"),
            "max_tokens": 8,
            "temperature": 0.0,
            "return_token_ids": True,
        },
    )
    assert second["token_ids"] == stateless["choices"][0]["token_ids"]
    listed = (await call(http, "GET", "/v1/sessions"))["data"]
    (mine,) = [s for s in listed if s["id"] == sid]
    assert mine["session_tokens"] == second["session_tokens"] and mine["state"] == "open"
    assert mine["idle_s"] >= 0 and not mine["busy"]
    await call(http, "DELETE", f"/v1/sessions/{sid}")
    assert sid not in [s["id"] for s in (await call(http, "GET", "/v1/sessions"))["data"]]
    await call(http, "POST", f"/v1/sessions/{sid}/generate", step("x"), status=404)


async def test_rewind_drops_the_tail_and_a_retry_repeats_the_turn(http):
    sid = await open_session(http)
    turn1 = await call(http, "POST", f"/v1/sessions/{sid}/generate", step("echo hi\n"))
    boundary = turn1["session_tokens"]
    retry_of = await call(http, "POST", f"/v1/sessions/{sid}/generate", step("cat f\n"))
    back = await call(http, "POST", f"/v1/sessions/{sid}/rewind", {"to": boundary})
    assert back["session_tokens"] == back["kv_tokens"] == boundary
    again = await call(http, "POST", f"/v1/sessions/{sid}/generate", step("cat f\n"))
    assert again["token_ids"] == retry_of["token_ids"]  # greedy: the same turn again
    assert again["cached_tokens"] == boundary  # the KV of turn 1 whole: kept by the rewind
    err = await call(http, "POST", f"/v1/sessions/{sid}/rewind", {"to": 10_000}, status=400)
    assert err["error"]["param"] == "to" and "an integer in [0," in err["error"]["message"]


async def test_steps_of_different_sessions_share_device_steps(served, http):
    engine, _ = served
    sids = [await open_session(http) for _ in range(SLOTS)]
    for sid in sids:  # each session holds its context first
        await call(http, "POST", f"/v1/sessions/{sid}/generate", step(f"s{sid[-4:]}\n", 1))
    before = engine.stats["steps"]
    outs = await asyncio.gather(
        *(
            call(http, "POST", f"/v1/sessions/{sid}/generate", step("go\n", 24, ignore_eos=True))
            for sid in sids
        )
    )
    steps = engine.stats["steps"] - before
    assert all(len(o["token_ids"]) == 24 for o in outs)
    # One session alone needs >= 24 / decode_steps device steps; four in lockstep need about
    # the same, not four times as many.
    assert steps < 2 * (24 // ECFG.decode_steps + 4)


async def test_misuse_gets_a_status_and_a_reason(served, http):
    engine, _ = served
    sid = await open_session(http)
    for body, param in [
        ({}, "append_token_ids"),
        ({"append_text": "a", "append_token_ids": [1]}, "append_token_ids"),
        ({"append_token_ids": [99999]}, "append_token_ids"),
        ({"append_token_ids": "abc"}, "append_token_ids"),
        ({"append_text": "a", "stream": True}, "stream"),
        ({"append_text": "a", "temperature": -1}, "temperature"),
    ]:
        err = await call(http, "POST", f"/v1/sessions/{sid}/generate", body, status=400)
        assert err["error"]["param"] == param, err
    # An append longer than the context: 413 with the limit.
    err = await call(http, "POST", f"/v1/sessions/{sid}/generate", step("a" * SEQ), status=413)
    assert f"at most {SEQ - 1}" in err["error"]["message"]
    # A second step while one runs: 409.
    slow = asyncio.create_task(
        call(http, "POST", f"/v1/sessions/{sid}/generate", step("b", 200, ignore_eos=True))
    )
    while not engine.sessions[sid].busy:
        await asyncio.sleep(0.001)
    err = await call(http, "POST", f"/v1/sessions/{sid}/generate", step("c"), status=409)
    assert "already generating" in err["error"]["message"]
    await slow
    for method, path, body in [
        ("POST", "/v1/sessions/nope/generate", step("a")),
        ("POST", "/v1/sessions/nope/rewind", {"to": 0}),
        ("DELETE", "/v1/sessions/nope", None),
    ]:
        err = await call(http, method, path, body, status=404)
        assert "does not exist" in err["error"]["message"]
    for body, says in [
        ({"compaction": {"mode": "zip"}}, "compaction.mode='zip' is invalid"),
        ({"compaction": {"mode": "budget"}}, "required by mode 'budget'"),
        ({"compaction": {"mode": "turn", "keep_ratio": 2}}, "in (0, 1]"),
        ({"compaction": {"mode": "turn", "ratio": 1}}, "unknown field(s) ['ratio']"),
        ({"compaction": "markovian"}, "must be an object"),
        ({"ttl_s": 0}, "'ttl_s'=0 is out of range"),
        ({"ttl": 5}, "unknown field(s) ['ttl']"),
    ]:
        err = await call(http, "POST", "/v1/sessions", body, status=400)
        assert says in err["error"]["message"], err
    async with http.get("/health") as r:
        assert r.status == 200  # none of it hurt the server


async def test_max_tokens_past_the_slot_is_a_400_unless_the_session_compacts(http):
    """A plain session's client knows what its slot holds: asking past it is an error naming
    the most it may ask. A compacting session's client cannot know what the compaction on
    arrival left, so its max_tokens is a cap clamped to the room (and may end on `length`)."""
    prompt = "x" * (SEQ - 40)
    plain = await open_session(http)
    err = await call(
        http,
        "POST",
        f"/v1/sessions/{plain}/generate",
        step(prompt, 100, ignore_eos=True),
        status=400,
    )
    assert err["error"]["param"] == "max_tokens" and "so at most 40" in err["error"]["message"]
    packed = await open_session(http, compaction={"mode": "markovian", "n_protect_turns": 1})
    out = await call(
        http, "POST", f"/v1/sessions/{packed}/generate", step(prompt, 100, ignore_eos=True)
    )
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 40
    assert out["kv_tokens"] == SEQ - 1  # every key but the last sampled token's


async def test_a_session_past_its_ttl_is_told_why_then_forgotten(http):
    sid = await open_session(http, ttl_s=0.05)
    await call(http, "POST", f"/v1/sessions/{sid}/generate", step("a\n", 2))
    await asyncio.sleep(0.2)
    err = await call(http, "POST", f"/v1/sessions/{sid}/generate", step("b"), status=409)
    assert "idle for more than its ttl_s=0.05" in err["error"]["message"]
    await call(http, "POST", f"/v1/sessions/{sid}/generate", step("b"), status=404)


async def test_memory_pressure_evicts_the_least_recently_used_idle_session(served, http):
    engine, _ = served
    sids = [await open_session(http) for _ in range(SLOTS)]
    for sid in sids:  # every slot pinned by an idle session
        await call(http, "POST", f"/v1/sessions/{sid}/generate", step(f"{sid[-3:]}\n", 2))
    evicted = engine.stats["sessions_evicted"]
    done = await call(
        http, "POST", "/v1/completions", {"prompt": "hello", "max_tokens": 2, "temperature": 0.0}
    )
    assert done["choices"][0]["finish_reason"] in ("length", "stop")
    assert engine.stats["sessions_evicted"] == evicted + 1
    listed = {s["id"]: s for s in (await call(http, "GET", "/v1/sessions"))["data"]}
    assert listed[sids[0]]["state"] == "gone" and "memory pressure" in listed[sids[0]]["reason"]
    err = await call(http, "POST", f"/v1/sessions/{sids[0]}/generate", step("x"), status=409)
    assert "memory pressure" in err["error"]["message"]
    for sid in sids[1:]:  # the others kept their KV
        out = await call(http, "POST", f"/v1/sessions/{sid}/generate", step("y", 1))
        assert out["cached_tokens"] > 0


# ----- sharing the server between clients -------------------------------------------------


async def test_a_step_and_a_rewind_refuse_fields_they_do_not_take(served, http):
    """`n=2` on a step used to be ignored silently (one sequence came back): now every field a
    session route does not take is a 400 naming it and what the route takes."""
    sid = await open_session(http)
    for body, param in [
        (step("a", n=2), "n"),
        (step("a", best_of=2), "best_of"),
        (step("a", logit_bias={"1": 5}), "logit_bias"),
    ]:
        err = await call(http, "POST", f"/v1/sessions/{sid}/generate", body, status=400)
        assert err["error"]["param"] == param and f"['{param}']" in err["error"]["message"]
        assert "append_token_ids" in err["error"]["message"]  # what it takes
    err = await call(
        http, "POST", f"/v1/sessions/{sid}/generate", step("a", model="other"), status=404
    )
    assert err["error"]["param"] == "model"
    err = await call(http, "POST", f"/v1/sessions/{sid}/rewind", {"to": 0, "keep": 1}, status=400)
    assert err["error"]["param"] == "keep" and "takes to" in err["error"]["message"]
    assert served[0].sessions[sid].tokens == []  # the refused calls appended nothing


async def test_sessions_gone_past_their_ttl_make_room_at_the_engine_limit(served, http):
    """Sessions that expired used to count against `max_sessions` until their next call, so
    a burst of idle sessions locked every client out for good: at the limit, they give way."""
    engine, _ = served
    idle = [await open_session(http, ttl_s=0.05) for _ in range(MAX_SESSIONS)]
    err = await call(http, "POST", "/v1/sessions", {}, status=429)
    assert f"the limit is {MAX_SESSIONS}" in err["error"]["message"]
    await asyncio.sleep(0.2)  # every one of them is past its ttl_s
    fresh = await open_session(http)
    assert len(engine.sessions) == 1 and fresh in engine.sessions
    await call(http, "POST", f"/v1/sessions/{idle[0]}/generate", step("a"), status=404)


@pytest.mark.filterwarnings("ignore::pytest.PytestWarning")
@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("max_sessions_per_client", 0, "an integer in [1, 1000000]"),
        ("max_sessions_per_client", True, "an integer in [1, 1000000]"),
        ("client_identity", "cookie", "one of ['peer', 'api_key']"),
        ("session_tokens", "yes", "true or false"),
    ],
)
def test_the_sharing_settings_are_validated(field, value, allowed):
    with pytest.raises(ValueError) as e:
        ServerConfig(**{field: value})
    assert f"ServerConfig.{field}={value!r} is invalid: {allowed}" in str(e.value)


@contextlib.asynccontextmanager
async def front(engine, **cfg):
    """A second `Server` over the module's engine with its own `ServerConfig` (no new engine):
    yields the server and its URL."""
    from serving.server import Server

    server = Server(engine, TOK, ServerConfig(model_name="tiny", **cfg))
    runner = web.AppRunner(server.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield server, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


def _clients(url: str, identity: str) -> tuple[aiohttp.ClientSession, aiohttp.ClientSession]:
    """Two clients of `url`, different by `identity`: their address (127.0.0.2 is another
    loopback address) or their API key."""
    if identity == "peer":
        host, port = url.removeprefix("http://").split(":")
        try:
            socket.create_connection((host, int(port)), 5, ("127.0.0.2", 0)).close()
        except OSError:
            pytest.skip("127.0.0.2 is no local address here (macOS has only 127.0.0.1)")
        other = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
        return (
            aiohttp.ClientSession(base_url=url),
            aiohttp.ClientSession(base_url=url, connector=other),
        )
    return tuple(
        aiohttp.ClientSession(base_url=url, headers={"Authorization": f"Bearer {k}"})
        for k in ("key-of-a", "key-of-b")
    )


@pytest.mark.parametrize("identity", ["peer", "api_key"])
async def test_a_client_at_its_session_cap_gets_429_while_others_open_theirs(
    served, http, identity
):
    engine, _ = served
    cap = 3
    async with front(engine, max_sessions_per_client=cap, client_identity=identity) as (_, url):
        a, b = _clients(url, identity)
        async with a, b:
            mine = [await open_session(a) for _ in range(cap)]
            err = (await call(a, "POST", "/v1/sessions", {}, status=429))["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == "client_session_limit"
            assert (
                f"the per-client limit is {cap} (ServerConfig.max_sessions_per_client)"
                in (err["message"])
            )
            theirs = [await open_session(b) for _ in range(cap)]  # not locked out by a
            assert len(set(mine + theirs)) == 2 * cap and len(engine.sessions) == 2 * cap
            await call(a, "DELETE", f"/v1/sessions/{mine[0]}")
            await open_session(a)  # a closed one: room for one more


async def test_refused_opens_keep_no_state(served, http):
    """A flood of opens past the per-client cap and past the engine's limit, from one key and
    from many new keys, leaves the sessions and the server's per-client bookkeeping as they
    were; closed sessions leave the bookkeeping too."""
    engine, _ = served
    cfg = dict(max_sessions_per_client=2, client_identity="api_key")
    async with front(engine, **cfg) as (server, url), aiohttp.ClientSession(base_url=url) as h:

        async def open_as(key: str, status: int = 200) -> dict:
            async with h.post(
                "/v1/sessions", json={}, headers={"Authorization": f"Bearer {key}"}
            ) as r:
                assert r.status == status, await r.text()
                return await r.json()

        held = [(await open_as(f"k{i // 2}"))["id"] for i in range(MAX_SESSIONS)]
        owners = dict(server.owners)
        assert len(engine.sessions) == MAX_SESSIONS and len(owners) == MAX_SESSIONS
        for i in range(100):  # the engine is full: new clients are refused
            await open_as(f"new-{i}", status=429)
        for _ in range(50):  # k0 is at its cap
            await open_as("k0", status=429)
        assert set(engine.sessions) == set(held) and server.owners == owners
        for sid in held:
            async with h.delete(f"/v1/sessions/{sid}") as r:
                assert r.status == 200
        assert not server.owners and not engine.sessions
        await open_as("k0")
        assert len(server.owners) == len(engine.sessions) == 1


async def test_session_tokens_keep_other_clients_out_of_a_session(served, http):
    engine, _ = served
    async with front(engine, session_tokens=True) as (_, url):
        async with aiohttp.ClientSession(base_url=url) as h:
            opened = await call(h, "POST", "/v1/sessions", {})
            sid, token = opened["id"], opened["token"]
            assert isinstance(token, str) and len(token) >= 16
            for given in [None, "x" * 32, token[:-1]]:
                headers = {} if given is None else {"X-Session-Token": given}
                for method, path, body in [
                    ("POST", f"/v1/sessions/{sid}/generate", step("a")),
                    ("POST", f"/v1/sessions/{sid}/rewind", {"to": 0}),
                    ("DELETE", f"/v1/sessions/{sid}", None),
                ]:
                    async with h.request(method, path, json=body, headers=headers) as r:
                        err = await r.json()
                        assert r.status == 404 and err["error"]["param"] == "session_id", err
                        assert set(err["error"]) == {"message", "type", "param", "code"}
                        assert "X-Session-Token" in err["error"]["message"]
            assert sid in engine.sessions and engine.sessions[sid].tokens == []
            mine = {"X-Session-Token": token}
            for method, path, body in [
                ("POST", f"/v1/sessions/{sid}/generate", step("a", 2)),
                ("POST", f"/v1/sessions/{sid}/rewind", {"to": 1}),
                ("DELETE", f"/v1/sessions/{sid}", None),
            ]:
                async with h.request(method, path, json=body, headers=mine) as r:
                    assert r.status == 200, await r.text()
            assert sid not in engine.sessions
            # A client may choose its token; it must be one a header can carry.
            own = "my-own-session-token-0123"
            opened = await call(h, "POST", "/v1/sessions", {"token": own})
            assert opened["token"] == own
            async with h.delete(
                f"/v1/sessions/{opened['id']}", headers={"X-Session-Token": own}
            ) as r:
                assert r.status == 200
            for bad in ["short", "has space in it 12345", 12345678901234567, "\u00e9" * 20]:
                err = await call(h, "POST", "/v1/sessions", {"token": bad}, status=400)
                assert err["error"]["param"] == "token"
    # Where tokens are off, a token would protect nothing: refused.
    err = await call(http, "POST", "/v1/sessions", {"token": "x" * 20}, status=400)
    assert err["error"]["param"] == "token" and "session_tokens" in err["error"]["message"]


def _refused(metrics: str) -> dict[str, float]:
    prefix = 'simloop_refused_total{reason="'
    return {
        line[len(prefix) :].split('"')[0]: float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith(prefix)
    }


async def test_metrics_count_refusals_by_reason(served, http):
    engine, _ = served
    cfg = dict(max_sessions_per_client=1, client_identity="api_key", session_tokens=True)
    async with front(engine, **cfg) as (_, url), aiohttp.ClientSession(base_url=url) as h:

        async def as_key(key: str, method: str, path: str, status: int, **kw) -> dict:
            headers = {"Authorization": f"Bearer {key}", **kw.pop("headers", {})}
            async with h.request(method, path, headers=headers, **kw) as r:
                assert r.status == status, await r.text()
                return await r.json()

        async with h.get("/metrics") as r:
            assert "# TYPE simloop_refused_total counter" in await r.text()
        sids = [
            (await as_key(f"k{i}", "POST", "/v1/sessions", 200, json={}))["id"]
            for i in range(MAX_SESSIONS)
        ]
        await as_key("k0", "POST", "/v1/sessions", 429, json={})  # its cap
        for _ in range(2):
            await as_key("new", "POST", "/v1/sessions", 429, json={})  # the engine's limit
        for _ in range(3):  # someone else's session
            await as_key(
                "k1",
                "DELETE",
                f"/v1/sessions/{sids[0]}",
                404,
                headers={"X-Session-Token": "not-the-token-at-all"},
            )
        async with h.get("/metrics") as r:
            refused = _refused(await r.text())
    assert refused == {
        "client_sessions": 1,
        "sessions": 2,
        "session_token": 3,
        "queue": 0,
        "connections": 0,
    }


# ----- the orchestrator on sessions ------------------------------------------------------------


async def test_episodes_through_sessions_equal_stateless_ones_and_close_their_sessions(served):
    """`orchestrator.sessions`: the same greedy episodes, token for token, with each turn
    sending only its new tokens; every session is closed when its episode ends."""
    from envs.config import LocalShellConfig, TerminalConfig, TextopsConfig
    from envs.local import LocalShell
    from envs.textops import generate_textops
    from rl.data import ChatRenderer
    from rl.orchestrator.config import OrchestratorConfig
    from rl.orchestrator.runner import Backends, RolloutRunner
    from serving.client import ClientConfig, InferenceClient

    engine, url = served
    for sid in list(engine.sessions):
        engine.close_session(sid)
    renderer = ChatRenderer(TOK)
    tasks = generate_textops(TextopsConfig(num_tasks=3, seed=1))
    terminal = TerminalConfig(
        max_turns=3,
        max_format_errors=3,
        prompt_template="{instruction}",
        format_error_template="Format error: {reason}",
    )
    backends = Backends(real=lambda t: LocalShell(LocalShellConfig(), setup=t.setup))
    runs = {}
    async with InferenceClient(ClientConfig(url, max_retries=0)) as client:
        for sessions in (False, True):
            ocfg = OrchestratorConfig(
                arm="real",
                max_context_tokens=SEQ,
                max_tokens_per_turn=24,
                temperature=0.0,
                sessions=sessions,
            )
            cached, opened = engine.stats["cached_tokens"], engine.stats["sessions_opened"]
            runs[sessions] = await RolloutRunner(
                ocfg, terminal, renderer, backends, client=client
            ).run(tasks)
            runs[sessions, "cached"] = engine.stats["cached_tokens"] - cached
            runs[sessions, "opened"] = engine.stats["sessions_opened"] - opened
    assert [t.token_ids for t in runs[True]] == [t.token_ids for t in runs[False]]
    assert sum(len(t.turns) for t in runs[True]) > len(tasks)  # multi-turn episodes
    assert runs[False, "opened"] == 0 and runs[True, "opened"] == len(tasks)
    assert not engine.sessions  # every one closed at its episode's end
    # With sessions every later turn reuses the whole history; stateless turns reuse it only
    # when the prefix cache still holds it.
    assert runs[True, "cached"] >= runs[False, "cached"]


async def test_a_server_without_sessions_is_detected_for_the_stateless_fallback():
    from aiohttp import web

    from serving.client import ClientConfig, InferenceClient

    app = web.Application()  # no routes: what vLLM answers to /v1/sessions (404)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with InferenceClient(ClientConfig(f"http://127.0.0.1:{port}")) as client:
            assert await client.open_session() is None
    finally:
        await runner.cleanup()
