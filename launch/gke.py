"""`simloop gke render`: the Kubernetes manifests that run a simloop job on a GKE TPU slice, and
the in-pod launcher that starts each host's share of the chip plan (DESIGN.md §5).

    simloop gke render --config configs/gke-v6e-32.yaml > jobset.yaml
    simloop gke render --config configs/gke-v6e-8.yaml --output jobset.yaml
    kubectl apply -f jobset.yaml

Three documents, each checked against `launch.k8s_schema` before anything is printed:

    Service    headless (clusterIP: None) and named like the JobSet's `network.subdomain`; it
               selects the JobSet's pods, so pod i resolves as <name>-slice-0-<i>.<name>.
               (The JobSet controller creates the same Service when none exists; it leaves
               an existing one alone.)
    ConfigMap  `config.yaml` (the resolved config) and `plan.json` (the chip plan, per host),
               mounted read-only at /config.
    JobSet     one replicatedJob `slice` holding one Indexed Job with one pod per TPU host
               (parallelism = completions = hosts) on the node pool labelled with the slice's
               `gke-tpu-accelerator` / `gke-tpu-topology`, `google.com/tpu` = chips per
               host, hostNetwork, and the checkpoint volume at `gke.mount_path` (a GCS bucket
               through the gcsfuse CSI driver, or an existing PVC).

How a pod finds its processes. Kubernetes sets JOB_COMPLETION_INDEX in every pod of an
Indexed Job; with one Job per JobSet that index is the TPU host index 0 .. hosts-1 (JobSet
also names pod i `<name>-slice-0-<i>`, the name the planner's TPU_PROCESS_ADDRESSES use). The
container runs this module's launcher around `gke.command`:

    python -m launch.gke --plan /config/plan.json -- <gke.command ...>
    # on any machine, to see what host 3 would run (plan.json from the rendered ConfigMap):
    python -m launch.gke --plan plan.json --host-index 3 -- bash -c 'env | grep -E "TPU|SIMLOOP"'

It reads `plan.json`, takes `hosts[JOB_COMPLETION_INDEX]`, and starts `gke.command` once per
process planned there, each with that process's environment: the planner's TPU_* variables,
SIMLOOP_ROLE and SIMLOOP_PROCESS_KIND (servers also SIMLOOP_HTTP_PORT), so the command
dispatches on the role (the example configs use a `bash -c` case). Servers start first,
`vllm.start_stagger_s` apart. The pod succeeds when its trainers do (its servers are then
stopped) and fails as soon as any of its processes fails, which fails the Job and lets JobSet
restart the slice (up to `gke.max_restarts`). Hosts that only serve keep serving until the
Job's successPolicy (the hosts that train, all succeeded) ends them.

GKE describes the whole slice to every TPU pod (TPU_WORKER_ID and TPU_WORKER_HOSTNAMES on
multi-host slices); each process gets those, and the host-bounds pair TPU_HOST_BOUNDS /
TPU_CHIPS_PER_HOST_BOUNDS, set to its own group's values, so libtpu and
`jax.distributed.initialize()` see the role's process group, not the slice. One-host slices
address their processes as localhost.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPLICATED_JOB = "slice"
CONFIG_DIR = "/config"
PLAN_PATH = f"{CONFIG_DIR}/plan.json"
GCSFUSE_DRIVER = "gcsfuse.csi.storage.gke.io"
LIBTPU_LOCKFILE = "/tmp/libtpu_lockfile"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
EXIT_USAGE = 2


class GkeError(ValueError):
    """A config that cannot be rendered; the message says what to set."""


def pod_hostname(name: str, index: int) -> str:
    """DNS name of pod `index` of the JobSet's only Job (its headless Service is `name`)."""
    return f"{name}-{REPLICATED_JOB}-0-{index}.{name}"


