"""Replica pools against real HTTP servers on 127.0.0.1: sticky sessions, least-in-flight
balancing, ejection (dead server, failed health checks, failed publish, sick answers: hung
completions, 4xx to what a peer serves, missing logprobs) with `ReplicaDown` for exactly the
pinned episodes, readmission only at the current version (and after a probe completion for a
replica ejected for its answers), and the orchestrator ending affected episodes `aborted` with
the replica's reason while the rest finish."""

import asyncio
import dataclasses
import time

import pytest
from aiohttp import web

from envs.config import LocalShellConfig, SimulatedShellConfig, TerminalConfig, TextopsConfig
from envs.local import LocalShell
from envs.simulated import SimulatedShell
from envs.textops import generate_textops
from rl.data import ByteTokenizer, ChatRenderer
from rl.data.sim_format import format_observation
from rl.data.tokenizer import IM_START
from rl.data.trajectory import validate
from rl.orchestrator.config import OrchestratorConfig
from rl.orchestrator.runner import Backends, RolloutRunner
from serving.client import BadAnswer, ClientConfig, ClientError, ClientTimeout
from serving.pool import PoolConfig, ReplicaDown, ReplicaPool, pinned
from serving.pool_publish import PoolPublisher, PoolPublishError
from serving.publisher import EnginePublisher
from tests.fakes import FakeAgentClient, free_port, wait_until

TOK = ByteTokenizer()
RENDERER = ChatRenderer(TOK)
TERMINAL = TerminalConfig(max_turns=4, command_timeout_s=10)
HOLD = [7, 7, 7]
"""A prompt the fake server holds until the test releases it (or the server dies)."""
TOKEN = "secret"
FAST = ClientConfig(backoff_s=0.01, max_backoff_s=0.02, max_retries=1, timeout_s=10.0)


class FakeReplica:
    """One server: `/v1/completions` (a textops agent when given tasks, else a fixed
    observation), `/health`, `/admin/load_weights`; it can be killed and restarted on its
    port, and records what it served."""

    def __init__(self, tasks=None):
        self.agent = FakeAgentClient(tasks) if tasks else None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.prompts: list = []
        self.bodies: list[dict] = []
        self.loads: list[int] = []
        self.version = 0
        self.held = 0
        self.release = asyncio.Event()
        self.health_status = 200
        """200, 503, or 0: never answer."""
        self.completion_status = 200
        self.hang = False
        """Completions never answer (held until the test ends); `/health` still does."""
        self.max_prompt: int | None = None
        """A longer prompt is refused with 400, as a server refuses one past its context."""
        self.drop_logprobs = False
        """Answer without the logprobs asked for."""
        self.load_status = 200
        self.hold_from_turn: int | None = None
        """Hold agent requests whose prompt already holds this many replies."""
        self.on_load = None
        self.health_seen: list[float] = []
        """When each `/health` request came."""
        self._runner: web.AppRunner | None = None

    async def start(self):
        self.version, self.release = 0, asyncio.Event()  # a restarted server starts bare
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.health)
        app.router.add_post("/admin/load_weights", self.load_weights)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def kill(self):
        await self._runner.cleanup()

    async def _hold(self):
        self.held += 1
        try:
            await self.release.wait()
        finally:
            self.held -= 1

    async def completions(self, request):
        body = await request.json()
        prompt = body["prompt"]
        self.prompts.append(prompt)
        self.bodies.append(body)
        if self.max_prompt is not None and len(prompt) > self.max_prompt:
            error = {
                "message": f"This model's maximum context length is {self.max_prompt} "
                f"tokens; the prompt has {len(prompt)}"
            }
            return web.json_response({"error": error}, status=400)
        if self.hang:
            await self._hold()
        if self.completion_status != 200:
            error = {"message": "engine failed", "type": "server_error", "param": None}
            return web.json_response({"error": error}, status=self.completion_status)
        if prompt == HOLD:
            await self._hold()
        if self.agent is not None:
            replies = TOK.decode(prompt).count(f"{IM_START}assistant") - 1
            if self.hold_from_turn is not None and replies >= self.hold_from_turn:
                await self._hold()
            out = await self.agent.complete(prompt, max_tokens=body["max_tokens"])
            text, ids = out.text, out.token_ids
        else:
            text = format_observation("simulated", 0)
            ids = TOK.encode(text) + [TOK.eos_id]
        choice = {
            "index": 0,
            "text": text,
            "token_ids": ids,
            "finish_reason": "stop",
            "logprobs": {"token_logprobs": [-0.5] * len(ids)},
            "token_versions": [self.version] * len(ids),
        }
        if self.drop_logprobs or body.get("logprobs") is None:
            choice["logprobs"] = None
        return web.json_response({"choices": [choice], "weight_version": self.version})

    async def health(self, request):
        self.health_seen.append(time.monotonic())
        if self.health_status == 0:
            await asyncio.Event().wait()
        if self.health_status != 200:
            return web.json_response({"error": {"message": "engine dead"}}, status=503)
        return web.json_response({"status": "ok"})

    async def load_weights(self, request):
        assert request.headers["Authorization"] == f"Bearer {TOKEN}"
        body = await request.json()
        if self.on_load is not None:
            self.on_load(body["version"])
        if self.load_status != 200:
            return web.json_response(
                {"error": {"message": "cannot read checkpoint"}}, status=self.load_status
            )
        self.version = body["version"]
        self.loads.append(body["version"])
        return web.json_response({"version": self.version})


