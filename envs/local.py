"""`LocalShell`: real bash on this machine in a throwaway workspace, the embedded default.

    async with LocalShell() as sh:
        obs = await sh.run("echo hi", timeout_s=5)

Each command is a fresh `bash -c` in the workspace, in its own session (process group), with a
scrubbed environment and setrlimit limits (CPU seconds, address space, file size, processes).
Where the kernel allows, it also runs in fresh network, PID and mount namespaces
(`unshare -n -p -m --mount-proc`): no network; every process the command leaves behind dies
with it; its own `/proc` (no other process, nor its command line, is visible). As root, the
episode's mount namespace has a minimal root of its own (`envs/sandbox_root.py`): read-only system
folders, private tmpfs `/tmp`, `/var/tmp` and `/dev/shm` of `tmpfs_bytes` each, the workspace
(with its home and TMPDIR) on a tmpfs of `disk_bytes` (the episode's disk quota: a command that
fills it while running is killed, and its observation says so), the `visible_paths` read-only,
and nothing else of the host: no home folders, no project tree, no other workspace, no /sys.
Commands start under a seccomp filter that refuses new user namespaces (`envs/nouserns.py`),
so, without privileges, they can mount nothing either.
As root, each shell runs its commands as its own uid (`uid_base` + a free slot, held by a lock
file), because root ignores RLIMIT_NPROC and so that episodes cannot reach each other's files:
RLIMIT_NPROC then caps each episode alone (a fork bomb exhausts only its own uid). Resource caps
are rlimits and tmpfs sizes (no cgroups). The parent-death signal is set on both sides of
`unshare`, after the privilege drop too, so a killed simloop takes its commands with it; the
workspaces of dead simloop processes are swept at the first start of a process. What worked is
probed once per process (`envs/isolation.py`), logged, and recorded (`LocalShell.isolation`,
`Observation.info["isolation"]`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

from envs.config import LocalShellConfig
from envs.isolation import (  # _start_time: the sweep's, patched by tests
    _OWNER,
    _PATH,
    _REAP_TIMEOUT_S,
    _WS_PREFIX,
    Isolation,
    _enter,
    _start_holder,
    _start_time,
    _stop_holder,
    detect_isolation,
    isolation_report,
)
from envs.local_uids import UIDS, kill_uid
from envs.shell import (
    TIMEOUT_EXIT_CODE,
    HeadTailBuffer,
    Observation,
    ShellLifecycle,
    TaskSetup,
    TaskSetupError,
    buffered_observation,
    check_relative_path,
    tree_hash,
)

log = logging.getLogger(__name__)

_QUOTA_POLL_S = 0.25
"""How often a running command's disk use is checked against the quota."""
_WS_OWNER = re.compile(rf"{_WS_PREFIX}(\d+)\.(\d+)-")
"""Workspace names carry the owner's pid and start time, so a sweep can tell dead owners."""


@functools.cache
def sweep_stale_workspaces(root: str) -> int:
    """Delete the workspaces in `root` whose owning simloop process is gone (killed before it
    could clean up); once per process and folder. Returns how many were removed."""
    removed = 0
    with contextlib.suppress(OSError), os.scandir(root) as entries:
        for entry in entries:
            found = _WS_OWNER.match(entry.name)
            if found is None or not entry.is_dir(follow_symlinks=False):
                continue
            pid, started = found.groups()
            if _start_time(pid) == started:  # its owner still runs
                continue
            with contextlib.suppress(OSError):
                _cleanup(entry.path)
                removed += 1
    if removed:
        log.info("LocalShell: removed %d workspaces of dead processes from %s", removed, root)
    return removed


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
    top = os.path.abspath(path)

    def fix_and_retry(func, p, exc_info):  # an agent may chmod 000 its own files
        if isinstance(exc_info[1], FileNotFoundError):
            return  # already gone (a concurrent sweep)
        try:
            parent = os.path.abspath(os.path.dirname(p))
            if parent == top or parent.startswith(top + os.sep):  # never above the tree
                os.chmod(parent, stat.S_IRWXU)
            os.chmod(p, stat.S_IRWXU)
        except OSError:
            pass
        func(p)

    if os.path.lexists(path):
        shutil.rmtree(path, onerror=fix_and_retry)


