"""`simloop middleware`: Anthropic Messages and OpenAI chat for unmodified agent harnesses, in
front of an agent server, writing token-exact trajectories (docs/architecture.md §9).

    simloop middleware --config configs/demo_cpu.yaml --out runs/mw --middleware.port 8300
    simloop middleware --config configs/v6e-8.yaml --out runs/mw \\
        --agent.server_url http://10.0.0.2:8000          # an agent server that runs already

Without `agent.server_url` the agent server is started here, as `rollout` starts it
(`serve.backend`: `jax` or `vllm`; `--dry-run` prints it). Point a harness at it with its API
key set to the rollout's id (`ANTHROPIC_BASE_URL=http://127.0.0.1:8300
ANTHROPIC_API_KEY=<rollout id>`, or `OPENAI_BASE_URL=http://127.0.0.1:8300/v1
OPENAI_API_KEY=<rollout id>`). Rollouts are finished on the admin listener, which harnesses
do not reach: a Unix socket in a fresh private directory (or `middleware.admin_socket`, or TCP
`middleware.admin_port`), behind a bearer token (`middleware.admin_token`, else a secret made
at start). Both are in `--out/middleware-admin.json` (mode 0600, removed at stop) and the
start banner prints the curl line: `POST /rollouts/<id>/finish {"reward": r}` writes the
rollout's segments to `--out/trajectories/middleware-NNNNN.jsonl` and a `middleware` record
to `metrics.jsonl`. Stops on SIGINT/SIGTERM, writing the rollouts still open as `aborted`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NamedTuple

from launch.config import write_config
from launch.config.schema import SimloopConfig
from launch.deploy.dry_run import print_dry_run
from launch.errors import UsageError
from launch.jobs.episodes import check_servers
from rl.data import rundir


def run(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    if getattr(args, "dry_run", False):
        return print_dry_run(args, cfg, "middleware", ["agent"])
    if not args.out:
        raise UsageError("--out DIR is required (trajectories and metrics go there)")
    out = Path(args.out)
    check_servers(cfg, ["agent"])
    write_config(cfg, out)
    asyncio.run(serve_middleware(cfg, out))
    return 0


ADMIN_FILE = "middleware-admin.json"
"""`simloop middleware`'s note of its admin listener and token, in `--out` (mode 0600)."""


class RunningMiddleware(NamedTuple):
    middleware: Any
    """The `serving.middleware.app.Middleware` (its rollouts, counters)."""
    url: str
    """The API listener: what harnesses are pointed at."""
    admin: Any
    """`rl.orchestrator.harness.AdminAccess`: the admin listener and its token, for whoever
    finishes rollouts (the job), never for a sandbox."""


@contextlib.asynccontextmanager
async def running_middleware(
    cfg: SimloopConfig, out: Path, agent, on_written=None
) -> AsyncIterator[RunningMiddleware]:
    """The middleware in front of the client `agent`, serving its APIs on
    `middleware.host:port` and its admin routes on their own listener, writing finished
    rollouts into `out` (and handing them to `on_written(trajectories)`): yields
    `(middleware, url, admin)`. On exit the rollouts still open are written `aborted` and the
    trajectory writer is closed."""
    from rl.data import ChatRenderer, load_tokenizer
    from rl.orchestrator.harness import AdminAccess
    from rl.orchestrator.storage import TrajectoryWriter
    from serving.middleware.app import Middleware, serve

    mcfg = cfg.middleware
    renderer = ChatRenderer(load_tokenizer(cfg.agent.tokenizer))
    writer = TrajectoryWriter(out, prefix="middleware")
    metrics = rundir.MetricsLog(out)

    def sink(trajectories) -> list[str]:
        for t in trajectories:
            writer.add(t)
        paths = [str(p) for p in writer.paths[-1:]]
        writer.flush()  # each finished rollout is on disk, fsynced, before the reply
        if on_written is not None:
            on_written(trajectories)
        first = trajectories[0]
        metrics.write(
            {
                "stage": "middleware",
                "rollout_id": first.rollout_id,
                "segments": len(trajectories),
                "status": first.status,
                "reward": first.reward,
                "sampled_tokens": sum(sum(t.loss_mask) for t in trajectories),
                "turns": sum(len(t.turns) for t in trajectories),
            }
        )
        return paths

    tokenizer_name = cfg.agent.tokenizer.path or cfg.agent.tokenizer.kind
    middleware = Middleware(mcfg, agent, renderer, sink, tokenizer_name=tokenizer_name)
    try:
        async with serve(middleware, mcfg.host, mcfg.port) as where:
            admin = AdminAccess(where.admin_token, socket=where.admin_socket, url=where.admin_url)
            yield RunningMiddleware(middleware, where.url, admin)
    finally:
        middleware.unfinished = await middleware.flush_all(
            "the middleware stopped before the rollout finished"
        )
        writer.close()


async def serve_middleware(
    cfg: SimloopConfig, out: Path, stop: asyncio.Event | None = None, ready=None
) -> None:
    """Run until `stop` is set (or SIGINT/SIGTERM); `ready(url)` once it listens."""
    from launch.deploy.local import role_clients

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    async with role_clients(cfg, out, ["agent"], who="middleware") as clients:
        async with running_middleware(cfg, out, clients["agent"]) as (middleware, url, admin):
            note = write_admin_note(out, admin)
            upstream = ", ".join(clients.urls.get("agent", []))
            print(
                f"simloop middleware: {url} in front of the agent server {upstream}\n"
                f"  Anthropic: ANTHROPIC_BASE_URL={url} ANTHROPIC_API_KEY=<rollout id>\n"
                f"  OpenAI:    OPENAI_BASE_URL={url}/v1 OPENAI_API_KEY=<rollout id>\n"
                f"  admin:     {admin.socket or admin.url} (its token in {note})\n"
                f"  finish:    {finish_command(admin, note)}",
                flush=True,
            )
            try:
                if ready is not None:
                    ready(url)
                await stop.wait()
            finally:
                note.unlink(missing_ok=True)
        where = out / rundir.TRAJECTORIES
        print(
            f"simloop middleware: stopped; {middleware.finished} rollouts written "
            f"({middleware.unfinished} of them unfinished, as aborted) -> {where}"
        )


def write_admin_note(out: Path, admin) -> Path:
    """`out/middleware-admin.json`: the admin listener and its token, readable by this user
    only (a sandbox runs as another)."""
    path = out / ADMIN_FILE
    note = {
        "socket": admin.socket,
        "url": admin.url,
        "token": admin.token,
        "finish": 'POST /rollouts/<rollout id>/finish {"reward": r}',
        "auth": "Authorization: Bearer <token>",
    }
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # an older note may have had other bits
        json.dump(note, f, indent=1)
    return path


def finish_command(admin, note: Path) -> str:
    """The curl line that finishes a rollout, its token read from `note`."""
    read = 'import json,sys; print(json.load(open(sys.argv[1]))["token"])'
    token = f"$(python3 -c {shlex.quote(read)} {shlex.quote(str(note))})"
    if admin.socket:
        where = f"--unix-socket {shlex.quote(admin.socket)} http://middleware"
    else:
        where = admin.url.rstrip("/")
    return (
        f'curl -s -H "Authorization: Bearer {token}" -X POST '
        f"{where}/rollouts/<rollout id>/finish -d '{{\"reward\": 1.0}}'"
    )