@pytest.fixture
async def servers():
    started: list[FakeReplica] = []

    async def make(n, tasks=None):
        new = [await FakeReplica(tasks).start() for _ in range(n)]
        started.extend(new)
        return new

    yield make
    for s in started:
        s.release.set()
        await s._runner.cleanup()


def _pool(servers, **kw):
    cfg = kw.pop("config", PoolConfig(health_interval_s=0.02, health_timeout_s=1.0))
    return ReplicaPool([s.url for s in servers], config=cfg, client_config=FAST, **kw)


def _served(server, prompts):
    return [p for p in server.prompts if p in prompts]


async def test_sessions_stick_to_one_replica_and_new_ones_round_robin(servers):
    a, b = await servers(2)
    async with _pool([a, b]) as pool:
        s1, s2 = pool.session("ep1"), pool.session("ep2")
        for i in range(3):
            await s1.complete([1, i], max_tokens=2)
            await s2.complete([2, i], max_tokens=2)
        assert _served(a, [[1, i] for i in range(3)]) == [[1, 0], [1, 1], [1, 2]]
        assert _served(b, [[2, i] for i in range(3)]) == [[2, 0], [2, 1], [2, 2]]
        # The pool itself routes through the `pinned` scope's session: one replica per episode.
        with pinned("ep3"):
            outs = [await pool.complete([3, i], max_tokens=2) for i in range(3)]
        assert len(_served(a, [[3, i] for i in range(3)])) == 3 and outs[0].token_ids
        # Outside any episode each request is routed on its own (all in-flight 0: round robin).
        for i in range(4):
            await pool.complete([4, i], max_tokens=2)
        assert _served(a, [[4, i] for i in range(4)]) == [[4, 1], [4, 3]]
        assert _served(b, [[4, i] for i in range(4)]) == [[4, 0], [4, 2]]


