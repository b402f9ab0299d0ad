"""One job as several JAX processes: the environment that tells a process who it is, joining
the JAX distributed runtime from it, and a local launcher that starts a job's processes on
this machine (`--run.processes N`).

The contract, the same wherever the processes come from (the local launcher; on a pod slice,
one process per host of a trainer role, started by `simloop tpu-vm run --planned` or a GKE pod
with the values the chip planner gives it, `launch/deploy/chips.py`):

    SIMLOOP_COORDINATOR=HOST:PORT     process 0's address; it serves the coordination service
    SIMLOOP_NUM_PROCESSES=N           how many processes the job has
    SIMLOOP_PROCESS_ID=I              this one, 0..N-1

A process with these set calls `jax.distributed.initialize` before anything touches a device
(`initialize`), so each one's mesh spans every process's devices. On CPU the collectives run
over gloo (TCP on this machine). Process 0 writes the run directory (`rl.data.rundir`'s writer
flag); the others compute the same steps and write nothing there.

A process that dies stops sending heartbeats; the coordination service then ends every other
process within `run.heartbeat_timeout_s` (they abort with "another task died"), so a job never
hangs on a dead peer, and a rerun of the same command resumes from the last checkpoint. The
local launcher reports which process failed first and how, and stops the rest if they linger.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

COORDINATOR_ENV = "SIMLOOP_COORDINATOR"
PROCESSES_ENV = "SIMLOOP_NUM_PROCESSES"
PROCESS_ID_ENV = "SIMLOOP_PROCESS_ID"
LOGS = "processes"
"""`<run>/processes/process-<i>.log`: the output of the local launcher's processes 1..N-1
(process 0 writes to the terminal); `<run>/processes/pids`: `<i> <pid>` per process."""
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
"""The XLA flag that gives a CPU process its fake devices (a local process here, a `cpu-N`
plan's process in `launch/deploy/chips.py`)."""


@dataclass(frozen=True)
class ProcessEnv:
    """Who this process is in its job (read from the environment contract above)."""

    coordinator: str
    num_processes: int
    process_id: int

    def environ(self) -> dict[str, str]:
        return {
            COORDINATOR_ENV: self.coordinator,
            PROCESSES_ENV: str(self.num_processes),
            PROCESS_ID_ENV: str(self.process_id),
        }


def from_environ(environ: Mapping[str, str]) -> ProcessEnv | None:
    """This process's place in a multi-process job, or None when the environment names none
    (a one-process job). ValueError naming the variable when the contract is broken."""
    if PROCESSES_ENV not in environ:
        for name in (COORDINATOR_ENV, PROCESS_ID_ENV):
            if name in environ:
                raise ValueError(
                    f"{name} is set but {PROCESSES_ENV} is not: set all three of "
                    f"{COORDINATOR_ENV}, {PROCESSES_ENV}, {PROCESS_ID_ENV}"
                )
        return None
    raw = {k: environ.get(k, "") for k in (COORDINATOR_ENV, PROCESSES_ENV, PROCESS_ID_ENV)}
    try:
        n = int(raw[PROCESSES_ENV])
        i = int(raw[PROCESS_ID_ENV])
    except ValueError:
        raise ValueError(
            f"{PROCESSES_ENV}={raw[PROCESSES_ENV]!r} and {PROCESS_ID_ENV}={raw[PROCESS_ID_ENV]!r} "
            "must be integers (N >= 1 and 0 <= ID < N)"
        ) from None
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"{PROCESSES_ENV}={n}, {PROCESS_ID_ENV}={i}: need N >= 1, 0 <= ID < N")
    host, _, port = raw[COORDINATOR_ENV].rpartition(":")
    if n > 1 and (not host or not port.isdigit()):
        raise ValueError(
            f"{COORDINATOR_ENV}={raw[COORDINATOR_ENV]!r} is invalid: HOST:PORT of process 0"
        )
    return ProcessEnv(raw[COORDINATOR_ENV], n, i) if n > 1 else None


