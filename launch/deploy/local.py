"""The local launcher: the servers of jobs that need one and were not given one
(`agent.server_url` / `simulator.server_url` unset): `simloop serve` subprocesses (backend
`jax`), or `vllm serve` per planned replica through `serving.vllm.launcher` (backend `vllm`).
The commands and environments come from the plan, `launch/deploy/processes.py`, the same list
`--dry-run` prints.

    async with role_clients(cfg, run_dir, ["agent", "simulator"], who="eval-agent") as clients:
        await clients["agent"].complete(...)   # configured URL, or a local server, healthy

    with LocalServer.start("agent", run_dir) as server:
        server.url   # http://127.0.0.1:PORT, listening

Each server reads the run directory's resolved `config.yaml`, so it builds exactly the model
the config names, logs to `<run>/logs/<role>-server.log`, and is stopped (SIGTERM, then SIGKILL
after a grace period) when the block exits, on every path. A vLLM server starts from an HF
directory of the role's current weights (`write_vllm_model`), logs to
`<run>/logs/vllm-<role>_serve-<port>.log` and is `/health`-gated the same way.

A role with several replicas gets a `serving.pool.ReplicaPool`; when the pool ejects one of the
servers started here, a `ReplicaRestarter` kills what is left of it, starts the same planned
process on its port again and `readmit`s it (which republishes the current version first),
with retries; a replica that never comes back is given up and the run goes on with the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from launch.deploy.processes import (
    ADMIN_TOKEN_ENV,
    external_servers,
    local_server_args,
    serve_command,
    server_processes,
    vllm_model_dir,
)
from launch.errors import JobError  # no imports of its own: free at start-up
from rl.data.rundir import LOGS
from serving.lifetime import child_env

log = logging.getLogger(__name__)

LISTENING = re.compile(r"listening on (http://[\w.\-]+:\d+)")


# glibc (>= 2.35; others ignore it) backs malloc's large blocks with transparent huge pages
# where the kernel allows them (THP `madvise` or `always`): the fresh buffers of a weight load
# take 1/512 of the page faults. A 50M model's load_params on 2 cores: 242 -> 192 ms.
MALLOC_TUNABLES = "glibc.malloc.hugetlb=1"


def server_env(env: dict[str, str] | None) -> dict[str, str]:
    """A local server's environment: this process's, without its admin token, with `env`
    laid over it (its `XLA_FLAGS` merged into ours) and `GLIBC_TUNABLES` set to
    `MALLOC_TUNABLES` unless either already sets it."""
    inherited = {k: v for k, v in os.environ.items() if k != ADMIN_TOKEN_ENV}
    if env is None:
        merged = inherited
    else:
        from launch.distributed import merge_xla_flags

        planned = dict(env)
        if "XLA_FLAGS" in planned:
            planned["XLA_FLAGS"] = merge_xla_flags(
                os.environ.get("XLA_FLAGS", ""), planned["XLA_FLAGS"]
            )
        merged = {**inherited, **planned}
    return {"GLIBC_TUNABLES": MALLOC_TUNABLES, **merged}


class LocalServer:
    def __init__(self, role: str, proc: subprocess.Popen, url: str, log_path: Path):
        self.role, self.proc, self.url, self.log_path = role, proc, url, log_path

    @classmethod
    def start(
        cls,
        role: str,
        run_dir: str | os.PathLike,
        *,
        extra_args: list[str] = (),
        timeout_s: float = 300.0,
        port: int = 0,
        env: dict[str, str] | None = None,
        name: str | None = None,
    ) -> LocalServer:
        """Start `simloop serve --role ROLE` on `port` (0: a free one) and wait until it
        listens. `env` is laid over this process's environment (a chip plan's process env, and
        `SIMLOOP_ADMIN_TOKEN`: a secret never goes on a command line, where any process can
        read it; ours is not inherited; `server_env`); `name` names the log file (default: the
        role)."""
        run_dir = Path(run_dir)
        log_path = run_dir / LOGS / f"{name or role}-server.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = serve_command(role, run_dir, port=port, extra_args=extra_args)
        log = log_path.open("w")
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,
            env=child_env(server_env(env)),
        )
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
            raise JobError(f"the {role} server did not start (log {log_path}):\n{tail}")
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


def write_vllm_model(cfg, role: str, model_dir: Path) -> None:
    """An HF directory of `role`'s current weights for `vllm serve` to start from
    (`rl.model.hf_io.save_hf`), with the HF tokenizer's files copied in when the role has one
    (real vLLM needs them; the fake server falls back to the byte tokenizer without)."""
    import shutil

    from rl.model.hf_io import save_hf
    from rl.model.loading import ModelSource

    model = ModelSource.of_role(getattr(cfg, role)).build(seed=cfg.run.seed)
    save_hf(model.cfg, model, model_dir)
    tok = getattr(cfg, role).tokenizer
    if tok.kind == "hf":
        src = Path(tok.path)
        names = ("tokenizer", "vocab", "merges", "special_tokens")
        files = (
            [src]
            if src.is_file()
            else [f for f in src.iterdir() if f.is_file() and f.name.startswith(names)]
        )
        for f in files:
            shutil.copy2(f, model_dir / f.name)


# ----- restarting ejected replicas ------------------------------------------------------------

RESTART_ATTEMPTS = 3
RESTART_BACKOFF_S = 2.0
"""Defaults (`serve.restart_attempts`, `serve.restart_backoff_s` set them per job)."""
RESTART_CLOSE_S = 30.0
"""How long closing waits for the restarts it cancelled (a server mid-start is stopped)."""


class ReplicaRestarter:
    """Brings a pool's ejected replicas back: `on_eject` (the pool's hook) schedules, as its
    own task, `stop(server)` (what is left of it) -> `start(index, closing)` (the same process
    on the same port; `closing` is set when the restarter closes) -> `pool.readmit` (health,
    then the current version republished). A failed attempt is retried after a backoff; after
    `attempts` the replica is `retire`d (a clear log line; the others keep serving). `servers`
    holds each replica's current server and is updated in place, so whoever stops them at
    the end stops the restarted ones."""

    def __init__(
        self,
        pool,
        servers: list,
        start: Callable[[int, threading.Event], Awaitable],
        stop: Callable[[Any], Awaitable[None]],
        *,
        attempts: int = RESTART_ATTEMPTS,
        backoff_s: float = RESTART_BACKOFF_S,
    ):
        if len(servers) != len(pool.replicas):
            raise ValueError(f"{len(servers)} servers for {len(pool.replicas)} replicas")
        self.pool, self.servers, self.start, self.stop = pool, servers, start, stop
        self.attempts, self.backoff_s = attempts, backoff_s
        self.closing = threading.Event()
        self._tasks: dict[int, asyncio.Task] = {}
        pool.on_eject = self.on_eject

    def on_eject(self, replica, reason: str) -> None:
        if self.closing.is_set():
            return
        running = self._tasks.get(replica.index)
        if running is not None and not running.done():
            return
        name = f"restart-{self.pool.role}-{replica.index}"
        self._tasks[replica.index] = asyncio.create_task(self._restart(replica, reason), name=name)

    async def _restart(self, replica, reason: str) -> None:
        role, url = self.pool.role, replica.url
        log.warning("%s replica %s is down (%s): restarting it", role, url, reason)
        delay, last = self.backoff_s, None
        for attempt in range(1, self.attempts + 1):
            try:
                await self.stop(self.servers[replica.index])
                self.servers[replica.index] = await self.start(replica.index, self.closing)
                replica.restarts += 1
                await self.pool.readmit(replica)
            except Exception as e:  # noqa: BLE001 - retried, and reported when given up
                last = e
                log.warning(
                    "%s replica %s: restart %d/%d failed: %s", role, url, attempt, self.attempts, e
                )
            else:
                log.warning(
                    "%s replica %s restarted and back in service at version %s",
                    role,
                    url,
                    replica.version,
                )
                return
            if attempt < self.attempts:
                await asyncio.sleep(delay)
                delay *= 2
        if not replica.live:  # (not readmitted by someone else meanwhile)
            why = (
                f"{self.attempts} restarts failed, the last: {last}"
                if self.attempts
                else "restarts are off (serve.restart_attempts: 0)"
            )
            self.pool.retire(replica, f"down ({reason}); {why}")

    async def close(self) -> None:
        """Cancel the restarts under way (bounded; a server one was starting is stopped)."""
        self.closing.set()
        tasks = [t for t in self._tasks.values() if not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=RESTART_CLOSE_S)
            for t in pending:
                log.warning("%s did not stop within %gs", t.get_name(), RESTART_CLOSE_S)
        for t in self._tasks.values():  # a restart's own failure surfaces here
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()


def kill_server(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of an ejected server: its whole process group (the engine
    processes a dead `vllm serve` forked may still hold its chips), then reap it."""
    if getattr(proc, "returncode", None) is None:  # not reaped: its pid (its group) is its own
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


