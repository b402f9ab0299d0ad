"""Prometheus text exposition for the server, with no client library: a few counters, gauges
and histograms, rendered on `GET /metrics`."""

from __future__ import annotations

import bisect
import time
from collections import defaultdict, deque

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
REFUSALS = ("client_sessions", "sessions", "session_token", "queue", "connections")
"""Why the server refuses a request that is not wrong in itself (`simloop_refused_total`'s
reasons): the client holds `ServerConfig.max_sessions_per_client` sessions, the engine holds
`EngineConfig.max_sessions`, a session call lacks its session's token, `max_waiting` sequences
wait already, every one of `max_connections` connections is in a request."""


class Histogram:
    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        running = 0
        for bound, count in zip(self.buckets, self.counts, strict=False):
            running += count
            lines.append(f'{name}_bucket{{le="{bound}"}} {running}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines += [f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]
        return lines


class ServerMetrics:
    """What the server records; the engine's own counters are read at render time."""

    def __init__(self, window_s: float = 10.0):
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.refused = dict.fromkeys(REFUSALS, 0)
        self.latency = Histogram()
        self.queue_wait = Histogram()
        self.window_s = window_s
        self._generated: deque[tuple[float, int]] = deque()

    def record_request(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] += 1

    def refuse(self, reason: str) -> None:
        self.refused[reason] += 1

    def tokens_per_second(self, generated_total: int) -> float:
        """Generation rate over the last `window_s`, from samples of the engine's counter."""
        now = time.monotonic()
        self._generated.append((now, generated_total))
        while len(self._generated) > 2 and self._generated[0][0] < now - self.window_s:
            self._generated.popleft()
        (t0, n0), (t1, n1) = self._generated[0], self._generated[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def render(self, engine) -> str:
        lines = [
            "# HELP simloop_requests_total HTTP requests by endpoint and status",
            "# TYPE simloop_requests_total counter",
        ]
        for (endpoint, status), count in sorted(self.requests.items()):
            labels = f'endpoint="{endpoint}",status="{status}"'
            lines.append(f"simloop_requests_total{{{labels}}} {count}")
        lines += [
            "# HELP simloop_refused_total requests refused to protect the server (limits, "
            "session tokens), by reason",
            "# TYPE simloop_refused_total counter",
        ]
        for reason, count in self.refused.items():
            lines.append(f'simloop_refused_total{{reason="{reason}"}} {count}')
        stats = engine.stats
        for key, help_text in [
            ("generated_tokens", "tokens generated"),
            ("prompt_tokens", "prompt tokens admitted"),
            ("cached_tokens", "prompt tokens served from reused KV (prefix reuse)"),
            ("aborted", "requests aborted"),
            ("steps", "engine device steps"),
            ("spec_steps", "verify calls of speculative decoding (engine.speculate)"),
            ("spec_guessed", "tokens guessed by prompt lookup in verify calls"),
            ("spec_kept", "guessed tokens the model confirmed (kept)"),
        ]:
            name = f"simloop_{key}_total"
            lines += [
                f"# HELP {name} {help_text}",
                f"# TYPE {name} counter",
                f"{name} {stats[key]}",
            ]
        rate = self.tokens_per_second(stats["generated_tokens"])
        gauges = [
            ("queue_depth", "sequences waiting for a slot", engine.queue_depth),
            ("slots_active", "slots decoding or prefilling", engine.active_slots),
            ("slots_total", "slots in the pool", engine.cfg.num_slots),
            ("weight_version", "version of the weights being served", engine.version),
            ("generation_tokens_per_second", "generation rate since the previous scrape "
             f"(window {self.window_s:g}s)", round(rate, 3)),
        ]  # fmt: skip
        for key, help_text, value in gauges:
            lines += [
                f"# HELP simloop_{key} {help_text}",
                f"# TYPE simloop_{key} gauge",
                f"simloop_{key} {value}",
            ]
        lines += self.latency.render("simloop_request_latency_seconds", "request latency")
        lines += self.queue_wait.render("simloop_queue_wait_seconds", "wait for a slot")
        return "\n".join(lines) + "\n"
