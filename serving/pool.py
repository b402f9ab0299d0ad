"""A pool of server replicas for one role (agent or simulator): sticky routing, load balancing,
health checks, ejection, readmission, and KV sessions placed on one replica each (publishing
weights to every live replica: `serving.pool_publish`).

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
does (no connection, or 5xx after the client's own retries), when a publish fails, or when its
answers fail `answer_failures` times in a row (below); its in-flight requests and every later
request of a session pinned to it raise `ReplicaDown` (never moved mid-episode to another
replica: other KV, maybe another version; a request outside any episode is sent again to
another live replica instead). The owner restarts it (`on_eject`) and calls `readmit`, which
republishes the current version through the attached `serving.pool_publish.PoolPublisher`
before the replica takes traffic again; an owner that gives up on a replica `retire`s it, and
once every replica is retired new sessions fail at once.

Persistent KV sessions (`open_session`, `session_generate`, `rewind_session`, `close_session`:
the client's API) live on one replica each: a new one goes to the live replica holding the
fewest, and all its calls go there. When that replica is ejected its sessions' KV is gone:
their next call raises `SessionLost`, a 404 as from a server that forgot a session, and the
caller (the agent loop, the simulated shell) reopens the session, which the pool places on a
live replica, and sends it the episode's tokens again; the agent loop records each reopen in
the trajectory.

Answers count too, since a replica can answer `/health` and still fail every episode. For the
completion calls (`complete`, `complete_n`, `chat`; not the free-form `request`):
- Each has a timeout scaled to the work asked, `timeout_base_s + timeout_per_token_s *
  max_tokens` (never above the caller's own), so a hung replica is found in time.
- A timeout counts against the replica. So does a bad answer (a 4xx other than 429, or a 2xx
  that is not what was asked: `BadAnswer`, e.g. no logprobs), but only when another live
  replica answers the very same request well: a request that is itself bad (a prompt past the
  context, a bad parameter) is refused by every replica and ejects none, and a pool's last live
  replica is never ejected for a bad answer. 429 (busy) never counts. A good answer resets
  the count; `answer_failures` in a row eject the replica.
- A replica ejected for its answers is readmitted only after it serves a real completion (a
  1-token probe, `probe`), not on `/health` alone. With no owner (`on_eject`), the health loop
  probes it every round and readmits it once one succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from rl import validate
from serving.client import (
    BadAnswer,
    ClientConfig,
    ClientError,
    ClientTimeout,
    Completion,
    InferenceClient,
)

log = logging.getLogger(__name__)

JUDGED = ("complete", "complete_n", "chat")
"""The calls a replica is judged on by its answers (stateless: one can be sent to a peer)."""
ANSWER_KINDS = ("timeout", "bad_answer")
"""Ejections for what a replica answered: readmitted only after a probe completion."""
PROBE_PROMPT = [0]
"""The probe's prompt (as `serving.publisher`'s): token id 0 exists in every vocabulary."""


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
    answer_failures: int = 3
    """Consecutive failed answers (timeouts; bad answers a peer answered well) that eject a
    replica; a good answer resets the count."""
    timeout_base_s: float = 30.0
    """A completion's timeout through the pool is `timeout_base_s + timeout_per_token_s *
    max_tokens`, at most the caller's (or its client's) own: the base covers queueing and
    prefill under load, so a busy replica is not taken for a hung one."""
    timeout_per_token_s: float = 0.1
    """Per token asked (`max_tokens`; `n` samples decode together): 0.1 s is 10 tokens/s, slower
    than a loaded replica decodes. With the defaults, 1024 tokens keep a 120 s cap; 64 get 36 s."""

    def __post_init__(self) -> None:
        validate.positive(
            self, "health_interval_s", "health_timeout_s", "timeout_base_s", allowed="> 0"
        )
        validate.integer(self, "health_failures", "answer_failures", low=1)
        validate.number(self, "timeout_per_token_s", low=0, allowed=">= 0")
        validate.number(self, "wait_live_s", low=0, nan_ok=True, allowed=">= 0")

    def timeout_for(self, max_tokens: int | None, cap: float) -> float:
        """The timeout of a completion of `max_tokens` whose caller allows `cap` seconds."""
        if not isinstance(max_tokens, int):
            return cap
        return min(cap, self.timeout_base_s + self.timeout_per_token_s * max_tokens)


class ReplicaDown(ClientError):
    """The replica an episode is pinned to was ejected: the episode cannot go on there."""

    def __init__(self, url: str | None, why: str):
        super().__init__(f"replica {url} down: {why}" if url else why)
        self.url, self.why = url, why

    @property
    def retryable(self) -> bool:
        return False


class SessionLost(ReplicaDown):
    """A KV session's replica was ejected (or died under the call): its KV went with it.
    Status 404, as a server that forgot a session answers, so the caller reopens it (the pool
    places the new one on a live replica) and sends it the episode's tokens again."""

    def __init__(self, url: str | None, why: str):
        super().__init__(url, why)
        self.status = 404


class Republisher(Protocol):
    """What readmission needs of the pool's publisher (`serving.pool_publish.PoolPublisher`)."""

    async def bring_up(self, r: Replica, mark_live: Callable[[Replica], None]) -> None:
        """Bring `r` to the current version, then `mark_live(r)`."""


@dataclass(eq=False)
class Replica:
    """One server of the pool, with the numbers its metrics show."""

    index: int
    client: InferenceClient
    live: bool = True
    in_flight: int = 0
    sessions: int = 0
    """KV sessions the pool opened here that are still open."""
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
    ejected_for: Counter[str] = field(default_factory=Counter)
    """Ejections by kind: `dead`, `health`, `publish`, `timeout`, `bad_answer`, `manual`."""
    last_ejection: str | None = None
    """The reason of its last ejection (kept after readmission, unlike `reason`)."""
    streak: Counter[str] = field(default_factory=Counter)
    """Failed answers since its last good one, by kind (`timeout`, `bad_answer`)."""
    needs_probe: bool = False
    """Ejected for its answers: readmitted only after a probe completion succeeds."""
    _down: asyncio.Future | None = field(default=None, repr=False)

    @property
    def strikes(self) -> int:
        """Consecutive failed answers: `answer_failures` of them eject it."""
        return sum(self.streak.values())

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
    if not isinstance(e, ClientError) or isinstance(e, ClientTimeout | ReplicaDown | BadAnswer):
        return False
    return (e.status is not None and e.status >= 500) or isinstance(
        e.__cause__, aiohttp.ClientError
    )


def is_bad_answer(e: BaseException) -> bool:
    """An answer that is the replica's fault if a peer answers the same request well: a 4xx
    other than 429 (busy: load, not sickness), or a 2xx that is not what was asked."""
    if isinstance(e, BadAnswer):
        return True
    return (
        isinstance(e, ClientError)
        and not isinstance(e, ReplicaDown | ClientTimeout)
        and e.status is not None
        and 400 <= e.status < 500
        and e.status != 429
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
    """A client for one episode: its first request pins it to a replica, where it stays.
    A `oneoff` session (one request outside any episode) has nothing to keep warm: when its
    replica is ejected under it, the request goes again to another live replica."""

    def __init__(
        self, pool: ReplicaPool, key: str, affinity: Affinity | None = None, *, oneoff: bool = False
    ):
        self.pool, self.key, self._affinity, self._oneoff = pool, key, affinity, oneoff
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
        tries = 0
        while True:
            try:
                return await self._once(name, args, kw)
            except ReplicaDown as down:
                tries += 1
                if not (
                    self._oneoff
                    and down.url is not None
                    and self.pool.live
                    and tries < len(self.pool.replicas)
                ):
                    raise
                log.info("%s pool: %s again on another replica: %s", self.pool.role, name, down)
                self.replica = None

    async def _once(self, name: str, args: tuple, kw: dict[str, Any]) -> Any:
        if self.replica is None:
            try:
                self.replica = await self.pool._pick(self.key)
            except ReplicaDown as e:
                raise self._fail(e) from None
            self._generation = self.replica.generation
        r, generation = self.replica, self._generation
        if not r.live or r.generation != generation:
            raise self._fail(ReplicaDown(r.url, r.reason or "ejected"))
        try:
            out = await self.pool._send(r, name, args, kw, self.key)
        except ReplicaDown as down:  # ejected while in flight
            raise self._fail(down) from None
        except ClientError as e:
            if is_dead_server(e):
                self.pool.eject(r, f"{name} failed: {e}", generation=generation, kind="dead")
                raise self._fail(ReplicaDown(r.url, r.reason or str(e))) from e
            if name not in JUDGED:
                raise
            answer = await self.pool._judge(r, generation, name, args, kw, e, self.key)
            if answer is not None and self._oneoff:  # a peer answered it: that is the retry
                return answer
            if not r.live or r.generation != generation:
                raise self._fail(ReplicaDown(r.url, r.reason or str(e))) from e
            raise
        if name in JUDGED:
            self.pool._answered(r, generation)
        return out


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
        self.publisher: Republisher | None = None
        """Set by `serving.pool_publish.PoolPublisher`: readmission republishes its current
        version first."""
        self._cursor = 0
        self._live_changed = asyncio.Event()
        self._health: asyncio.Task | None = None
        self._probes: dict[int, asyncio.Task] = {}
        """Readmission attempts under way (`_probe_ejected`), by replica index."""
        self._homes: dict[str, tuple[Replica, int, str]] = {}
        """Open KV sessions: the pool's id -> (replica, its generation, the server's id)."""

    @property
    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.live]

    def replica(self, which: Replica | str | int) -> Replica:
        """A replica by object, URL or index."""
        for r in self.replicas:
            if which is r or which == r.url or which == r.index:
                return r
        raise KeyError(
            f"{which!r} is not a replica of the {self.role} pool ({[r.url for r in self.replicas]})"
        )

    # ----- routing ---------------------------------------------------------------------------

    def session(self, key: str) -> PoolSession:
        """A client for one episode, pinned to one replica from its first request on."""
        return PoolSession(self, key)

    def _current(self) -> PoolSession:
        affinity = _AFFINITY.get()
        if affinity is None:  # not inside an episode: each request is routed on its own
            return PoolSession(self, "unpinned", oneoff=True)
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

    async def _pick(self, key: str, *, by_sessions: bool = False) -> Replica:
        deadline = time.monotonic() + self.cfg.wait_live_s
        while not self.live:
            self._live_changed.clear()
            down = "; ".join(f"{r.url}: {r.reason}" for r in self.replicas)
            if all(r.retired for r in self.replicas):  # nothing will come back: do not wait
                raise ReplicaDown(
                    None,
                    f"no live {self.role} replica for {key}: every one "
                    f"failed and was given up ({down})",
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise ReplicaDown(
                    None,
                    f"no live {self.role} replica for {key} within "
                    f"{self.cfg.wait_live_s:g}s ({down})",
                )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._live_changed.wait()
        n = len(self.replicas)
        order = [self.replicas[(self._cursor + i) % n] for i in range(n)]
        if by_sessions:  # a KV session stays for good: balance what the replicas hold
            best = min((r for r in order if r.live), key=lambda r: (r.sessions, r.in_flight))
        else:
            best = min((r for r in order if r.live), key=lambda r: r.in_flight)
        self._cursor = best.index + 1
        return best

    # ----- persistent KV sessions: each lives on one replica ------------------------------------

    async def open_session(
        self, *, ttl_s: float | None = None, compaction: Any = None
    ) -> str | None:
        """Open a KV session (`InferenceClient.open_session`) on the live replica holding the
        fewest of the pool's open sessions (ties: the fewest requests in flight, then round
        robin); every call of it goes there. None when the replicas have no sessions (vLLM).
        A replica that fails as a dead server does is ejected and the next one is tried."""
        kw = {"ttl_s": ttl_s, "compaction": compaction}
        for _ in range(len(self.replicas)):
            r = await self._pick("session", by_sessions=True)
            generation = r.generation
            try:
                sid = await self._send(r, "open_session", (), kw, "session-open")
            except ReplicaDown:
                continue
            except ClientError as e:
                if not is_dead_server(e):
                    raise
                self.eject(r, f"open_session failed: {e}", generation=generation, kind="dead")
                continue
            if sid is None:
                return None
            if not r.live or r.generation != generation:  # ejected as it answered
                continue
            key = f"r{r.index}-{sid}"
            self._homes[key] = (r, generation, sid)
            r.sessions += 1
            return key
        raise ReplicaDown(None, f"no live {self.role} replica could open a session")

    def _drop(self, session_id: str) -> None:
        home = self._homes.pop(session_id, None)
        if home is not None:
            home[0].sessions -= 1

    async def _session_call(self, session_id: str, name: str, *args: Any, **kw: Any) -> Any:
        home = self._homes.get(session_id)
        if home is None:
            raise SessionLost(None, f"the {self.role} pool holds no session {session_id!r}")
        r, generation, sid = home
        if not r.live or r.generation != generation:
            self._drop(session_id)
            raise SessionLost(r.url, f"session {session_id} went with it: {r.reason}")
        try:
            return await self._send(r, name, (sid, *args), kw, session_id)
        except ReplicaDown as down:  # ejected while in flight
            self._drop(session_id)
            raise SessionLost(r.url, down.why) from None
        except ClientError as e:
            if is_dead_server(e):
                self.eject(r, f"{name} failed: {e}", generation=generation, kind="dead")
                self._drop(session_id)
                raise SessionLost(r.url, f"{name} failed: {e}") from e
            if e.status == 404:  # the server forgot it (TTL, memory pressure)
                self._drop(session_id)
            raise

    async def session_generate(
        self, session_id: str, append_token_ids: list[int], **kw: Any
    ) -> Completion:
        """`InferenceClient.session_generate` on the session's replica; `SessionLost` (404)
        when that replica is gone."""
        return await self._session_call(session_id, "session_generate", append_token_ids, **kw)

    async def rewind_session(self, session_id: str, to: int) -> dict[str, Any]:
        return await self._session_call(session_id, "rewind_session", to)

    async def close_session(self, session_id: str) -> None:
        """Close it on its replica (nothing to do where the replica is gone: its KV went with
        it)."""
        if session_id not in self._homes:
            return
        try:
            await self._session_call(session_id, "close_session")
        except SessionLost:
            pass
        finally:
            self._drop(session_id)

    def session_home(self, session_id: str) -> str | None:
        """The URL of the replica holding an open session (None: not open here)."""
        home = self._homes.get(session_id)
        return None if home is None else home[0].url

    # ----- sending, and judging replicas by their answers ----------------------------------------

    async def _send(self, r: Replica, name: str, args: tuple, kw: dict[str, Any], key: str) -> Any:
        """`r.client.<name>(*args, **kw)`, counted in `r`'s load, with a completion's timeout
        scaled to its `max_tokens`; `ReplicaDown` at once if `r` is ejected meanwhile."""
        if name in JUDGED:
            cap = kw.get("timeout_s") or r.client.cfg.timeout_s
            kw = {**kw, "timeout_s": self.cfg.timeout_for(kw.get("max_tokens"), cap)}
        down = r.down_future()
        r.in_flight += 1
        task_name = f"pool-{self.role}-{r.index}-{key}-{name}"
        call = asyncio.create_task(getattr(r.client, name)(*args, **kw), name=task_name)
        try:
            await asyncio.wait((call, down), return_when=asyncio.FIRST_COMPLETED)
        finally:
            r.in_flight -= 1
            finished = call.done()
            if not finished:  # ejected while in flight (or we were cancelled): drop the call
                call.cancel()
        if not finished:
            raise ReplicaDown(r.url, down.result())
        return call.result()

    async def _judge(
        self,
        r: Replica,
        generation: int,
        name: str,
        args: tuple,
        kw: dict[str, Any],
        e: ClientError,
        key: str,
    ) -> Any:
        """Count `e`, the failed answer of `r` to a `JUDGED` call, against `r` when it is
        `r`'s fault: a timeout always; a bad answer only when a peer (another live replica)
        answers the same request well, the peer's answer being returned. A request every
        replica refuses is at fault itself, and with no peer nothing can tell: not counted."""
        if isinstance(e, ClientTimeout):
            self._strike(r, generation, "timeout", f"{name}: {e}")
            return None
        if not is_bad_answer(e):
            return None
        peers = [p for p in self.live if p is not r]
        if not peers:
            return None
        peer = min(peers, key=lambda p: p.in_flight)
        peer_generation = peer.generation
        try:
            answer = await self._send(peer, name, args, kw, f"{key}-check")
        except ReplicaDown:
            return None
        except ClientError as pe:  # the peer's own failure is the peer's; `r` is not judged
            if is_dead_server(pe):
                self.eject(peer, f"{name} failed: {pe}", generation=peer_generation, kind="dead")
            elif isinstance(pe, ClientTimeout):
                self._strike(peer, peer_generation, "timeout", f"{name}: {pe}")
            return None  # (a bad answer there too: the request is bad, nobody is counted)
        self._answered(peer, peer_generation)
        self._strike(
            r,
            generation,
            "bad_answer",
            f"{name}: {e} (the same request was answered by {peer.url})",
        )
        return answer

    def _strike(self, r: Replica, generation: int, kind: str, why: str) -> None:
        """One more failed answer of `r`; `answer_failures` in a row eject it."""
        if not r.live or r.generation != generation:
            return
        r.streak[kind] += 1
        if r.strikes < self.cfg.answer_failures:
            log.info(
                "%s replica %s: failed answer %d/%d: %s",
                self.role,
                r.url,
                r.strikes,
                self.cfg.answer_failures,
                why,
            )
            return
        kinds = ", ".join(
            f"{n} {'timed out' if k == 'timeout' else 'bad'}"
            for k, n in sorted(r.streak.items(), reverse=True)
        )
        n = r.strikes
        self.eject(
            r,
            f"{n} answer{'s' * (n > 1)} in a row failed ({kinds}), the last: {why}",
            generation=generation,
            kind=kind,
        )

    def _answered(self, r: Replica, generation: int) -> None:
        """A good answer: `r`'s count of failed answers starts again."""
        if r.generation == generation:
            r.streak.clear()

    # ----- ejection and readmission ----------------------------------------------------------

    def eject(
        self,
        replica: Replica | str | int,
        reason: str,
        *,
        generation: int | None = None,
        kind: str = "manual",
    ) -> bool:
        """Take a replica out of service; False if it already was (or was readmitted since
        `generation`). Its in-flight requests end with `ReplicaDown` at once. `kind` (for
        metrics): `dead`, `health`, `publish`, `timeout`, `bad_answer`, or `manual` (its owner's
        call); the answer kinds make readmission wait for a probe completion."""
        r = self.replica(replica)
        if not r.live or (generation is not None and generation != r.generation):
            return False
        r.live, r.reason, r.ejections, r.failed_checks = False, reason, r.ejections + 1, 0
        r.ejected_for[kind] += 1
        r.last_ejection, r.needs_probe = reason, kind in ANSWER_KINDS
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
        """Put an ejected replica back in service once it answers `/health`, then (when it
        was ejected for its answers) serves a probe completion, then, with a `PoolPublisher`
        attached, holds the current version (republished first). Raises `ReplicaDown` (the
        replica stays ejected) when any of them fails."""
        r = self.replica(replica)
        if r.live:
            return r
        await r.client.close()  # its pooled connections went to the server that died
        try:
            await r.client.request("GET", "/health", timeout_s=self.cfg.health_timeout_s)
        except ClientError as e:
            raise ReplicaDown(r.url, f"not readmitted: health check failed: {e}") from e
        if r.needs_probe:  # `/health` answered before too: only a completion tells
            try:
                await self.probe(r)
            except ClientError as e:
                raise ReplicaDown(r.url, f"not readmitted: probe completion failed: {e}") from e
        if self.publisher is not None:
            await self.publisher.bring_up(r, self._mark_live)
        else:
            self._mark_live(r)
        return r

    def _mark_live(self, r: Replica) -> None:
        if r.live:  # readmitted by a concurrent call meanwhile: keep its generation
            return
        for key in [k for k, home in self._homes.items() if home[0] is r]:
            self._drop(key)  # their KV went with the old process: each was (or is) reopened
        r.live, r.generation, r.reason, r.retired = True, r.generation + 1, None, False
        r._down, r.failed_checks, r.needs_probe = None, 0, False
        r.streak.clear()
        log.info("%s replica %s readmitted (version %s)", self.role, r.url, r.version)
        self._live_changed.set()

    async def probe(self, replica: Replica | str | int) -> Completion:
        """One real completion on `replica`: 1 greedy token with its logprob, within the
        pool's timeout for 1 token. What a replica ejected for its answers must serve before
        it is readmitted (a hung engine still answers `/health`)."""
        r = self.replica(replica)
        timeout_s = self.cfg.timeout_for(1, r.client.cfg.timeout_s)
        return await r.client.complete(
            PROBE_PROMPT, max_tokens=1, temperature=0.0, logprobs=0, timeout_s=timeout_s
        )

    async def _try_readmit(self, r: Replica) -> None:
        try:
            await self.readmit(r)
        except ReplicaDown as e:  # recovered on purpose: probed again next round
            log.info("%s replica %s stays out: %s", self.role, r.url, e)
        else:
            log.warning("%s replica %s answered a probe: back in service", self.role, r.url)

    def _probe_ejected(self) -> None:
        """With no owner to restart them, replicas ejected for their answers are probed (one
        readmission attempt at a time each); a probe's unexpected error surfaces here."""
        for r in self.replicas:
            task = self._probes.get(r.index)
            if task is not None and task.done():
                del self._probes[r.index]
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()
            elif task is not None:
                continue
            if not r.live and r.needs_probe and not r.retired:
                self._probes[r.index] = asyncio.create_task(
                    self._try_readmit(r), name=f"pool-{self.role}-{r.index}-probe"
                )

    # ----- health checks ---------------------------------------------------------------------

    async def check_health(self) -> None:
        """One round of `GET /health` on every live replica (ejecting the ones that failed
        `health_failures` rounds in a row); without an owner, probes start for the replicas
        ejected for their answers."""

        async def check(r: Replica) -> None:
            generation = r.generation
            try:
                await r.client.request(
                    "GET", "/health", timeout_s=self.cfg.health_timeout_s, retries=0
                )
                r.failed_checks = 0
            except ClientError as e:  # counted: the replica is ejected after a few in a row
                if generation != r.generation or not r.live:
                    return
                r.failed_checks += 1
                if r.failed_checks >= self.cfg.health_failures:
                    self.eject(
                        r,
                        f"health check failed {r.failed_checks}x: {e}",
                        generation=generation,
                        kind="health",
                    )

        await asyncio.gather(*(check(r) for r in self.live))
        if self.on_eject is None:
            self._probe_ejected()

    async def _health_loop(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.cfg.health_interval_s)

    async def start(self) -> None:
        if self._health is None:
            self._health = asyncio.create_task(self._health_loop(), name=f"pool-{self.role}-health")

    async def close(self) -> None:
        """Stop the health checks and probes (surfacing their failure, if any) and close the
        clients the pool made."""
        tasks = list(self._probes.values()) + ([self._health] if self._health else [])
        self._health, self._probes = None, {}
        try:
            for t in tasks:
                t.cancel()
            for outcome in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(outcome, BaseException) and not isinstance(
                    outcome, asyncio.CancelledError
                ):
                    raise outcome
        finally:
            await asyncio.gather(*(c.close() for c in self._owned))

    async def __aenter__(self) -> ReplicaPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def stats(self) -> dict[str, Any]:
        """For metrics: live count, ejections (in all and by kind), and per replica its state,
        load, ejections by kind with the last one's reason, and its failed answers in a row."""
        return {
            "role": self.role,
            "live": len(self.live),
            "replicas": len(self.replicas),
            "ejections": sum(r.ejections for r in self.replicas),
            "ejected_for": dict(sum((r.ejected_for for r in self.replicas), Counter())),
            "restarts": sum(r.restarts for r in self.replicas),
            "in_flight": sum(r.in_flight for r in self.replicas),
            "sessions": len(self._homes),
            "per_replica": [
                {
                    "url": r.url,
                    "live": r.live,
                    "in_flight": r.in_flight,
                    "sessions": r.sessions,
                    "ejections": r.ejections,
                    "ejected_for": dict(r.ejected_for),
                    "last_ejection": r.last_ejection,
                    "strikes": r.strikes,
                    "restarts": r.restarts,
                    "version": r.version,
                    "reason": r.reason,
                }
                for r in self.replicas
            ],
        }
