"""The uids LocalShells run their commands as, when simloop runs as root: one per shell from
`LocalShellConfig.uid_base`, so RLIMIT_NPROC caps each episode alone and episodes cannot reach
each other's files. A uid is held by an exclusive `flock` on its lock file (across processes),
and handed out only once no process of it is alive: what a closed shell left behind would
otherwise count against the next one's process cap."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import pwd
import signal
import tempfile
import threading
import time

from envs.shell import ShellError

log = logging.getLogger(__name__)

KILL_WAIT_S = 5.0
"""How long `kill_uid` waits for SIGKILLed processes to be gone (they exit at once; this only
bounds a stuck reap)."""


def pids_of_uid(uid: int) -> list[int]:
    """Processes whose real uid is `uid` (what its RLIMIT_NPROC counts), zombies included.

    One read of each process's `status` (its `Uid:` line is within the first few hundred
    bytes): a busy machine has hundreds of processes, and a shell scans them at every close."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fd = os.open(f"/proc/{name}/status", os.O_RDONLY)
            try:
                head = os.read(fd, 1024)
            finally:
                os.close(fd)
        except OSError:  # gone meanwhile
            continue
        at = head.find(b"\nUid:")
        if at >= 0 and int(head[at + 5 :].split(None, 1)[0]) == uid:
            pids.append(int(name))
    return pids


def kill_uid(uid: int, wait_s: float = KILL_WAIT_S) -> list[int]:
    """SIGKILL every process of a shell's own uid (no account has it: nothing else runs as it)
    and wait until they are gone; returns those still there after `wait_s`."""
    deadline = time.monotonic() + wait_s
    while pids := pids_of_uid(uid):
        if time.monotonic() > deadline:
            return pids
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    return []


class UidSlots:
    """Distinct uids for concurrent shells, across processes: a uid is held by an exclusive
    `flock` on its lock file, released when its process dies.

    A shell that closes with no process of its uid left gives the uid back to this process's
    idle pool, still locked (`release(uid, clean=True)`): no other process could have run as
    it since, so the next shell here takes it without sweeping `/proc` again (each sweep reads
    every process's status: ~7 ms on a machine busy with episodes, twice an episode before)."""

    def __init__(self) -> None:
        self._held: dict[int, int] = {}  # uid -> lock fd, in use by a shell
        self._idle: dict[int, int] = {}  # uid -> lock fd, held and found with no process
        self._lock = threading.Lock()  # shells acquire and release from worker threads

    @staticmethod
    def _folder() -> str:
        parent = "/run/lock" if os.path.isdir("/run/lock") else tempfile.gettempdir()
        folder = os.path.join(parent, "simloop-uids")
        os.makedirs(folder, mode=0o700, exist_ok=True)
        return folder

    def acquire(self, base: int, count: int) -> int:
        """A free uid, with no process of it alive: what a closed shell left behind (its
        PID namespace still being torn down, say) is killed first, so a new episode's process
        cap counts only its own processes. A uid whose processes will not die is skipped."""
        with self._lock:
            for uid in sorted(self._idle):
                if base <= uid < base + count:
                    self._held[uid] = self._idle.pop(uid)
                    return uid
        folder = self._folder()
        for uid in range(base, base + count):
            if uid in self._held or uid in self._idle or has_account(uid):
                continue
            fd = os.open(os.path.join(folder, f"{uid}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            left = kill_uid(uid)
            if left:
                log.warning("LocalShell: uid %d still runs %s after SIGKILL; skipped", uid, left)
                os.close(fd)
                continue
            with self._lock:
                self._held[uid] = fd
            return uid
        raise ShellError(
            f"LocalShell: all {count} uids from LocalShellConfig.uid_base={base} are in use by "
            "other shells; raise uid_count or run fewer concurrent local shells"
        )

    def release(self, uid: int, *, clean: bool = False) -> None:
        """Give `uid` back. `clean`: no process of it is alive (the caller just swept it), so
        this process keeps it locked for its next shell; otherwise the lock goes, and whoever
        takes the uid next sweeps it first."""
        with self._lock:
            fd = self._held.pop(uid, None)
            if fd is not None and clean:
                self._idle[uid] = fd
                return
        if fd is not None:
            os.close(fd)


@functools.cache
def has_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


UIDS = UidSlots()
"""This process's holdings."""