async def test_new_sessions_go_to_the_replica_with_fewest_in_flight(servers):
    r0, r1, r2 = await servers(3)
    async with _pool([r0, r1, r2]) as pool:
        a, b, c = pool.session("a"), pool.session("b"), pool.session("c")
        for s in (a, b, c):  # round robin while loads are equal
            await s.complete([0], max_tokens=1)
        assert [s.replica.url for s in (a, b, c)] == [r0.url, r1.url, r2.url]
        held = [
            asyncio.create_task(s.complete(HOLD, max_tokens=1), name=f"hold-{i}")
            for i, s in enumerate((a, a, c))
        ]
        assert await wait_until(lambda: r0.held == 2 and r2.held == 1)
        assert [r.in_flight for r in pool.replicas] == [2, 0, 1]
        # Round robin would pick r0 next; the least loaded replica is r1, twice over.
        for key in ("d", "e"):
            s = pool.session(key)
            await s.complete([5], max_tokens=1)
            assert s.replica.url == r1.url
        for srv in (r0, r2):
            srv.release.set()
        await asyncio.gather(*held)
        assert pool.stats()["in_flight"] == 0 and pool.stats()["live"] == 3


@pytest.mark.parametrize("health", [503, 0], ids=["503", "hung"])
async def test_health_check_failures_eject_and_fail_in_flight_and_pinned_requests(servers, health):
    good, bad = await servers(2)
    ejected = []
    cfg = PoolConfig(health_interval_s=0.02, health_timeout_s=0.1, health_failures=2)
    async with _pool(
        [good, bad], config=cfg, on_eject=lambda r, why: ejected.append((r.url, why))
    ) as pool:
        first, second = pool.session("ep0"), pool.session("ep1")
        await first.complete([1], max_tokens=1)
        stuck = asyncio.create_task(second.complete(HOLD, max_tokens=1), name="stuck")
        assert await wait_until(lambda: bad.held == 1)
        bad.health_status = health
        why = "503" if health else "no answer within 0.1s"
        with pytest.raises(ReplicaDown, match=f"health check failed 2x.*{why}") as info:
            await asyncio.wait_for(stuck, timeout=5.0)
        assert info.value.url == bad.url and str(info.value).startswith(f"replica {bad.url} down:")
        assert [u for u, _ in ejected] == [bad.url] and "health check" in ejected[0][1]
        # Later requests of the pinned session fail at once, never moved to the other replica.
        seen = len(bad.prompts) + len(good.prompts)
        with pytest.raises(ReplicaDown):
            await second.complete([2], max_tokens=1)
        assert len(bad.prompts) + len(good.prompts) == seen
        await first.complete([3], max_tokens=1)  # the healthy replica's episode goes on
        fresh = pool.session("ep2")
        await fresh.complete([4], max_tokens=1)
        assert fresh.replica.url == good.url
        stats = pool.stats()
        assert stats["live"] == 1 and stats["ejections"] == 1
        assert stats["per_replica"][1]["in_flight"] == 0 and not stats["per_replica"][1]["live"]


async def test_5xx_after_the_clients_retries_ejects_a_bad_request_does_not(servers):
    r0, r1 = await servers(2)
    async with _pool([r0, r1], config=PoolConfig(health_interval_s=60.0)) as pool:
        on_r0, on_r1 = pool.session("a"), pool.session("b")
        await on_r0.complete([0], max_tokens=1)
        await on_r1.complete([1], max_tokens=1)
        r0.completion_status = 400
        with pytest.raises(ClientError, match="400") as info:
            await on_r0.complete([2], max_tokens=1)
        assert not isinstance(info.value, ReplicaDown) and len(pool.live) == 2
        r1.completion_status = 503
        with pytest.raises(ReplicaDown, match=f"replica {r1.url} down: complete failed.*503"):
            await on_r1.complete([3], max_tokens=1)
        assert r1.prompts.count([3]) == 1 + FAST.max_retries  # the client's retries came first
        assert [r.url for r in pool.live] == [r0.url]


async def test_no_live_replica_waits_then_fails_with_a_reason(servers):
    (only,) = await servers(1)
    cfg = PoolConfig(health_interval_s=60.0, wait_live_s=0.05)
    async with _pool([only], config=cfg, role="simulator") as pool:
        pool.eject(only.url, "killed by the test")
        with pytest.raises(ReplicaDown, match="no live simulator replica.*killed by the test"):
            await pool.session("late").complete([1], max_tokens=1)
    cfg = PoolConfig(health_interval_s=60.0, wait_live_s=30.0)
    async with _pool([only], config=cfg) as pool:
        pool.eject(only.url, "restarting")
        waiting = asyncio.create_task(
            pool.session("patient").complete([2], max_tokens=1), name="waiting"
        )
        await asyncio.sleep(0)
        assert not waiting.done()
        await pool.readmit(only.url)  # no publisher attached: health alone readmits
        assert (await asyncio.wait_for(waiting, timeout=5.0)).token_ids