async def start_in_thread(start: Callable[[], Any], stop: Callable[[Any], None]) -> Any:
    """`start()` in a thread; if the caller is cancelled meanwhile, what it starts is stopped
    once it is up (a thread cannot be interrupted)."""
    job = asyncio.ensure_future(asyncio.to_thread(start))
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            server = await job
            await asyncio.to_thread(stop, server)
        raise


def _sleep_unless(closing: threading.Event, seconds: float) -> None:
    if closing.wait(seconds):
        raise RuntimeError("the job is ending: restart abandoned")


class RoleServers(dict):
    """`{role: client}`: the role's server's `InferenceClient`, or a `serving.pool.ReplicaPool`
    over its replicas; with every replica's URL and client (`urls[role]`, `replicas[role]`),
    and the servers started here (`servers[role]`: the current `LocalServer`/`VllmServer` of
    each replica, a restarted one in place of the dead one; empty for servers of others)."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: dict[str, list[str]] = {}
        self.replicas: dict[str, list] = {}
        self.servers: dict[str, list] = {}


def role_client_config(cfg, role: str, url: str, *, named: bool = True):
    """The `ClientConfig` of one of `role`'s servers: on vLLM it sends the role as the model
    name (`named`: servers simloop started or the pod entry named, `--served-model-name`) and
    keeps the episodes' sessions itself (vLLM has no session API; `serving.token_sessions`)."""
    from serving.client import ClientConfig

    vllm = cfg.serve.backend_of(role) == "vllm"
    return ClientConfig(
        url,
        timeout_s=cfg.orchestrator.request_timeout_s,
        model=role if vllm and named else None,
        client_sessions=vllm,
    )


