"""`VllmPublisher`: the `WeightPublisher` (rl/model/publish.py) for vllm-tpu servers.

A publish asks every server, concurrently, to run simloop's worker extension on all of its
workers (`POST /collective_rpc`, `serving.vllm.worker_extension.OrbaxWeightLoader`); each worker
must answer with the version it now serves. Then each server's prefix cache is reset (its KV
was computed with the old weights) and a one-token greedy `/v1/completions` probe measures how
long until the new weights generate, as `EnginePublisher` does for simloop's own servers.
`/collective_rpc` and `/reset_prefix_cache` exist only with `VLLM_SERVER_DEV_MODE=1`, which
`serving.vllm.launcher` sets.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from rl.model.publish import PublishReport
from serving.client import ClientConfig, ClientError, InferenceClient
from serving.publisher import PROBE_PROMPT

LOAD_METHOD = "load_orbax_weights"


class VllmPublishError(RuntimeError):
    """A server refused or failed a step of a publish; the message names the server, the step
    and the server's answer. Servers that did load keep serving the new version."""


class VllmPublisher:
    """Publishes `save_params` directories to vllm-tpu servers (one `WeightPublisher`)."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        model_name: str,
        timeout_s: float = 600.0,
        probe: bool = True,
        reset_prefix_cache: bool = True,
        api_key: str | None = None,
    ):
        """`urls`: server roots (`http://host:port`, no /v1). `model_name`: the servers'
        `--served-model-name`. `timeout_s` bounds each request of a publish (loading a large
        checkpoint takes a while). `api_key`: vLLM's `--api-key`, when servers have one."""
        if not urls:
            raise ValueError("VllmPublisher needs at least one server URL")
        if timeout_s <= 0:
            raise ValueError(f"VllmPublisher timeout_s={timeout_s!r} is invalid: > 0")
        self.urls = [u.rstrip("/") for u in urls]
        self.model_name, self.timeout_s = model_name, timeout_s
        self.probe, self.reset_prefix_cache = probe, reset_prefix_cache
        self.clients = [
            InferenceClient(
                ClientConfig(
                    u, model=model_name, timeout_s=timeout_s, max_retries=0, api_key=api_key
                )
            )
            for u in self.urls
        ]

    async def __aenter__(self) -> VllmPublisher:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))

    async def publish(self, path: str, version: int) -> PublishReport:
        started = time.perf_counter()
        await self._on_every_server(self._load, str(path), int(version))
        load_s = time.perf_counter() - started
        if self.reset_prefix_cache:
            await self._on_every_server(self._reset_prefix_cache)
        first_token_s = None
        if self.probe:
            await self._on_every_server(self._probe)
            first_token_s = time.perf_counter() - started
        return PublishReport(
            int(version),
            str(path),
            load_s=load_s,
            first_token_s=first_token_s,
            servers=list(self.urls),
        )

    # ----- steps -----------------------------------------------------------------------------

    async def _on_every_server(self, step: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Run `step(client, *args)` on all servers at once and wait for all of them, so one
        failure does not hide another; raise naming every server that failed."""
        outcomes = await asyncio.gather(
            *(step(c, *args) for c in self.clients), return_exceptions=True
        )
        errors = [e for e in outcomes if isinstance(e, BaseException)]
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise VllmPublishError(
                f"{len(errors)} of {len(self.clients)} servers failed:\n"
                + "\n".join(f"  {e}" for e in errors)
            ) from errors[0]

    async def _load(self, client: InferenceClient, path: str, version: int) -> None:
        # vLLM's route (dev mode only; https://github.com/vllm-project/vllm/blob/main/vllm/
        # entrypoints/serve/rpc/api_router.py, later serve/dev/rpc/) reads a JSON object with
        # "method" (required), "args" (list), "kwargs" (dict) and "timeout" (seconds), calls
        # the method on every worker and answers {"results": [one per worker]}, dicts as-is.
        body = {"method": LOAD_METHOD, "args": [path, version]}
        answer = await self._request(
            client, "POST", "/collective_rpc", body, f"{LOAD_METHOD}({path!r}, {version})"
        )
        results = answer.get("results") if isinstance(answer, dict) else None
        if not results:
            raise VllmPublishError(
                f"{client.cfg.base_url}: /collective_rpc answered {_show(answer)} without worker "
                "results: was the server started with --worker-extension-cls "
                "serving.vllm.worker_extension.OrbaxWeightLoader?"
            )
        wrong = [r for r in results if not isinstance(r, dict) or r.get("version") != version]
        if wrong:
            raise VllmPublishError(
                f"{client.cfg.base_url}: {len(wrong)} of {len(results)} workers did not report "
                f"version {version} after {LOAD_METHOD}: {_show(wrong)}"
            )

    async def _reset_prefix_cache(self, client: InferenceClient) -> None:
        await self._request(client, "POST", "/reset_prefix_cache", None, "reset_prefix_cache")

    async def _probe(self, client: InferenceClient) -> None:
        try:
            out = await client.complete(
                PROBE_PROMPT, max_tokens=1, temperature=0.0, timeout_s=self.timeout_s
            )
        except ClientError as e:
            raise _server_error(client, "the probe completion", e) from e
        if len(out.token_ids) != 1:
            raise VllmPublishError(
                f"{client.cfg.base_url}: the probe asked for 1 token and got {out.token_ids!r}"
            )

    async def _request(
        self, client: InferenceClient, method: str, route: str, body: Any, what: str
    ) -> Any:
        """One call to a dev-mode route (never retried: a load may have half-happened)."""
        try:
            answer, _ = await client.request(
                method, route, json_body=body, timeout_s=self.timeout_s, retries=0
            )
        except ClientError as e:
            raise _server_error(client, what, e, dev_route=True) from e
        return answer


def _server_error(
    client: InferenceClient, what: str, e: ClientError, *, dev_route: bool = False
) -> VllmPublishError:
    message = f"{client.cfg.base_url}: {what} failed: {e}"
    if e.body is not None:
        message += f"; response body: {_show(e.body)}"
    if dev_route and e.status == 404:
        message += " (404: is the server running with VLLM_SERVER_DEV_MODE=1?)"
    return VllmPublishError(message)


def _show(value: Any, limit: int = 500) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit] + "..."
