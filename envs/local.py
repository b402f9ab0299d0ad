"""`LocalShell`: real bash on this machine in a throwaway workspace, the embedded default.

    async with LocalShell() as sh:
        obs = await sh.run("echo hi", timeout_s=5)

Each command is a fresh `bash -c` in the workspace, in its own session (process group), with a
scrubbed environment and setrlimit limits (CPU seconds, address space, file size, processes).
Where the kernel allows, it also runs in fresh network and PID namespaces (`unshare -n -p`): no
network, and every process the command leaves behind dies with it. As root, commands run as an
unprivileged user (`nobody`), because root ignores RLIMIT_NPROC. What worked is probed once per
process and recorded (`LocalShell.isolation`, `Observation.info["isolation"]`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import pwd
import resource
import shutil
import signal
import stat
import subprocess
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs.config import LocalShellConfig
from envs.shell import (
    TIMEOUT_EXIT_CODE,
    HeadTailBuffer,
    Observation,
    ShellLifecycle,
    TaskSetup,
    TaskSetupError,
    buffered_observation,
    check_relative_path,
)

_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_REAP_TIMEOUT_S = 5.0  # SIGKILLed processes exit at once; this only bounds a stuck reap


@dataclass(frozen=True)
class Isolation:
    """How commands are contained on this machine (probed once per process)."""

    prefix: tuple[str, ...]
    """argv placed before the rlimit wrapper and `bash -c COMMAND`."""
    network: bool
    """Commands see no network (fresh network namespace)."""
    pid_namespace: bool
    """Commands run in a fresh PID namespace: leftovers die when the command exits."""
    user: str
    uid: int
    gid: int
    popen_user: bool = False
    """Drop to uid/gid through Popen itself (root without setpriv)."""

    @property
    def label(self) -> str:
        net = "netns" if self.network else "hostnet"
        parts = [net, "pidns" if self.pid_namespace else "pgroup"]
        return "+".join([*parts, self.user])


def _probe(prefix: tuple[str, ...]) -> bool:
    try:
        res = subprocess.run(
            [*prefix, "bash", "-c", "echo ok"],
            capture_output=True,
            env={"PATH": _PATH},
            cwd="/",
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return res.returncode == 0 and res.stdout == b"ok\n"


@functools.cache
def detect_isolation(user: str, isolate_network: bool) -> Isolation:
    """The strongest containment that works here, tried from strongest to weakest."""
    root = os.geteuid() == 0
    if root:
        try:
            pw = pwd.getpwnam(user)
        except KeyError as e:
            raise ValueError(
                f"LocalShellConfig.user={user!r} is invalid: no such account on this machine"
            ) from e
        name, uid, gid = user, pw.pw_uid, pw.pw_gid
    else:
        name, uid, gid = pwd.getpwuid(os.getuid()).pw_name, os.getuid(), os.getgid()
    have = {tool: shutil.which(tool, path=_PATH) is not None for tool in ("unshare", "setpriv")}
    # As root the namespaces are made first and privileges dropped inside them; otherwise a
    # user namespace (`-c`, keep our uid) makes the other namespaces possible without root.
    drop: tuple[str, ...] = ()
    if root and have["setpriv"]:
        drop = ("setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--no-new-privs")
        drop += ("--",)
    userns = () if root else ("-c",)
    pidns = ("-p", "-f", "--kill-child")
    candidates: list[tuple[tuple[str, ...], bool, bool]] = []
    if have["unshare"] and (drop or not root):
        if isolate_network:
            candidates.append((("unshare", *userns, "-n", *pidns, "--", *drop), True, True))
            candidates.append((("unshare", *userns, "-n", "--", *drop), True, False))
        candidates.append((("unshare", *userns, *pidns, "--", *drop), False, True))
    for prefix, net, pid in candidates:
        if _probe(prefix):
            return Isolation(prefix, net, pid, name, uid, gid)
    if drop and _probe(drop):
        return Isolation(drop, False, False, name, uid, gid)
    if root:  # no setpriv: Popen drops privileges itself
        return Isolation((), False, False, name, uid, gid, popen_user=True)
    return Isolation((), False, False, name, uid, gid)


def limits_wrapper(cfg: LocalShellConfig) -> tuple[str, ...]:
    """argv that sets the rlimits (bash's `ulimit`, i.e. setrlimit, soft and hard) and then
    execs `bash -c COMMAND` (COMMAND appended by the caller).

    Not preexec_fn: that forces a plain fork() of this (possibly multithreaded, JAX-loaded)
    process and runs Python in the child; this way the child is vfork+exec only. Values are
    clamped to our own hard limits, which an unprivileged user can only lower."""

    def clamp(res: int, value: int) -> int:
        hard = resource.getrlimit(res)[1]
        return value if hard == resource.RLIM_INFINITY else min(value, hard)

    # bash's ulimit counts -v and -f in KiB; -t in seconds; -u in processes.
    flags = (
        f"-t {clamp(resource.RLIMIT_CPU, cfg.cpu_time_s)} "
        f"-v {clamp(resource.RLIMIT_AS, cfg.memory_bytes) // 1024} "
        f"-f {clamp(resource.RLIMIT_FSIZE, cfg.file_size_bytes) // 1024} "
        f"-u {clamp(resource.RLIMIT_NPROC, cfg.max_processes)} -c 0"
    )
    return ("bash", "-c", f'ulimit {flags} && exec bash -c "$1"', "simloop-shell")


def _rmtree(path: str) -> None:
    def fix_and_retry(func, p, _exc):  # an agent may chmod 000 its own files
        try:
            os.chmod(os.path.dirname(p), stat.S_IRWXU)
            os.chmod(p, stat.S_IRWXU)
        except OSError:
            pass
        func(p)

    if os.path.lexists(path):
        shutil.rmtree(path, onerror=fix_and_retry)


def _cleanup(base: str) -> None:
    _kill_stragglers(base)
    _rmtree(base)


def _check_reachable(path: str, uid: int) -> None:
    """Every directory above the workspace must let `uid` through, or its commands would run
    in a directory they cannot name."""
    parent = os.path.dirname(os.path.abspath(path))
    while True:
        st = os.stat(parent)
        if st.st_uid != uid and not st.st_mode & stat.S_IXOTH:
            raise ValueError(
                f"LocalShellConfig.workspace_root={path!r} is invalid: {parent} is not "
                f"traversable by uid {uid}; choose a directory under a world-traversable path"
            )
        if parent == "/":
            return
        parent = os.path.dirname(parent)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_stragglers(base: str) -> int:
    """SIGKILL processes whose working directory lies under `base`: without a PID namespace,
    that is how processes that left the command's group (setsid, double fork) are found."""
    killed = 0
    prefix = base.rstrip("/") + "/"
    me = str(os.getpid())
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or entry.name == me:
            continue
        try:
            cwd = os.readlink(f"/proc/{entry.name}/cwd")
        except OSError:  # gone already, or not ours to inspect
            continue
        if cwd == base or cwd.startswith(prefix):
            try:
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
    return killed


class _Collector(asyncio.SubprocessProtocol):
    """Collects merged output into a bounded buffer and signals exit, EOF and runaway output.
    (asyncio's `Process.wait()` also waits for the pipes, which background children hold.)"""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_bytes: int, kill_after: int):
        self.buf = HeadTailBuffer(max_bytes)
        self.kill_after = kill_after
        self.pgid: int | None = None
        self.exited: asyncio.Future[None] = loop.create_future()
        self.eof: asyncio.Future[None] = loop.create_future()
        self.limit_hit: asyncio.Future[None] = loop.create_future()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self.buf.write(data)
        if self.buf.total > self.kill_after and not self.limit_hit.done():
            self.limit_hit.set_result(None)
            if self.pgid is not None:
                _kill_group(self.pgid)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        if fd == 1 and not self.eof.done():
            self.eof.set_result(None)

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)


