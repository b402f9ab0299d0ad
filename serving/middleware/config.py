"""`MiddlewareConfig`: the `middleware` section of a simloop config (no JAX imported)."""

from __future__ import annotations

from dataclasses import dataclass

REWARD_MODES = ("all_segments", "last_segment")


@dataclass(frozen=True)
class MiddlewareConfig:
    """`simloop middleware`: the Anthropic / OpenAI front for unmodified agent harnesses."""

    host: str = "127.0.0.1"
    port: int = 8300
    """0 picks a free port (printed at start)."""
    segments_max: int = 8
    """Segments per rollout; one more (the harness rewrote its history again) ends the rollout
    with a 400 naming this limit, and its trajectories are written `truncated`."""
    reward_mode: str = "all_segments"
    """`all_segments`: every segment of a rollout carries its reward; `last_segment`: only the
    last one trains (earlier ones are written, excluded as `earlier_segment`)."""
    enable_thinking: bool = False
    """Render the generation prompt with Qwen3's thinking on (False: the empty think block)."""
    default_max_tokens: int = 1024
    """OpenAI requests that give no `max_tokens` (Anthropic's is required)."""
    max_tokens_cap: int | None = None
    """Clamp every request's `max_tokens` to this (None: the request's own)."""
    request_timeout_s: float = 600.0
    """One generation, end to end (the agent server's answer)."""
    rollout_ttl_s: float = 3600.0
    """A rollout whose finish (its grade) has not arrived this long after its last request is
    written `aborted`, with a reason saying so, and forgotten."""
    max_rollouts: int = 1024
    """Rollouts open at once; a request that would open one more is answered 429 (naming this
    limit) and creates nothing."""
    max_waiting_requests: int = 4
    """Requests of one rollout waiting while another of its requests runs (they run one at a
    time); one more is answered 429."""
    admin_socket: str | None = None
    """The admin listener (`GET /rollouts`, `GET /rollouts/{id}`, `POST /rollouts/{id}/finish`)
    as a Unix socket at this path. None (and no `admin_port`): a socket in a fresh private
    directory (mode 0700), out of every sandbox's reach. The API listener serves no admin
    route."""
    admin_port: int | None = None
    """The admin listener on TCP `admin_host:admin_port` instead (0: a free port), for finishing
    rollouts from another machine; the token is still required."""
    admin_host: str = "127.0.0.1"
    """`admin_port`'s interface."""
    admin_token: str | None = None
    """The admin listener's bearer token (`Authorization: Bearer <token>`), always required.
    None: a fresh secret per run, handed to the job that started the middleware (and written
    to `<out>/middleware-admin.json`, mode 0600, by `simloop middleware`)."""
    model_name: str = "simloop-agent"
    """The model name the APIs report when a request names none."""

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            value = getattr(self, name)
            return ValueError(f"MiddlewareConfig.{name}={value!r} is invalid: {allowed}")

        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise bad("port", "an integer in [0, 65535]")
        if not isinstance(self.segments_max, int) or self.segments_max < 1:
            raise bad("segments_max", "an integer >= 1")
        if self.reward_mode not in REWARD_MODES:
            raise bad("reward_mode", f"one of {list(REWARD_MODES)}")
        if not isinstance(self.default_max_tokens, int) or self.default_max_tokens < 1:
            raise bad("default_max_tokens", "an integer >= 1")
        if self.max_tokens_cap is not None and (
            not isinstance(self.max_tokens_cap, int) or self.max_tokens_cap < 1
        ):
            raise bad("max_tokens_cap", "an integer >= 1 or null")
        for name in ("request_timeout_s", "rollout_ttl_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value <= 0:
                raise bad(name, "a number of seconds > 0")
        if self.admin_token is not None and not (
            isinstance(self.admin_token, str) and self.admin_token
        ):
            raise bad("admin_token", "a non-empty string or null")
        if not isinstance(self.max_rollouts, int) or self.max_rollouts < 1:
            raise bad("max_rollouts", "an integer >= 1")
        if not isinstance(self.max_waiting_requests, int) or self.max_waiting_requests < 0:
            raise bad("max_waiting_requests", "an integer >= 0")
        if self.admin_port is not None:
            if not isinstance(self.admin_port, int) or not 0 <= self.admin_port < 65536:
                raise bad("admin_port", "an integer in [0, 65535] or null")
            if self.admin_port and self.admin_port == self.port:
                raise bad("admin_port", "another port than `port` (the API listener's)")
            if self.admin_socket is not None:
                raise bad("admin_port", "null when admin_socket is set (one admin listener)")
        if self.admin_socket is not None and not (
            isinstance(self.admin_socket, str) and 0 < len(self.admin_socket.encode()) < 108
        ):
            raise bad("admin_socket", "a path of 1-107 bytes (a Unix socket's limit) or null")
        if not isinstance(self.admin_host, str) or not self.admin_host:
            raise bad("admin_host", "a non-empty host name or address")