def chip_plan(cfg):
    """The chip plan of `cfg.chips`, with the pods' DNS names as host names."""
    from launch.chips import PlanError, config_plan, parse_accelerator

    try:
        acc = parse_accelerator(cfg.chips.accelerator)
    except PlanError as e:
        raise GkeError(f"chips.accelerator: {e}") from e
    if not acc.is_tpu or acc.gke_accelerator is None:
        raise GkeError(
            f"chips.accelerator={acc.name!r}: gke render needs a TPU slice such as v6e-8 or "
            "v6e-32 (cpu-N plans run locally)"
        )
    hostnames = None
    if acc.hosts > 1:
        hostnames = [pod_hostname(cfg.gke.name, i) for i in range(acc.hosts)]
    try:
        return config_plan(cfg, accelerator=acc, hostnames=hostnames)
    except PlanError as e:
        raise GkeError(f"chips: {e}") from e


def process_env(proc, acc) -> dict[str, str]:
    """Everything one process starts with: the planner's env, its role, and the slice-wide
    variables of GKE's TPU webhook narrowed to the process's own group."""
    env = dict(proc.env)
    env["SIMLOOP_ROLE"] = proc.role
    env["SIMLOOP_PROCESS_KIND"] = proc.kind
    if acc.is_tpu:
        peers = env["TPU_PROCESS_ADDRESSES"].split(",")
        env["TPU_WORKER_ID"] = str(proc.rank)
        env["TPU_WORKER_HOSTNAMES"] = ",".join(a.rsplit(":", 1)[0] for a in peers)
        env["TPU_HOST_BOUNDS"] = env["TPU_PROCESS_BOUNDS"]
        env["TPU_CHIPS_PER_HOST_BOUNDS"] = env["TPU_CHIPS_PER_PROCESS_BOUNDS"]
    return env


def host_layout(cfg, plan) -> dict[str, Any]:
    """`plan.json`: per host (= pod), the processes the launcher starts there."""
    acc = plan.accelerator
    hosts = []
    for h in range(acc.hosts):
        procs = [
            {
                "role": p.role,
                "kind": p.kind,
                "rank": p.rank,
                "group_size": p.group_size,
                "chips": list(p.chips),
                "http_port": p.http_port,
                "env": process_env(p, acc),
            }
            for p in plan.processes
            if p.host == h
        ]
        hosts.append({"index": h, "hostname": pod_hostname(cfg.gke.name, h), "processes": procs})
    return {
        "accelerator": acc.name,
        "tpu": acc.is_tpu,
        "stagger_s": cfg.vllm.start_stagger_s,
        "hosts": hosts,
    }


def _bucket_name(bucket: str) -> str:
    name = bucket.removeprefix("gs://").rstrip("/")
    if not re.fullmatch(r"[a-z0-9][-_.a-z0-9]{1,220}[a-z0-9]", name):
        raise GkeError(
            f"gke.bucket={bucket!r} is invalid: a Cloud Storage bucket name such as "
            "my-simloop-ckpt (gs:// optional, no path)"
        )
    return name


def _port_name(role: str, port: int) -> str:
    name = re.sub("-+", "-", role.replace("_", "-")).strip("-")[:15].strip("-")
    ok = re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) and re.search("[a-z]", name)
    return name if ok else f"http-{port}"