def _publisher(pool):
    return PoolPublisher(pool, lambda r: EnginePublisher([r.client], token=TOKEN, retries=0))


async def test_publish_reaches_every_live_replica_and_ejects_one_that_fails(servers):
    r0, r1, r2 = await servers(3)
    ejected = []
    async with _pool([r0, r1, r2], on_eject=lambda r, why: ejected.append((r.url, why))) as pool:
        pub = _publisher(pool)
        report = await pub.publish("/ckpt/1", 1)
        assert report.servers == [r0.url, r1.url, r2.url] and report.first_token_s is not None
        assert [s.version for s in (r0, r1, r2)] == [1, 1, 1]
        r2.load_status = 500
        report = await pub.publish("/ckpt/2", 2)
        assert report.servers == [r0.url, r1.url] and pub.version == 2
        assert [s.version for s in (r0, r1, r2)] == [2, 2, 1]
        assert (
            ejected == [(r2.url, ejected[0][1])] and "publish of version 2 failed" in ejected[0][1]
        )
        assert [r.url for r in pool.live] == [r0.url, r1.url]  # never serves version 1 silently
        r0.load_status = r1.load_status = 400
        with pytest.raises(PoolPublishError, match="version 3 .*reached no agent replica"):
            await pub.publish("/ckpt/3", 3)
        assert pool.live == [] and pub.version == 2


async def test_readmission_only_after_republishing_the_current_version(servers):
    r0, r1 = await servers(2)
    async with _pool([r0, r1]) as pool:
        pub = _publisher(pool)
        await pub.publish("/ckpt/1", 1)
        await pool.session("on-r0").complete([0], max_tokens=1)
        await r1.kill()
        pinned_to_r1 = pool.session("ep")  # round robin: the next session goes to r1
        with pytest.raises(ReplicaDown, match=f"replica {r1.url} down: complete failed"):
            await pinned_to_r1.complete([1], max_tokens=1)
        with pytest.raises(ReplicaDown, match="health check failed"):
            await pool.readmit(r1.url)  # still dead
        await pub.publish("/ckpt/2", 2)
        assert r0.loads == [1, 2] and r1.loads == [1]
        await r1.start()  # restarted bare (version 0)
        r1.load_status = 500
        with pytest.raises(ReplicaDown, match="republishing version 2 failed"):
            await pool.readmit(r1.url)
        assert [r.url for r in pool.live] == [r0.url]
        r1.load_status = 200
        live_during_load = []
        r1.on_load = lambda v: live_during_load.append((v, pool.replica(r1.url).live))
        await pool.readmit(r1.url)
        assert live_during_load == [(2, False)] and r1.loads == [1, 2]
        assert pool.replica(r1.url).live and pool.replica(r1.url).version == 2
        # The episode pinned before the ejection stays failed; new ones get version 2 there.
        with pytest.raises(ReplicaDown):
            await pinned_to_r1.complete([2], max_tokens=1)
        outs = [await pool.complete([3, i], max_tokens=1) for i in range(2)]
        assert {o.weight_version for o in outs} == {2} and [3, 0] in r0.prompts + r1.prompts
        assert len(_served(r1, [[3, 0], [3, 1]])) == 1


# ----- sick answers: hung completions, refusals, missing logprobs ---------------------------

SICK = PoolConfig(
    health_interval_s=60.0, answer_failures=2, timeout_base_s=0.1, timeout_per_token_s=0.05
)
"""Two failed answers in a row eject; a 2-token completion times out after 0.2 s (the clients'
own timeout is 10 s)."""
GUARD_S = 2.0
"""Bounds each request in these tests: far above the scaled timeouts, far below the client's."""


