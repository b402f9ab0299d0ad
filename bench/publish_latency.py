"""Weight-sync latency: publishing a policy version (checkpoint write + load on every replica,
until each reports the version) against the raw checkpoint write of the same weights
(`save_params`), measured side by side in the same loop, for

- simloop's JAX engine: `simloop serve` replicas, weights over `POST /admin/load_weights`
  (`serving.publisher.EnginePublisher`);
- the fake vLLM server (`serving.vllm.fake_server`, started by `serving.vllm.launcher`):
  `serving.vllm.publisher.VllmPublisher` runs the real `OrbaxWeightLoader` worker extension
  over `/collective_rpc`, then resets the prefix cache.

Every server is a real process on 127.0.0.1. A greedy one-token probe after the load (until
the new weights generate) is reported apart from the publish.

    .venv/bin/python bench/publish_latency.py                # tiny and ~50M, 2 replicas each
    .venv/bin/python bench/publish_latency.py --quick        # tiny, 1 replica (smoke test)

Target (issue 18): publish <= 2x the raw write.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from flax import nnx
from model_forward import SIZES  # bench/ is on sys.path: the same models as that bench
from results import Row, add_json_flag, write_json  # bench/ is on sys.path
from rich.console import Console
from rich.table import Table

from launch.deploy.local import ADMIN_TOKEN_ENV, LocalServer
from rl.data.rundir import CONFIG
from rl.model import Qwen3, save_hf
from rl.model.params_io import save_params
from serving.client import ClientConfig, InferenceClient
from serving.publisher import EnginePublisher
from serving.vllm.config import VllmConfig
from serving.vllm.launcher import ServedModel, launch_servers, stop_servers
from serving.vllm.publisher import VllmPublisher

BACKENDS = ("jax", "fake-vllm")
FAKE_VLLM = [sys.executable, "-m", "serving.vllm.fake_server", "serve"]
MAX_LEN = 64
"""Each server's context: the probe needs two tokens; a small KV cache starts fast."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def jax_servers(hf_dir: Path, root: Path, replicas: int):
    """`replicas` `simloop serve` processes on `hf_dir`, loading from under `root / ckpt`;
    yields an `EnginePublisher` over them and a check that each serves a given version."""
    token = secrets.token_hex(16)
    (root / CONFIG).write_text("{}\n")  # defaults: the model comes from --model
    args = ["--model", str(hf_dir), "--model-name", "agent", "--checkpoint-root",
            str(root / "ckpt"), "--num-slots", "1", "--max-seq-len", str(MAX_LEN)]  # fmt: skip
    servers = []
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(lambda: [s.stop() for s in servers])
        for i in range(replicas):
            servers.append(
                await asyncio.to_thread(
                    LocalServer.start,
                    "agent",
                    root,
                    extra_args=args,
                    env={ADMIN_TOKEN_ENV: token},
                    name=f"jax-{i}",
                )
            )
        clients = [
            InferenceClient(ClientConfig(s.url, model="agent", max_retries=0, timeout_s=600.0))
            for s in servers
        ]
        for c in clients:
            stack.push_async_callback(c.close)

        async def serving(version: int) -> bool:
            return all([await c.version(token=token) == version for c in clients])

        yield EnginePublisher(clients, token=token, retries=0), serving


@contextlib.asynccontextmanager
async def fake_vllm_servers(hf_dir: Path, root: Path, replicas: int):
    """`replicas` fake `vllm serve` processes (1 chip, one worker each, as on a v6e-8)."""
    procs = [
        SimpleNamespace(role="agent_serve", chips=(i,), http_port=_free_port(), env={})
        for i in range(replicas)
    ]
    cfg = VllmConfig(
        command=FAKE_VLLM,
        max_model_len=MAX_LEN,
        start_stagger_s=0.0,
        health_timeout_s=600.0,
        extra_args=["--max-num-seqs", "1"],
    )
    servers = await asyncio.to_thread(
        launch_servers,
        procs,
        cfg,
        {"agent_serve": ServedModel(str(hf_dir), "agent")},
        log_dir=root / "logs",
        lockfile=root / "libtpu_lockfile",
        poll_s=0.2,
    )
    try:
        async with VllmPublisher([s.url for s in servers], model_name="agent") as publisher:
            # VllmPublisher checks every worker's answer: a publish that returns is served.
            yield publisher, None
    finally:
        stop_servers(servers)


WARMUP = 3
"""Rounds before the timed ones. A server's first loads read into fresh host memory (a page
fault per page: on a 2-core VM 0.3-0.5 s for 196 MiB); from the third on, the buffers of two
versions back are reused (`rl.model.zarr_read`). The first round is reported apart, cold."""


