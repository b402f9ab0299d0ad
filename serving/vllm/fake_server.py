"""A fake `vllm serve`: vLLM's HTTP API and worker-extension RPC on simloop's JAX engine, so the
vllm production path (launcher, `VllmPublisher`, `OrbaxWeightLoader`, vLLM's response shapes)
runs for real on a CPU.

    python -m serving.vllm.fake_server serve MODEL_DIR --port 8000 --served-model-name agent \\
        --tensor-parallel-size 2 --max-model-len 512 \\
        --worker-extension-cls serving.vllm.worker_extension.OrbaxWeightLoader

It takes the flags `serving.vllm.launcher.build_vllm_command` writes (plus `--tokenizer`,
`--seed`, `--max-num-seqs`); any other flag exits 2 with argparse's message, as vLLM does.
MODEL_DIR is an HF directory (`rl.model.hf_io.save_hf`); the model is served by
`serving.engine.Engine`, its KV cache `--max-model-len` long, and the socket is bound only
once the engine has compiled (one token per decode call, `--max-num-seqs` slots, default
8). Routes, in vLLM's shapes:

    GET  /health, /v1/models, /version, /metrics
    POST /v1/completions, /v1/chat/completions        (no streaming)
    POST /collective_rpc, /reset_prefix_cache          (only with VLLM_SERVER_DEV_MODE=1)

`/collective_rpc` calls the method on `--tensor-parallel-size` workers, each an instance of a
class with the `--worker-extension-cls` class (imported by its dotted name) among its bases,
as vLLM builds them. A worker's `model_runner` looks like tpu-inference's: `state` is an
`nnx.State` of per-layer parameters named like the HF tensors (`kernel`, `embedding`, `scale`
leaves), in tpu-inference's layout, which is simloop's without the stacked layer axis, and
`state_leaves` the tuple its step runs with. When a call replaced the runners' parameters
(the extension sets new `state_leaves`), the engine is reloaded from them before the call
answers, so tokens generated after a publish come from the published weights.

Compiled programs go to JAX's persistent cache in `VLLM_XLA_CACHE_PATH`, as vLLM-TPU's go to
its XLA cache there (`SIMLOOP_COMPILE_CACHE_DIR` first, when set), so a restarted server loads
them (`_compile_cache`).

Fake-only conveniences, not vLLM behaviour: without `tokenizer.json` (in MODEL_DIR or at
`--tokenizer`) simloop's byte tokenizer is used; `--seed` is accepted and unused (a request's
`seed` makes its samples reproducible); `--gpu-memory-utilization` is only validated.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from http import HTTPStatus
from pathlib import Path
from typing import Any

log = logging.getLogger("vllm.entrypoints.openai.api_server")

VERSION = "0.0.0+simloop.fake"
DEFAULT_MAX_NUM_SEQS = 8
DEFAULT_BLOCK_SIZE = 16
"""Tokens per KV block: vLLM's prefix cache hits whole blocks, and so do the fake's counts."""
"""Sequences decoded together (vLLM's default, 256, is far more than a CPU test needs)."""


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """-> (`vllm`, its `serve` subcommand)."""
    parser = argparse.ArgumentParser(prog="vllm", description="simloop's fake vLLM server")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve an HF model directory")
    serve.add_argument("model", metavar="MODEL_DIR", help="HF directory (config + safetensors)")
    serve.add_argument("--tensor-parallel-size", type=int, default=1, help="workers per call")
    serve.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context per sequence (default: the model's, <= 2048)",
    )
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--served-model-name", default=None, help="default: MODEL_DIR")
    serve.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    serve.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    serve.add_argument("--worker-extension-cls", default=None, metavar="DOTTED")
    serve.add_argument("--tokenizer", default=None, help="tokenizer directory or tokenizer.json")
    serve.add_argument("--seed", type=int, default=None, help="accepted, unused")
    serve.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS)
    serve.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens (prefix cache hits)",
    )
    serve.add_argument(
        "--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="KV block (hits count whole)"
    )
    serve.add_argument(
        "--speculative-config",
        type=_speculative,
        default=None,
        metavar="JSON",
        help='n-gram speculation only: {"method": "ngram", '
        '"num_speculative_tokens": K, "prompt_lookup_max": N}',
    )
    return parser, serve


