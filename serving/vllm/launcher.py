"""Start vllm-tpu servers for the serving processes of a chip plan and wait until they answer.

    serve = [p for p in plan.processes if p.kind == "serve"]
    servers = launch_servers(serve, cfg.vllm, {"agent_serve": ServedModel(hf_dir, "agent")},
                             log_dir=run_dir / "logs")
    ...
    stop_servers(servers)

Each server is one `vllm serve` process, pinned to its chips by the plan's environment
(docs/architecture.md §5), with simloop's worker extension and `VLLM_SERVER_DEV_MODE=1` so that
`serving.vllm.publisher` can swap weights over `/collective_rpc`. A stale libtpu lockfile is
cleared first; servers start `start_stagger_s` apart and must answer `GET /health` with 200
within `health_timeout_s`. A server that exits or times out stops all of them and raises
`VllmLaunchError` with the end of its log. The spawner and the clock are parameters, so tests
run the same code against a small fake server.
"""

from __future__ import annotations

import errno
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

from serving.lifetime import child_env
from serving.vllm.config import VllmConfig

log = logging.getLogger(__name__)

LIBTPU_LOCKFILE = Path("/tmp/libtpu_lockfile")
WORKER_EXTENSION = "serving.vllm.worker_extension.OrbaxWeightLoader"
REPO_ROOT = Path(__file__).resolve().parents[2]
LOG_TAIL_LINES = 40


class ServerProcess(Protocol):
    """What the launcher reads from a chip plan's `ProcessPlan` (launch/chips.py)."""

    role: str
    chips: tuple[int, ...]
    http_port: int | None
    env: dict[str, str]


class ProcessHandle(Protocol):
    """The part of `subprocess.Popen` the launcher uses (what a test spawner returns)."""

    pid: int

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


Spawn = Callable[[list[str], dict[str, str], IO[bytes]], ProcessHandle]
"""`spawn(argv, env, log_file) -> process`; output goes to `log_file`."""


class VllmLaunchError(RuntimeError):
    """A server exited or stayed unhealthy; the message ends with the tail of its log."""


@dataclass(frozen=True)
class ServedModel:
    """What one serving role serves."""

    model_dir: str
    """HF directory `vllm serve` starts from (config, tokenizer, initial weights)."""
    name: str
    """`--served-model-name`: the `model` clients send."""


def vllm_missing() -> str | None:
    """Why `vllm serve` cannot start on this machine (None: it can, as far as can be told
    without starting it)."""
    if sys.version_info < (3, 12):
        return (
            f"this is Python {sys.version_info.major}.{sys.version_info.minor}, where the [tpu] "
            "extra installs no vLLM (vllm-tpu needs >= 3.12)"
        )
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (pip install 'simloop[tpu]')"
    if shutil.which("vllm") is None:
        return "no `vllm` executable is on PATH"
    return None


def build_vllm_command(
    model_dir: str | os.PathLike,
    process: ServerProcess,
    cfg: VllmConfig,
    *,
    served_model_name: str,
    host: str = "127.0.0.1",
) -> list[str]:
    """The `vllm serve` argv for one server process (`cfg.command` first): tensor-parallel
    over all its chips.

    `host` defaults to loopback (docs/architecture.md §4): dev mode exposes `/collective_rpc`,
    which runs methods on the workers without authentication; bind wider only on a private
    network."""
    if process.http_port is None:
        raise ValueError(f"process of role {process.role!r} has no http_port: not a server")
    if not process.chips:
        raise ValueError(f"process of role {process.role!r} has no chips")
    argv = [
        *cfg.command, str(model_dir),
        "--tensor-parallel-size", str(len(process.chips)),
        "--max-model-len", str(cfg.max_model_len),
        "--port", str(process.http_port),
        "--host", host,
        "--served-model-name", served_model_name,
        # vLLM V1 caches prefixes unless told not to, so "off" must be said explicitly.
        "--enable-prefix-caching" if cfg.enable_prefix_caching else "--no-enable-prefix-caching",
        # usage.prompt_tokens_details.cached_tokens: the client reads prefix cache hits there
        "--enable-prompt-tokens-details",
        "--gpu-memory-utilization", str(cfg.gpu_memory_utilization),
        "--worker-extension-cls", WORKER_EXTENSION,
    ]  # fmt: skip
    if cfg.speculate:
        argv += ["--speculative-config", speculative_config(cfg.speculate, cfg.speculate_ngram)]
    return argv + list(cfg.extra_args)


