"""`ReplicaRestarter` (launch/deploy/local.py) against real HTTP servers on 127.0.0.1: an ejected
replica's server is stopped, started again on its port and readmitted at the pool's current
version; failed restarts are retried, then the replica is given up (sessions fail at once when
none is left, never wait); closing cancels the restarts under way and stops what they started.
"""

import asyncio
import threading
import time

import pytest
from aiohttp import web

from launch.deploy.local import ReplicaRestarter, start_in_thread
from rl.model.publish import InMemoryPublisher
from serving.client import ClientConfig
from serving.pool import PoolConfig, ReplicaDown, ReplicaPool
from serving.pool_publish import PoolPublisher
from tests.fakes import free_port, wait_until

FAST = ClientConfig(backoff_s=0.01, max_backoff_s=0.02, max_retries=0, timeout_s=5.0)
SLOW_HEALTH = PoolConfig(health_interval_s=60.0, wait_live_s=30.0)
"""Ejections come from the test; a session waits long for a live replica unless told not to."""


async def _health(request):
    return web.json_response({"status": "ok"})


class Server:
    """A `/health` server on a fixed port, startable again after a stop."""

    def __init__(self, port: int):
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.runner: web.AppRunner | None = None

    async def start(self) -> "Server":
        app = web.Application()
        app.router.add_get("/health", _health)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


@pytest.fixture
async def fleet():
    """-> make(n): n started servers and a pool over them; everything stops at the end."""
    made: list[tuple[list[Server], ReplicaPool]] = []

    async def make(n: int):
        servers = [await Server(free_port()).start() for _ in range(n)]
        pool = ReplicaPool([s.url for s in servers], config=SLOW_HEALTH, client_config=FAST)
        await pool.start()
        made.append((servers, pool))
        return servers, pool

    yield make
    for servers, pool in made:
        await pool.close()
        for s in servers:
            await s.stop()


async def test_an_ejected_replica_is_restarted_on_its_port_and_readmitted_at_the_version(fleet):
    servers, pool = await fleet(2)
    made: list[int] = []
    PoolPublisher(pool, lambda r: made.append(r.index) or InMemoryPublisher())
    await pool.publisher.publish("/ckpt/v3", 3)
    stopped, started = [], []

    async def stop(server):
        stopped.append(server)
        await server.stop()

    async def start(i, closing):
        started.append(i)
        return await Server(servers[i].port).start()

    current = list(servers)
    restarter = ReplicaRestarter(pool, current, start, stop, backoff_s=0.01)
    await servers[1].stop()  # it died
    assert pool.eject(1, "died")
    assert await wait_until(lambda: pool.replicas[1].live)
    assert stopped == [servers[1]] and started == [1]
    assert current[1] is not servers[1] and current[1].port == servers[1].port
    assert pool.replicas[1].version == 3 and made == [0, 1, 1]  # republished to the new one
    assert pool.replicas[0].live
    assert pool.stats()["restarts"] == 1 and pool.stats()["per_replica"][1]["restarts"] == 1
    await restarter.close()
    for s in current:
        await s.stop()


async def test_a_replica_that_never_comes_back_is_given_up_and_sessions_fail_at_once(fleet, caplog):
    servers, pool = await fleet(2)
    tries: list[tuple[int, float]] = []

    async def start(i, closing):
        tries.append((i, time.monotonic()))
        raise RuntimeError(f"chips of replica {i} are held by another process")

    async def stop(server):
        await server.stop()

    restarter = ReplicaRestarter(pool, list(servers), start, stop, attempts=3, backoff_s=0.05)
    pool.eject(0, "died")
    assert await wait_until(lambda: pool.replicas[0].retired)
    assert [i for i, _ in tries] == [0, 0, 0]
    gaps = [b - a for (_, a), (_, b) in zip(tries, tries[1:], strict=False)]
    assert gaps[0] >= 0.05 and gaps[1] >= 0.1  # backoff, doubled
    assert "3 restarts failed" in pool.replicas[0].reason
    assert "held by another process" in pool.replicas[0].reason
    assert any(r.levelname == "ERROR" and "given up" in r.message for r in caplog.records)

    # The other replica still serves new sessions.
    session = pool.session("ep-1")
    await session.request("GET", "/health")
    assert session.replica is pool.replicas[1]

    # With none left, a new session fails at once with the reasons (not after wait_live_s).
    pool.eject(1, "died too")
    assert await wait_until(lambda: pool.replicas[1].retired)
    began = time.monotonic()
    with pytest.raises(ReplicaDown, match="given up") as e:
        await pool.session("ep-2").request("GET", "/health")
    assert time.monotonic() - began < 1.0 and servers[0].url in str(e.value)
    await restarter.close()