def _speculative(text: str) -> dict:
    """`--speculative-config` as vLLM reads it, of which the fake serves the `ngram` method
    (simloop's engine guesses by prompt lookup); anything else is refused by name."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg})") from None
    if not isinstance(spec, dict) or spec.get("method") != "ngram":
        raise argparse.ArgumentTypeError('only {"method": "ngram", ...} is served by the fake')
    known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
    if set(spec) - known:
        raise argparse.ArgumentTypeError(
            f"unknown keys {sorted(set(spec) - known)}; the fake knows {sorted(known)}"
        )
    for key, default in (
        ("num_speculative_tokens", None),
        ("prompt_lookup_max", 3),
        ("prompt_lookup_min", 1),
    ):
        value = spec.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise argparse.ArgumentTypeError(f"{key}={value!r} is invalid: a positive integer")
        spec[key] = value
    return spec


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser, serve = build_parser()
    args = parser.parse_args(argv)
    for flag, value, ok, allowed in (
        (
            "--tensor-parallel-size",
            args.tensor_parallel_size,
            args.tensor_parallel_size >= 1,
            ">= 1",
        ),
        (
            "--max-model-len",
            args.max_model_len,
            args.max_model_len is None or args.max_model_len >= 2,
            ">= 2",
        ),
        ("--port", args.port, 0 <= args.port <= 65535, "in [0, 65535]"),
        (
            "--gpu-memory-utilization",
            args.gpu_memory_utilization,
            0 < args.gpu_memory_utilization <= 1,
            "in (0, 1]",
        ),
        ("--max-num-seqs", args.max_num_seqs, args.max_num_seqs >= 1, ">= 1"),
        ("--block-size", args.block_size, args.block_size >= 1, ">= 1"),
    ):
        if not ok:
            serve.error(f"argument {flag}: {value} is invalid: {allowed}")
    return args


def import_by_name(dotted: str) -> type:
    """The class `package.module.Class` names (vLLM's `resolve_obj_by_qualname`)."""
    module, _, name = dotted.rpartition(".")
    if not module:
        raise ValueError(f"--worker-extension-cls {dotted!r} is not a dotted module.Class name")
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--worker-extension-cls {dotted!r} cannot be imported: {e}") from e
    if not isinstance(obj, type):
        raise ValueError(
            f"--worker-extension-cls {dotted!r} is a {type(obj).__name__}, not a class"
        )
    return obj


# ----- workers ---------------------------------------------------------------------------------


def _runner_path(hf_name: str) -> tuple[str, ...]:
    """tpu-inference's parameter path for an HF tensor name: Flax leaf names for weights."""
    *parents, leaf = hf_name.split(".")
    if leaf == "weight":
        module = parents[-1]
        leaf = (
            "embedding"
            if module == "embed_tokens"
            else "scale"
            if module.endswith("norm")
            else "kernel"
        )
    return (*parents, leaf)


def _put(tree: dict, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


class FakeModelRunner:
    """The part of tpu-inference's runner that `OrbaxWeightLoader` uses: `state` (an
    `nnx.State`) and `state_leaves`, which the extension replaces after a load."""

    def __init__(self, cfg, params: dict):
        """`params`: the served `nnx.to_pure_dict` tree (simloop layout, layers stacked)."""
        from flax import nnx
        from jax import tree_util

        from rl.model.hf_io import tensor_table

        self.cfg = cfg
        tree: dict = {}
        for t in tensor_table(cfg):
            value = functools.reduce(lambda node, key: node[key], t.path, params)
            for i in range(cfg.num_layers) if t.per_layer else [None]:
                leaf = value if i is None else value[i]
                _put(tree, _runner_path(t.hf_name.format(i=i)), nnx.Param(leaf))
        self.state = nnx.State(tree)
        self.state_leaves = tuple(tree_util.tree_leaves(self.state))
        self.served_leaves = self.state_leaves
        """`state_leaves` when the engine last took this runner's parameters."""

    @property
    def reloaded(self) -> bool:
        return self.state_leaves is not self.served_leaves

    def params(self) -> dict:
        """The runner's parameters as the engine's `nnx.to_pure_dict` tree (layers stacked,
        on the host: one copy into reused memory, where a device stack dispatches op by
        op into fresh memory)."""
        import numpy as np

        from rl.model.hf_io import tensor_table
        from rl.model.state_tree import pure_dict
        from rl.model.zarr_read import host_array

        tree = pure_dict(self.state)  # no reference cycle keeps replaced leaves alive
        out: dict = {}
        for t in tensor_table(self.cfg):
            layers = range(self.cfg.num_layers) if t.per_layer else [None]
            values = [
                functools.reduce(
                    lambda node, key: node[key], _runner_path(t.hf_name.format(i=i)), tree
                )
                for i in layers
            ]
            if t.per_layer:
                stacked = host_array((len(values), *values[0].shape), values[0].dtype)
                _put(out, t.path, np.stack([np.asarray(v) for v in values], out=stacked))
            else:
                _put(out, t.path, values[0])
        return out


class FakeWorker:
    """What a worker extension sees of a vLLM worker: its `rank` and its `model_runner`."""

    def __init__(self, rank: int, model_runner: FakeModelRunner):
        self.rank, self.model_runner = rank, model_runner


def worker_class(extension: type | None) -> type:
    """`FakeWorker` with `extension` appended to its bases, refusing an extension attribute
    the worker already has (vLLM's `WorkerWrapperBase.init_worker` does both)."""
    if extension is None:
        return FakeWorker
    probe = FakeWorker(0, None)  # type: ignore[arg-type]
    for attr in dir(extension):
        if not attr.startswith("__") and hasattr(probe, attr):
            raise ValueError(
                f"worker class {FakeWorker.__name__} already has an attribute "
                f"{attr!r}, which conflicts with the worker extension class "
                f"{extension.__qualname__}"
            )
    return type(f"FakeWorker+{extension.__name__}", (FakeWorker, extension), {})


def rpc_methods(worker: object) -> list[str]:
    """What `/collective_rpc` may call: the worker's public methods."""
    return sorted(a for a in dir(worker) if not a.startswith("_") and callable(getattr(worker, a)))


# ----- the HTTP server ---------------------------------------------------------------------------

_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
}


def vllm_error(status: int, message: str, param: str | None = None):
    """vLLM's error response: `{"error": {"message", "type", "param", "code": status}}`."""
    from aiohttp import web

    kind = _ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)


