"""Deployment settings (no JAX): the chip plan, TPU VMs, GKE and vllm-tpu servers.

chips:   which accelerator, and how many chips each role gets (`simloop plan-chips`)
tpu_vm:  the gcloud TPU VM the job runs on (`simloop tpu-vm ...`)
gke:     the JobSet that runs it on GKE (`simloop gke render`)

`VllmConfig` (how `vllm serve` starts) lives with the launcher in `serving/vllm/config.py`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def _bad(cls: str, name: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"{cls}.{name}={value!r} is invalid: {allowed}")


def _port(cls: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1024 <= value <= 65000:
        raise _bad(cls, name, value, "a port number in [1024, 65000]")


def _dns_name(cls: str, name: str, value: object, max_len: int = 40) -> None:
    if not isinstance(value, str) or not _NAME.match(value) or len(value) > max_len:
        raise _bad(
            cls,
            name,
            value,
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
        c = "ChipsConfig"
        if not isinstance(self.accelerator, str) or not self.accelerator:
            raise _bad(c, "accelerator", self.accelerator, "a name such as v6e-8 or cpu-8")
        if not isinstance(self.roles, dict) or not self.roles:
            raise _bad(c, "roles", self.roles, "a non-empty mapping role -> chips")
        for role, n in self.roles.items():
            if not isinstance(role, str) or not re.match(r"^[a-z][a-z0-9_]*$", role):
                raise _bad(c, "roles", role, "role names are lower-case identifiers")
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise _bad(c, f"roles.{role}", n, "a positive number of chips")
        if not isinstance(self.replicas, dict):
            raise _bad(c, "replicas", self.replicas, "a mapping server role -> count")
        for role, r in self.replicas.items():
            if role not in self.roles or not (role == "serve" or str(role).endswith("_serve")):
                raise _bad(
                    c, "replicas", role, f"a server role of chips.roles {sorted(self.roles)}"
                )
            if isinstance(r, bool) or not isinstance(r, int) or r < 1:
                raise _bad(c, f"replicas.{role}", r, "a positive number of processes")
        _port(c, "tpu_port_base", self.tpu_port_base)
        _port(c, "http_port_base", self.http_port_base)


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
        c = "TpuVmConfig"
        _dns_name(c, "name", self.name)
        if self.command is not None and (
            not self.command or not all(isinstance(a, str) for a in self.command)
        ):
            raise _bad(c, "command", self.command, "a non-empty list of strings, or null")
        if not re.match(r"^[a-z]+-[a-z]+[0-9]+-[a-z]$", str(self.zone)):
            raise _bad(c, "zone", self.zone, "a Cloud zone such as us-east5-b")
        if self.spot and self.reserved:
            raise _bad(c, "spot", self.spot, "false when reserved is true (pick one)")


@dataclass(frozen=True)
class GkeConfig:
    """A JobSet for a GKE TPU node pool: one pod per TPU host of the slice."""

    name: str = "simloop"
    namespace: str = "default"
    image: str = "us-docker.pkg.dev/PROJECT/simloop/simloop:latest"
    command: list[str] = field(
        default_factory=lambda: [
            "simloop",
            "train-agent",
            "--config",
            "/config/config.yaml",
            "--out",
            "/ckpt/run",
        ]  # fmt: skip
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
        c = "GkeConfig"
        if self.admin_token_secret is not None:
            _dns_name(c, "admin_token_secret", self.admin_token_secret, 253)
        _dns_name(c, "name", self.name, 40)
        _dns_name(c, "namespace", self.namespace, 63)
        if self.bucket is not None and self.pvc is not None:
            raise _bad(c, "bucket", self.bucket, "unset when gke.pvc is set (one volume)")
        if not str(self.mount_path).startswith("/"):
            raise _bad(c, "mount_path", self.mount_path, "an absolute path")
        for name in ("backoff_limit", "max_restarts"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise _bad(c, name, v, "an integer >= 0")
        if not self.command or not all(isinstance(a, str) for a in self.command):
            raise _bad(c, "command", self.command, "a non-empty list of strings")
