"""`E2BShell`: commands in an e2b cloud sandbox (`e2b.AsyncSandbox`), and `sweep`, which kills
sandboxes that simloop runs left behind.

Components: `RateLimiter` and `E2BLimits` (one creation rate and one cap on live sandboxes,
shared by every episode of the process through `shared_limits`), `E2BShell` (one sandbox per
episode: tagged with run and episode ids, task files uploaded, killed in `finally`), `sweep`.

Retries (tenacity, set up by `_retry_policy`): uploads, kills and listings are idempotent and
are retried with backoff; a creation is retried only when the API refused it or did not answer,
and carries an idempotency key so a retry can never make a second sandbox; commands are never
retried. The SDK (imported lazily: it takes a second) can be swapped for a fake with the same
signatures (`sdk=`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
import uuid
import weakref
from datetime import UTC, datetime
from typing import Any

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt

from envs.config import E2BConfig
from envs.shell import (
    TIMEOUT_EXIT_CODE,
    HeadTailBuffer,
    Observation,
    ShellError,
    ShellLifecycle,
    TaskSetup,
    TaskSetupError,
    buffered_observation,
    check_relative_path,
)

log = logging.getLogger(__name__)

RUN_TAG = "simloop_run"
"""Sandbox metadata key holding the run id (what `sweep` looks for)."""
EPISODE_TAG = "simloop_episode"
"""Sandbox metadata key holding the episode id."""


def _sdk() -> Any:
    from e2b import AsyncSandbox

    return AsyncSandbox


def _errors() -> Any:
    """The SDK's exception classes (exported at the package top level)."""
    import e2b

    return e2b


class RateLimiter:
    """At most `rate_per_s` acquisitions per second, spaced evenly (no bursts)."""

    def __init__(self, rate_per_s: float):
        if rate_per_s <= 0:
            raise ValueError(f"rate_per_s={rate_per_s!r} is invalid: a positive number")
        self.interval = 1.0 / rate_per_s
        self._next = 0.0

    async def acquire(self) -> None:
        now = time.monotonic()
        # No await between reading and updating `_next`: each caller reserves its own slot.
        slot = max(now, self._next)
        self._next = slot + self.interval
        if slot > now:
            await asyncio.sleep(slot - now)


class E2BLimits:
    """Creation rate and live-sandbox cap shared by all `E2BShell`s that get this object."""

    def __init__(self, creation_rate_per_s: float, max_concurrent: int):
        self.creation = RateLimiter(creation_rate_per_s)
        self.slots = asyncio.Semaphore(max_concurrent)
        self.max_concurrent = max_concurrent


_SHARED: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple, E2BLimits]] = (
    weakref.WeakKeyDictionary()
)


def shared_limits(config: E2BConfig) -> E2BLimits:
    """The process-wide limits for `config`'s rate and cap (one per event loop, because
    asyncio primitives belong to one loop)."""
    per_loop = _SHARED.setdefault(asyncio.get_running_loop(), {})
    key = (config.creation_rate_per_s, config.max_concurrent)
    if key not in per_loop:
        per_loop[key] = E2BLimits(*key)
    return per_loop[key]


def _api_opts(config: E2BConfig, api_key: str | None) -> dict[str, Any]:
    key = api_key or os.environ.get(config.api_key_env)
    return {"api_key": key} if key else {}


def _retry_policy(
    config: E2BConfig, retry_on: tuple[type[BaseException], ...], what: str | None = None
) -> AsyncRetrying:
    """tenacity's loop for one e2b call: up to `config.retries` retries of the errors in
    `retry_on` (anything else raises at once), each after min(`max_backoff_s`, `backoff_s` *
    2**retry) seconds jittered down to as little as half; with `what`, each retry is logged."""
    err = _errors()
    gone = (err.SandboxNotRunningException, err.SandboxNotFoundException)  # never transient

    def delay(state: RetryCallState) -> float:
        return min(config.max_backoff_s, config.backoff_s * 2 ** (state.attempt_number - 1))

    def log_retry(state: RetryCallState) -> None:
        e = state.outcome.exception() if state.outcome else None
        n = state.attempt_number
        log.warning("e2b %s failed (%r); retry %d in %.2fs", what, e, n, delay(state))

    return AsyncRetrying(
        stop=stop_after_attempt(config.retries + 1),
        wait=lambda state: delay(state) * random.uniform(0.5, 1.0),
        retry=retry_if_exception(lambda e: isinstance(e, retry_on) and not isinstance(e, gone)),
        before_sleep=log_retry if what else None,
        reraise=True,
    )