_dumps = functools.partial(json.dumps, default=str)  # a worker's dict may hold any value


def _json_safe(result: Any) -> Any:
    """vLLM's `/collective_rpc` answers dicts, lists and None as they are, anything else as
    its `str`."""
    return result if result is None or isinstance(result, dict | list) else str(result)


def make_server_class():
    """`FakeVllmServer`, built on first use: `serving.server` imports JAX."""
    from aiohttp import web

    from serving.engine import EngineError
    from serving.protocol import ApiError, CompletionRequest, build_response, new_id
    from serving.server import Server

    class FakeVllmServer(Server):
        """simloop's `Server` (its engine plumbing, parsing and limits) with vLLM's routes and
        shapes."""

        def __init__(
            self,
            engine,
            tokenizer,
            cfg,
            *,
            workers,
            root: str,
            dev_mode: bool,
            block_size: int = DEFAULT_BLOCK_SIZE,
            prompt_details: bool = False,
        ):
            super().__init__(engine, tokenizer, cfg)
            self.workers, self.root, self.dev_mode = workers, root, dev_mode
            self.block_size, self.prompt_details = block_size, prompt_details
            self.cache_queries = self.cache_hits = 0
            """vLLM's `prefix_cache_queries` / `prefix_cache_hits` counters (tokens)."""
            self._rpc_lock = asyncio.Lock()
            self._background: set[asyncio.Task] = set()

        def app(self) -> web.Application:
            app = web.Application(
                client_max_size=self.cfg.max_body_bytes,
                middlewares=[self._errors, self._vllm_errors],
            )
            routes = [
                web.get("/health", self.health),
                web.get("/v1/models", self.models),
                web.get("/version", self.version_info),
                web.get("/metrics", self.prometheus),
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
            ]
            if self.dev_mode:  # vLLM mounts these only with VLLM_SERVER_DEV_MODE=1
                routes += [
                    web.post("/collective_rpc", self.collective_rpc),
                    web.post("/reset_prefix_cache", self.reset_prefix_cache),
                ]
            app.add_routes(routes)
            for route in routes:
                log.info("Route: %s, Methods: %s", route.path, route.method)
            return app

        @web.middleware
        async def _vllm_errors(self, request: web.Request, handler) -> web.StreamResponse:
            """Inside `Server._errors` (connection bookkeeping, metrics): vLLM's error shape."""
            try:
                return await handler(request)
            except ApiError as e:
                return vllm_error(e.status, e.message, e.param)
            except web.HTTPRequestEntityTooLarge:
                return vllm_error(413, f"request body is over {self.cfg.max_body_bytes} bytes")
            except web.HTTPException as e:
                if e.status < 400:
                    raise
                return vllm_error(e.status, f"{request.method} {request.path}: {e.reason}")
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a bug must not take the server down
                log.exception("unhandled error on %s", request.path)
                return vllm_error(500, f"internal error: {type(e).__name__}: {e}")

        def _check_model(self, name: str | None) -> None:
            if name is not None and name != self.cfg.model_name:
                raise ApiError(404, f"The model `{name}` does not exist.", param="model")

        # ----- OpenAI routes --------------------------------------------------------------

        async def health(self, request: web.Request) -> web.Response:
            if self.engine.failure is not None or not self.engine.running:
                raise ApiError(503, f"engine is dead: {self.engine.failure!r}")
            return web.Response(status=200)

        async def models(self, request: web.Request) -> web.Response:
            return web.json_response(
                {
                    "object": "list",
                    "data": [
                        {
                            "id": self.cfg.model_name,
                            "object": "model",
                            "created": int(time.time()),
                            "owned_by": "vllm",
                            "root": self.root,
                            "parent": None,
                            "max_model_len": self.engine.cfg.max_seq_len,
                        }
                    ],
                }
            )

        async def version_info(self, request: web.Request) -> web.Response:
            return web.json_response({"version": VERSION})

        async def _complete(self, request, req: CompletionRequest, prefix: str):
            if req.stream:
                raise ApiError(
                    400,
                    "the fake vLLM server does not stream: leave 'stream' false",
                    param="stream",
                )
            self._check_model(req.model)
            started = time.perf_counter()
            request_id = new_id(prefix)
            handles = self._submit(req, request_id)
            try:
                outputs = await asyncio.gather(*(h.result() for h in handles))
            finally:  # a disconnect cancels us: abort what is left
                for h in handles:
                    self.engine.abort(h.id)
            self._record(outputs, started)
            body = build_response(
                req,
                outputs,
                tokenizer=self.tokenizer,
                model=self.cfg.model_name,
                version=self.engine.version,
                request_id=request_id,
            )
            # vLLM's prefix cache hits whole blocks: the engine's reused tokens, whole blocks
            block = self.block_size
            hits = sum(outs[0].cached_tokens // block * block for outs in outputs if outs)
            self.cache_queries += sum(len(p) for p in req.prompts)
            self.cache_hits += hits
            return web.json_response(
                _as_vllm(body, req, outputs, cached=hits if self.prompt_details else None)
            )

        async def prometheus(self, request: web.Request) -> web.Response:
            lines = [self.metrics.render(self.engine).rstrip("\n")]
            for name, value, text in (
                ("prefix_cache_queries", self.cache_queries, "prompt tokens looked up"),
                ("prefix_cache_hits", self.cache_hits, "prompt tokens found (whole blocks)"),
            ):
                lines += [
                    f"# HELP vllm:{name}_total {text} in the prefix cache",
                    f"# TYPE vllm:{name}_total counter",
                    f'vllm:{name}_total{{model_name="{self.cfg.model_name}"}} {value}',
                ]
            return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

        # ----- dev-mode routes ------------------------------------------------------------

        async def collective_rpc(self, request: web.Request) -> web.Response:
            body = await self._json(request)
            if not isinstance(body, dict):
                raise ApiError(400, "the request body must be a JSON object")
            method, args, kwargs = body.get("method"), body.get("args", []), body.get("kwargs", {})
            timeout = body.get("timeout")
            if not isinstance(method, str) or not method:
                raise ApiError(400, "Missing 'method' in request body", param="method")
            methods = rpc_methods(self.workers[0])
            if method not in methods:
                raise ApiError(
                    400,
                    f"the workers have no method {method!r}; they have {methods}",
                    param="method",
                )
            if not isinstance(args, list):
                raise ApiError(
                    400, f"'args' must be a list, got {type(args).__name__}", param="args"
                )
            if not isinstance(kwargs, dict):
                raise ApiError(
                    400, f"'kwargs' must be an object, got {type(kwargs).__name__}", param="kwargs"
                )
            if timeout is not None and (
                isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0
            ):
                raise ApiError(
                    400,
                    f"'timeout' must be a positive number of seconds or null, got {timeout!r}",
                    param="timeout",
                )
            # The call keeps running past a timeout (as vLLM's workers do); the lock keeps the
            # next one from overlapping it, and a load that finishes late still takes effect.
            task = asyncio.create_task(self._rpc(method, args, kwargs), name=f"rpc-{method}")
            self._background.add(task)
            task.add_done_callback(self._rpc_done)
            try:
                results = await asyncio.wait_for(asyncio.shield(task), timeout)
            except TimeoutError:
                raise ApiError(
                    500, f"collective_rpc {method!r} did not finish within {timeout}s"
                ) from None
            return web.json_response({"results": results}, dumps=_dumps)

        async def _rpc(self, method: str, args: list, kwargs: dict) -> list:
            async with self._rpc_lock:
                try:
                    results = await asyncio.to_thread(self._call_workers, method, args, kwargs)
                except Exception as e:  # noqa: BLE001 - the method's error goes to the caller
                    log.warning("collective_rpc %s failed: %r", method, e)
                    raise ApiError(
                        500, f"{method} failed on a worker: {type(e).__name__}: {e}"
                    ) from e
                await self._sync_engine(method)
                return results

        def _call_workers(self, method: str, args: list, kwargs: dict) -> list:
            return [_json_safe(getattr(w, method)(*args, **kwargs)) for w in self.workers]

        def _rpc_done(self, task: asyncio.Task) -> None:
            self._background.discard(task)
            # Read the error of a call that outlived its request's timeout, so that asyncio
            # does not report it as never retrieved (a caller that waited already got it).
            if not task.cancelled() and task.exception() is not None:
                log.debug("collective_rpc task ended with %r", task.exception())

        async def _sync_engine(self, method: str) -> None:
            """Reload the engine when the call replaced the runners' parameters."""
            runners = [w.model_runner for w in self.workers]
            reloaded = [r.reloaded for r in runners]
            if not any(reloaded):
                return
            if not all(reloaded):
                raise ApiError(
                    500,
                    f"{method} replaced the parameters of workers "
                    f"{[i for i, r in enumerate(reloaded) if r]} only, of "
                    f"{len(runners)}: the engine keeps its weights",
                )
            params = await asyncio.to_thread(runners[0].params)
            try:
                self.engine.install_params(params, self.engine.version + 1)
            except EngineError as e:
                raise ApiError(500, f"the engine refused the workers' parameters: {e}") from e
            for r in runners:
                r.served_leaves = r.state_leaves
            log.info("engine reloaded from the workers' parameters after %s", method)

        async def reset_prefix_cache(self, request: web.Request) -> web.Response:
            self.engine.reset_prefix_cache()
            return web.Response(status=200)

    return FakeVllmServer


def _as_vllm(body: dict, req, outputs, *, cached: int | None = None) -> dict:
    """simloop's response as vLLM writes it: no `weight_version` / `token_versions`, chat's
    `prompt_token_ids` at the top, `stop_reason` the stop token id that ended a choice, usage
    without prompt token details (vLLM's default) unless `cached` is given
    (`--enable-prompt-tokens-details`: the prompt tokens the prefix cache served)."""
    body.pop("weight_version", None)
    body["system_fingerprint"] = None
    body["usage"]["prompt_tokens_details"] = None if cached is None else {"cached_tokens": cached}
    flat = [o for outs in outputs for o in outs]
    stop_ids = set(req.params.stop_token_ids)
    for choice, out in zip(body["choices"], flat, strict=True):
        choice.pop("token_versions", None)
        last = out.token_ids[-1] if out.token_ids else None
        if out.finish_reason == "stop" and last in stop_ids:
            choice["stop_reason"] = last
        choice["prompt_logprobs"] = None
        if req.chat:
            choice.pop("prompt_token_ids", None)
            choice["message"]["tool_calls"] = []
    if req.chat:
        body["prompt_logprobs"] = None
        body["prompt_token_ids"] = req.prompts[0] if req.return_token_ids else None
    return body


# ----- entry point -------------------------------------------------------------------------------


def _load(args: argparse.Namespace):
    """-> (model, tokenizer, the workers' class); ValueError/OSError name what is wrong."""
    from rl.data.tokenizer import ByteTokenizer, hf_dir_tokenizer
    from rl.model import load_hf

    extension = import_by_name(args.worker_extension_cls) if args.worker_extension_cls else None
    cls = worker_class(extension)  # refuse a conflicting extension before the model loads
    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise ValueError(
            f"model directory {args.model!r} does not exist: the fake server "
            "serves a local HF directory (config.json + safetensors)"
        )
    _, model = load_hf(model_dir)
    tokenizer = hf_dir_tokenizer(args.tokenizer or model_dir)
    if args.tokenizer and isinstance(tokenizer, ByteTokenizer):
        raise ValueError(f"--tokenizer {args.tokenizer!r}: no tokenizer.json there")
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
            f"{model.cfg.vocab_size} embeddings"
        )
    return model, tokenizer, cls