def speculative_config(tokens: int, ngram: int) -> str:
    """vLLM's `--speculative-config` JSON for n-gram (prompt lookup) speculation."""
    return json.dumps(
        {
            "method": "ngram",
            "num_speculative_tokens": tokens,
            "prompt_lookup_max": ngram,
            "prompt_lookup_min": 1,
        }
    )


def build_vllm_env(process: ServerProcess, base_env: Mapping[str, str] | None = None) -> dict:
    """`base_env` (default: this process's) with the plan's chip environment on top, the dev
    routes switched on, and this checkout importable so vLLM finds the worker extension."""
    env = dict(os.environ if base_env is None else base_env)
    env.update(process.env)
    # vllm/envs.py: VLLM_SERVER_DEV_MODE mounts /collective_rpc and /reset_prefix_cache.
    env["VLLM_SERVER_DEV_MODE"] = "1"
    paths = [str(REPO_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


# ----- the libtpu lockfile -------------------------------------------------------------------


def lockfile_holders(path: str | os.PathLike = LIBTPU_LOCKFILE) -> list[int]:
    """Pids of live processes, other than this one, with `path` open (from /proc/<pid>/fd).
    Other users' processes cannot be inspected without root and are not listed."""
    target = os.path.realpath(path)
    holders = []
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit() or int(proc_dir.name) == os.getpid():
            continue
        try:
            fds = list((proc_dir / "fd").iterdir())
        except OSError:  # gone meanwhile, or another user's
            continue
        for fd in fds:
            try:
                if os.readlink(fd) == target:
                    holders.append(int(proc_dir.name))
                    break
            except OSError:
                continue
    return holders


def lockfile_is_locked(path: str | os.PathLike = LIBTPU_LOCKFILE) -> bool:
    """True when some process holds a POSIX (`lockf`/`fcntl`) lock on `path`, which shows
    holders of any user. Probed with a shared lock, taken and released at once."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except PermissionError:
        return True  # unreadable: assume held rather than delete it
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EAGAIN):
            return True
        raise
    else:
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def clear_stale_libtpu_lock(path: str | os.PathLike = LIBTPU_LOCKFILE) -> bool:
    """Remove libtpu's lockfile unless a live process holds it; True when removed.

    A process that owns the host's TPU keeps the file open (and locked); one that died
    without cleaning up leaves the file behind, and the next libtpu may refuse to start. So the
    file is stale, and removed, when no process has it open (`lockfile_holders`: this user's
    processes) and nobody holds a lock on it (`lockfile_is_locked`: any user's). A held file is
    left alone with a warning: that process claimed the whole host, and the servers' logs will
    say so."""
    path = Path(path)
    if not path.exists():
        return False
    holders = lockfile_holders(path)
    if holders or lockfile_is_locked(path):
        log.warning("%s is held by a live process %s: leaving it", path, holders or "")
        return False
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except PermissionError:
        log.warning(
            "%s belongs to another user and cannot be removed: if none of their "
            "processes uses the TPU, remove it with sudo",
            path,
        )
        return False
    log.info("removed stale %s", path)
    return True


# ----- servers -------------------------------------------------------------------------------


def default_spawn(argv: list[str], env: dict[str, str], log_file: IO[bytes]) -> ProcessHandle:
    """Start `argv` in its own session, so stopping it also stops the engine processes it
    forks."""
    # vLLM itself ignores SIMLOOP_PARENT_PID; simloop's fake vLLM ends with its job.
    return subprocess.Popen(
        argv,
        env=child_env(env),
        stdout=log_file,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


@dataclass
class VllmServer:
    """One started server."""

    role: str
    url: str
    """Root URL clients use (`http://127.0.0.1:PORT` when bound to all interfaces)."""
    argv: list[str]
    log_path: Path
    proc: ProcessHandle

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 256 * lines))
                text = f.read().decode("utf-8", errors="replace")
        except OSError as e:
            return f"(log unreadable: {e})"
        return "\n".join(text.splitlines()[-lines:])

    def failure(self, what: str) -> VllmLaunchError:
        return VllmLaunchError(
            f"vLLM server {self.role} ({self.url}) {what}.\n"
            f"--- last {LOG_TAIL_LINES} lines of {self.log_path} ---\n{self.log_tail()}"
        )

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (to its process group when it leads one), SIGKILL after `timeout_s`."""
        if self.proc.poll() is not None:
            return self.proc.poll()
        for sig, send in ((signal.SIGTERM, self.proc.terminate), (signal.SIGKILL, self.proc.kill)):
            try:
                if os.getpgid(self.proc.pid) == self.proc.pid:
                    os.killpg(self.proc.pid, sig)
                else:
                    send()
            except ProcessLookupError:
                return self.proc.poll()
            try:
                return self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) ignored %s", self.role, self.proc.pid, sig.name)
        return self.proc.poll()


def health_ok(url: str, timeout_s: float = 5.0) -> bool:
    """True when `GET {url}/health` answers 200 (direct connection, no proxy)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"{url}/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def launch_servers(
    processes: Sequence[ServerProcess],
    cfg: VllmConfig,
    models: Mapping[str, ServedModel],
    *,
    log_dir: str | os.PathLike,
    host: str = "127.0.0.1",
    base_env: Mapping[str, str] | None = None,
    lockfile: str | os.PathLike = LIBTPU_LOCKFILE,
    spawn: Spawn = default_spawn,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    poll_s: float = 2.0,
) -> list[VllmServer]:
    """Start one server per process (`models[process.role]` says what it serves), staggered by
    `cfg.start_stagger_s`, and return once every `/health` answers 200. On an early exit or a
    timeout, every server started is stopped and `VllmLaunchError` raised."""
    processes = list(processes)
    if not processes:
        raise ValueError("launch_servers needs at least one server process")
    for p in processes:
        if p.role not in models:
            raise ValueError(f"no ServedModel for role {p.role!r} (have {sorted(models)})")
        if getattr(p, "group_size", 1) > 1:
            raise ValueError(
                f"role {p.role!r} spans {p.group_size} hosts: multi-host vLLM servers are not "
                "supported; give it the chips of one host"
            )
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    connect_host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    clear_stale_libtpu_lock(lockfile)  # before the first server's libtpu looks at it

    servers: list[VllmServer] = []
    deadlines: dict[int, float] = {}
    healthy: set[int] = set()

    def check(until: float | None) -> None:
        """Poll the servers until `until` (None: until all are healthy); raise as soon as one
        has exited or is past its deadline."""
        while True:
            for i, server in enumerate(servers):
                if i in healthy:
                    continue
                code = server.proc.poll()
                if code is not None:
                    raise server.failure(f"exited with code {code} before /health answered")
                if health_ok(server.url, timeout_s=min(5.0, max(poll_s, 0.5))):
                    healthy.add(i)
                    log.info("%s is healthy at %s", server.role, server.url)
                elif clock() > deadlines[i]:
                    raise server.failure(
                        f"did not answer /health with 200 within {cfg.health_timeout_s:g}s"
                    )
            now = clock()
            if until is None and len(healthy) == len(servers):
                return
            if until is not None and now >= until:
                return
            sleep(poll_s if until is None else min(poll_s, until - now))

    try:
        for i, process in enumerate(processes):
            if i and cfg.start_stagger_s > 0:
                check(until=clock() + cfg.start_stagger_s)
            model = models[process.role]
            argv = build_vllm_command(
                model.model_dir, process, cfg, served_model_name=model.name, host=host
            )
            log_path = log_dir / f"vllm-{process.role}-{process.http_port}.log"
            with open(log_path, "ab") as log_file:  # the child keeps its own descriptor
                proc = spawn(argv, build_vllm_env(process, base_env), log_file)
            log.info(
                "started %s (pid %d) on chips %s: %s",
                process.role,
                proc.pid,
                list(process.chips),
                " ".join(argv),
            )
            servers.append(
                VllmServer(
                    process.role, f"http://{connect_host}:{process.http_port}", argv, log_path, proc
                )
            )
            deadlines[i] = clock() + cfg.health_timeout_s
        check(until=None)
    except BaseException:
        stop_servers(servers)
        raise
    return servers


def stop_servers(servers: Sequence[VllmServer], timeout_s: float = 30.0) -> None:
    """Stop every server (each bounded by `timeout_s` before SIGKILL)."""
    for server in servers:
        server.stop(timeout_s)
