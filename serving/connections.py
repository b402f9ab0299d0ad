"""The server's connections, kept apart from its routes: a deadline for each request head, a
cap on open connections (idle ones make room, busy ones refuse the newcomer with a JSON 503),
aiohttp's own error answers in the API's JSON shape (`ApiErrorHandler`), and rate-limited
logging so a flood of hostile sockets cannot fill the disk. `serving.server.run_server` wraps
each accepted socket in a `Connection` around aiohttp's handler."""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from typing import Any

from aiohttp import web

from serving.config import ServerConfig
from serving.metrics import ServerMetrics
from serving.protocol import ApiError

log = logging.getLogger(__name__)


class Connection(asyncio.Protocol):
    """One client connection: aiohttp's protocol inside, plus a deadline for each request
    head (from its first byte) and a place in the connection cap."""

    def __init__(self, conns: Connections, inner: asyncio.Protocol):
        self.conns, self.inner = conns, inner
        self.transport: asyncio.Transport | None = None
        self.busy = 0
        """Requests of this connection inside a handler (their heads were read)."""
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        if not self.conns.admit(self):
            err = ApiError(
                503,
                f"all {self.conns.cap} connections the server takes are in requests: retry later",
            )
            body = json.dumps(err.body()).encode()
            transport.write(
                b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json"
                b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
            )
            transport.close()
            self.inner = None
            return
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            return
        if not self.busy and self._deadline is None:  # the first bytes of a request head
            timeout = self.conns.cfg.header_timeout_s
            self._deadline = asyncio.get_running_loop().call_later(timeout, self._expire)
        self.inner.data_received(data)

    def _expire(self) -> None:
        self._deadline = None
        if not self.busy and self.transport is not None:
            _ratelimited.warning(
                "closed a connection from %s: no complete request head within %ss",
                self.transport.get_extra_info("peername"),
                self.conns.cfg.header_timeout_s,
            )
            self.transport.abort()

    def begin(self) -> None:
        self.busy += 1
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def end(self) -> None:
        self.busy -= 1

    def eof_received(self):
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self.conns.remove(self)
        if self.inner is not None:
            self.inner.connection_lost(exc)


class ApiErrorHandler(web.RequestHandler):
    """aiohttp's connection handler, whose own answers (a malformed request, an Expect it
    refuses, an error that escaped the server's `_errors`) are in the API's JSON error shape too,
    never plain text; aiohttp logs the error, and a 5xx is logged here as well."""

    __slots__ = ()

    async def finish_response(self, request, resp, start_time):
        if (
            isinstance(resp, web.Response)
            and resp.status >= 400
            and not resp.prepared
            and resp.content_type != "application/json"
        ):
            text = " ".join((resp.text or resp.reason or "").split())
            if resp.status >= 500:
                log.error(
                    "%s %s: %d from outside the request handlers (%s)",
                    request.method,
                    request.path,
                    resp.status,
                    text[:200],
                )
                text = "internal error outside the request handlers (the server log has it)"
            err = ApiError(resp.status, text[:300] or str(resp.reason))
            json_resp = web.json_response(err.body(), status=resp.status)
            if resp.keep_alive is False or resp.status >= 500:
                json_resp.force_close()
            resp = json_resp
        return await super().finish_response(request, resp, start_time)


class Connections:
    """The open connections, oldest first, at most `cap`: a new one past the cap closes the
    oldest idle one (not in a request), or is refused when every one is in a request."""

    def __init__(self, cfg: ServerConfig, cap: int, metrics: ServerMetrics | None = None):
        self.cfg, self.cap, self.metrics = cfg, cap, metrics
        self._open: dict[Connection, None] = {}
        self._by_transport: dict[Any, Connection] = {}
        self.evicted = self.refused = 0

    def __len__(self) -> int:
        return len(self._open)

    def get(self, transport) -> Connection | None:
        return self._by_transport.get(transport)

    def admit(self, conn: Connection) -> bool:
        if len(self._open) >= self.cap:
            idle = next((c for c in self._open if not c.busy), None)
            if idle is None:
                self.refused += 1
                if self.metrics is not None:
                    self.metrics.refuse("connections")
                _ratelimited.warning("refused a connection: all %d are in requests", self.cap)
                return False
            self.evicted += 1
            _ratelimited.warning(
                "at the cap of %d connections: closed the oldest idle one", self.cap
            )
            self.remove(idle)
            idle.transport.abort()
        self._open[conn] = None
        self._by_transport[conn.transport] = conn
        return True

    def remove(self, conn: Connection) -> None:
        self._open.pop(conn, None)
        self._by_transport.pop(conn.transport, None)


class RateLimitFilter(logging.Filter):
    """Lets at most `burst` records of one message template through per `window_s`; the next
    one let through says how many were dropped. A flood (one per failed accept, one per
    hostile socket) cannot fill the disk."""

    def __init__(self, burst: int = 5, window_s: float = 10.0, clock=time.monotonic):
        super().__init__()
        self.burst, self.window_s, self.clock = burst, window_s, clock
        self._seen: dict[tuple[str, Any], list] = {}  # key -> [window start, count, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        now = self.clock()
        key = (record.name, record.msg)
        state = self._seen.get(key)
        if state is None or now - state[0] >= self.window_s:
            if len(self._seen) > 1000:  # templates are few; a flood of distinct ones is not
                self._seen.clear()
            dropped = state[2] if state else 0
            state = self._seen[key] = [now, 0, 0]
            if dropped:
                record.msg = f"{record.msg} [{dropped} similar messages dropped]"
        state[1] += 1
        if state[1] > self.burst:
            state[2] += 1
            return False
        return True


_ratelimited = logging.getLogger(__name__)
LIMITED_LOGGERS = (
    "asyncio",
    "aiohttp.server",
    "aiohttp.web",
    "aiohttp.access",
    __name__,
    "serving.server",
)


def limit_logging() -> None:
    """Rate-limit the loggers a connection flood writes to (`RateLimitFilter`)."""
    for name in LIMITED_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RateLimitFilter) for f in logger.filters):
            logger.addFilter(RateLimitFilter())


def connection_cap(wanted: int) -> int:
    """`wanted`, kept below the open-file limit (less room for the engine's own files)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    cap = max(1, min(wanted, soft - 64))
    if cap < wanted:
        log.warning(
            "max_connections %d is above the open-file limit %d: capped at %d", wanted, soft, cap
        )
    return cap