def _episode(pool, i, prompt, **kw):
    async def run():
        with pinned(f"ep{i}"):
            return await pool.complete(prompt, **kw)

    return asyncio.wait_for(run(), timeout=GUARD_S)


async def test_a_replica_whose_completions_hang_is_ejected_after_n_timeouts(servers):
    good, sick = await servers(2)
    sick.hang = True  # its /health answers 200 throughout
    scaled = SICK.timeout_for(2, FAST.timeout_s)
    assert scaled == pytest.approx(0.2) and SICK.timeout_for(10_000, FAST.timeout_s) == 10.0
    ejected = []
    async with _pool(
        [good, sick],
        config=dataclasses.replace(SICK, health_interval_s=0.02),
        on_eject=lambda r, why: ejected.append((r.url, why)),
    ) as pool:
        outcomes, waits = [], []
        for i in range(10):  # one request per episode: round robin while the loads are equal
            began = time.monotonic()
            try:
                out = await _episode(pool, i, [i], max_tokens=2)
                outcomes.append("ok" if [i] in good.prompts and out.token_ids else "?")
            except ClientError as e:
                outcomes.append(type(e).__name__)
            waits.append(time.monotonic() - began)
        # The 2nd episode times out on the sick replica, the 4th too and ejects it: every
        # later episode goes to the healthy one, and none waited more than the scaled timeout.
        assert outcomes == ["ok", "ClientTimeout", "ok", "ReplicaDown"] + ["ok"] * 6
        assert max(waits) < scaled + 0.5 and len(sick.bodies) == 2
        assert [u for u, _ in ejected] == [sick.url]
        assert ejected[0][1] == (
            "2 answers in a row failed (2 timed out), the last: complete: "
            "POST /v1/completions: no answer within 0.2s"
        )
        # Its health checks (every 0.02 s) passed all along: only its answers told. The
        # requests it held were dropped, nothing was sent to it since, and it stays out (its
        # owner restarts it).
        assert len(sick.health_seen) >= 2 and sick.health_status == 200
        assert await wait_until(lambda: sick.held == 0) and len(sick.bodies) == 2
        assert not pool.replica(sick.url).live
        stats = pool.stats()
        assert stats["ejected_for"] == {"timeout": 1} and stats["live"] == 1
        assert stats["per_replica"][1]["ejected_for"] == {"timeout": 1}
        assert stats["per_replica"][1]["last_ejection"] == ejected[0][1]
        assert stats["per_replica"][0]["strikes"] == 0


async def test_concurrent_episodes_on_a_hung_replica_end_within_the_scaled_timeout(servers):
    good, sick = await servers(2)
    sick.hang = True
    async with _pool([good, sick], config=SICK) as pool:
        began = time.monotonic()
        outs = await asyncio.gather(
            *(_episode(pool, i, [i], max_tokens=2) for i in range(8)), return_exceptions=True
        )
        took = time.monotonic() - began
        failed = [type(o).__name__ for o in outs if isinstance(o, BaseException)]
        # The 4 episodes pinned to the sick replica time out together: the first to end is a
        # timeout, the second ejects the replica, and all three after the first end
        # `ReplicaDown` (the episode is blamed on it); the 4 on the healthy replica finish.
        assert sorted(failed) == ["ClientTimeout"] + ["ReplicaDown"] * 3
        assert took < SICK.timeout_for(2, FAST.timeout_s) + 0.5
        assert [r.url for r in pool.live] == [good.url]