def _ranges(indexes: Sequence[int]) -> str:
    """[0, 1, 2, 3, 5] -> "0-3,5" (a Job successPolicy's succeededIndexes)."""
    runs: list[list[int]] = []
    for i in sorted(set(indexes)):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def render(cfg) -> list[dict[str, Any]]:
    """The Service, ConfigMap and JobSet of `cfg`, validated (GkeError / ManifestError)."""
    from launch import k8s_schema
    from launch.config import dump_config

    g = cfg.gke
    if g.bucket is None and g.pvc is None:
        raise GkeError(
            "set gke.bucket (a GCS bucket, mounted through the gcsfuse CSI driver) or gke.pvc "
            "(an existing PersistentVolumeClaim): the pods keep checkpoints at "
            f"gke.mount_path={g.mount_path!r}"
        )
    if g.mount_path.rstrip("/") == CONFIG_DIR or g.mount_path.startswith(CONFIG_DIR + "/"):
        raise GkeError(f"gke.mount_path={g.mount_path!r} collides with the config at /config")
    plan = chip_plan(cfg)
    acc = plan.accelerator
    layout = host_layout(cfg, plan)
    labels = {"app.kubernetes.io/name": "simloop", "app.kubernetes.io/instance": g.name}

    def meta(name: str, **extra: Any) -> dict[str, Any]:
        return {"name": name, "namespace": g.namespace, "labels": dict(labels), **extra}

    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(g.name),
        "spec": {
            "clusterIP": "None",
            "selector": {"jobset.sigs.k8s.io/jobset-name": g.name},
            # Peers resolve each other while they start (before any readiness).
            "publishNotReadyAddresses": True,
        },
    }
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta(f"{g.name}-config"),
        "data": {"config.yaml": dump_config(cfg), "plan.json": json.dumps(layout, indent=1)},
    }

    if g.bucket is not None:
        checkpoints = {
            "name": "checkpoints",
            "csi": {
                "driver": GCSFUSE_DRIVER,
                "volumeAttributes": {
                    "bucketName": _bucket_name(g.bucket),
                    # Orbax/tensorstore write objects without directory placeholders.
                    "mountOptions": "implicit-dirs",
                    # hostNetwork pods authenticate with their own KSA only when asked to.
                    "hostNetworkPodKSA": "true",
                },
            },
        }
    else:
        checkpoints = {"name": "checkpoints", "persistentVolumeClaim": {"claimName": g.pvc}}
    servers = sorted({(p.http_port, p.role) for p in plan.processes if p.http_port})
    container = {
        "name": "simloop",
        "image": g.image,
        "command": ["python", "-m", "launch.gke", "--plan", PLAN_PATH, "--", *g.command],
        "env": [
            {"name": "SIMLOOP_PLAN", "value": PLAN_PATH},
            {"name": "SIMLOOP_CONFIG", "value": f"{CONFIG_DIR}/config.yaml"},
            {"name": "SIMLOOP_JOBSET", "value": g.name},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
        ],
        "ports": [
            {"name": _port_name(role, port), "containerPort": port, "protocol": "TCP"}
            for port, role in servers
        ],
        "resources": {
            "requests": {"google.com/tpu": acc.chips_per_host},
            "limits": {"google.com/tpu": acc.chips_per_host},
        },
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "checkpoints", "mountPath": g.mount_path},
        ],
    }
    if not container["ports"]:
        del container["ports"]
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "hostNetwork": True,
        "dnsPolicy": "ClusterFirstWithHostNet",
        "nodeSelector": {
            "cloud.google.com/gke-tpu-accelerator": acc.gke_accelerator,
            "cloud.google.com/gke-tpu-topology": acc.topology,
        },
        "containers": [container],
        "volumes": [
            {"name": "config", "configMap": {"name": f"{g.name}-config"}},
            checkpoints,
        ],
    }
    if g.service_account:
        pod_spec["serviceAccountName"] = g.service_account
    pod_meta: dict[str, Any] = {"labels": dict(labels)}
    if g.bucket is not None:
        pod_meta["annotations"] = {"gke-gcsfuse/volumes": "true"}
    job_spec: dict[str, Any] = {
        "parallelism": acc.hosts,
        "completions": acc.hosts,
        "completionMode": "Indexed",
        "backoffLimit": g.backoff_limit,
    }
    trainer_hosts = sorted({p.host for p in plan.processes if p.kind != "serve"})
    serving_only = {p.host for p in plan.processes} - set(trainer_hosts)
    if trainer_hosts and serving_only:
        # Servers never exit on their own; the Job is done when every training host is.
        job_spec["successPolicy"] = {"rules": [{"succeededIndexes": _ranges(trainer_hosts)}]}
    job_spec["template"] = {"metadata": pod_meta, "spec": pod_spec}
    jobset_meta = meta(g.name)
    if acc.hosts > 1:
        # All pods of the Job on one node pool, i.e. one physical slice joined by ICI.
        jobset_meta["annotations"] = {
            "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"
        }
    jobset = {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": jobset_meta,
        "spec": {
            "failurePolicy": {"maxRestarts": g.max_restarts},
            "network": {
                "enableDNSHostnames": True,
                "subdomain": g.name,
                "publishNotReadyAddresses": True,
            },
            "replicatedJobs": [
                {"name": REPLICATED_JOB, "replicas": 1, "template": {"spec": job_spec}}
            ],
        },
    }
    docs = [service, config_map, jobset]
    for doc in docs:
        k8s_schema.check(doc)
    return docs