def _cleanup(base: str, uid: int | None = None, holder: subprocess.Popen | None = None) -> None:
    _kill_stragglers(base)
    if holder is not None:
        _stop_holder(holder)
    _rmtree(base)
    if uid is not None:
        UIDS.release(uid)


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
        self._uid: int | None = None
        """This shell's own uid (from `uid_base`), where it has one."""
        self._holder: subprocess.Popen | None = None
        """Holds the episode's mount namespace (where there is one)."""
        self._env: dict[str, str] = {}
        self._lock = asyncio.Lock()
        self._start_lock = asyncio.Lock()
        self._closed = False
        self._wrapper = limits_wrapper(self.config)
        self._argv: tuple[str, ...] = ()

    @property
    def workdir(self) -> Path:
        """The working directory of every command, as the commands name it."""
        if self._base is None:
            raise RuntimeError("LocalShell is not started")
        return Path(self._base) / "work"

    @property
    def workspace(self) -> Path:
        """The working directory of every command as this process reaches its files (exists
        between start and close): `workdir`, or, in an episode's mount namespace, the same
        folder through the holder's root (`/proc/<holder>/root/...`, a tmpfs of `disk_bytes`
        only that namespace mounts)."""
        if self._base is None:
            raise RuntimeError("LocalShell is not started")
        return Path(self._files_base()) / "work"

    def _files_base(self) -> str:
        assert self._base is not None
        if self._holder is None:
            return self._base
        return f"/proc/{self._holder.pid}/root{self._base}"

    async def workspace_hash(self) -> str:
        """`envs.shell.tree_hash` of the workspace as it is now."""
        return await asyncio.to_thread(tree_hash, self.workspace)

    @property
    def isolation(self) -> dict[str, Any]:
        """What containment is in force (`isolation_report`: namespaces, private /proc and tmp
        folders, read-only root, identity, resource caps), with this shell's `uid`."""
        if self._iso is None:
            raise RuntimeError("LocalShell is not started")
        report = isolation_report(self._iso, self.config)
        report["distinct_uid"] = self._uid is not None
        report["uid"] = self._ids()[0]
        report["user"] = self._user()
        return report

    def _ids(self) -> tuple[int, int]:
        assert self._iso is not None
        return (self._uid, self._uid) if self._uid is not None else (self._iso.uid, self._iso.gid)

    def _user(self) -> str:
        assert self._iso is not None
        return f"uid{self._uid}" if self._uid is not None else self._iso.user

    async def start(self) -> None:
        """Create the workspace and apply the task setup (idempotent)."""
        async with self._start_lock:
            if self._closed:
                raise RuntimeError("LocalShell is closed")
            if self._base is None:
                await self._start()

    async def _start(self) -> None:
        cfg = self.config
        self._iso = iso = await asyncio.to_thread(detect_isolation, cfg.user, cfg.isolate_network)
        root = os.path.abspath(cfg.workspace_root or tempfile.gettempdir())
        await asyncio.to_thread(sweep_stale_workspaces, root)
        if self._closed:  # closed while it probed: create nothing
            raise RuntimeError("LocalShell is closed")
        if os.geteuid() == 0 and iso.per_shell_uid and cfg.uid_base > 0:
            self._uid = await asyncio.to_thread(UIDS.acquire, cfg.uid_base, cfg.uid_count)
        try:
            base = tempfile.mkdtemp(prefix=f"{_WS_PREFIX}{_OWNER}-", dir=root)
        except BaseException:
            if self._uid is not None:
                UIDS.release(self._uid)
            raise
        self._base = base
        # Backstop for a shell that is never closed: removed at garbage collection or exit.
        self._finalizer = weakref.finalize(self, _cleanup, base, self._uid)
        try:
            if os.geteuid() == 0:
                _check_reachable(base, self._ids()[0])
            for sub in ("work", "home", "tmp"):
                os.mkdir(os.path.join(base, sub), 0o700)
            self._chown_tree(base)
            prefix = iso.prefix
            if iso.mount_namespace:
                size, ro = cfg.tmpfs_bytes, iso.readonly_root
                # parents before their children: a child may lie inside a parent's bind
                shown = {os.path.abspath(p) for p in cfg.visible_paths if os.path.isdir(p)}
                visible = tuple(sorted(shown, key=lambda p: (len(p), p)))
                self._holder = await asyncio.to_thread(
                    _start_holder, base, size, cfg.disk_bytes, self._ids(), ro, visible
                )
                self._finalizer.detach()
                self._finalizer = weakref.finalize(self, _cleanup, base, self._uid, self._holder)
                prefix = _enter(prefix, self._holder.pid)
            self._argv = (*prefix, *self._drop(), *self._wrapper)
            self._env = {
                "PATH": _PATH,
                "HOME": os.path.join(base, "home"),
                "TMPDIR": os.path.join(base, "tmp"),
                "USER": self._user(),
                "LOGNAME": self._user(),
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

    def _drop(self) -> tuple[str, ...]:
        uid, gid = self._ids()
        return tuple(a.format(uid=uid, gid=gid) for a in self._iso.drop) if self._iso else ()

    def _chown_tree(self, root: str) -> None:
        if os.geteuid() != 0 or self._iso is None:
            return
        uid, gid = self._ids()
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
            uid, gid = self._ids()
            kwargs = {"user": uid, "group": gid, "extra_groups": []}
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        spawn = asyncio.ensure_future(
            loop.subprocess_exec(
                lambda: _Collector(loop, cfg.max_output_bytes, cfg.kill_after_output_bytes),
                *self._argv,
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,  # on this host too; the holder's namespace has its own
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
        timed_out = quota_hit = False
        try:
            quota_hit = await self._await_command(proto, timeout_s)
            if not proto.exited.done():
                timed_out = not proto.limit_hit.done() and not quota_hit
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
        info: dict[str, Any] = {"isolation": iso.label(self._user()), "output_bytes": buf.total}
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
        if quota_hit or (self._holder is not None and self._disk_full()):
            info["disk_full"] = True
            what = "the command was killed" if quota_hit else "writes fail until files are removed"
            info["reason"] = (
                f"the episode's disk quota ({cfg.disk_bytes} bytes for the "
                f"workspace, its home and TMPDIR) is full: {what}"
            )
            if quota_hit:
                info["killed"] = "disk_quota"
            buf.write(f"\nsimloop: disk quota exceeded ({cfg.disk_bytes} bytes); {what}\n".encode())
        return buffered_observation(buf, exit_code, start, info)

    async def _await_command(self, proto: _Collector, timeout_s: float) -> bool:
        """Wait until the command exits, prints too much or runs out of time; with a disk
        quota, also until the quota's tmpfs is full while it runs, which kills it (True)."""
        waits = {proto.exited, proto.limit_hit}
        if self._holder is None:
            await asyncio.wait(waits, timeout=timeout_s, return_when="FIRST_COMPLETED")
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (left := deadline - loop.time()) > 0:
            done, _ = await asyncio.wait(
                waits, timeout=min(left, _QUOTA_POLL_S), return_when="FIRST_COMPLETED"
            )
            if done:
                return False
            if self._disk_full():
                return True
        return False

    def _disk_full(self) -> bool:
        """The workspace's tmpfs has no block left (its quota, `disk_bytes`, is used up)."""
        try:
            return os.statvfs(self._files_base()).f_bavail == 0
        except OSError:  # the namespace is gone (closing)
            return False

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
                if self._holder is not None:
                    await asyncio.to_thread(_stop_holder, self._holder)
                await asyncio.to_thread(_rmtree, base)
            if self._uid is not None:  # only once nothing of it is left
                left = await asyncio.to_thread(kill_uid, self._uid)
                if left:  # acquire sweeps again before anyone reuses it
                    log.warning("LocalShell: uid %d still runs %s at close", self._uid, left)
                UIDS.release(self._uid, clean=not left)


if __name__ == "__main__":  # python -m envs.local: what containment this machine gives a shell
    import json

    async def _report() -> None:
        async with LocalShell() as shell:
            print(json.dumps(shell.isolation, indent=1))

    asyncio.run(_report())
