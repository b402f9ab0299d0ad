"""`simloop gke render`: the Kubernetes manifests that run a simloop job on a GKE TPU slice, and
the pod entry (`gke_pod`) that starts each host's share of the chip plan (docs/architecture.md §5).

    simloop gke render --config configs/gke-v6e-32.yaml > jobset.yaml
    simloop gke render --config configs/gke-v6e-8.yaml --output jobset.yaml
    kubectl apply -f jobset.yaml

Three documents, each checked against `launch.deploy.k8s_schema` before anything is printed:

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

Each pod runs `launch/deploy/gke_pod.py` around `gke.command`: it starts the processes the
plan puts on its host: each server with its own command (`vllm serve ...` with
`serve.backend: vllm`, `simloop serve ...` with `jax`: the commands `--dry-run` lists, from
`launch.deploy.processes`), every other process with `gke.command`.

GKE describes the whole slice to every TPU pod (TPU_WORKER_ID and TPU_WORKER_HOSTNAMES on
multi-host slices); each process gets those, and the host-bounds pair TPU_HOST_BOUNDS /
TPU_CHIPS_PER_HOST_BOUNDS, set to its own group's values, so libtpu and
`jax.distributed.initialize()` see the role's process group, not the slice. A trainer group
of several hosts also gets the planner's SIMLOOP_COORDINATOR / SIMLOOP_NUM_PROCESSES /
SIMLOOP_PROCESS_ID (`launch/distributed.py`), which agree with those: the coordinator is the
group's first pod, TPU_WORKER_HOSTNAMES[0], and the process id is TPU_WORKER_ID. One-host
slices address their processes as localhost.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
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
    from launch.deploy.chips import PlanError, config_plan, parse_accelerator

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
    """Everything one process starts with: the planner's env (with the multi-process
    contract for a trainer on several hosts), its role, and the slice-wide variables of GKE's
    TPU webhook narrowed to the process's own group."""
    env = dict(proc.env)
    env["SIMLOOP_ROLE"] = proc.role
    env["SIMLOOP_REPLICA"] = str(proc.replica)
    env["SIMLOOP_PROCESS_KIND"] = proc.kind
    if acc.is_tpu:
        peers = env["TPU_PROCESS_ADDRESSES"].split(",")
        env["TPU_WORKER_ID"] = str(proc.rank)
        env["TPU_WORKER_HOSTNAMES"] = ",".join(a.rsplit(":", 1)[0] for a in peers)
        env["TPU_HOST_BOUNDS"] = env["TPU_PROCESS_BOUNDS"]
        env["TPU_CHIPS_PER_HOST_BOUNDS"] = env["TPU_CHIPS_PER_PROCESS_BOUNDS"]
    return env


def server_commands(
    cfg,
    plan,
    *,
    hostnames: Sequence[str] | None = None,
    run_dir: str | None = None,
    config_path: str = f"{CONFIG_DIR}/config.yaml",
) -> tuple[dict[tuple[str, int], Any], dict[str, list[str]]]:
    """The planned servers' processes (`launch.deploy.processes.server_processes`, the list
    `--dry-run` prints) by (role, replica), and each model role's server URLs. Servers bind
    to all interfaces on a multi-host slice (the trainer is on another host; hostNetwork on
    the cluster's private network), to loopback on one host. `hostnames`, `run_dir` and
    `config_path` default to the pods' (`pod_hostname`, `gke.mount_path`, the ConfigMap's
    config); the TPU VM workers give theirs (`launch.deploy.tpu_worker`)."""
    from launch.deploy.chips import SERVE_ROLE
    from launch.deploy.processes import server_processes, vllm_model_dir

    acc = plan.accelerator
    if hostnames is None:
        hostnames = [pod_hostname(cfg.gke.name, h) for h in range(acc.hosts)]
    if run_dir is None:
        run_dir = cfg.gke.mount_path
    bind = "0.0.0.0" if acc.hosts > 1 else "127.0.0.1"
    out: dict[tuple[str, int], Any] = {}
    urls: dict[str, list[str]] = {}
    for model_role, serve_role in SERVE_ROLE.items():
        if not plan.role(serve_role):
            continue
        role = getattr(cfg, model_role)
        if cfg.serve.backend_of(model_role) == "vllm" and (
            vllm_model_dir(cfg, model_role, "/") != Path(role.hf_path or "")
        ):
            raise GkeError(
                f"{model_role}: vLLM servers started from the chip plan (GKE pods, TPU VM "
                f"workers) start from {model_role}.hf_path (an HF directory every host has, "
                f"e.g. on the volume under {cfg.gke.mount_path}); set it, and unset "
                f"{model_role}.weights (publish trained weights instead)"
            )
        procs = server_processes(
            cfg,
            model_role,
            run_dir,
            plan=plan,
            hostnames=hostnames,
            bind=bind,
            fixed_ports=True,
            python="python",
            config_path=config_path,
            publishes=model_role == "agent",
        )
        for p in procs:
            out[p.role, p.replica] = p
        host = {pp.replica: pp.host for pp in plan.role(serve_role)}
        urls[model_role] = [
            f"http://{'127.0.0.1' if acc.hosts == 1 else hostnames[host[p.replica]]}:{p.port}"
            for p in procs
        ]
    return out, urls


