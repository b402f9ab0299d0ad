"""Weight publishing: after a trainer saves version v, make the inference servers serve it.

Trainers and servers meet only here and in checkpoints (docs/architecture.md §3): `rl/train`
knows the `WeightPublisher` Protocol; implementations that speak HTTP live with the servers
(`serving/publisher.py`: the JAX engine's `/admin/load_weights`; `serving/vllm`: vllm-tpu's
worker extension over `/collective_rpc`). `InMemoryPublisher` is the test double.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class PublishReport:
    """What one publish did and how long it took."""

    version: int
    path: str
    load_s: float
    """Until every server acknowledged the load."""
    first_token_s: float | None = None
    """Until a probe request generated a token tagged with `version` (None: not probed)."""
    servers: list[str] = field(default_factory=list)


class WeightPublisher(Protocol):
    async def publish(self, path: str, version: int) -> PublishReport:
        """Make every server of the role serve the weights at `path` as `version`; raises when
        a server refuses (the trainer keeps the checkpoint and may retry)."""
        ...


class InMemoryPublisher:
    """Records publishes; `on_publish(path, version)` lets a test swap weights in-process."""

    def __init__(self, on_publish: Callable[[str, int], None] | None = None):
        self.on_publish = on_publish
        self.published: list[tuple[str, int]] = []

    @property
    def version(self) -> int | None:
        return self.published[-1][1] if self.published else None

    async def publish(self, path: str, version: int) -> PublishReport:
        if self.published and version <= self.published[-1][1]:
            raise ValueError(f"version {version} is not newer than {self.published[-1][1]}")
        started = time.perf_counter()
        if self.on_publish is not None:
            self.on_publish(path, version)
        self.published.append((path, version))
        return PublishReport(
            version, path, load_s=time.perf_counter() - started, servers=["in-memory"]
        )
