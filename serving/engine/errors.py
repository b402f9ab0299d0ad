"""What the engine raises; the server maps each to an HTTP status."""

from __future__ import annotations


class EngineError(ValueError):
    """A request the engine refuses; `field` names the offending input (HTTP 400)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class EngineBusy(RuntimeError):
    """Too many sequences are waiting (HTTP 429)."""


class SessionError(Exception):
    """A session call that cannot be served: `status` is the HTTP status that says why (404
    unknown, 409 busy / closed / evicted, 413 over-long), `field` the offending field."""

    def __init__(self, status: int, message: str, field: str | None = None):
        super().__init__(message)
        self.status, self.field = status, field