def to_yaml(docs: Sequence[dict[str, Any]]) -> str:
    """Documents separated by `---`; multi-line strings (the config) as literal blocks."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def str_block(dumper, data):
        style = "|" if "\n" in data else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)

    Dumper.add_representer(str, str_block)
    return yaml.dump_all(docs, Dumper=Dumper, sort_keys=False, width=4096)


def run(args, cfg) -> int:
    """`simloop gke render [--output FILE]`."""
    from launch.k8s_schema import ManifestError

    if args.action != "render":
        print("simloop gke: say which action: render", file=sys.stderr)
        return EXIT_USAGE
    try:
        text = to_yaml(render(cfg))
    except (GkeError, ManifestError) as e:
        print(f"simloop gke render: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.output:
        Path(args.output).write_text(text)
        print(f"simloop gke render: wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def add_arguments(p) -> None:
    p.add_argument("--output", metavar="FILE", help="write the manifests here (default: stdout)")


# --- the in-pod launcher (`python -m launch.gke`) ------------------------------------------


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
            _log(f"host {host_index}: {proc['role']} [{proc['kind']}] rank {proc['rank']}, "
                 f"chips {chips}")  # fmt: skip
            env = {**os.environ, **proc["env"]}
            running.append((proc, subprocess.Popen(list(command), env=env,
                                                   start_new_session=True)))  # fmt: skip
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
    """`python -m launch.gke [--plan FILE] [--host-index N] -- COMMAND...` (in a pod)."""
    import argparse

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m launch.gke [--plan FILE] [--host-index N] -- COMMAND...",
              file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    cut = argv.index("--")
    own, command = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(prog="python -m launch.gke", description=__doc__)
    parser.add_argument("--plan", default=PLAN_PATH, help="plan.json from `gke render`")
    parser.add_argument("--host-index", type=int, help="default: $JOB_COMPLETION_INDEX")
    parser.add_argument("--grace-s", type=float, default=20.0, help="SIGTERM -> SIGKILL wait")
    args = parser.parse_args(own)
    if not command:
        print("python -m launch.gke: give the command after --", file=sys.stderr)
        return EXIT_USAGE
    index, lockfile = args.host_index, None
    if index is None:
        if "JOB_COMPLETION_INDEX" not in os.environ:
            print("python -m launch.gke: JOB_COMPLETION_INDEX is not set (it is in a pod of an "
                  "Indexed Job); pass --host-index elsewhere", file=sys.stderr)  # fmt: skip
            return EXIT_USAGE
        index = int(os.environ["JOB_COMPLETION_INDEX"])
        lockfile = LIBTPU_LOCKFILE  # in the pod: nothing else can be using the chips yet
    plan = json.loads(Path(args.plan).read_text())
    stop = {"requested": False}

    def on_signal(signum, frame):
        stop["requested"] = True

    # Kubernetes stops a pod with SIGTERM: pass it on to every process group, then exit.
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return launch(plan, index, command, lockfile=lockfile, grace_s=args.grace_s,
                      should_stop=lambda: stop["requested"])  # fmt: skip
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    raise SystemExit(main())
