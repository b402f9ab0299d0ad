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

Only the standard library, and no site packages (`-I -S`): it runs before anything else in a
command's start, once per command (~15 ms, about twice the bash it replaces).
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys

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


def install() -> None:
    """Install the filter on this process (and everything it will start)."""
    prog = program()
    raw = b"".join(struct.pack("HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(raw, len(raw))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(prog), ctypes.cast(buf, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                           ctypes.c_ulong]  # fmt: skip
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


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