async def test_with_restarts_off_a_dead_replica_is_retired_at_once_saying_so(fleet):
    servers, pool = await fleet(2)
    started: list[int] = []

    async def start(i, closing):
        started.append(i)

    restarter = ReplicaRestarter(pool, list(servers), start, lambda s: s.stop(), attempts=0)
    pool.eject(0, "died")
    assert await wait_until(lambda: pool.replicas[0].retired)
    assert started == [] and "restarts are off (serve.restart_attempts: 0)" in (
        pool.replicas[0].reason
    )
    await restarter.close()


def test_restart_settings_are_validated_with_the_allowed_range():
    from launch.config.schema import ServeConfig

    assert ServeConfig(restart_attempts=5, restart_backoff_s=0.5).restart_attempts == 5
    for bad, says in (
        ({"restart_attempts": -1}, "restart_attempts=-1 is invalid: an integer"),
        ({"restart_attempts": True}, "restart_attempts=True"),
        ({"restart_backoff_s": float("nan")}, "restart_backoff_s=nan"),
    ):
        with pytest.raises(ValueError, match=None) as e:
            ServeConfig(**bad)
        assert says in str(e.value)


async def test_a_session_waiting_for_a_replica_fails_when_the_last_one_is_given_up(fleet):
    servers, pool = await fleet(2)
    go = asyncio.Event()

    async def start(i, closing):
        await go.wait()
        raise RuntimeError("no chips")

    restarter = ReplicaRestarter(pool, list(servers), start, lambda s: s.stop(), attempts=1)
    pool.eject(0, "died")
    pool.eject(1, "died")
    waiting = asyncio.create_task(pool.session("ep").request("GET", "/health"), name="waiting")
    await asyncio.sleep(0.05)  # it waits for a restart (SLOW_HEALTH: up to 30 s)
    assert not waiting.done()
    go.set()
    with pytest.raises(ReplicaDown, match="given up"):
        await asyncio.wait_for(waiting, 5.0)
    await restarter.close()


async def test_closing_cancels_a_restart_under_way(fleet):
    servers, pool = await fleet(2)
    entered, cancelled = asyncio.Event(), asyncio.Event()
    seen: list[threading.Event] = []

    async def start(i, closing):
        seen.append(closing)
        entered.set()
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    restarter = ReplicaRestarter(pool, list(servers), start, lambda s: s.stop())
    pool.eject(1, "died")
    await asyncio.wait_for(entered.wait(), 5.0)
    await asyncio.wait_for(restarter.close(), 5.0)
    assert cancelled.is_set() and seen[0].is_set() and not pool.replicas[1].live
    pool.eject(0, "after close")  # ignored: nothing is restarted any more
    assert len(seen) == 1


async def test_a_server_started_in_a_thread_for_a_cancelled_restart_is_stopped():
    release, stopped = threading.Event(), []

    def start():
        release.wait(5.0)
        return "server-1"

    job = asyncio.create_task(start_in_thread(start, stopped.append), name="restart")
    await asyncio.sleep(0)  # the restart is under way: its thread runs `start`
    job.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await job
    assert stopped == ["server-1"]
