"""The processes a job starts, as one list (the plan; nothing here starts or prints one):
`--dry-run` prints it (`launch/deploy/dry_run.py`), the local launcher starts the servers in
it (`launch/deploy/local.py`), and `simloop gke render` puts each server's command into its
pod's plan (`launch/deploy/gke.py`).

    procs = job_processes(cfg, "train-agent", ["agent", "simulator"], run_dir)

A job's list holds, for every model role it needs a server for (`<role>.server_url` unset),
one entry per planned replica of the role's server (`agent_serve`, `sim_serve`): with
`serve.backend` `vllm` the exact `build_vllm_command` argv and `build_vllm_env` environment,
with `jax` the `simloop serve` argv; then the job's own process (the trainer, on its planned
chips). Secrets never appear: the admin token reaches a local server through its environment
when it starts, not through this list.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from launch.deploy.chips import SERVE_ROLE, ChipPlan, ProcessPlan, config_plan, server_env
from rl.data.rundir import CONFIG

ADMIN_TOKEN_ENV = "SIMLOOP_ADMIN_TOKEN"
"""Where `simloop serve` reads its admin token (or `--admin-token-file`); never a flag."""
SERVER_URLS_ENV = "SIMLOOP_SERVER_URLS"
"""JSON `{role: [url, ...]}`: servers someone else started (the GKE pod entry); a job whose
environment has it connects to them instead of starting its own."""


def external_servers() -> dict[str, list[str]]:
    """`$SIMLOOP_SERVER_URLS`: the roles whose servers someone else started, and their URLs."""
    return json.loads(os.environ.get(SERVER_URLS_ENV) or "{}")


TRAIN_JOB_ROLE = {"train-agent": "policy_train", "train-sim": "sim_train"}
"""Jobs that train -> the chip-plan role their own process runs as."""


@dataclass(frozen=True)
class PlannedProcess:
    """One process a job would start."""

    role: str
    """Its chip-plan role (`agent_serve`, `policy_train`, ...) or, off the plan, the job."""
    replica: int
    host: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    """Set on top of the environment it inherits."""
    port: int | None = None
    """HTTP port of a server; None: none, or a free one chosen at start."""
    kind: str = "serve"
    """`serve`, `train` or `job`."""
    model_role: str | None = None
    """`agent` / `simulator` for servers."""

    def line(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in sorted(self.env.items()))
        port = "-" if self.port is None else str(self.port)
        return (
            f"{self.role}[{self.replica}] host={self.host} port={port} "
            f"env: {env or '-'} cmd: {' '.join(self.command)}"
        )


def host_name(plan: ChipPlan, host: int, hostnames: Sequence[str] | None = None) -> str:
    if hostnames is not None:
        return hostnames[host]
    return "localhost" if plan.accelerator.hosts == 1 else f"host-{host}"


def vllm_model_dir(cfg, model_role: str, run_dir: str | Path) -> Path:
    """The HF directory a vLLM server of `model_role` starts from: the role's `hf_path` when
    it serves those weights unchanged (no `weights`), else `<run>/serving/<role>-hf`, which
    the job writes before starting the server (`launch.deploy.local.write_vllm_model`)."""
    role = getattr(cfg, model_role)
    if role.weights is None and role.hf_path is not None:
        return Path(role.hf_path)
    return Path(run_dir) / "serving" / f"{model_role}-hf"


def serve_command(
    role: str,
    run_dir: str | os.PathLike,
    *,
    port: int = 0,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
    config_path: str | None = None,
) -> list[str]:
    """The `simloop serve` argv of a local server for `role` (its config: the run
    directory's, or `config_path`)."""
    config = config_path or str(Path(run_dir) / CONFIG)
    return [python, "-m", "launch", "serve", "--config", config, "--role", role,
            "--port", str(port), *extra_args]  # fmt: skip


def local_server_args(
    cfg, role: str, run_dir: Path, admin_token: str | None = None, *, publishes: bool = False
) -> list[str]:
    """`simloop serve` flags of a job's local server for `role`. Its KV cache holds one context
    (decode attends over the whole cache): the agent's episode context
    (`orchestrator.max_context_tokens`), the simulator's prompt
    (`env.shell.simulated.max_context_tokens`, when set). With `admin_token` (or `publishes`)
    the server accepts weight loads from under the run directory (a trainer publishes policy
    versions)."""
    if role == "agent":
        args = ["--max-seq-len", str(cfg.orchestrator.max_context_tokens)]
    else:
        n = cfg.env.shell.simulated.max_context_tokens
        args = [] if n is None else ["--max-seq-len", str(n)]
    if admin_token is not None or publishes:  # the token goes in the environment
        args += ["--checkpoint-root", str(Path(run_dir).absolute())]
    return args


def server_processes(
    cfg,
    model_role: str,
    run_dir: str | Path,
    *,
    plan: ChipPlan | None = None,
    hostnames: Sequence[str] | None = None,
    bind: str = "127.0.0.1",
    fixed_ports: bool = False,
    python: str = sys.executable,
    config_path: str | None = None,
    publishes: bool = False,
) -> list[PlannedProcess]:
    """The server processes of `model_role` (one per planned replica). `fixed_ports`: a jax
    server takes its planned port (on GKE) instead of a free one (a local run); vLLM servers
    always take theirs. `publishes`: a trainer will publish weights to it."""
    serve_role = SERVE_ROLE[model_role]
    plan = plan or config_plan(cfg)
    planned = plan.role(serve_role)
    backend = cfg.serve.backend_of(model_role)
    if backend == "vllm":
        from serving.vllm.launcher import build_vllm_command, build_vllm_env

        if not planned:
            raise ValueError(
                f"serve.backend=vllm for the {model_role} needs its servers in the chip plan: "
                f"add {serve_role} to chips.roles (or set {model_role}.server_url)"
            )
        model_dir = vllm_model_dir(cfg, model_role, run_dir)
        return [
            PlannedProcess(
                serve_role,
                p.replica,
                host_name(plan, p.host, hostnames),
                build_vllm_command(model_dir, p, cfg.vllm, served_model_name=model_role, host=bind),
                build_vllm_env(p, base_env={}),
                p.http_port,
                "serve",
                model_role,
            )
            for p in planned
        ]
    out = []
    for p in planned or [None]:
        port = p.http_port if (p is not None and fixed_ports) else None
        args = local_server_args(cfg, model_role, Path(run_dir), publishes=publishes)
        if bind != "127.0.0.1":
            args += ["--host", bind]
        command = serve_command(
            model_role,
            run_dir,
            port=port or 0,
            extra_args=args,
            python=python,
            config_path=config_path,
        )
        env = {} if p is None else server_env(p)
        if port is not None:
            env["SIMLOOP_HTTP_PORT"] = str(port)
        host = "localhost" if p is None else host_name(plan, p.host, hostnames)
        out.append(
            PlannedProcess(
                serve_role,
                0 if p is None else p.replica,
                host,
                command,
                env,
                port,
                "serve",
                model_role,
            )
        )
    return out


def job_processes(
    cfg, job: str, roles: Sequence[str], run_dir: str | Path, *, publishes: Sequence[str] = ()
) -> list[PlannedProcess]:
    """Everything `simloop JOB` starts: the servers of `roles` it starts itself (those
    without a `server_url`; `publishes`: roles a trainer publishes to), then the job's own
    process, on its trainer role's planned chips (`TRAIN_JOB_ROLE`)."""
    plan = config_plan(cfg)
    out: list[PlannedProcess] = []
    for role in roles:
        if getattr(cfg, role).server_url is None:
            out += server_processes(cfg, role, run_dir, plan=plan, publishes=role in publishes)
    run_dir = str(run_dir)
    command = [sys.executable, "-m", "launch", job, "--config", f"{run_dir}/config.yaml",
               "--out", run_dir]  # fmt: skip
    trainers: list[ProcessPlan] = plan.role(TRAIN_JOB_ROLE.get(job, ""))
    if not trainers:
        return [*out, PlannedProcess(job, 0, "localhost", command, {}, None, "job")]
    return out + [
        PlannedProcess(
            p.role, p.replica, host_name(plan, p.host), command, dict(p.env), None, "train"
        )
        for p in trainers
    ]
