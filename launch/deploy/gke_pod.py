"""The GKE pod entry: start this TPU host's share of the chip plan (`simloop gke render` puts
it in every pod of the JobSet; docs/architecture.md §5).

How a pod finds its processes. Kubernetes sets JOB_COMPLETION_INDEX in every pod of an
Indexed Job; with one Job per JobSet that index is the TPU host index 0 .. hosts-1 (JobSet
also names pod i `<name>-slice-0-<i>`, the name the planner's TPU_PROCESS_ADDRESSES use). The
container runs this launcher around `gke.command`:

    python -m launch.deploy.gke_pod --plan /config/plan.json -- <gke.command ...>
    # on any machine, to see what host 3 would run (plan.json from the rendered ConfigMap):
    python -m launch.deploy.gke_pod --plan plan.json --host-index 3 -- \
        bash -c 'env | grep -E "TPU|SIMLOOP"'

It reads `plan.json`, takes `hosts[JOB_COMPLETION_INDEX]`, and starts each process planned
there, with that process's environment: the planner's TPU_* variables, SIMLOOP_ROLE and
SIMLOOP_PROCESS_KIND (servers also SIMLOOP_HTTP_PORT). A process runs its own `command` when
the plan gives one (servers: `vllm serve ...`), else `gke.command`, which may dispatch on the
role (a `bash -c` case); trainers find the servers in SIMLOOP_SERVER_URLS. Servers start first,
`vllm.start_stagger_s` apart. The pod succeeds when its trainers do (its servers are then
stopped) and fails as soon as any of its processes fails, which fails the Job and lets JobSet
restart the slice (up to `gke.max_restarts`). Hosts that only serve keep serving until the
Job's successPolicy (the hosts that train, all succeeded) ends them.

The process contract on the pods. A trainer role that spans several hosts
(`configs/gke-v6e-32.yaml`: policy_train on pods 0-3, sim_train on pods 4-5) is one JAX job
of one process per pod, and each of those processes starts with `launch/distributed.py`'s
variables, as the local launcher would set them: SIMLOOP_COORDINATOR is the group's first pod
(its DNS name, `<name>-slice-0-<i>.<name>`) at the group's own port (`chips.tpu_port_base` +
process groups + k: clear of every TPU process and HTTP port), SIMLOOP_NUM_PROCESSES the
group's pods, SIMLOOP_PROCESS_ID the pod's rank in the group (0 on the first). `simloop`
passes exactly those to `jax.distributed.initialize` (nothing is detected from the TPU
variables), and process 0 alone writes the run directory. TPU_WORKER_ID and
TPU_WORKER_HOSTNAMES are narrowed to the same group, so libtpu sees the same job. A role on
one host (every server; a trainer of one host's chips or fewer) gets none of the three: a
one-process job. The values are in `plan.json`, where `simloop gke render` put them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from launch.deploy.gke import EXIT_USAGE, LIBTPU_LOCKFILE, PLAN_PATH


def _log(msg: str) -> None:
    print(f"simloop launcher: {msg}", file=sys.stderr, flush=True)


def _failure(running: list[tuple[dict, subprocess.Popen]]) -> int | None:
    """The exit status of the first process that failed, if any did."""
    for proc, p in running:
        rc = p.poll()
        if rc is not None and rc != 0:
            _log(f"{proc['role']} (rank {proc['rank']}) failed with exit status {rc}")
            return rc
    return None


def _outcome(running: list[tuple[dict, subprocess.Popen]]) -> int | None:
    """0 when the host's work is done, an exit status when it failed, None while it runs."""
    rc = _failure(running)
    if rc is not None:
        return rc
    trainers = [p for proc, p in running if proc["kind"] != "serve"]
    if trainers:
        if all(p.poll() == 0 for p in trainers):
            return 0
        for proc, p in running:
            if proc["kind"] == "serve" and p.poll() is not None:
                _log(f"server {proc['role']} exited while trainers still run")
                return 1
        return None
    return 0 if all(p.poll() is not None for _, p in running) else None