async def _retrying(config: E2BConfig, what: str, call, *, gone_ok: bool = False) -> Any:
    """`await call()` with a per-attempt timeout, retried with backoff on transient errors.
    Only for idempotent calls. With `gone_ok`, a sandbox that no longer exists is success."""
    err = _errors()
    transient = (
        err.RateLimitException,
        err.ServiceBusyException,
        err.TimeoutException,  # includes SandboxUnreachableException
        TimeoutError,
    )
    try:
        async for attempt in _retry_policy(config, transient, what):
            with attempt:
                return await asyncio.wait_for(call(), timeout=config.request_timeout_s)
    except (err.SandboxNotRunningException, err.SandboxNotFoundException) as e:
        if gone_ok:
            return None
        raise ShellError(f"e2b {what}: the sandbox is gone ({e})") from e
    except transient as e:  # what is left of them after the last retry
        raise ShellError(f"e2b {what} failed after {config.retries + 1} attempts: {e!r}") from e


class E2BShell(ShellLifecycle):
    """One e2b sandbox for one episode; see the module docstring."""

    def __init__(
        self,
        config: E2BConfig | None = None,
        *,
        run_id: str,
        episode_id: str,
        setup: TaskSetup | None = None,
        limits: E2BLimits | None = None,
        sdk: Any = None,
        api_key: str | None = None,
    ):
        self.config = config or E2BConfig()
        self.run_id = run_id
        self.episode_id = episode_id
        self.setup = setup or TaskSetup()
        self._limits = limits
        self._sdk = sdk
        self._opts = _api_opts(self.config, api_key)
        self._sandbox: Any = None
        self._holds_slot = False
        self._lock = asyncio.Lock()
        self._start_lock = asyncio.Lock()
        self._closed = False

    @property
    def sandbox_id(self) -> str | None:
        return None if self._sandbox is None else self._sandbox.sandbox_id

    async def start(self) -> None:
        """Take a slot, create the sandbox and apply the task setup (idempotent)."""
        async with self._start_lock:
            if self._closed:
                raise RuntimeError("E2BShell is closed")
            if self._sandbox is not None:
                return
            if self._limits is None:
                self._limits = shared_limits(self.config)
            if self._sdk is None:
                self._sdk = _sdk()
            try:
                await self._limits.slots.acquire()
                self._holds_slot = True
                self._sandbox = await self._create()
                await self._apply_setup()
            except BaseException:
                await self.close()
                raise

    async def _create(self) -> Any:
        cfg, err = self.config, _errors()
        key = str(uuid.uuid4())  # the same key on every attempt: at most one sandbox
        metadata = {RUN_TAG: self.run_id, EPISODE_TAG: self.episode_id}
        refused = (err.RateLimitException, err.ServiceBusyException, TimeoutError)
        try:
            async for attempt in _retry_policy(cfg, refused):  # retries not logged
                with attempt:
                    await self._limits.creation.acquire()
                    return await asyncio.wait_for(
                        self._sdk.create(
                            template=cfg.template,
                            timeout=cfg.sandbox_timeout_s,
                            metadata=metadata,
                            allow_internet_access=cfg.allow_internet_access,
                            idempotency_key=key,
                            request_timeout=cfg.request_timeout_s,
                            **self._opts,
                        ),
                        timeout=cfg.request_timeout_s + 5.0,
                    )
        except refused as e:  # what is left of them after the last retry
            raise ShellError(
                f"e2b sandbox creation failed after {cfg.retries + 1} attempts: {e!r}"
            ) from e
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _apply_setup(self) -> None:
        cfg, sb = self.config, self._sandbox
        workdir = cfg.workdir.rstrip("/")
        await _retrying(
            cfg,
            "mkdir workdir",  # mkdir -p is idempotent, so it may be retried
            lambda: sb.commands.run(
                f"mkdir -p '{workdir}'", user=cfg.user, timeout=cfg.request_timeout_s
            ),
        )
        for rel, text in self.setup.files.items():
            path = f"{workdir}/{check_relative_path(rel, 'TaskSetup.files')}"
            await _retrying(
                cfg,
                f"upload {rel}",
                lambda path=path, text=text: sb.files.write(
                    path, text, user=cfg.user, request_timeout=cfg.request_timeout_s
                ),
            )
        for cmd in self.setup.commands:
            obs = await self._run(cmd, cfg.setup_timeout_s)
            if obs.exit_code != 0:
                raise TaskSetupError(
                    f"setup command {cmd!r} exited {obs.exit_code}: "
                    f"{obs.info.get('reason', '')} {obs.output[-2000:]}"
                )

    async def run(self, command: str, timeout_s: float) -> Observation:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s!r} is invalid: a positive number of seconds")
        await self.start()
        return await self._run(command, timeout_s)

    async def _run(self, command: str, timeout_s: float) -> Observation:
        cfg, err = self.config, _errors()
        async with self._lock:
            sb = self._sandbox
            if sb is None or self._closed:
                raise RuntimeError("E2BShell is closed")
            info: dict[str, Any] = {"sandbox_id": sb.sandbox_id}
            start = time.monotonic()
            stdout = stderr = ""
            try:
                # The SDK's own timeout (default 60 s) ends the command; wait_for bounds the
                # request itself should the SDK never answer.
                res = await asyncio.wait_for(
                    sb.commands.run(
                        command,
                        cwd=cfg.workdir,
                        user=cfg.user,
                        timeout=timeout_s,
                        request_timeout=cfg.request_timeout_s,
                    ),
                    timeout=timeout_s + cfg.request_timeout_s,
                )
                stdout, stderr, exit_code = res.stdout, res.stderr, res.exit_code
            except err.CommandExitException as e:  # a non-zero exit is an observation
                stdout, stderr, exit_code = e.stdout, e.stderr, e.exit_code
            except (err.SandboxNotRunningException, err.SandboxUnreachableException) as e:
                raise ShellError(f"e2b sandbox {sb.sandbox_id} is gone or unreachable: {e}") from e
            except err.TimeoutException as e:
                exit_code = TIMEOUT_EXIT_CODE
                info["timeout"] = True
                info["reason"] = (
                    f"command timed out after {timeout_s:g}s (e2b {type(e).__name__}: {e})"
                )
            except TimeoutError:
                exit_code = TIMEOUT_EXIT_CODE
                info["timeout"] = True
                info["reason"] = (
                    f"no answer from e2b within {timeout_s + cfg.request_timeout_s:g}s "
                    f"(command timeout {timeout_s:g}s + request timeout)"
                )
            buf = HeadTailBuffer(cfg.max_output_bytes)
            # e2b returns the two streams apart; their interleaving is lost.
            buf.write((stdout or "").encode())
            buf.write((stderr or "").encode())
            info["output_bytes"] = buf.total
            return buffered_observation(buf, exit_code, start, info)

    async def close(self) -> None:
        """Kill the sandbox and free its slot (safe to call twice or before start). A
        cancelled caller does not stop the kill: it finishes in the background. Raises
        ShellError when the kill still fails after retries; the sandbox's own lifetime
        (`sandbox_timeout_s`) and `sweep` are the backstops."""
        self._closed = True
        sb, self._sandbox = self._sandbox, None
        holds, self._holds_slot = self._holds_slot, False
        if sb is None and not holds:
            return
        task = asyncio.create_task(
            self._kill_and_release(sb, holds), name=f"e2b-kill-{self.episode_id}"
        )
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(_report_kill_failure)
            raise

    async def _kill_and_release(self, sb: Any, holds_slot: bool) -> None:
        try:
            if sb is not None:
                await _retrying(
                    self.config,
                    f"kill {sb.sandbox_id}",
                    lambda: sb.kill(request_timeout=self.config.request_timeout_s),
                    gone_ok=True,
                )
        finally:
            if holds_slot and self._limits is not None:
                self._limits.slots.release()


