"""A server started by a job ends with that job, however the job ends.

A job stops the servers it started when it exits normally; one killed outright (SIGKILL, or a
multi-process job's process 0 aborted by the distributed runtime when a peer died) cannot, and
its servers, each in a session of its own, would keep their ports, memory and chips. So the
job names itself in the server's environment (`PARENT_PID_ENV`), and the server asks Linux to
send it SIGTERM, which it handles as a shutdown, when that parent goes away
(`prctl(PR_SET_PDEATHSIG)`), and exits at once if the parent is already gone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Mapping

PARENT_PID_ENV = "SIMLOOP_PARENT_PID"
_PR_SET_PDEATHSIG = 1


# XLA flags for the servers alone (simloop's engine and vLLM), in place of the job's own; a
# planned fake-device count is kept. A server compiles a few programs and runs them thousands of
# times, a trainer of a short job compiles many and runs each a few times, so the two can want
# different optimisation levels. Unset: servers get the job's XLA_FLAGS.
SERVER_XLA_FLAGS_ENV = "SIMLOOP_SERVER_XLA_FLAGS"
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a server this process starts and owns: it ends with this process, and its
    XLA_FLAGS are `$SIMLOOP_SERVER_XLA_FLAGS` (plus `env`'s device count) where that is set."""
    out = {**env, PARENT_PID_ENV: str(os.getpid())}
    own = os.environ.get(SERVER_XLA_FLAGS_ENV)
    if own is not None:
        count = [f for f in out.get("XLA_FLAGS", "").split() if f.startswith(_DEVICE_COUNT_FLAG)]
        out["XLA_FLAGS"] = " ".join([*own.split(), *count])
        if not out["XLA_FLAGS"]:
            del out["XLA_FLAGS"]
    return out


def die_with_parent(environ: Mapping[str, str] = os.environ) -> bool:
    """Arrange SIGTERM for this process when the parent named in `PARENT_PID_ENV` dies (Linux;
    elsewhere nothing); SystemExit(1) when it is already gone. True when armed."""
    raw = environ.get(PARENT_PID_ENV)
    if not raw or not sys.platform.startswith("linux"):
        return False
    try:
        parent = int(raw)
    except ValueError:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        return False
    # The parent may have died before the request above: then this process was re-parented.
    if os.getppid() != parent:
        print(
            f"the job that started this server (pid {parent}) is gone; exiting",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(1)
    return True