def check_prompt_layout(cfg) -> None:
    """`JobError` when `simulator.weights` record a prompt layout (`train-sim` writes it:
    `rl.data.sim_format.PROMPT_LAYOUT_FILE`) other than the one `env.shell.simulated` would
    ask with: served another layout, a simulator answers worse with nothing to say so (a
    workspace simulator trained with the named files last scored 0.777 served without, 0.970
    with)."""
    from rl.data.sim_format import PROMPT_LAYOUT_FILE, layout_mismatches

    weights = cfg.simulator.weights
    if not weights:
        return
    wrong = layout_mismatches(weights, cfg.env.shell.simulated.prompt_layout())
    if wrong:
        said = "; ".join(
            f"{f} trained {str(t).lower()}, served {str(s).lower()}" for f, t, s in wrong
        )
        flags = " ".join(f"--env.shell.simulated.{f} {str(t).lower()}" for f, t, _ in wrong)
        raise JobError(
            f"simulator weights {weights} were trained on another prompt layout "
            f"({Path(weights) / PROMPT_LAYOUT_FILE}): {said}. Serve them as trained ({flags}) "
            "or train them for this layout (simloop train-sim)"
        )


@contextlib.asynccontextmanager
async def role_clients(
    cfg,
    run_dir: str | os.PathLike,
    roles: Sequence[str],
    *,
    who: str,
    admin_token: str | None = None,
    admin_roles: Sequence[str] = ("agent",),
    health_timeout_s: float = 300.0,
) -> AsyncIterator[RoleServers]:
    """`{role: InferenceClient}` for every role in `roles`: the configured server
    (`<role>.server_url`), the servers named in `$SIMLOOP_SERVER_URLS` (started by the GKE
    pod entry), or the role's servers started here from the run directory's config, one per
    planned replica (`launch.deploy.processes.server_processes`, backend `jax` or `vllm`),
    each healthy before the block runs. Clients close and local servers stop when it exits,
    on every path. `admin_token` goes to the local jax servers of `admin_roles` (the agent's; the
    simulator's too when a co-trainer publishes to it); vLLM servers take weights over
    `/collective_rpc` instead."""
    from serving.client import InferenceClient

    if "simulator" in roles:
        check_prompt_layout(cfg)
    run_dir = Path(run_dir)
    external = external_servers()
    async with contextlib.AsyncExitStack() as stack:
        clients = RoleServers()
        # The roles' own `simloop serve` processes start together (each start is mostly one
        # process's imports and compile-cache loads: the agent's and the simulator's overlap
        # on two cores). Every start runs to its end before a failure is raised, so no server
        # starts after the stack that stops it has closed.
        ours = [
            r
            for r in roles
            if getattr(cfg, r).server_url is None
            and r not in external
            and cfg.serve.backend_of(r) != "vllm"
        ]
        begun = await asyncio.gather(
            *(
                _start_jax(
                    cfg,
                    run_dir,
                    r,
                    who,
                    stack,
                    admin_token if r in admin_roles else None,
                    health_timeout_s,
                )
                for r in ours
            ),
            return_exceptions=True,
        )
        for result in begun:
            if isinstance(result, BaseException):
                raise result
        local = dict(zip(ours, begun, strict=True))
        for role in roles:
            url = getattr(cfg, role).server_url
            vllm = cfg.serve.backend_of(role) == "vllm"
            timeout = health_timeout_s
            servers: list = []  # the ones started here, which a pool may restart
            if url is not None:
                urls = [url]
            elif role in external:
                urls, timeout = list(external[role]), max(timeout, cfg.vllm.health_timeout_s)
            elif vllm:
                servers, start = await _start_vllm(cfg, run_dir, role, who, stack)
                urls, timeout = [s.url for s in servers], cfg.vllm.health_timeout_s
            else:
                servers, start = local[role]
                urls = [s.url for s in servers]
            clients.urls[role], clients.replicas[role], clients.servers[role] = urls, [], servers
            for u in urls:
                cc = role_client_config(cfg, role, u, named=url is None)
                client = await stack.enter_async_context(InferenceClient(cc))
                await client.wait_healthy(timeout_s=timeout)
                clients.replicas[role].append(client)
            clients[role] = clients.replicas[role][0]
            if len(urls) > 1:  # episodes pinned to a replica, balanced, dead ones ejected
                from serving.pool import ReplicaPool

                pool = ReplicaPool(clients.replicas[role], role=role)
                if servers:  # ours: an ejected one is restarted (before the servers stop)
                    restarter = ReplicaRestarter(
                        pool,
                        servers,
                        start,
                        _kill,
                        attempts=cfg.serve.restart_attempts,
                        backoff_s=cfg.serve.restart_backoff_s,
                    )
                    stack.push_async_callback(restarter.close)
                clients[role] = await stack.enter_async_context(pool)
        yield clients


