"""A pool of server replicas for one role (agent or simulator): sticky routing, load balancing,
health checks, ejection, and publishing weights to every live replica.

    pool = ReplicaPool(["http://127.0.0.1:8001", "http://127.0.0.1:8002"], role="agent",
                       on_eject=lambda replica, why: restart(replica.url))
    async with pool:                               # starts the health checks
        with pinned("g0-ep1"):                     # one episode: every pool sticks to a replica
            out = await pool.complete(ids, max_tokens=64)
        session = pool.session("g0-ep2")           # or explicitly, one client per episode
        out = await session.complete(ids, max_tokens=64)

Components (who calls whom): an episode calls a `PoolSession` (the pool itself routes through
the session of the current `pinned` scope) -> `ReplicaPool` picks, once per session, the live
replica with the fewest in-flight requests (ties: round robin), and the session stays there
(its prefix cache stays warm) -> `InferenceClient` of that replica. A replica is ejected when
its health check fails `health_failures` times in a row, when a request fails as a dead server
does (no connection, or 5xx after the client's own retries), or when a publish fails; its
in-flight requests and every later request of a session pinned to it raise `ReplicaDown`
(never moved mid-episode to another replica: other KV, maybe another version). The owner
restarts it (`on_eject`) and calls `readmit`, which republishes the current version through
the attached `PoolPublisher` before the replica takes traffic again; an owner that gives up on
a replica `retire`s it, and once every replica is retired new sessions fail at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from rl.model.publish import PublishReport, WeightPublisher
from serving.client import ClientConfig, ClientError, ClientTimeout, Completion, InferenceClient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolConfig:
    """How a pool watches its replicas."""

    health_interval_s: float = 5.0
    """Between two rounds of `GET /health` on every live replica."""
    health_timeout_s: float = 5.0
    """Per health check; no answer in time counts as a failure."""
    health_failures: int = 2
    """Consecutive failed health checks that eject a replica."""
    wait_live_s: float = 60.0
    """How long a new session waits for a live replica (all ejected, e.g. restarting)."""

    def __post_init__(self) -> None:
        for name in ("health_interval_s", "health_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PoolConfig.{name}={getattr(self, name)!r} is invalid: > 0")
        if not isinstance(self.health_failures, int) or self.health_failures < 1:
            raise ValueError(f"PoolConfig.health_failures={self.health_failures!r} is invalid: "
                             "an integer >= 1")  # fmt: skip
        if self.wait_live_s < 0:
            raise ValueError(f"PoolConfig.wait_live_s={self.wait_live_s!r} is invalid: >= 0")


class ReplicaDown(ClientError):
    """The replica an episode is pinned to was ejected: the episode cannot go on there."""

    def __init__(self, url: str | None, why: str):
        super().__init__(f"replica {url} down: {why}" if url else why)
        self.url, self.why = url, why

    @property
    def retryable(self) -> bool:
        return False


class PoolPublishError(ClientError):
    """No live replica took the published version."""


@dataclass(eq=False)
class Replica:
    """One server of the pool, with the numbers its metrics show."""

    index: int
    client: InferenceClient
    live: bool = True
    in_flight: int = 0
    ejections: int = 0
    generation: int = 0
    """Bumped at every readmission: a session pinned to an older generation is stale."""
    reason: str | None = None
    """Why it was last ejected."""
    version: int | None = None
    """Last weight version published to it through the pool."""
    failed_checks: int = 0
    restarts: int = 0
    """Processes its owner started in place of a dead one (counted by the owner)."""
    retired: bool = False
    """Its owner gave up restarting it: it stays out until readmitted."""
    _down: asyncio.Future | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return self.client.cfg.base_url

    def down_future(self) -> asyncio.Future:
        """Resolves (with the reason) when this generation of the replica is ejected."""
        if self._down is None:
            self._down = asyncio.get_running_loop().create_future()
            if not self.live:
                self._down.set_result(self.reason)
        return self._down


def is_dead_server(e: BaseException) -> bool:
    """A failure that says the server is gone or broken (not that the request was bad or
    slow): no connection / reset, or 5xx after the client's own retries."""
    if not isinstance(e, ClientError) or isinstance(e, ClientTimeout | ReplicaDown):
        return False
    return (e.status is not None and e.status >= 500) or isinstance(
        e.__cause__, aiohttp.ClientError
    )


# ----- per-episode affinity --------------------------------------------------------------------


@dataclass(eq=False)
class Affinity:
    """One episode's sessions, one per pool it used, and the `ReplicaDown`s it met."""

    key: str
    sessions: dict[int, PoolSession] = field(default_factory=dict)
    failures: list[ReplicaDown] = field(default_factory=list)


_AFFINITY: ContextVar[Affinity | None] = ContextVar("simloop_pool_affinity", default=None)