async def test_a_replica_refusing_what_its_peer_serves_is_ejected_a_bad_request_ejects_none(
    servers,
):
    good, sick = await servers(2)
    for s in (good, sick):
        s.max_prompt = 8  # their context
    too_long = list(range(20))
    async with _pool([good, sick], config=SICK) as pool:
        # A request that is itself bad is refused by every replica: however often, and on
        # whichever replica it lands, it ejects none (each refusal was checked on the peer).
        for i in range(6):
            with pytest.raises(ClientError, match="400.*maximum context length") as info:
                await _episode(pool, i, too_long, max_tokens=2)
            assert not isinstance(info.value, ReplicaDown)
            with pytest.raises(ClientError, match="400"):
                await pool.complete(too_long, max_tokens=2)  # outside an episode: the same
        assert len(pool.live) == 2 and pool.stats()["ejections"] == 0
        assert good.prompts.count(too_long) == sick.prompts.count(too_long) == 12
        assert [r.strikes for r in pool.replicas] == [0, 0]
    async with _pool([sick, good], config=SICK) as pool:
        on_sick = pool.session("ep-a")
        await on_sick.complete([1], max_tokens=2)
        assert on_sick.replica.url == sick.url
        sick.completion_status = 400  # refuses everything, /health still fine
        with pytest.raises(ClientError, match="400") as info:
            await on_sick.complete([2], max_tokens=2)
        assert not isinstance(info.value, ReplicaDown) and pool.replica(sick.url).strikes == 1
        assert good.prompts[-1] == [2]  # the same request, answered by the peer: sick's fault
        # Outside an episode a refusal is answered by the peer instead (round robin sends the
        # 2nd request to the sick replica): its 2nd strike ejects it.
        first = await pool.complete([3], max_tokens=2)
        second = await pool.complete([4], max_tokens=2)
        assert first.token_ids and second.token_ids
        assert sick.prompts[-1] == [4] and good.prompts[-2:] == [[3], [4]]
        assert [r.url for r in pool.live] == [good.url]
        why = r"2 answers in a row failed \(2 bad\), the last: complete: POST /v1/\S+ -> 400"
        with pytest.raises(ReplicaDown, match=f"replica {sick.url} down: {why}"):
            await on_sick.complete([5], max_tokens=2)
        assert pool.stats()["ejected_for"] == {"bad_answer": 1}
        assert f"answered by {good.url}" in pool.stats()["per_replica"][0]["last_ejection"]
    # A lone replica cannot be told from a bad request: it is never ejected for refusals.
    async with _pool([sick], config=SICK) as pool:
        for i in range(4):
            with pytest.raises(ClientError, match="400"):
                await _episode(pool, i, [i], max_tokens=2)
        assert len(pool.live) == 1 and pool.replicas[0].strikes == 0


async def test_an_answer_without_the_logprobs_asked_for_is_an_error_counted_against_it(servers):
    good, sick = await servers(2)
    async with _pool([sick, good], config=SICK) as pool:
        on_sick = pool.session("ep")
        await on_sick.complete([1], max_tokens=2, logprobs=0)
        sick.drop_logprobs = True
        out = await on_sick.complete([2], max_tokens=2)  # none asked: none missing
        assert out.logprobs is None and pool.replica(sick.url).strikes == 0
        with pytest.raises(
            BadAnswer,
            match=r"without the logprobs asked for \(logprobs=0\): "
            "choice 0 has no logprobs for",
        ):
            await on_sick.complete([3], max_tokens=2, logprobs=0)
        assert pool.replica(sick.url).strikes == 1
        with pytest.raises(ReplicaDown, match="2 answers in a row failed.*no logprobs"):
            await on_sick.complete([4], max_tokens=2, logprobs=0)
        assert pool.stats()["ejected_for"] == {"bad_answer": 1}


async def test_a_good_answer_resets_the_count_of_failed_answers(servers):
    good, flaky = await servers(2)
    async with _pool([flaky, good], config=SICK) as pool:
        session = pool.session("ep")
        for _ in range(3):  # fail, succeed, fail...: never 2 in a row
            flaky.hang = True
            with pytest.raises(ClientTimeout):
                await asyncio.wait_for(session.complete([1], max_tokens=2), GUARD_S)
            flaky.hang = False
            await session.complete([2], max_tokens=2)
            assert pool.replica(flaky.url).strikes == 0
        assert len(pool.live) == 2 and session.replica.url == flaky.url