async def measure(
    backend: str, model, hf_dir: Path, root: Path, replicas: int, repeats: int
) -> dict:
    """Medians over `repeats` rounds, after `WARMUP` rounds. Each round writes the raw
    checkpoint and the one it publishes (alternating which goes first), then publishes the
    latter as the next version; publish = that write + the load on every replica."""
    start = jax_servers if backend == "jax" else fake_vllm_servers
    rounds = []
    async with start(hf_dir, root, replicas) as (publisher, serving):
        for version in range(1, repeats + WARMUP + 1):
            raw_dir, ckpt = root / "raw", root / "ckpt" / f"v{version}"
            times = {}
            for what in (raw_dir, ckpt)[:: 1 if version % 2 else -1]:  # alternate the order
                t = time.perf_counter()
                save_params(model, what)
                times[what] = time.perf_counter() - t
            report = await publisher.publish(str(ckpt), version)
            if serving is not None and not await serving(version):
                raise RuntimeError(f"{backend}: a replica does not serve version {version}")
            rounds.append(
                dict(
                    raw_write_s=times[raw_dir],
                    write_s=times[ckpt],
                    load_s=report.load_s,
                    probe_s=report.first_token_s - report.load_s,
                )
            )
            shutil.rmtree(raw_dir)
            shutil.rmtree(ckpt)
    timed = rounds[WARMUP:]
    row = {k: statistics.median(r[k] for r in timed) for k in rounds[0]}
    row["publish_s"] = statistics.median(r["write_s"] + r["load_s"] for r in timed)
    row["ratio"] = row["publish_s"] / row["raw_write_s"]
    row["cold_publish_s"] = rounds[0]["write_s"] + rounds[0]["load_s"]
    return dict(backend=backend, replicas=replicas, rounds=repeats, **row)


def _mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


async def bench_size(name: str, replicas: int, repeats: int, console: Console) -> list[dict]:
    cfg = SIZES[name]
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    rows = []
    with tempfile.TemporaryDirectory(prefix="publish-bench-") as tmp:
        tmp = Path(tmp)
        hf_dir = save_hf(cfg, model, tmp / "hf")
        size_mb = _mb(save_params(model, tmp / "sized"))
        for backend in BACKENDS:
            root = tmp / backend
            (root / "ckpt").mkdir(parents=True)
            with console.status(f"{name}: {backend}, {replicas} replica(s)"):
                row = await measure(backend, model, hf_dir, root, replicas, repeats)
            rows.append(
                dict(size=name, params_m=cfg.num_params() / 1e6, checkpoint_mb=size_mb, **row)
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny, 1 replica (smoke test)")
    parser.add_argument(
        "--sizes", nargs="+", choices=list(SIZES), help="models (default: all; --quick: tiny)"
    )
    parser.add_argument("--replicas", type=int, help="servers per backend (default 2; quick 1)")
    parser.add_argument("--repeats", type=int, help="timed rounds (default 5; quick 2)")
    add_json_flag(parser)
    args = parser.parse_args()
    q = args.quick
    sizes = args.sizes or (["tiny"] if q else list(SIZES))
    replicas = args.replicas or (1 if q else 2)
    repeats = args.repeats or (2 if q else 5)
    for flag, value in (("--replicas", replicas), ("--repeats", repeats)):
        if value < 1:
            parser.error(f"{flag} {value} is invalid: >= 1")

    console = Console()
    console.print(f"{os.cpu_count()} CPU(s); every server a process on 127.0.0.1")
    rows = []
    for name in sizes:
        rows += asyncio.run(bench_size(name, replicas, repeats, console))

    table = Table(title="publish (write + load on every replica) vs raw write; target <= 2x")
    for col in (
        "model",
        "backend",
        "replicas",
        "MiB",
        "write s",
        "publish s",
        "ratio",
        "probe s",
        "cold publish s",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            f"{r['size']} {r['params_m']:.1f}M",
            r["backend"],
            str(r["replicas"]),
            f"{r['checkpoint_mb']:.1f}",
            f"{r['raw_write_s']:.3f}",
            f"{r['publish_s']:.3f}",
            f"{r['ratio']:.2f}x",
            f"{r['probe_s']:.3f}",
            f"{r['cold_publish_s']:.3f}",
        )
    console.print(table)
    console.print(
        f"medians of {repeats} rounds after {WARMUP} warm-up rounds; publish = its "
        "own checkpoint write + load until every replica reports the version; probe "
        "= one greedy token afterwards (JAX: the first replica; vLLM: prefix-cache "
        "reset and every replica); cold = the first round's publish, into servers' "
        "fresh memory."
    )
    if args.json:
        json_rows = [
            Row(
                f"publish vs raw write, {r['size']} {r['backend']} x{r['replicas']}",
                r["publish_s"],
                r["raw_write_s"],
                "s",
                "<= 2x",
            )
            for r in rows
        ]
        write_json(args.json, "publish_latency", json_rows, rows)


if __name__ == "__main__":
    main()
