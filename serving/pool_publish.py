"""Publishing weights to a replica pool (`serving.pool.ReplicaPool`): every live replica at
once, through one publisher per replica; a replica that fails the publish is ejected, and a
readmitted one is brought to the current version before it takes traffic.

    publisher = PoolPublisher(pool, lambda r: EnginePublisher([r.client], token=token))
    await publisher.publish(path, version)   # every live replica serves `version`
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from rl.model.publish import PublishReport, WeightPublisher
from serving.client import ClientError
from serving.pool import Replica, ReplicaDown, ReplicaPool


class PoolPublishError(ClientError):
    """No live replica took the published version."""


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
                    self.pool.eject(
                        r, f"publish of version {version} failed: {out}", kind="publish"
                    )
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
                int(version),
                str(path),
                load_s=time.perf_counter() - started,
                first_token_s=None if None in probes else max(probes),
                servers=[r.url for r, _ in done],
            )

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
                    raise ReplicaDown(
                        r.url, f"not readmitted: republishing version {self.version} failed: {e}"
                    ) from e
            mark_live(r)

    async def close(self) -> None:
        for pub in self._publishers.values():
            close = getattr(pub, "close", None)
            if close is not None:
                await close()
