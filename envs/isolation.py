"""How `LocalShell` contains commands on this machine, probed once per process: the strongest
of fresh network, PID and mount namespaces (`unshare`), a privilege drop to a uid of the
shell's own (`setpriv`), the parent-death signal and the seccomp filter refusing user
namespaces that work here (`detect_isolation`), and what that amounts to in words for logs
and the README (`isolation_report`). Also the process tag (`_OWNER`: pid and start time) that
names the workspaces this process makes, so a later sweep can tell a dead owner's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import pwd
import select
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs import nouserns
from envs.config import LocalShellConfig
from envs.shell import ShellError

log = logging.getLogger(__name__)

_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_REAP_TIMEOUT_S = 5.0  # SIGKILLed processes exit at once; this only bounds a stuck reap
_WS_PREFIX = "simloop-ws-"


@dataclass(frozen=True)
class Isolation:
    """How commands are contained on this machine (probed once per process)."""

    prefix: tuple[str, ...]
    """argv placed before the privilege drop (`drop`), the rlimit wrapper and `bash -c COMMAND`
    (with `mount_namespace`, `nsenter` into the episode's namespace goes before `unshare`)."""
    network: bool
    """Commands see no network (fresh network namespace)."""
    pid_namespace: bool
    """Commands run in a fresh PID namespace: leftovers die when the command exits."""
    user: str
    uid: int
    gid: int
    popen_user: bool = False
    """Drop to uid/gid through Popen itself (root without setpriv)."""
    drop: tuple[str, ...] = ()
    """The privilege drop (setpriv) with `{uid}`/`{gid}` placeholders: each shell fills in its
    own uid. Empty: `prefix` already drops to `uid` (or no drop is needed)."""
    mount_namespace: bool = False
    """A private mount namespace per episode (each command in a copy with its own /proc):
    private tmpfs tmp folders, the other workspaces hidden."""
    readonly_root: bool = False
    """`/` is mounted read-only in the command's mount namespace."""
    parent_death: bool = False
    """The command is SIGKILLed when its parent dies (setpriv --pdeathsig), after the drop."""
    userns_refused: bool = False
    """Commands cannot make user namespaces (`envs/nouserns.py`'s seccomp filter, first in
    `prefix`), hence cannot mount anything either."""
    userns_filter: str | None = None
    """Which runner installs that filter: `compiled` (a C program built once per machine) or
    `python` (no C compiler here: ~15-60 ms more per command)."""

    def label(self, user: str | None = None) -> str:
        """e.g. `netns+pidns+mntns+uid60000`: the containment, then who runs the commands
        (`user`, a shell's own uid, else the probed account)."""
        net = "netns" if self.network else "hostnet"
        parts = [net, "pidns" if self.pid_namespace else "pgroup"]
        if self.mount_namespace:
            parts.append("mntns")
        return "+".join([*parts, user or self.user])

    @property
    def per_shell_uid(self) -> bool:
        """Whether each shell can run as its own uid (root dropping privileges per command)."""
        return any("{uid}" in arg for arg in self.drop) or self.popen_user


def _probe(prefix: tuple[str, ...], cwd: str = "/") -> bool:
    try:
        res = subprocess.run(
            [*prefix, "bash", "-c", "echo ok"],
            capture_output=True,
            env={"PATH": _PATH},
            cwd=cwd,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return res.returncode == 0 and res.stdout == b"ok\n"


def _start_holder(
    base: str,
    tmpfs_bytes: int,
    disk_bytes: int,
    ids: tuple[int, int],
    readonly_root: bool,
    visible: tuple[str, ...] = (),
) -> subprocess.Popen:
    """The process that makes and holds an episode's mount namespace (`envs/sandbox_root.py`:
    its minimal root, the workspace on a tmpfs of `disk_bytes` owned by `ids`), once it is
    ready; raises ShellError if it could not be made."""
    argv = [
        *_HOLDER,
        base,
        str(tmpfs_bytes),
        str(disk_bytes),
        str(ids[0]),
        str(ids[1]),
        "ro" if readonly_root else "rw",
        *visible,
    ]
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=base,
        env={"PATH": _PATH},
    )
    ready, _, _ = select.select([proc.stdout], [], [], 10)
    if ready and proc.stdout.readline() == b"ready\n":
        return proc
    _stop_holder(proc)
    err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
    raise ShellError(f"LocalShell: the episode's mount namespace could not be made: {err}")


def _stop_holder(proc: subprocess.Popen) -> None:
    for pipe in (proc.stdin, proc.stdout):
        with contextlib.suppress(OSError):
            pipe.close()
    try:
        proc.wait(timeout=_REAP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=_REAP_TIMEOUT_S)


def _probe_mounts(
    prefix: tuple[str, ...], drop: tuple[str, ...], readonly_root: bool, ids: tuple[int, int]
) -> bool:
    base = tempfile.mkdtemp(prefix=f"{_WS_PREFIX}{_OWNER}-probe-")
    try:
        os.chmod(base, 0o755)
        os.mkdir(os.path.join(base, "work"), 0o755)
        holder = _start_holder(base, 2**20, 2**20, ids, readonly_root)
        try:
            return _probe((*_enter(prefix, holder.pid), *drop))
        finally:
            _stop_holder(holder)
    except (OSError, ShellError):
        return False
    finally:
        shutil.rmtree(base, ignore_errors=True)


_HOLDER = (sys.executable, "-I", "-S", str(Path(__file__).with_name("sandbox_root.py")))


def _refuse_userns(iso: Isolation, drop: tuple[str, ...]) -> Isolation:
    """`iso` with the user-namespace filter first in its prefix, where it works here: a
    command still runs, and `unshare -U` inside it is refused. The filter's runner is compiled
    once per machine where a C compiler is (`nouserns.runner`: ~1 ms a command; the Python
    runner it falls back to costs ~15-60 ms of interpreter start per command)."""
    runner = nouserns.runner()
    tried = (*runner, *iso.prefix, *drop)
    if not _probe(tried):
        log.warning(
            "LocalShell: the seccomp filter refusing user namespaces does not run here; "
            "commands may create them"
        )
        return iso
    if shutil.which("unshare", path=_PATH) is not None:
        res = subprocess.run(
            [*tried, "bash", "-c", "unshare -U true"],
            capture_output=True,
            env={"PATH": _PATH},
            cwd="/",
            timeout=10,
            check=False,
        )
        if res.returncode == 0:
            log.warning("LocalShell: user namespaces are not refused by the seccomp filter")
            return iso
    how = "python" if runner == nouserns.PYTHON_RUNNER else "compiled"
    return dataclasses.replace(
        iso, prefix=(*runner, *iso.prefix), userns_refused=True, userns_filter=how
    )


def _enter(prefix: tuple[str, ...], holder_pid: int) -> tuple[str, ...]:
    """`prefix` with `nsenter` into the holder's mount namespace, and in its working directory
    (the workspace as mounted there), before `unshare`."""
    at = prefix.index("unshare")
    nsenter = ("nsenter", f"--target={holder_pid}", "--mount", "--wd", "--")
    return (*prefix[:at], *nsenter, *prefix[at:])


@functools.cache
def detect_isolation(user: str, isolate_network: bool) -> Isolation:
    """The strongest containment that works here, tried from strongest to weakest."""
    iso = _detect(user, isolate_network)
    log.info("LocalShell isolation on this machine: %s", isolation_report(iso))
    return iso


def _detect(user: str, isolate_network: bool) -> Isolation:
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
    # The parent-death signal, on both sides of unshare: on unshare itself (it dies with us),
    # and on the command after the privilege drop, which clears the one `--kill-child` set.
    death = ("--pdeathsig", "KILL")
    parent_death = have["setpriv"] and _probe(("setpriv", *death, "--"))
    death = death if parent_death else ()
    outer = ("setpriv", *death, "--") if parent_death else ()
    # As root the namespaces are made first and privileges dropped inside them; otherwise a
    # user namespace (`-c`, keep our uid) makes the other namespaces possible without root.
    drop: tuple[str, ...] = ()
    if root and have["setpriv"]:
        drop = ("setpriv", "--reuid={uid}", "--regid={gid}", "--clear-groups", "--no-new-privs")
        drop += (*death, "--")
    elif parent_death:
        drop = ("setpriv", *death, "--")
    userns = () if root else ("-c",)
    pidns = ("-p", "-f", "--kill-child")
    candidates: list[tuple[tuple[str, ...], bool, bool]] = []
    if have["unshare"] and (drop or not root):
        if isolate_network:
            candidates.append((("unshare", *userns, "-n", *pidns, "--"), True, True))
            candidates.append((("unshare", *userns, "-n", "--"), True, False))
        candidates.append((("unshare", *userns, *pidns, "--"), False, True))
    filled = tuple(a.format(uid=uid, gid=gid) for a in drop)
    for flags, net, pid in candidates:
        prefix = (*outer, *flags)
        if not _probe((*prefix, *filled)):
            continue
        iso = Isolation(prefix, net, pid, name, uid, gid, drop=drop, parent_death=parent_death)
        if root and pid and shutil.which("nsenter", path=_PATH):
            # Each command gets a copy of the episode's mount namespace, with its own /proc.
            mounted = (*prefix[:-1], "-m", "--mount-proc", "--")
            for ro in (True, False):
                if _probe_mounts(mounted, filled, ro, (uid, gid)):
                    iso = dataclasses.replace(
                        iso, prefix=mounted, mount_namespace=True, readonly_root=ro
                    )
                    break
        return _refuse_userns(iso, filled) if root else iso
    if root and drop and _probe(filled):
        return Isolation((), False, False, name, uid, gid, drop=drop, parent_death=parent_death)
    if root:  # no setpriv: Popen drops privileges itself
        return Isolation((), False, False, name, uid, gid, popen_user=True)
    return Isolation((), False, False, name, uid, gid)


def isolation_report(iso: Isolation, cfg: LocalShellConfig | None = None) -> dict[str, Any]:
    """What containment is in force, for logs and the README: namespaces, identity, caps."""
    cfg = cfg or LocalShellConfig()
    distinct = iso.per_shell_uid and cfg.uid_base > 0
    tmp = f"tmpfs {cfg.tmpfs_bytes} bytes each" if iso.mount_namespace else "shared with the host"
    return {
        "network": iso.network,
        "pid_namespace": iso.pid_namespace,
        "mount_namespace": iso.mount_namespace,
        "private_proc": iso.mount_namespace and iso.pid_namespace,
        "private_tmp": iso.mount_namespace,
        "workspaces_hidden": iso.mount_namespace,
        "minimal_root": iso.mount_namespace,
        "readonly_root": iso.readonly_root,
        "userns_refused": iso.userns_refused,
        "userns_filter": iso.userns_filter,
        "user": iso.user,
        "distinct_uid": distinct,
        "parent_death": iso.parent_death,
        "limits": {
            "processes": f"RLIMIT_NPROC {cfg.max_processes} "
            + ("per episode (its own uid)" if distinct else f"shared by all shells of {iso.user}"),
            "memory": f"RLIMIT_AS {cfg.memory_bytes} bytes per process",
            "cpu": f"RLIMIT_CPU {cfg.cpu_time_s} s per process",
            "disk": f"RLIMIT_FSIZE {cfg.file_size_bytes} bytes per file; /tmp, /var/tmp, "
            f"/dev/shm: {tmp}; workspace, home and TMPDIR: "
            + (
                f"tmpfs of {cfg.disk_bytes} bytes (the episode's quota)"
                if iso.mount_namespace
                else "no quota (no mount namespace)"
            ),
            "cgroups": "not used",
        },
    }


def _start_time(pid: int | str) -> str | None:
    """A process's start time (clock ticks since boot), which tells it from a later process
    with the same pid; None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


_OWNER = f"{os.getpid()}.{_start_time('self')}"
