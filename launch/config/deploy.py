"""Deployment settings (no JAX): the chip plan, TPU VMs, GKE and vllm-tpu servers.

chips:   which accelerator, and how many chips each role gets (`simloop plan-chips`)
tpu_vm:  the gcloud TPU VM the job runs on (`simloop tpu-vm ...`)
gke:     the JobSet that runs it on GKE (`simloop gke render`)

`VllmConfig` (how `vllm serve` starts) lives with the launcher in `serving/vllm/config.py`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rl import validate

_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def _dns_name(obj: object, name: str, max_len: int = 40) -> None:
    value = getattr(obj, name)
    validate.require(
        isinstance(value, str) and _NAME.match(value) and len(value) <= max_len,
        obj,
        name,
        f"lower-case letters, digits and '-', starting with a letter, at most {max_len} "
        "characters (it becomes a cloud resource / Kubernetes name)",
    )


@dataclass(frozen=True)
class ChipsConfig:
    """How the chips of an accelerator are split between roles (docs/architecture.md §5).

    Roles ending in `_serve` are inference servers (an HTTP port and their own compile cache
    each); the others are trainers. `cpu-N` plans N fake CPU devices the same way, which is
    what the tests and the CPU demo run."""

    accelerator: str = "cpu-8"
    """`v6e-1|4|8` (one host), `v6e-16 ... v6e-256` (4-chip hosts), `v5litepod-1|4|8`,
    `v5p-8 ...` (named by TensorCores: 2 per chip), or `cpu-N`."""
    roles: dict[str, int] = field(
        default_factory=lambda: {"policy_train": 4, "agent_serve": 2, "sim_serve": 2}
    )
    """Role -> chips, in the order chips are handed out."""
    replicas: dict[str, int] = field(default_factory=dict)
    """Server role -> how many processes of `roles[role]` chips each (default 1), e.g.
    `{agent_serve: 2}` with `roles.agent_serve: 1`: two 1-chip agent servers."""
    tpu_port_base: int = 8476
    """`TPU_PROCESS_PORT` of the first process; each process group gets the next one, and
    after those each trainer group spanning several hosts its JAX coordinator's port
    (`SIMLOOP_COORDINATOR`)."""
    http_port_base: int = 8000
    """HTTP port of the first server; each server gets the next one."""
    cache_dir: str = "/tmp/simloop/xla_cache"
    """Servers compile into `<cache_dir>/<role>` (`VLLM_XLA_CACHE_PATH`): one cache each."""

    def __post_init__(self) -> None:
        validate.text(self, "accelerator", allowed="a name such as v6e-8 or cpu-8")
        validate.require(
            isinstance(self.roles, dict) and self.roles,
            self,
            "roles",
            "a non-empty mapping role -> chips",
        )
        for role, n in self.roles.items():
            validate.require(
                isinstance(role, str) and re.match(r"^[a-z][a-z0-9_]*$", role),
                self,
                "roles",
                "role names are lower-case identifiers",
                value=role,
            )
            validate.require(
                validate.is_int(n) and n >= 1,
                self,
                f"roles.{role}",
                "a positive number of chips",
                value=n,
            )
        validate.require(
            isinstance(self.replicas, dict), self, "replicas", "a mapping server role -> count"
        )
        for role, r in self.replicas.items():
            validate.require(
                role in self.roles and (role == "serve" or str(role).endswith("_serve")),
                self,
                "replicas",
                f"a server role of chips.roles {sorted(self.roles)}",
                value=role,
            )
            validate.require(
                validate.is_int(r) and r >= 1,
                self,
                f"replicas.{role}",
                "a positive number of processes",
                value=r,
            )
        validate.integer(
            self,
            "tpu_port_base",
            "http_port_base",
            low=1024,
            high=65000,
            allowed="a port number in [1024, 65000]",
        )


@dataclass(frozen=True)
class TpuVmConfig:
    """A Cloud TPU VM (or queued resource) created and driven through gcloud."""

    name: str = "simloop"
    project: str | None = None
    """None: gcloud's configured project."""
    zone: str = "us-east5-b"
    runtime_version: str = "v2-alpha-tpuv6e"
    """The TPU software version (v6e: v2-alpha-tpuv6e)."""
    queued: bool = False
    """Create through a queued resource (waits for capacity) instead of directly."""
    spot: bool = False
    reserved: bool = False
    network: str | None = None
    subnetwork: str | None = None
    service_account: str | None = None
    repo_dir: str = "~/simloop"
    """Where the project lives on every worker (`run` commands start there)."""
    command: list[str] | None = None
    """What `simloop tpu-vm run --planned` runs for each trainer process of the chip plan
    (when no command follows `--`), from `repo_dir`, with SIMLOOP_ROLE naming its role, so it
    may dispatch on it (a `bash -c` case, as `gke.command` does); servers run their own."""

    def __post_init__(self) -> None:
        _dns_name(self, "name")
        validate.require(
            self.command is None
            or (self.command and all(isinstance(a, str) for a in self.command)),
            self,
            "command",
            "a non-empty list of strings, or null",
        )
        validate.require(
            re.match(r"^[a-z]+-[a-z]+[0-9]+-[a-z]$", str(self.zone)),
            self,
            "zone",
            "a Cloud zone such as us-east5-b",
        )
        validate.require(
            not (self.spot and self.reserved),
            self,
            "spot",
            "false when reserved is true (pick one)",
        )