class LocalShell(ShellLifecycle):
    """Real bash in a fresh temporary workspace; see the module docstring."""

    def __init__(self, config: LocalShellConfig | None = None, setup: TaskSetup | None = None):
        self.config = config or LocalShellConfig()
        self.setup = setup or TaskSetup()
        self._base: str | None = None
        self._finalizer: weakref.finalize | None = None
        self._iso: Isolation | None = None
        self._env: dict[str, str] = {}
        self._lock = asyncio.Lock()
        self._start_lock = asyncio.Lock()
        self._closed = False
        self._wrapper = limits_wrapper(self.config)

    @property
    def workspace(self) -> Path:
        """The working directory of every command (exists between start and close)."""
        if self._base is None:
            raise RuntimeError("LocalShell is not started")
        return Path(self._base) / "work"

    @property
    def isolation(self) -> dict[str, Any]:
        """What containment is in force: network, pid_namespace, user."""
        if self._iso is None:
            raise RuntimeError("LocalShell is not started")
        iso = self._iso
        return {"network": iso.network, "pid_namespace": iso.pid_namespace, "user": iso.user}

    async def start(self) -> None:
        """Create the workspace and apply the task setup (idempotent)."""
        async with self._start_lock:
            if self._closed:
                raise RuntimeError("LocalShell is closed")
            if self._base is None:
                await self._start()

    async def _start(self) -> None:
        cfg = self.config
        self._iso = await asyncio.to_thread(detect_isolation, cfg.user, cfg.isolate_network)
        base = tempfile.mkdtemp(prefix="simloop-ws-", dir=cfg.workspace_root)
        self._base = base
        # Backstop for a shell that is never closed: removed at garbage collection or exit.
        self._finalizer = weakref.finalize(self, _cleanup, base)
        try:
            if os.geteuid() == 0:
                _check_reachable(base, self._iso.uid)
            for sub in ("work", "home", "tmp"):
                os.mkdir(os.path.join(base, sub), 0o700)
            self._chown_tree(base)
            self._env = {
                "PATH": _PATH,
                "HOME": os.path.join(base, "home"),
                "TMPDIR": os.path.join(base, "tmp"),
                "USER": self._iso.user,
                "LOGNAME": self._iso.user,
                "SHELL": "/bin/bash",
                "LANG": "C.UTF-8",
                "LC_ALL": "C.UTF-8",
                "TERM": "dumb",
                "PAGER": "cat",
                "MANPAGER": "cat",
                "GIT_PAGER": "cat",
                "PIP_PROGRESS_BAR": "off",
                "TQDM_DISABLE": "1",
                **cfg.env,
            }
            await self._apply_setup()
        except BaseException:
            await self.close()
            raise

    def _chown_tree(self, root: str) -> None:
        if os.geteuid() != 0 or self._iso is None:
            return
        uid, gid = self._iso.uid, self._iso.gid
        os.chown(root, uid, gid)
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                os.chown(os.path.join(dirpath, name), uid, gid, follow_symlinks=False)

    async def _apply_setup(self) -> None:
        work = self.workspace
        for rel, text in self.setup.files.items():
            path = work / check_relative_path(rel, "TaskSetup.files")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        if self.setup.files:
            self._chown_tree(str(work))
        for cmd in self.setup.commands:
            obs = await self._run_locked(cmd, self.config.setup_timeout_s)
            if obs.exit_code != 0:
                raise TaskSetupError(
                    f"setup command {cmd!r} exited {obs.exit_code}: {obs.output[-2000:]}"
                )

    async def run(self, command: str, timeout_s: float) -> Observation:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s!r} is invalid: a positive number of seconds")
        await self.start()
        return await self._run_locked(command, timeout_s)

    async def _run_locked(self, command: str, timeout_s: float) -> Observation:
        async with self._lock:
            if self._closed or self._base is None:
                raise RuntimeError("LocalShell is closed")
            return await self._run(command, timeout_s)

    async def _run(self, command: str, timeout_s: float) -> Observation:
        cfg, iso = self.config, self._iso
        assert iso is not None
        kwargs: dict[str, Any] = {}
        if iso.popen_user:
            kwargs = {"user": iso.uid, "group": iso.gid, "extra_groups": []}
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        spawn = asyncio.ensure_future(
            loop.subprocess_exec(
                lambda: _Collector(loop, cfg.max_output_bytes, cfg.kill_after_output_bytes),
                *iso.prefix,
                *self._wrapper,
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                cwd=self.workspace,
                env=self._env,
                start_new_session=True,  # its own process group: one killpg reaches every child
                **kwargs,
            )
        )
        try:
            # Shielded: a cancellation while the process starts must still kill its whole
            # group. asyncio's own clean-up would kill only the direct child (unshare, whose
            # --kill-child signal the privilege drop clears) and then wait for the pipe, i.e.
            # for the command to end on its own (a `sleep 400` held an episode for 400 s).
            transport, proto = await asyncio.shield(spawn)
        except asyncio.CancelledError:
            if not spawn.cancelled():
                with contextlib.suppress(Exception):  # it never started: nothing to kill
                    transport, _ = await spawn
                    _kill_group(transport.get_pid())
                    transport.close()
            raise
        pgid = transport.get_pid()
        proto.pgid = pgid
        timed_out = False
        try:
            await asyncio.wait(
                {proto.exited, proto.limit_hit}, timeout=timeout_s, return_when="FIRST_COMPLETED"
            )
            if not proto.exited.done():
                timed_out = not proto.limit_hit.done()
                _kill_group(pgid)
                await asyncio.wait({proto.exited}, timeout=_REAP_TIMEOUT_S)
            # Background children may still hold the pipe: give them a moment, then kill the
            # group (in a PID namespace they already died with bash). Killing after every
            # command also ends children that redirected their output elsewhere.
            if not proto.eof.done():
                await asyncio.wait({proto.eof}, timeout=cfg.drain_grace_s)
            _kill_group(pgid)
            if not proto.eof.done() and not iso.pid_namespace and self._base is not None:
                _kill_stragglers(self._base)
            if not proto.eof.done():
                await asyncio.wait({proto.eof}, timeout=cfg.drain_grace_s)
        finally:
            _kill_group(pgid)
            transport.close()
        rc = transport.get_returncode()
        buf = proto.buf
        info: dict[str, Any] = {"isolation": iso.label, "output_bytes": buf.total}
        if not proto.eof.done():
            info["pipe_held"] = "output pipe still held by processes that escaped the group"
        if timed_out:
            exit_code = TIMEOUT_EXIT_CODE
            info["timeout"] = True
            info["reason"] = f"command timed out after {timeout_s:g}s and was killed"
        elif rc is None:
            exit_code = 128 + signal.SIGKILL
            info["reason"] = "command could not be reaped after SIGKILL"
        else:
            exit_code = 128 - rc if rc < 0 else rc
        if proto.limit_hit.done():
            info["killed"] = "output_limit"
            info["reason"] = f"output exceeded {cfg.kill_after_output_bytes} bytes; killed"
        return buffered_observation(buf, exit_code, start, info)

    async def close(self) -> None:
        """Delete the workspace (always safe to call, also twice or before start)."""
        self._closed = True
        async with self._lock:  # never delete under a running command
            base, self._base = self._base, None
            if self._finalizer is not None:
                self._finalizer.detach()
            if base is not None:
                if self._iso is not None and not self._iso.pid_namespace:
                    _kill_stragglers(base)
                await asyncio.to_thread(_rmtree, base)
