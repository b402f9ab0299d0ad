"""`EnginePublisher`: the `WeightPublisher` (rl/model/publish.py) for simloop's own servers.

Each server is asked to load the params checkpoint over `POST /admin/load_weights`; then one
probe request (a single greedy token) measures how long until a token of the new version is
generated: the trainer-to-sampler latency of a publish.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from rl.model.publish import PublishReport
from serving.client import InferenceClient

PROBE_PROMPT = [0]


class EnginePublisher:
    def __init__(
        self,
        clients: Sequence[InferenceClient],
        *,
        token: str,
        probe: bool = True,
        timeout_s: float = 600.0,
    ):
        if not clients:
            raise ValueError("EnginePublisher needs at least one server client")
        self.clients, self.token, self.probe, self.timeout_s = (
            list(clients),
            token,
            probe,
            timeout_s,
        )

    async def publish(self, path: str, version: int) -> PublishReport:
        started = time.perf_counter()
        await asyncio.gather(
            *(
                c.load_weights(path, version, token=self.token, timeout_s=self.timeout_s)
                for c in self.clients
            )
        )
        load_s = time.perf_counter() - started
        first_token_s = None
        if self.probe:
            out = await self.clients[0].complete(
                PROBE_PROMPT, max_tokens=1, temperature=0.0, timeout_s=self.timeout_s
            )
            served = out.weight_version
            if served is not None and served < version:
                raise RuntimeError(
                    f"published version {version} but the server generated with version {served}"
                )
            first_token_s = time.perf_counter() - started
        return PublishReport(
            version,
            path,
            load_s=load_s,
            first_token_s=first_token_s,
            servers=[c.cfg.base_url for c in self.clients],
        )