def _engine_config(args: argparse.Namespace, model_cfg):
    from serving.config import EngineConfig

    max_len = args.max_model_len or min(model_cfg.max_position_embeddings, 2048)
    if max_len > model_cfg.max_position_embeddings:
        limit = model_cfg.max_position_embeddings
        raise ValueError(f"--max-model-len {max_len} is over the model's {limit} positions")
    chunk = 16
    while chunk * 2 <= min(256, max_len):
        chunk *= 2
    spec = args.speculative_config or {}
    # One token per decode call: the multi-step decode's compile costs seconds of every start.
    return EngineConfig(
        num_slots=args.max_num_seqs,
        max_seq_len=max_len,
        prefill_chunk=chunk,
        decode_steps=1,
        prefix_reuse=args.enable_prefix_caching,
        speculate=spec.get("num_speculative_tokens", 0),
        speculate_ngram=spec.get("prompt_lookup_max", 3),
    )


def _compile_cache() -> None:
    """Keep compiled programs where vLLM-TPU keeps its own, `VLLM_XLA_CACHE_PATH` (the launcher
    sets one per server), so that a restarted server loads them instead of compiling again;
    `SIMLOOP_COMPILE_CACHE_DIR`, when set, comes first (the test suite's cache for one run).
    The engine runs on one device, whose programs the cache serves on every backend
    (`launch/compile_cache.py`)."""
    from serving.xla_cache import CACHE_DIR_ENV, use_compile_cache

    path = os.environ.get(CACHE_DIR_ENV) or os.environ.get("VLLM_XLA_CACHE_PATH")
    if not path:
        return
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("compilation cache off (%s cannot be created: %s)", path, e)
        return

    use_compile_cache(path)
    log.info("compilation cache: %s", path)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)  # exits 2 on a bad flag, before anything heavy is imported
    from serving.lifetime import die_with_parent

    die_with_parent()  # started by a job (not by a pod entry): it ends with that job
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stdout,
        format="%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s",
        datefmt="%m-%d %H:%M:%S",
    )
    log.info("vLLM API server version %s", VERSION)
    log.info("non-default args: %s", {k: v for k, v in vars(args).items() if v is not None})
    _compile_cache()
    try:
        model, tokenizer, cls = _load(args)
        engine_cfg = _engine_config(args, model.cfg)
    except (OSError, ValueError) as e:
        log.error("cannot start: %s", e)
        return 1

    from flax import nnx

    from serving.config import ServerConfig
    from serving.engine import Engine
    from serving.server import EngineDied, run_server

    engine = Engine(model, tokenizer, engine_cfg)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    workers = [
        cls(rank, FakeModelRunner(model.cfg, params)) for rank in range(args.tensor_parallel_size)
    ]
    dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE", "0").strip().lower() in ("1", "true")
    name = args.served_model_name or args.model
    server_cfg = ServerConfig(
        host=args.host,
        port=args.port,
        model_name=name,
        max_body_bytes=64 * 2**20,
        shutdown_timeout_s=3.0,
    )
    make = functools.partial(
        make_server_class(),
        workers=workers,
        root=args.model,
        dev_mode=dev_mode,
        block_size=args.block_size,
        prompt_details=args.enable_prompt_tokens_details,
    )
    log.info(
        "model %s: %.2fM params, %d worker(s) (%s), max_model_len %d, %d sequences, "
        "prefix caching %s, n-gram speculation %s, dev mode %s",
        args.model,
        model.cfg.num_params() / 1e6,
        len(workers),
        cls.__name__,
        engine_cfg.max_seq_len,
        engine_cfg.num_slots,
        "on" if engine_cfg.prefix_reuse else "off",
        engine_cfg.speculate or "off",
        "on" if dev_mode else "off",
    )

    def ready(port: int) -> None:
        print(f"INFO:     Started server process [{os.getpid()}]", flush=True)
        print("INFO:     Application startup complete.", flush=True)
        print(
            f"INFO:     Uvicorn running on http://{args.host}:{port} (Press CTRL+C to quit)",
            flush=True,
        )

    try:
        asyncio.run(run_server(engine, tokenizer, server_cfg, ready=ready, make_server=make))
    except EngineDied as e:
        log.error("%s", e)
        return 1
    except OSError as e:  # the port is taken, the address is not ours
        log.error("cannot serve on %s:%s: %s", args.host, args.port, e)
        return 1
    print("INFO:     Shutting down", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