@contextlib.contextmanager
def pinned(key: str) -> Iterator[Affinity]:
    """Within this scope (and tasks started from it), every pool routes through one session
    per pool: an episode's agent and simulator requests each stick to one replica, without
    the code in between (shells, envs) knowing about pools."""
    affinity = Affinity(key)
    token = _AFFINITY.set(affinity)
    try:
        yield affinity
    finally:
        _AFFINITY.reset(token)


class PoolSession:
    """A client for one episode: its first request pins it to a replica, where it stays."""

    def __init__(self, pool: ReplicaPool, key: str, affinity: Affinity | None = None):
        self.pool, self.key, self._affinity = pool, key, affinity
        self.replica: Replica | None = None
        self._generation = 0

    async def complete(self, prompt: list[int] | str, **kw: Any) -> Completion:
        return await self._call("complete", prompt, **kw)

    async def complete_n(self, prompt: list[int] | str, **kw: Any) -> list[Completion]:
        return await self._call("complete_n", prompt, **kw)

    async def chat(self, messages: list[dict[str, Any]], **kw: Any) -> Completion:
        return await self._call("chat", messages, **kw)

    async def request(self, method: str, path: str, **kw: Any) -> tuple[Any, int]:
        return await self._call("request", method, path, **kw)

    def _fail(self, down: ReplicaDown) -> ReplicaDown:
        if self._affinity is not None:
            self._affinity.failures.append(down)
        return down

    async def _call(self, name: str, *args: Any, **kw: Any) -> Any:
        if self.replica is None:
            try:
                self.replica = await self.pool._pick(self.key)
            except ReplicaDown as e:
                raise self._fail(e) from None
            self._generation = self.replica.generation
        r = self.replica
        if not r.live or r.generation != self._generation:
            raise self._fail(ReplicaDown(r.url, r.reason or "ejected"))
        down = r.down_future()
        r.in_flight += 1
        task_name = f"pool-{self.pool.role}-{r.index}-{self.key}-{name}"
        call = asyncio.create_task(getattr(r.client, name)(*args, **kw), name=task_name)
        try:
            await asyncio.wait((call, down), return_when=asyncio.FIRST_COMPLETED)
        finally:
            r.in_flight -= 1
            finished = call.done()
            if not finished:  # ejected while in flight (or we were cancelled): drop the call
                call.cancel()
        if not finished:
            raise self._fail(ReplicaDown(r.url, down.result()))
        try:
            return call.result()
        except ClientError as e:
            if not is_dead_server(e):
                raise
            self.pool.eject(r, f"{name} failed: {e}", generation=self._generation)
            raise self._fail(ReplicaDown(r.url, r.reason or str(e))) from e


# ----- the pool --------------------------------------------------------------------------------


