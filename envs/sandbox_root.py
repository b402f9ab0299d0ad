"""The holder of an episode's mount namespace: makes the namespace, builds its minimal root,
pivots into it, says `ready` and waits on stdin; the namespace ends with it. `LocalShell` runs
it as root, once per shell, and enters the namespace (`nsenter --mount`) for every command.

    python -I -S envs/sandbox_root.py BASE TMPFS_BYTES DISK_BYTES UID GID ro|rw [VISIBLE ...]

The root is a small tmpfs holding:
- read-only binds of the system folders (/usr, /etc, and /bin, /sbin, /lib* as the host has
  them: folders, or the same links); plain binds, not recursive, so files a container runtime
  binds over /etc (hostname, hosts, resolv.conf) stay out, and /etc/hostname and
  /etc/machine-id read empty;
- /dev with null, zero, full, random, urandom and tty, and the fd links;
- private tmpfs /tmp, /var/tmp and /dev/shm of TMPDIR_BYTES each;
- BASE (the episode's folder) as a tmpfs of DISK_BYTES owned by UID:GID, with `work` (the
  workspace), `home` and `tmp` (its TMPDIR) in it: the episode's disk quota;
- each VISIBLE host folder, read-only at its own path;
- an empty /proc: each command mounts its own (`unshare --mount-proc`).
No home folders, no /sys, /opt, /srv or /mnt, no project tree and nothing beside the
workspace. The old root is detached after the pivot, so `nsenter --mount` lands in the new one
and simloop reaches the workspace through /proc/<holder>/root.

One process and direct system calls, because the same root built by ~30 `mount(8)` runs from
a shell added ~100 ms to every episode's start; this starts in 24-40 ms (fastest of 5, 2 busy
cores) against 22-31 ms for the old holder that bound the whole host read-only. Only the
standard library (`-I -S`).
"""

from __future__ import annotations

import ctypes
import os
import sys

CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_NOSUID, MS_NODEV = 0x1, 0x2, 0x4
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MNT_DETACH = 0x2
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
SYSTEM = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
MASKED = ("/etc/hostname", "/etc/machine-id")

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(
    source: str | None, target: str, fstype: str | None, flags: int = 0, data: str | None = None
) -> None:
    enc = [None if x is None else x.encode() for x in (source, target, fstype, data)]
    _check(
        _libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]),
        f"mount {source} on {target}",
    )


def bind_readonly(source: str, target: str) -> None:
    mount(source, target, None, MS_BIND)
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def build(
    base: str,
    tmpfs_bytes: int,
    disk_bytes: int,
    uid: int,
    gid: int,
    readonly: bool,
    visible: list[str],
) -> None:
    """Make this process's mount namespace and pivot into the minimal root (see above)."""
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing propagates back to the host
    new = os.path.join(base, ".root")
    os.makedirs(new, exist_ok=True)
    mount("simloop-root", new, "tmpfs", 0, "size=4m,mode=755")
    for d in SYSTEM:
        if os.path.islink(d):
            os.symlink(os.readlink(d), new + d)
        elif os.path.isdir(d):
            os.makedirs(new + d)
            bind_readonly(d, new + d)
    for f in MASKED:
        if os.path.isfile(new + f):
            mount("/dev/null", new + f, None, MS_BIND)
    for d in ("/dev/shm", "/proc", "/tmp", "/var/tmp", "/.old"):
        os.makedirs(new + d, exist_ok=True)
    for name in DEVICES:
        if os.path.exists(f"/dev/{name}"):
            open(f"{new}/dev/{name}", "w").close()
            mount(f"/dev/{name}", f"{new}/dev/{name}", None, MS_BIND)
    os.symlink("/proc/self/fd", f"{new}/dev/fd")
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"{new}/dev/{name}")
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        mount(
            "simloop-tmp", new + d, "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmpfs_bytes},mode=1777"
        )
    os.makedirs(new + base, exist_ok=True)
    mount(
        "simloop-disk",
        new + base,
        "tmpfs",
        MS_NOSUID | MS_NODEV,
        f"size={disk_bytes},mode=700,uid={uid},gid={gid}",
    )
    for sub in ("work", "home", "tmp"):
        os.mkdir(f"{new}{base}/{sub}", 0o700)
        os.chown(f"{new}{base}/{sub}", uid, gid)
    for path in visible:  # parents before their children: a child may lie in a parent's bind
        os.makedirs(new + path, exist_ok=True)
        bind_readonly(path, new + path)
    os.chdir(new)
    number = PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(f"no pivot_root number for {os.uname().machine}")
    _check(_libc.syscall(number, b".", b".old"), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.old", MNT_DETACH), "umount /.old")
    os.rmdir("/.old")
    if readonly:
        mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(f"{base}/work")


def main(argv: list[str]) -> int:
    if len(argv) < 6 or argv[5] not in ("ro", "rw"):
        print(
            "usage: sandbox_root.py BASE TMPFS_BYTES DISK_BYTES UID GID ro|rw [VISIBLE ...]",
            file=sys.stderr,
        )
        return 2
    base, tmpfs_bytes, disk_bytes, uid, gid, ro, *visible = argv
    try:
        build(base, int(tmpfs_bytes), int(disk_bytes), int(uid), int(gid), ro == "ro", visible)
    except (OSError, ValueError) as e:
        print(f"simloop-sandbox: {e}", file=sys.stderr)
        return 1
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sys.stdin.read()  # until simloop closes the pipe, or dies
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