async def test_a_replica_ejected_for_its_answers_is_readmitted_only_after_a_probe_completion(
    servers,
):
    good, sick = await servers(2)
    cfg = dataclasses.replace(SICK, answer_failures=1)
    async with _pool([sick, good], config=cfg, on_eject=lambda r, why: None) as pool:
        pub = _publisher(pool)
        await pub.publish("/ckpt/1", 1)
        sick.hang = True
        with pytest.raises(ReplicaDown, match="1 timed out"):
            await _episode(pool, 0, [1], max_tokens=2)
        # /health answers, completions hang: the probe (1 token, its timeout scaled) keeps it out.
        with pytest.raises(
            ReplicaDown,
            match="not readmitted: probe completion failed: "
            "POST /v1/completions: no answer within 0.15s",
        ):
            await asyncio.wait_for(pool.readmit(sick.url), GUARD_S)
        probe = sick.bodies[-1]
        assert probe["prompt"] == [0] and probe["max_tokens"] == 1 and probe["logprobs"] == 0
        assert not pool.replica(sick.url).live and sick.loads == [1]  # nothing republished
        sick.hang = False
        await pool.readmit(sick.url)  # probed, then brought to the current version
        assert pool.replica(sick.url).live and sick.loads == [1, 1]
        assert [b for b in sick.bodies if b == probe] == [probe, probe]
        # It takes new episodes again (round robin: the next one goes to it).
        await _episode(pool, 1, [2], max_tokens=2)
        await _episode(pool, 2, [3], max_tokens=2)
        assert len(_served(sick, [[2], [3]])) == 1


async def test_without_an_owner_the_pool_probes_a_sick_replica_and_readmits_it(servers):
    good, sick = await servers(2)
    sick.hang = True
    cfg = dataclasses.replace(SICK, answer_failures=1, health_interval_s=0.02)
    async with _pool([sick, good], config=cfg) as pool:
        with pytest.raises(ReplicaDown, match="1 timed out"):
            await _episode(pool, 0, [1], max_tokens=2)
        # Every health round probes it; while its completions hang it stays out.
        assert await wait_until(lambda: sick.prompts.count([0]) >= 3)
        assert not pool.replica(sick.url).live
        sick.hang = False
        assert await wait_until(lambda: pool.replica(sick.url).live)
        assert pool.stats()["per_replica"][0]["reason"] is None


# ----- the orchestrator ----------------------------------------------------------------------


def _local(task):
    return LocalShell(LocalShellConfig(), setup=task.setup)


async def test_a_replica_killed_mid_episode_aborts_only_its_episodes(servers):
    tasks = generate_textops(TextopsConfig(num_tasks=3, seed=0, from_file_prob=0.0))
    keep, doomed = await servers(2, tasks)
    doomed.hold_from_turn = 1  # its episodes play turn 0, then wait mid-episode
    ejected = []
    async with _pool([keep, doomed], on_eject=lambda r, why: ejected.append(r.url)) as pool:
        runner = RolloutRunner(
            OrchestratorConfig(arm="real", group_size=2),
            TERMINAL,
            RENDERER,
            Backends(real=_local),
            client=pool,
        )
        job = asyncio.create_task(runner.run(tasks), name="rollout")
        # Every episode either finished (on `keep`) or is stuck mid-episode on `doomed`.
        assert await wait_until(lambda: doomed.held and runner.metrics.episodes + doomed.held == 6)
        stuck = doomed.held
        await doomed.kill()
        trajs = await asyncio.wait_for(job, timeout=10.0)
    assert ejected == [doomed.url]
    aborted = [t for t in trajs if t.status == "aborted"]
    assert len(aborted) == stuck and len(trajs) == 6
    for t in trajs:
        validate(t)
        if t.status == "aborted":
            assert t.reason.startswith(f"replica {doomed.url} down:")
            assert t.replica_down == doomed.url and t.reward is None
            assert len(t.turns) == 1  # played its first turn there, nothing was moved
        else:
            assert t.status == "ok" and t.reward == 1.0, (t.status, t.reason)
    summary = runner.metrics.summary()
    assert summary["replica_down"] == {doomed.url: stuck}
    assert summary["status"] == {"ok": 6 - stuck, "aborted": stuck}
    assert summary["pools"]["agent"]["ejections"] == 1


