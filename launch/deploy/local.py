"""The local launcher: `simloop serve` subprocesses for jobs that need a server and were not
given one (`agent.server_url` / `simulator.server_url` unset).

    async with role_clients(cfg, run_dir, ["agent", "simulator"], who="eval-agent") as clients:
        await clients["agent"].complete(...)   # configured URL, or a local server, healthy

    with LocalServer.start("agent", run_dir) as server:
        server.url   # http://127.0.0.1:PORT, listening

Each server reads the run directory's resolved `config.yaml`, so it builds exactly the model
the config names, logs to `<run>/logs/<role>-server.log`, and is stopped (SIGTERM, then SIGKILL
after a grace period) when the block exits, on every path.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from rl.data.rundir import CONFIG, LOGS

ADMIN_TOKEN_ENV = "SIMLOOP_ADMIN_TOKEN"
"""Where `simloop serve` reads its admin token (or `--admin-token-file`)."""
LISTENING = re.compile(r"listening on (http://[\w.\-]+:\d+)")


class LocalServer:
    def __init__(self, role: str, proc: subprocess.Popen, url: str, log_path: Path):
        self.role, self.proc, self.url, self.log_path = role, proc, url, log_path

    @classmethod
    def start(cls, role: str, run_dir: str | os.PathLike, *, extra_args: list[str] = (),
              timeout_s: float = 300.0, port: int = 0, env: dict[str, str] | None = None,
              name: str | None = None) -> LocalServer:  # fmt: skip
        """Start `simloop serve --role ROLE` on `port` (0: a free one) and wait until it
        listens. `env` is laid over this process's environment (a chip plan's process env, and
        `SIMLOOP_ADMIN_TOKEN`: a secret never goes on a command line, where any process can
        read it; ours is not inherited); `name` names the log file (default: the role)."""
        run_dir = Path(run_dir)
        log_path = run_dir / LOGS / f"{name or role}-server.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "launch", "serve", "--config", str(run_dir / CONFIG),
               "--role", role, "--port", str(port), *extra_args]  # fmt: skip
        log = log_path.open("w")
        inherited = {k: v for k, v in os.environ.items() if k != ADMIN_TOKEN_ENV}
        if env is None:
            env = inherited
        else:
            from launch.deploy.chips import merge_xla_flags

            planned = dict(env)
            if "XLA_FLAGS" in planned:
                planned["XLA_FLAGS"] = merge_xla_flags(
                    os.environ.get("XLA_FLAGS", ""), planned["XLA_FLAGS"]
                )
            env = {**inherited, **planned}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                                start_new_session=True, env=env)  # fmt: skip
        deadline = time.monotonic() + timeout_s
        url = None
        while url is None:
            line = proc.stdout.readline()
            if not line:
                break
            log.write(line)
            log.flush()
            m = LISTENING.search(line)
            url = m.group(1) if m else None
            if time.monotonic() > deadline:
                break
        if url is None:
            proc.kill()
            proc.wait(timeout=10)
            log.close()
            tail = "".join(log_path.read_text().splitlines(keepends=True)[-15:])
            raise RuntimeError(f"the {role} server did not start (log {log_path}):\n{tail}")
        log.close()
        return cls(role, proc, url, log_path)

    def stop(self, grace_s: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(timeout=10)

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def local_server_args(cfg, role: str, run_dir: Path, admin_token: str | None = None) -> list[str]:
    """`simloop serve` flags of a job's local server for `role`. Its KV cache holds one context
    (decode attends over the whole cache): the agent's episode context
    (`orchestrator.max_context_tokens`), the simulator's prompt
    (`env.shell.simulated.max_context_tokens`, when set). With `admin_token` the server accepts
    weight loads from under the run directory (a trainer publishes policy versions)."""
    if role == "agent":
        args = ["--max-seq-len", str(cfg.orchestrator.max_context_tokens)]
    else:
        n = cfg.env.shell.simulated.max_context_tokens
        args = [] if n is None else ["--max-seq-len", str(n)]
    if admin_token is not None:  # the token itself goes in the environment (`role_clients`)
        args += ["--checkpoint-root", str(Path(run_dir).absolute())]
    return args


@contextlib.asynccontextmanager
async def role_clients(
    cfg,
    run_dir: str | os.PathLike,
    roles: Sequence[str],
    *,
    who: str,
    admin_token: str | None = None,
    health_timeout_s: float = 300.0,
) -> AsyncIterator[dict]:
    """`{role: InferenceClient}` for every role in `roles`: the configured server
    (`<role>.server_url`) or a local `simloop serve` started from the run directory's config
    on the role's planned devices, each healthy before the block runs. Clients close and local
    servers stop when it exits, on every path. `admin_token` goes to a local agent server."""
    from launch.deploy.chips import server_env
    from serving.client import ClientConfig, InferenceClient

    run_dir = Path(run_dir)
    async with contextlib.AsyncExitStack() as stack:
        clients = {}
        for role in roles:
            url = getattr(cfg, role).server_url
            if url is None:
                print(f"simloop {who}: starting a local {role} server ...", flush=True)
                token = admin_token if role == "agent" else None
                env = server_env(cfg, role)
                if token is not None:
                    env = {**(env or {}), ADMIN_TOKEN_ENV: token}
                server = await asyncio.to_thread(
                    LocalServer.start,
                    role,
                    run_dir,
                    extra_args=local_server_args(cfg, role, run_dir, token),
                    env=env,
                )
                stack.push_async_callback(asyncio.to_thread, server.stop)
                url = server.url
            timeout = cfg.orchestrator.request_timeout_s
            client = await stack.enter_async_context(
                InferenceClient(ClientConfig(url, timeout_s=timeout))
            )
            await client.wait_healthy(timeout_s=health_timeout_s)
            clients[role] = client
        yield clients
