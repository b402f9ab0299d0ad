"""Run a program under a seccomp filter that refuses new user namespaces: the door to mounts
(and to most kernel exploits) for a process without privileges. `LocalShell` starts each
command through it, as root, before it enters the episode's namespaces and drops to the
episode's uid; the filter is inherited by everything the command starts and cannot be removed.

    python -I -S envs/nouserns.py PROGRAM [ARG ...]

What the filter does (x86-64 and aarch64; any other syscall ABI is refused outright):
- `unshare` and `clone` with CLONE_NEWUSER in their flags fail with EPERM;
- `clone3` fails with ENOSYS (its flags sit in a struct a filter cannot read; the C library
  falls back to `clone`, which the rule above checks);
- everything else is allowed, so the namespaces the sandbox itself makes (network, PID,
  mount, as root) still work. Without a user namespace, an unprivileged process has no
  capability in any mount namespace: `mount`, `umount` and `pivot_root` fail with EPERM.

Only the standard library, and no site packages (`-I -S`). Run this way it costs ~15 ms of
Python start per command, twice the bash it precedes, so `runner()` prefers a 30-line C
program (`_C_SOURCE`, compiled once per machine with the system's `cc` into a private cache)
that installs the same instructions, handed over as hex, in ~1 ms; without a compiler it falls
back to this file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import stat
import struct
import subprocess
import sys
import tempfile

CLONE_NEWUSER = 0x10000000
EPERM, ENOSYS = 1, 38

# BPF opcodes (linux/filter.h, linux/seccomp.h)
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
_ALLOW = 0x7FFF0000
_ERRNO = 0x00050000
_KILL_PROCESS = 0x80000000

# offsets in struct seccomp_data: nr (u32), arch (u32), ip (u64), args (u64[6])
_NR, _ARCH, _ARG0_LOW = 0, 4, 16

ABIS = {
    # machine: (AUDIT_ARCH, unshare, clone, clone3, x32 bit to refuse or 0)
    "x86_64": (0xC000003E, 272, 56, 435, 0x40000000),
    "aarch64": (0xC00000B7, 97, 220, 435, 0),
}

PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2


def program(machine: str | None = None) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions for `machine` (default: this one's)."""
    machine = machine or os.uname().machine  # not `platform`: it imports `re` (13 ms)
    if machine not in ABIS:
        raise OSError(f"no seccomp filter for this machine ({machine}): only {sorted(ABIS)}")
    arch, unshare, clone, clone3, x32 = ABIS[machine]
    eperm, enosys = _ERRNO | EPERM, _ERRNO | ENOSYS
    prog = [
        (_LD_W_ABS, 0, 0, _ARCH),
        (_JEQ_K, 1, 0, arch),
        (_RET_K, 0, 0, _KILL_PROCESS),  # another ABI (i386 on x86-64): its numbers differ
        (_LD_W_ABS, 0, 0, _NR),
    ]
    if x32:
        prog += [(_JGE_K, 0, 1, x32), (_RET_K, 0, 0, eperm)]
    prog += [
        (_JEQ_K, 0, 1, clone3),
        (_RET_K, 0, 0, enosys),
        (_JEQ_K, 1, 0, unshare),
        (_JEQ_K, 0, 3, clone),
        (_LD_W_ABS, 0, 0, _ARG0_LOW),  # the flags, first argument of both
        (_JSET_K, 0, 1, CLONE_NEWUSER),
        (_RET_K, 0, 0, eperm),
        (_RET_K, 0, 0, _ALLOW),
    ]
    return prog


def packed(prog: list[tuple[int, int, int, int]]) -> bytes:
    """`prog` as the kernel's `struct sock_filter` array (u16 code, u8 jt, u8 jf, u32 k)."""
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