def _simulated_on(pool):
    def simulated(task):
        cfg = SimulatedShellConfig(max_tokens=64)
        return SimulatedShell(
            pool, task_instruction=task.instruction, setup=task.setup, config=cfg, renderer=RENDERER
        )

    return simulated


def _sim_pool(dead, sim):
    return ReplicaPool(
        [dead, sim.url],
        role="simulator",
        client_config=FAST,
        config=PoolConfig(health_interval_s=60.0),
    )


async def test_a_dead_simulator_replica_aborts_the_episodes_pinned_to_it(servers):
    tasks = generate_textops(TextopsConfig(num_tasks=2, seed=1))
    (sim,) = await servers(1)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused
    async with _sim_pool(dead, sim) as pool:
        runner = RolloutRunner(
            OrchestratorConfig(arm="closed_loop", group_size=2),
            TERMINAL,
            RENDERER,
            Backends(simulated=_simulated_on(pool)),
            client=FakeAgentClient(tasks),
        )
        trajs = await runner.run(tasks)
        assert [r.url for r in pool.live] == [sim.url]
    down = [t for t in trajs if t.status == "aborted"]
    assert down and len(down) < len(trajs) and sim.prompts
    for t in trajs:
        validate(t)
        if t in down:  # the simulated shell reported a shell error: the replica is blamed
            assert t.reason.startswith(f"replica {dead} down:") and t.replica_down == dead
        else:
            assert t.status == "ok" and t.replica_down is None
    assert runner.metrics.summary()["replica_down"] == {dead: len(down)}
    # Arm (c) replays through a simulator pool: the first replay lands on the dead replica.
    async with _sim_pool(dead, sim) as pool:
        runner = RolloutRunner(
            OrchestratorConfig(arm="replay"),
            TERMINAL,
            RENDERER,
            Backends(simulated=_simulated_on(pool)),
        )
        replays = await runner.run(tasks, replay=[t for t in trajs if t.status == "ok"])
    assert replays[0].status == "aborted" and replays[0].replica_down == dead
    assert replays[0].reason.startswith(f"replica {dead} down:")
    assert all(t.status == "ok" for t in replays[1:])


def test_pool_config_and_construction_errors_name_the_field():
    with pytest.raises(ValueError, match="health_failures=0"):
        PoolConfig(health_failures=0)
    with pytest.raises(ValueError, match="health_interval_s=0"):
        PoolConfig(health_interval_s=0)
    for bad, says in (
        ({"answer_failures": 0}, "answer_failures=0 is invalid: an integer >= 1"),
        ({"answer_failures": True}, "answer_failures=True is invalid"),
        ({"timeout_base_s": 0.0}, "timeout_base_s=0.0 is invalid: > 0"),
        ({"timeout_per_token_s": -1.0}, "timeout_per_token_s=-1.0 is invalid"),
        ({"timeout_per_token_s": float("nan")}, "per_token_s=nan"),
    ):
        with pytest.raises(ValueError) as info:
            PoolConfig(**bad)
        assert says in str(info.value)
    with pytest.raises(ValueError, match="at least one replica"):
        ReplicaPool([])
    with pytest.raises(ValueError, match="twice"):
        ReplicaPool(["http://127.0.0.1:1", "http://127.0.0.1:1"])
    with pytest.raises(KeyError, match="not a replica"):
        ReplicaPool(["http://127.0.0.1:1"]).replica("http://127.0.0.1:2")
