"""`MiddlewareConfig`: the `middleware` section of a simloop config (no JAX imported)."""

from __future__ import annotations

from dataclasses import dataclass

from rl import validate

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
        validate.integer(self, "port", low=0, high=65535)
        validate.integer(self, "segments_max", "default_max_tokens", "max_rollouts", low=1)
        validate.one_of(self, "reward_mode", REWARD_MODES)
        validate.integer(self, "max_tokens_cap", low=1, optional=True)
        validate.positive(
            self,
            "request_timeout_s",
            "rollout_ttl_s",
            nan_ok=True,
            allowed="a number of seconds > 0",
        )
        validate.text(self, "admin_token", optional=True, allowed="a non-empty string or null")
        validate.integer(self, "max_waiting_requests", low=0)
        if self.admin_port is not None:
            validate.integer(self, "admin_port", low=0, high=65535, optional=True)
            validate.require(
                not self.admin_port or self.admin_port != self.port,
                self,
                "admin_port",
                "another port than `port` (the API listener's)",
            )
            validate.require(
                self.admin_socket is None,
                self,
                "admin_port",
                "null when admin_socket is set (one admin listener)",
            )
        socket = self.admin_socket
        validate.require(
            socket is None or (isinstance(socket, str) and 0 < len(socket.encode()) < 108),
            self,
            "admin_socket",
            "a path of 1-107 bytes (a Unix socket's limit) or null",
        )
        validate.text(self, "admin_host", allowed="a non-empty host name or address")