def _report_kill_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error(
            "e2b kill after cancellation failed: %r (`simloop e2b sweep` finds it)",
            task.exception(),
        )


async def sweep(
    run_id: str | None,
    *,
    config: E2BConfig | None = None,
    older_than_s: float = 0.0,
    sdk: Any = None,
    api_key: str | None = None,
) -> list[str]:
    """Kill sandboxes tagged by simloop: those of `run_id`, or of every run when None; only
    those started at least `older_than_s` ago. Returns the ids killed."""
    from e2b import SandboxQuery, SandboxState

    cfg = config or E2BConfig()
    sdk = sdk or _sdk()
    opts = _api_opts(cfg, api_key)
    query = SandboxQuery(
        metadata={RUN_TAG: run_id} if run_id else None,
        state=[SandboxState.RUNNING, SandboxState.PAUSED],
    )
    paginator = sdk.list(query=query, limit=100, **opts)
    found: list[Any] = []
    while paginator.has_next:
        found += await _retrying(cfg, "list sandboxes", lambda: paginator.next_items(**opts))
    now = datetime.now(UTC)
    killed: list[str] = []
    for info in found:
        tags = info.metadata or {}
        if RUN_TAG not in tags or (run_id is not None and tags[RUN_TAG] != run_id):
            continue
        started = info.started_at
        if started.tzinfo is None:
            started = started.replace(tzinfo=UTC)
        if (now - started).total_seconds() < older_than_s:
            continue
        sid = info.sandbox_id
        await _retrying(cfg, f"kill {sid}", lambda sid=sid: sdk.kill(sid, **opts), gone_ok=True)
        killed.append(sid)
    return killed