async def _kill(server) -> None:
    await asyncio.to_thread(kill_server, server.proc)


async def _start_jax(
    cfg, run_dir: Path, role: str, who: str, stack, admin_token: str | None, timeout_s: float
):
    """Start `role`'s planned `simloop serve` processes, stopped when `stack` closes. ->
    (servers, `start(index, closing)`: that replica's process again, on its port)."""
    token = admin_token
    servers: list[LocalServer] = []
    stack.push_async_callback(asyncio.to_thread, lambda: [s.stop() for s in servers])
    launches = []
    for proc in server_processes(cfg, role, run_dir):
        env = dict(proc.env)
        if token is not None:
            env[ADMIN_TOKEN_ENV] = token
        launches.append(
            dict(
                extra_args=local_server_args(cfg, role, run_dir, token),
                env=env or None,
                timeout_s=timeout_s,
                name=f"{role}-{proc.replica}" if proc.replica else None,
            )
        )
    for kw in launches:
        print(f"simloop {who}: starting a local {role} server ...", flush=True)
        servers.append(await asyncio.to_thread(LocalServer.start, role, run_dir, **kw))

    restarts = [0] * len(servers)

    async def start(i: int, closing: threading.Event) -> LocalServer:
        port = int(servers[i].url.rsplit(":", 1)[1])  # the pool's client knows this URL
        restarts[i] += 1  # a log of its own: the dead server's log tells why it died
        kw = {**launches[i], "name": f"{launches[i]['name'] or role}-restart{restarts[i]}"}
        server = await start_in_thread(
            lambda: LocalServer.start(role, run_dir, port=port, **kw), LocalServer.stop
        )
        if server.url != servers[i].url:
            await asyncio.to_thread(server.stop)
            raise RuntimeError(
                f"the restarted {role} server listens on {server.url}, not {servers[i].url}"
            )
        return server

    return servers, start