def _stop(running: list[tuple[dict, subprocess.Popen]], grace_s: float) -> None:
    """SIGTERM every process group still running, SIGKILL what is left after `grace_s`."""
    alive = [p for _, p in running if p.poll() is None]
    for p in alive:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:  # exited since the poll: nothing to stop
            pass
    deadline = time.monotonic() + grace_s
    for p in alive:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def launch(
    plan: dict[str, Any],
    host_index: int,
    command: Sequence[str],
    *,
    lockfile: str | None = None,
    grace_s: float = 20.0,
    poll_s: float = 0.5,
    should_stop: Callable[[], bool] = lambda: False,
) -> int:
    """Run `command` once per process of host `host_index` in `plan` (a `plan.json`) and
    return the host's exit status (see the module docstring). `lockfile`: libtpu's lock to
    clear first (only in a fresh pod, where no live process can hold it)."""
    hosts = plan["hosts"]
    if not 0 <= host_index < len(hosts):
        _log(f"host index {host_index} is outside the plan's {len(hosts)} host(s)")
        return EXIT_USAGE
    procs = hosts[host_index]["processes"]
    if not procs:
        _log(f"nothing is planned on host {host_index}; exiting")
        return 0
    if plan.get("tpu") and lockfile is not None:
        # A lock left by an earlier libtpu process makes the first one here fail to start.
        Path(lockfile).unlink(missing_ok=True)
    servers = [p for p in procs if p["kind"] == "serve"]
    ordered = servers + [p for p in procs if p["kind"] != "serve"]
    running: list[tuple[dict, subprocess.Popen]] = []
    try:
        for i, proc in enumerate(ordered):
            if 0 < i < len(servers):
                deadline = time.monotonic() + float(plan.get("stagger_s", 0.0))
                while time.monotonic() < deadline:
                    if should_stop():
                        return 128 + signal.SIGTERM
                    if (rc := _failure(running)) is not None:
                        return rc
                    time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
            chips = ",".join(map(str, proc["chips"]))
            job = (
                f", process {proc['rank']} of {proc['group_size']}, coordinator "
                f"{proc['coordinator']}"
                if proc.get("coordinator")
                else ""
            )
            _log(
                f"host {host_index}: {proc['role']} [{proc['kind']}] rank {proc['rank']}, "
                f"chips {chips}{job}"
            )
            env = {**os.environ, **proc["env"]}
            argv = list(proc.get("command") or command)
            running.append((proc, subprocess.Popen(argv, env=env, start_new_session=True)))
        while True:
            if should_stop():
                _log("terminated; stopping this host's processes")
                return 128 + signal.SIGTERM
            rc = _outcome(running)
            if rc is not None:
                return rc
            time.sleep(poll_s)
    finally:
        _stop(running, grace_s)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m launch.deploy.gke_pod [--plan FILE] [--host-index N] -- COMMAND...` (in a pod)."""
    import argparse

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print(
            "usage: python -m launch.deploy.gke_pod [--plan FILE] [--host-index N] -- COMMAND...",
            file=sys.stderr,
        )
        return EXIT_USAGE
    cut = argv.index("--")
    own, command = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(prog="python -m launch.deploy.gke_pod", description=__doc__)
    parser.add_argument("--plan", default=PLAN_PATH, help="plan.json from `gke render`")
    parser.add_argument("--host-index", type=int, help="default: $JOB_COMPLETION_INDEX")
    parser.add_argument("--grace-s", type=float, default=20.0, help="SIGTERM -> SIGKILL wait")
    args = parser.parse_args(own)
    if not command:
        print("python -m launch.deploy.gke_pod: give the command after --", file=sys.stderr)
        return EXIT_USAGE
    index, lockfile = args.host_index, None
    if index is None:
        if "JOB_COMPLETION_INDEX" not in os.environ:
            print(
                "python -m launch.deploy.gke_pod: JOB_COMPLETION_INDEX is not set (it is in a "
                "pod of an Indexed Job); pass --host-index elsewhere",
                file=sys.stderr,
            )
            return EXIT_USAGE
        index = int(os.environ["JOB_COMPLETION_INDEX"])
        lockfile = LIBTPU_LOCKFILE  # in the pod: nothing else can be using the chips yet
    plan = json.loads(Path(args.plan).read_text())
    # Kubernetes stops a pod with SIGTERM: pass it on to every process group, then exit.
    return launch_until_signalled(
        plan,
        index,
        command,
        lockfile=lockfile,
        grace_s=args.grace_s,
        signals=(signal.SIGTERM, signal.SIGINT),
    )


def launch_until_signalled(
    plan: dict[str, Any],
    host_index: int,
    command: Sequence[str],
    *,
    lockfile: str | None,
    grace_s: float,
    signals: Sequence[signal.Signals],
) -> int:
    """`launch`, stopping the host's processes (and returning 128 + SIGTERM) when one of
    `signals` arrives; the previous handlers are restored after."""
    stop = {"requested": False}

    def on_signal(signum, frame):
        stop["requested"] = True

    previous = {s: signal.signal(s, on_signal) for s in signals}
    try:
        return launch(
            plan,
            host_index,
            command,
            lockfile=lockfile,
            grace_s=grace_s,
            should_stop=lambda: stop["requested"],
        )
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    raise SystemExit(main())