class ReplicaPool:
    """R replicas of one role; client-like (`complete`, `complete_n`, `chat`, `request`)."""

    def __init__(
        self,
        replicas: Sequence[InferenceClient | str],
        *,
        role: str = "agent",
        config: PoolConfig | None = None,
        client_config: ClientConfig | None = None,
        on_eject: Callable[[Replica, str], None] | None = None,
    ):
        """`replicas`: clients, or URLs made into clients with `client_config` (its
        `base_url` replaced). `on_eject(replica, reason)` is called once per ejection (the
        owner restarts the server and later calls `readmit`); it must not block."""
        if not replicas:
            raise ValueError(f"ReplicaPool({role!r}) needs at least one replica")
        self.role, self.cfg, self.on_eject = role, config or PoolConfig(), on_eject
        base = client_config or ClientConfig()
        self.replicas: list[Replica] = []
        self._owned: list[InferenceClient] = []
        for i, r in enumerate(replicas):
            if isinstance(r, str):
                r = InferenceClient(dataclasses.replace(base, base_url=r))
                self._owned.append(r)
            self.replicas.append(Replica(i, r))
        urls = [r.url for r in self.replicas]
        if len(set(urls)) != len(urls):
            raise ValueError(f"ReplicaPool({role!r}) lists a replica twice: {urls}")
        self.publisher: PoolPublisher | None = None
        """Set by `PoolPublisher`: readmission republishes its current version first."""
        self._cursor = 0
        self._live_changed = asyncio.Event()
        self._health: asyncio.Task | None = None

    @property
    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.live]

    def replica(self, which: Replica | str | int) -> Replica:
        """A replica by object, URL or index."""
        for r in self.replicas:
            if which is r or which == r.url or which == r.index:
                return r
        raise KeyError(f"{which!r} is not a replica of the {self.role} pool "
                       f"({[r.url for r in self.replicas]})")  # fmt: skip

    # ----- routing ---------------------------------------------------------------------------

    def session(self, key: str) -> PoolSession:
        """A client for one episode, pinned to one replica from its first request on."""
        return PoolSession(self, key)

    def _current(self) -> PoolSession:
        affinity = _AFFINITY.get()
        if affinity is None:  # not inside an episode: each request is routed on its own
            return PoolSession(self, "unpinned")
        session = affinity.sessions.get(id(self))
        if session is None:
            session = affinity.sessions[id(self)] = PoolSession(self, affinity.key, affinity)
        return session

    async def complete(self, prompt: list[int] | str, **kw: Any) -> Completion:
        return await self._current().complete(prompt, **kw)

    async def complete_n(self, prompt: list[int] | str, **kw: Any) -> list[Completion]:
        return await self._current().complete_n(prompt, **kw)

    async def chat(self, messages: list[dict[str, Any]], **kw: Any) -> Completion:
        return await self._current().chat(messages, **kw)

    async def request(self, method: str, path: str, **kw: Any) -> tuple[Any, int]:
        return await self._current().request(method, path, **kw)

    async def _pick(self, key: str) -> Replica:
        deadline = time.monotonic() + self.cfg.wait_live_s
        while not self.live:
            self._live_changed.clear()
            down = "; ".join(f"{r.url}: {r.reason}" for r in self.replicas)
            if all(r.retired for r in self.replicas):  # nothing will come back: do not wait
                raise ReplicaDown(None, f"no live {self.role} replica for {key}: every one "
                                  f"failed and was given up ({down})")  # fmt: skip
            left = deadline - time.monotonic()
            if left <= 0:
                raise ReplicaDown(None, f"no live {self.role} replica for {key} within "
                                  f"{self.cfg.wait_live_s:g}s ({down})")  # fmt: skip
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._live_changed.wait()
        n = len(self.replicas)
        order = [self.replicas[(self._cursor + i) % n] for i in range(n)]
        best = min((r for r in order if r.live), key=lambda r: r.in_flight)
        self._cursor = best.index + 1
        return best

    # ----- ejection and readmission ----------------------------------------------------------

    def eject(self, replica: Replica | str | int, reason: str, *,
              generation: int | None = None) -> bool:  # fmt: skip
        """Take a replica out of service; False if it already was (or was readmitted since
        `generation`). Its in-flight requests end with `ReplicaDown` at once."""
        r = self.replica(replica)
        if not r.live or (generation is not None and generation != r.generation):
            return False
        r.live, r.reason, r.ejections, r.failed_checks = False, reason, r.ejections + 1, 0
        if r._down is not None and not r._down.done():
            r._down.set_result(reason)
        log.warning("%s replica %s ejected: %s", self.role, r.url, reason)
        if self.on_eject is not None:
            try:
                self.on_eject(r, reason)
            except Exception:  # noqa: BLE001 - a broken restart hook must not stop routing
                log.exception("%s pool: on_eject(%s) failed", self.role, r.url)
        return True

    def retire(self, replica: Replica | str | int, reason: str) -> None:
        """Its owner gave up on an ejected replica (e.g. every restart failed): it stays out,
        and when no replica is left new sessions fail at once instead of waiting."""
        r = self.replica(replica)
        if r.live:
            raise ValueError(f"{self.role} replica {r.url} is live: eject it before retiring it")
        r.retired, r.reason = True, reason
        log.error("%s replica %s given up: %s", self.role, r.url, reason)
        self._live_changed.set()  # sessions waiting for a live replica look again

    async def readmit(self, replica: Replica | str | int) -> Replica:
        """Put an ejected replica back in service once it answers `/health` and, with a
        `PoolPublisher` attached, holds the current version (republished first). Raises
        (the replica stays ejected) when either fails."""
        r = self.replica(replica)
        if r.live:
            return r
        await r.client.close()  # its pooled connections went to the server that died
        try:
            await r.client.request("GET", "/health", timeout_s=self.cfg.health_timeout_s)
        except ClientError as e:
            raise ReplicaDown(r.url, f"not readmitted: health check failed: {e}") from e
        if self.publisher is not None:
            await self.publisher.bring_up(r, self._mark_live)
        else:
            self._mark_live(r)
        return r

    def _mark_live(self, r: Replica) -> None:
        if r.live:  # readmitted by a concurrent call meanwhile: keep its generation
            return
        r.live, r.generation, r.reason, r.retired = True, r.generation + 1, None, False
        r._down, r.failed_checks = None, 0
        log.info("%s replica %s readmitted (version %s)", self.role, r.url, r.version)
        self._live_changed.set()

    # ----- health checks ---------------------------------------------------------------------

    async def check_health(self) -> None:
        """One round of `GET /health` on every live replica (ejecting the ones that failed
        `health_failures` rounds in a row)."""

        async def check(r: Replica) -> None:
            generation = r.generation
            try:
                await r.client.request("GET", "/health", timeout_s=self.cfg.health_timeout_s,
                                       retries=0)  # fmt: skip
                r.failed_checks = 0
            except ClientError as e:  # counted: the replica is ejected after a few in a row
                if generation != r.generation or not r.live:
                    return
                r.failed_checks += 1
                if r.failed_checks >= self.cfg.health_failures:
                    self.eject(r, f"health check failed {r.failed_checks}x: {e}",
                               generation=generation)  # fmt: skip

        await asyncio.gather(*(check(r) for r in self.live))

    async def _health_loop(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.cfg.health_interval_s)

    async def start(self) -> None:
        if self._health is None:
            self._health = asyncio.create_task(self._health_loop(), name=f"pool-{self.role}-health")

    async def close(self) -> None:
        """Stop the health checks (surfacing their failure, if any) and close the clients
        the pool made."""
        task, self._health = self._health, None
        try:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        finally:
            await asyncio.gather(*(c.close() for c in self._owned))

    async def __aenter__(self) -> ReplicaPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def stats(self) -> dict[str, Any]:
        """For metrics: live count, ejections, and per replica its state and load."""
        return {
            "role": self.role,
            "live": len(self.live),
            "replicas": len(self.replicas),
            "ejections": sum(r.ejections for r in self.replicas),
            "restarts": sum(r.restarts for r in self.replicas),
            "in_flight": sum(r.in_flight for r in self.replicas),
            "per_replica": [
                {"url": r.url, "live": r.live, "in_flight": r.in_flight, "ejections": r.ejections,
                 "restarts": r.restarts, "version": r.version, "reason": r.reason}
                for r in self.replicas
            ],
        }  # fmt: skip


