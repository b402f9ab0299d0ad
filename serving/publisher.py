"""`EnginePublisher`: the `WeightPublisher` (rl/model/publish.py) for simloop's own servers.

Each server is asked to load the params checkpoint over `POST /admin/load_weights`; then one
probe request (a single greedy token) measures how long until a token of the new version is
generated: the trainer-to-sampler latency of a publish.

A load that fails transiently (no connection, 429, 5xx) is retried `retries` times with
backoff; a refusal (4xx) or the last failure raises `PublishError` naming the server, the
version and the reason: a trainer never trains on as if the version had been published.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from rl.model.publish import PublishReport
from serving.client import ClientError, InferenceClient

PROBE_PROMPT = [0]


class PublishError(ClientError):
    """A server did not load the published version (it keeps serving its previous one)."""


class EnginePublisher:
    def __init__(
        self,
        clients: Sequence[InferenceClient],
        *,
        token: str,
        probe: bool = True,
        timeout_s: float = 600.0,
        retries: int = 2,
        backoff_s: float = 1.0,
    ):
        if not clients:
            raise ValueError("EnginePublisher needs at least one server client")
        self.clients, self.token, self.probe, self.timeout_s = (
            list(clients),
            token,
            probe,
            timeout_s,
        )
        self.retries, self.backoff_s = retries, backoff_s

    async def _load(self, client: InferenceClient, path: str, version: int) -> None:
        for attempt in range(1, self.retries + 2):
            try:
                await client.load_weights(path, version, token=self.token, timeout_s=self.timeout_s)
                return
            except ClientError as e:
                # Retried on purpose: a server restarting or overloaded answers later.
                if not e.retryable or attempt > self.retries:
                    raise PublishError(
                        f"publishing version {version} ({path}) to {client.cfg.base_url} "
                        f"failed after {attempt} attempt(s): {e}",
                        status=e.status,
                        body=e.body,
                        attempts=attempt,
                    ) from e
            await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))

    async def publish(self, path: str, version: int) -> PublishReport:
        started = time.perf_counter()
        await asyncio.gather(*(self._load(c, path, version) for c in self.clients))
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