async def _start_vllm(cfg, run_dir: Path, role: str, who: str, stack):
    """Start `role`'s planned vLLM servers (`serving.vllm.launcher.launch_servers`:
    staggered, `/health`-gated, log tail on failure), stopped when `stack` closes. ->
    (servers, `start(index, closing)`: that replica's process again, on its chips and port)."""
    from launch.deploy.chips import SERVE_ROLE, config_plan
    from serving.vllm.launcher import ServedModel, VllmLaunchError, launch_servers, stop_servers

    procs = config_plan(cfg).role(SERVE_ROLE[role])
    if any(p.host != 0 for p in procs):
        raise JobError(
            f"the {role}'s planned vLLM servers include other hosts of the slice than this "
            f"one: start them there (simloop gke render) and set {role}.server_url"
        )
    model_dir = vllm_model_dir(cfg, role, run_dir)
    if model_dir != Path(getattr(cfg, role).hf_path or ""):  # the role's weights, written now
        print(f"simloop {who}: writing the {role}'s HF weights for vLLM to {model_dir}", flush=True)
        await asyncio.to_thread(write_vllm_model, cfg, role, model_dir)
    print(f"simloop {who}: starting {len(procs)} vLLM {role} server(s) ...", flush=True)
    models = {SERVE_ROLE[role]: ServedModel(str(model_dir), role)}
    try:
        servers = await asyncio.to_thread(
            launch_servers, procs, cfg.vllm, models, log_dir=run_dir / LOGS
        )
    except VllmLaunchError as e:  # every server it started is already stopped
        raise JobError(str(e)) from e
    stack.push_async_callback(asyncio.to_thread, stop_servers, servers)

    async def start(i: int, closing: threading.Event):
        (server,) = await start_in_thread(
            lambda: launch_servers(
                [procs[i]],
                cfg.vllm,
                models,
                log_dir=run_dir / LOGS,
                sleep=lambda s: _sleep_unless(closing, s),
            ),
            stop_servers,
        )
        return server

    return servers, start