def initialize(penv: ProcessEnv, *, heartbeat_timeout_s: int, init_timeout_s: int = 300) -> None:
    """Join the job's JAX runtime (before any device is touched) and make process 0 the only
    writer of the run directory."""
    import jax

    from rl.data import rundir

    # Cross-process collectives of the CPU backend (the TPU's go over ICI/DCN regardless).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=penv.coordinator,
        num_processes=penv.num_processes,
        process_id=penv.process_id,
        initialization_timeout=init_timeout_s,
        heartbeat_timeout_seconds=heartbeat_timeout_s,
    )
    rundir.set_writer(penv.process_id == 0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_environments(
    n: int, devices_per_process: int, environ: Mapping[str, str], port: int | None = None
) -> list[dict[str, str]]:
    # port None: a free one now; 0: shown as `127.0.0.1:PORT` (a dry run picks none)
    """The environment of each of `n` local processes: the contract, and XLA_FLAGS giving each
    `devices_per_process` fake CPU devices (the user's other XLA flags kept)."""
    coordinator = "127.0.0.1:PORT" if port == 0 else f"127.0.0.1:{port or free_port()}"
    flags = merge_xla_flags(
        environ.get("XLA_FLAGS", ""), f"{DEVICE_COUNT_FLAG}={devices_per_process}"
    )
    return [
        {
            **environ,
            **ProcessEnv(coordinator, n, i).environ(),
            "XLA_FLAGS": flags,
            "JAX_PLATFORMS": "cpu",
        }
        for i in range(n)
    ]


def merge_xla_flags(inherited: str, planned: str) -> str:
    """A planned process's XLA_FLAGS: the plan's (its fake-device count) after the ones the
    user set for the whole run (dumps, optimisation levels), whose own device count, if any,
    the plan replaces."""
    kept = [f for f in inherited.split() if not f.startswith(DEVICE_COUNT_FLAG)]
    return " ".join([*kept, *planned.split()])


def run_local(
    argv: Sequence[str], n: int, devices_per_process: int, out: Path | None, *, grace_s: float
) -> int:
    """Run `simloop ARGV` as `n` local processes of one job and wait for them: 0 when all
    exit 0; else the first failure's exit code, after the others ended (the runtime ends them
    within the heartbeat timeout; those still alive `grace_s` later are killed)."""
    envs = local_environments(n, devices_per_process, os.environ)
    logs = (Path(out) if out else Path.cwd()) / LOGS
    logs.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "launch", *argv]
    procs: list[subprocess.Popen] = []
    files = []
    coordinator = envs[0][COORDINATOR_ENV]
    print(
        f"simloop: {n} processes x {devices_per_process} devices, coordinator {coordinator} "
        f"(processes 1..{n - 1} log to {logs}/)",
        flush=True,
    )
    try:
        for i, env in enumerate(envs):
            if i == 0:
                procs.append(subprocess.Popen(cmd, env=env))
                continue
            f = open(logs / f"process-{i}.log", "wb")  # noqa: SIM115 (closed below)
            files.append(f)
            procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT))
        (logs / "pids").write_text("".join(f"{i} {p.pid}\n" for i, p in enumerate(procs)))
        return _wait(procs, logs, grace_s)
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                p.kill()
        return 130
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in files:
            f.close()


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited {code}"


def _wait(procs: list[subprocess.Popen], logs: Path, grace_s: float) -> int:
    first: tuple[int, int] | None = None  # (process id, exit code) of the first failure
    deadline = None
    while True:
        codes = [p.poll() for p in procs]
        for i, code in enumerate(codes):
            if code not in (None, 0) and first is None:
                first = (i, code)
                deadline = time.monotonic() + grace_s
        if all(c is not None for c in codes):
            break
        if deadline is not None and time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            break
        time.sleep(0.05)
    if first is None:
        return 0
    i, code = first
    where = "its output is above" if i == 0 else f"its log: {logs}/process-{i}.log"
    others = [f"{j} {_how(p.returncode)}" for j, p in enumerate(procs) if j != i]
    print(
        f"simloop: process {i} of {len(procs)} {_how(code)} first ({where}); the others "
        f"then ended ({', '.join(others)}). Run the same command again to resume from the "
        "last checkpoint.",
        file=sys.stderr,
        flush=True,
    )
    return code if code > 0 else 128 - code


def dry_run_rows(argv: Sequence[str], n: int, devices_per_process: int | None) -> list[dict] | None:
    """What the local launcher would start: each process's id, host, coordinator, global
    device indices, command and the environment it adds (None: the plan does not split)."""
    cmd = ["python", "-m", "launch", *[a for a in argv if a != "--dry-run"]]
    if n == 1:
        return [
            {
                "process_id": 0,
                "host": "127.0.0.1",
                "coordinator": None,
                "devices": None,
                "command": cmd,
                "env": {},
            }
        ]
    if devices_per_process is None:
        return None
    envs = local_environments(n, devices_per_process, {}, port=0)
    rows = []
    for i, env in enumerate(envs):
        first = i * devices_per_process
        rows.append(
            {
                "process_id": i,
                "host": "127.0.0.1",
                "coordinator": env[COORDINATOR_ENV],
                "devices": list(range(first, first + devices_per_process)),
                "command": cmd,
                "env": env,
            }
        )
    return rows


def format_rows(rows: list[dict], fmt: str) -> str:
    if fmt == "json":
        return json.dumps({"processes": rows}, indent=1)
    return "\n".join(
        f"process {r['process_id']} on {r['host']} devices {r['devices'] or 'all'} "
        f"coordinator {r['coordinator'] or '-'}: "
        + " ".join(f"{k}={v}" for k, v in sorted(r["env"].items()))
        + " "
        + " ".join(r["command"])
        for r in rows
    )