@dataclass(frozen=True)
class GkeConfig:
    """A JobSet for a GKE TPU node pool: one pod per TPU host of the slice."""

    name: str = "simloop"
    namespace: str = "default"
    image: str = "us-docker.pkg.dev/MY_PROJECT/simloop/simloop:latest"
    """The image every pod runs: build it from the repository's Dockerfile (docs/tpu-gke.md)."""
    command: list[str] = field(
        default_factory=lambda: [
            "simloop",
            "train-agent",
            "--config",
            "/config/config.yaml",
            "--out",
            "/ckpt/run",
        ]
    )
    """What every pod runs (the chip-plan environment is set around it)."""
    bucket: str | None = None
    """GCS bucket mounted at `mount_path` through the gcsfuse CSI driver..."""
    pvc: str | None = None
    """... or an existing PersistentVolumeClaim (one of the two; `gke render` needs one)."""
    mount_path: str = "/ckpt"
    service_account: str | None = None
    """Kubernetes service account (Workload Identity for the bucket)."""
    backoff_limit: int = 0
    """Pod failures tolerated before the job fails (restarts resume from checkpoints)."""
    max_restarts: int = 3
    """JobSet-level restarts of the whole slice."""
    admin_token_secret: str | None = None
    """An existing Kubernetes Secret whose key `token` is the admin token of the pods' JAX
    servers (`serve.backend: jax`): every process gets it as SIMLOOP_ADMIN_TOKEN, so the
    trainer can publish weights to them (`kubectl create secret generic NAME
    --from-literal=token=$(openssl rand -hex 16)`). Required when the plan starts JAX servers;
    vLLM servers take weights through their worker extension instead."""

    def __post_init__(self) -> None:
        if self.admin_token_secret is not None:
            _dns_name(self, "admin_token_secret", 253)
        _dns_name(self, "name", 40)
        _dns_name(self, "namespace", 63)
        validate.require(
            self.bucket is None or self.pvc is None,
            self,
            "bucket",
            "unset when gke.pvc is set (one volume)",
        )
        validate.require(
            str(self.mount_path).startswith("/"), self, "mount_path", "an absolute path"
        )
        validate.integer(self, "backoff_limit", "max_restarts", low=0)
        validate.require(
            self.command and all(isinstance(a, str) for a in self.command),
            self,
            "command",
            "a non-empty list of strings",
        )
