"""Replica pools against real HTTP servers on 127.0.0.1: sticky sessions, least-in-flight
balancing, ejection (dead server, failed health checks, failed publish) with `ReplicaDown` for
exactly the pinned episodes, readmission only at the current version, and the orchestrator
ending affected episodes `aborted` with the replica's reason while the rest finish."""

import asyncio

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
from serving.client import ClientConfig, ClientError
from serving.pool import (
    PoolConfig,
    PoolPublisher,
    PoolPublishError,
    ReplicaDown,
    ReplicaPool,
    pinned,
)
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
        self.loads: list[int] = []
        self.version = 0
        self.held = 0
        self.release = asyncio.Event()
        self.health_status = 200
        """200, 503, or 0: never answer."""
        self.completion_status = 200
        self.load_status = 200
        self.hold_from_turn: int | None = None
        """Hold agent requests whose prompt already holds this many replies."""
        self.on_load = None
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
        choice = {"index": 0, "text": text, "token_ids": ids, "finish_reason": "stop",
                  "logprobs": {"token_logprobs": [-0.5] * len(ids)},
                  "token_versions": [self.version] * len(ids)}  # fmt: skip
        return web.json_response({"choices": [choice], "weight_version": self.version})

    async def health(self, request):
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
            return web.json_response({"error": {"message": "cannot read checkpoint"}},
                                     status=self.load_status)  # fmt: skip
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
        held = [asyncio.create_task(s.complete(HOLD, max_tokens=1), name=f"hold-{i}")
                for i, s in enumerate((a, a, c))]  # fmt: skip
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
        waiting = asyncio.create_task(pool.session("patient").complete([2], max_tokens=1),
                                      name="waiting")  # fmt: skip
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


# ----- the orchestrator ----------------------------------------------------------------------


def _local(task):
    return LocalShell(LocalShellConfig(), setup=task.setup)


async def test_a_replica_killed_mid_episode_aborts_only_its_episodes(servers):
    tasks = generate_textops(TextopsConfig(num_tasks=3, seed=0, from_file_prob=0.0))
    keep, doomed = await servers(2, tasks)
    doomed.hold_from_turn = 1  # its episodes play turn 0, then wait mid-episode
    ejected = []
    async with _pool([keep, doomed], on_eject=lambda r, why: ejected.append(r.url)) as pool:
        runner = RolloutRunner(OrchestratorConfig(arm="real", group_size=2), TERMINAL, RENDERER,
                               Backends(real=_local), client=pool)  # fmt: skip
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
            assert t.meta["replica_down"] == doomed.url and t.reward is None
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
        return SimulatedShell(pool, task_instruction=task.instruction, setup=task.setup,
                              config=cfg, renderer=RENDERER)  # fmt: skip

    return simulated


def _sim_pool(dead, sim):
    return ReplicaPool([dead, sim.url], role="simulator", client_config=FAST,
                       config=PoolConfig(health_interval_s=60.0))  # fmt: skip


async def test_a_dead_simulator_replica_aborts_the_episodes_pinned_to_it(servers):
    tasks = generate_textops(TextopsConfig(num_tasks=2, seed=1))
    (sim,) = await servers(1)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused
    async with _sim_pool(dead, sim) as pool:
        runner = RolloutRunner(OrchestratorConfig(arm="closed_loop", group_size=2), TERMINAL,
                               RENDERER, Backends(simulated=_simulated_on(pool)),
                               client=FakeAgentClient(tasks))  # fmt: skip
        trajs = await runner.run(tasks)
        assert [r.url for r in pool.live] == [sim.url]
    down = [t for t in trajs if t.status == "aborted"]
    assert down and len(down) < len(trajs) and sim.prompts
    for t in trajs:
        validate(t)
        if t in down:  # the simulated shell reported a shell error: the replica is blamed
            assert t.reason.startswith(f"replica {dead} down:") and t.meta["replica_down"] == dead
        else:
            assert t.status == "ok" and "replica_down" not in t.meta
    assert runner.metrics.summary()["replica_down"] == {dead: len(down)}
    # Arm (c) replays through a simulator pool: the first replay lands on the dead replica.
    async with _sim_pool(dead, sim) as pool:
        runner = RolloutRunner(OrchestratorConfig(arm="replay"), TERMINAL, RENDERER,
                               Backends(simulated=_simulated_on(pool)))  # fmt: skip
        replays = await runner.run(tasks, replay=[t for t in trajs if t.status == "ok"])
    assert replays[0].status == "aborted" and replays[0].meta["replica_down"] == dead
    assert replays[0].reason.startswith(f"replica {dead} down:")
    assert all(t.status == "ok" for t in replays[1:])


def test_pool_config_and_construction_errors_name_the_field():
    with pytest.raises(ValueError, match="health_failures=0"):
        PoolConfig(health_failures=0)
    with pytest.raises(ValueError, match="health_interval_s=0"):
        PoolConfig(health_interval_s=0)
    with pytest.raises(ValueError, match="at least one replica"):
        ReplicaPool([])
    with pytest.raises(ValueError, match="twice"):
        ReplicaPool(["http://127.0.0.1:1", "http://127.0.0.1:1"])
    with pytest.raises(KeyError, match="not a replica"):
        ReplicaPool(["http://127.0.0.1:1"]).replica("http://127.0.0.1:2")