# ----- publishing --------------------------------------------------------------------------------


class PoolPublisher:
    """A `WeightPublisher` for a pool: publishes to every live replica at once through one
    per-replica publisher (`make(replica)`, e.g. `EnginePublisher([r.client], token=...)` or
    `VllmPublisher([r.url], model_name=...)`); completes when every live replica holds the
    version. A replica that fails the publish is ejected (it never serves an old version
    silently). The version is remembered, so a readmitted replica is brought to it first."""

    def __init__(self, pool: ReplicaPool, make: Callable[[Replica], WeightPublisher]):
        self.pool, self.make = pool, make
        self.path: str | None = None
        self.version: int | None = None
        """The version every live replica serves (None before the first publish)."""
        self._publishers: dict[int, WeightPublisher] = {}
        self._lock = asyncio.Lock()
        pool.publisher = self

    async def _publish_one(self, r: Replica, path: str, version: int) -> PublishReport:
        pub = self._publishers.get(r.index)
        if pub is None:
            pub = self._publishers[r.index] = self.make(r)
        report = await pub.publish(path, version)
        r.version = version
        return report

    async def publish(self, path: str, version: int) -> PublishReport:
        async with self._lock:
            live = self.pool.live
            started = time.perf_counter()
            outcomes = await asyncio.gather(
                *(self._publish_one(r, path, version) for r in live), return_exceptions=True
            )
            done: list[tuple[Replica, PublishReport]] = []
            errors: list[str] = []
            for r, out in zip(live, outcomes, strict=True):
                if isinstance(out, BaseException):
                    if not isinstance(out, Exception):
                        raise out
                    errors.append(f"{r.url}: {out}")
                    self.pool.eject(r, f"publish of version {version} failed: {out}")
                else:
                    done.append((r, out))
            if not done:
                why = "; ".join(errors) or "no live replica"
                raise PoolPublishError(
                    f"version {version} ({path}) reached no {self.pool.role} replica: {why}"
                )
            self.path, self.version = str(path), int(version)
            probes = [rep.first_token_s for _, rep in done]
            return PublishReport(
                int(version), str(path), load_s=time.perf_counter() - started,
                first_token_s=None if None in probes else max(probes),
                servers=[r.url for r, _ in done],
            )  # fmt: skip

    async def bring_up(self, r: Replica, mark_live: Callable[[Replica], None]) -> None:
        """Republish the current version to `r`, then `mark_live(r)`, with no publish between
        (so `r` never serves a version older than the others)."""
        async with self._lock:
            if r.live:
                return
            old = self._publishers.pop(r.index, None)  # its connections went to the old server
            if old is not None and hasattr(old, "close"):
                await old.close()
            if self.version is not None and self.path is not None:
                try:
                    await self._publish_one(r, self.path, self.version)
                except Exception as e:  # any failure keeps it out: it would serve an old version
                    raise ReplicaDown(r.url, f"not readmitted: republishing version "
                                      f"{self.version} failed: {e}") from e  # fmt: skip
            mark_live(r)

    async def close(self) -> None:
        for pub in self._publishers.values():
            close = getattr(pub, "close", None)
            if close is not None:
                await close()