def host_layout(
    cfg,
    plan,
    *,
    hostnames: Sequence[str] | None = None,
    run_dir: str | None = None,
    config_path: str = f"{CONFIG_DIR}/config.yaml",
) -> dict[str, Any]:
    """`plan.json`: per host (= pod), the processes the launcher starts there. A server's
    `command` is the one `--dry-run` lists for it; trainers run `gke.command`, with the
    servers' URLs in `SIMLOOP_SERVER_URLS` (so a job connects to them, starting none), and,
    in a group of several hosts, their `coordinator` (`SIMLOOP_COORDINATOR`). The keyword
    arguments are `server_commands`'."""
    from launch.deploy.processes import SERVER_URLS_ENV

    acc = plan.accelerator
    if hostnames is None:
        hostnames = [pod_hostname(cfg.gke.name, h) for h in range(acc.hosts)]
    servers, urls = server_commands(
        cfg, plan, hostnames=hostnames, run_dir=run_dir, config_path=config_path
    )
    hosts = []
    for h in range(acc.hosts):
        procs = []
        for p in plan.processes:
            if p.host != h:
                continue
            proc = {
                "role": p.role,
                "kind": p.kind,
                "replica": p.replica,
                "rank": p.rank,
                "group_size": p.group_size,
                "coordinator": p.coordinator,
                "chips": list(p.chips),
                "http_port": p.http_port,
                "env": process_env(p, acc),
            }
            server = servers.get((p.role, p.replica))
            if server is not None:
                # This machine's checkout is no path in the image, where simloop is installed.
                proc["env"].update({k: v for k, v in server.env.items() if k != "PYTHONPATH"})
                proc["command"] = server.command
            elif p.kind == "train" and urls:
                proc["env"][SERVER_URLS_ENV] = json.dumps(urls, sort_keys=True)
            procs.append(proc)
        hosts.append({"index": h, "hostname": hostnames[h], "processes": procs})
    return {
        "accelerator": acc.name,
        "tpu": acc.is_tpu,
        "stagger_s": cfg.vllm.start_stagger_s,
        "hosts": hosts,
    }


def gke_processes(cfg) -> list:
    """Every process the GKE pods of `cfg` start, as `PlannedProcess`es (what
    `--dry-run --target gke` prints): each server with its own command, each trainer with
    `gke.command`, with the environment `plan.json` gives it."""
    from launch.deploy.processes import PlannedProcess

    out = []
    for host in host_layout(cfg, chip_plan(cfg))["hosts"]:
        for p in host["processes"]:
            out.append(
                PlannedProcess(
                    p["role"],
                    p["replica"],
                    host["hostname"],
                    list(p.get("command") or cfg.gke.command),
                    dict(p["env"]),
                    p["http_port"],
                    p["kind"],
                )
            )
    return out


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


def _admin_token_env(cfg, plan) -> list[dict[str, Any]]:
    """SIMLOOP_ADMIN_TOKEN from `gke.admin_token_secret` when the plan starts JAX servers (their
    /admin routes need it, and the trainer publishes with it); GkeError when it is unset."""
    from launch.deploy.chips import SERVE_ROLE
    from launch.deploy.processes import ADMIN_TOKEN_ENV

    jax_roles = [
        m
        for m, serve in SERVE_ROLE.items()
        if plan.role(serve) and cfg.serve.backend_of(m) == "jax"
    ]
    if not jax_roles:
        return []
    secret = cfg.gke.admin_token_secret
    if secret is None:
        raise GkeError(
            f"the plan starts JAX servers ({', '.join(jax_roles)}; serve.backend: jax), whose "
            "weights are published through /admin with a token: create a Secret (kubectl "
            "create secret generic simloop-admin --from-literal=token=$(openssl rand -hex 16)) "
            "and set gke.admin_token_secret to its name, or use serve.backend: vllm"
        )
    ref = {"secretKeyRef": {"name": secret, "key": "token"}}
    return [{"name": ADMIN_TOKEN_ENV, "valueFrom": ref}]


def render(cfg) -> list[dict[str, Any]]:
    """The Service, ConfigMap and JobSet of `cfg`, validated (GkeError / ManifestError)."""
    from launch.config.loading import dump_config
    from launch.deploy import k8s_schema
    from rl.data.rundir import CONFIG

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
        "data": {CONFIG: dump_config(cfg), "plan.json": json.dumps(layout, indent=1)},
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
    token_env = _admin_token_env(cfg, plan)
    container = {
        "name": "simloop",
        "image": g.image,
        "command": ["python", "-m", "launch.deploy.gke_pod", "--plan", PLAN_PATH, "--", *g.command],
        "env": [
            {"name": "SIMLOOP_PLAN", "value": PLAN_PATH},
            {"name": "SIMLOOP_CONFIG", "value": f"{CONFIG_DIR}/config.yaml"},
            {"name": "SIMLOOP_JOBSET", "value": g.name},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            *token_env,
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
    from launch.deploy.k8s_schema import ManifestError

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