def install() -> None:
    """Install the filter on this process (and everything it will start)."""
    prog = program()
    raw = packed(prog)
    buf = ctypes.create_string_buffer(raw, len(raw))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(prog), ctypes.cast(buf, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [
        ctypes.c_int,
        ctypes.c_ulong,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


_C_SOURCE = r"""
/* simloop: install a seccomp filter given as hex (struct sock_filter array), then exec. */
#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

static int nibble(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: nouserns HEX-FILTER PROGRAM [ARG ...]\n");
        return 2;
    }
    size_t n = strlen(argv[1]);
    size_t count = n / (2 * sizeof(struct sock_filter));
    if (count == 0 || count > BPF_MAXINSNS || n != count * 2 * sizeof(struct sock_filter)) {
        fprintf(stderr, "simloop: the user-namespace filter is malformed\n");
        return 126;
    }
    struct sock_filter *prog = calloc(count, sizeof *prog);
    unsigned char *raw = (unsigned char *)prog;
    for (size_t i = 0; prog && i < n / 2; i++) {
        int hi = nibble(argv[1][2 * i]), lo = nibble(argv[1][2 * i + 1]);
        if (hi < 0 || lo < 0) {
            fprintf(stderr, "simloop: the user-namespace filter is malformed\n");
            return 126;
        }
        raw[i] = (unsigned char)(hi * 16 + lo);
    }
    struct sock_fprog fprog = {.len = (unsigned short)count, .filter = prog};
    if (!prog || prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
        prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fprog, 0, 0) != 0) {
        fprintf(stderr, "simloop: the user-namespace filter could not be installed: %s\n",
                strerror(errno));
        return 126;
    }
    execvp(argv[2], argv + 2);
    fprintf(stderr, "simloop: %s: %s\n", argv[2], strerror(errno));
    return 127;
}
"""

PYTHON_RUNNER = (sys.executable, "-I", "-S", os.path.abspath(__file__))
"""argv prefix running a program under the filter through this file (no compiler needed)."""


def _private_dir(path: str) -> bool:
    """Whether `path` is a directory only this user can write: a binary that root will run
    must not be replaceable by anyone else."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (
        stat.S_ISDIR(st.st_mode)
        and st.st_uid == os.geteuid()
        and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def compiled(cache: str | None = None) -> str | None:
    """The compiled runner's path, built on first use into `cache` (default
    `$XDG_CACHE_HOME/simloop` or `~/.cache/simloop`, made 0700) under a name holding the
    source's hash; None when there is no C compiler, it fails, or the cache is not private."""
    if cache is None:
        home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        cache = os.path.join(home, "simloop")
    digest = hashlib.sha256(f"{_C_SOURCE}{os.uname().machine}".encode()).hexdigest()[:16]
    path = os.path.join(cache, f"nouserns-{digest}")
    try:
        os.makedirs(cache, mode=0o700, exist_ok=True)
    except OSError:
        return None
    if not _private_dir(cache):
        return None
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022:
            return path
    except OSError:
        pass
    cc = next((c for c in ("cc", "gcc", "clang") if _which(c)), None)
    if cc is None:
        return None
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        src, out = os.path.join(tmp, "nouserns.c"), os.path.join(tmp, "nouserns")
        with open(src, "w") as f:
            f.write(_C_SOURCE)
        try:
            done = subprocess.run(
                [cc, "-O2", "-o", out, src], capture_output=True, timeout=60, check=False
            )
        except (OSError, subprocess.SubprocessError):
            return None
        if done.returncode != 0 or not os.path.isfile(out):
            return None
        os.chmod(out, 0o755)
        os.replace(out, path)
    return path


def _which(name: str) -> str | None:
    for folder in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep):
        candidate = os.path.join(folder, name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def runner(cache: str | None = None) -> tuple[str, ...]:
    """argv prefix that runs the rest of a command line under the filter: the compiled runner
    with this machine's filter as hex when it can be built, else `PYTHON_RUNNER`."""
    path = compiled(cache)
    if path is None:
        return PYTHON_RUNNER
    return (path, packed(program()).hex())


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: nouserns.py PROGRAM [ARG ...]", file=sys.stderr)
        return 2
    try:
        install()
    except OSError as e:
        print(f"simloop: the user-namespace filter could not be installed: {e}", file=sys.stderr)
        return 126
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        print(f"simloop: {argv[0]}: {e}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
