"""The processes a job starts, as one list: `--dry-run` prints it, the local launcher starts
the servers in it (`launch/deploy/local.py`), and `simloop gke render` puts each server's
command into its pod's plan (`launch/deploy/gke.py`).

    simloop train-agent --config configs/v6e-8.yaml --dry-run --format json

A job's list holds, for every model role it needs a server for (`<role>.server_url` unset),
one entry per planned replica of the role's server (`agent_serve`, `sim_serve`): with
`serve.backend` `vllm` the exact `build_vllm_command` argv and `build_vllm_env` environment,
with `jax` the `simloop serve` argv; then the job's own process (the trainer, on its planned
chips). Secrets never appear: the admin token reaches a local server through its environment
when it starts, not through this list.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from launch.deploy.chips import SERVE_ROLE, ChipPlan, ProcessPlan, config_plan, server_env

SERVER_URLS_ENV = "SIMLOOP_SERVER_URLS"
"""JSON `{role: [url, ...]}`: servers someone else started (the GKE pod entry); a job whose
environment has it connects to them instead of starting its own."""
TRAIN_JOB_ROLE = {"train-agent": "policy_train", "train-sim": "sim_train"}
"""Jobs that train -> the chip-plan role their own process runs as."""
DRY_RUN_OUT = "RUN_DIR"
"""The run directory a dry run without `--out` shows."""


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
        return (f"{self.role}[{self.replica}] host={self.host} port={port} "
                f"env: {env or '-'} cmd: {' '.join(self.command)}")  # fmt: skip


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


def server_processes(cfg, model_role: str, run_dir: str | Path, *, plan: ChipPlan | None = None,
                     hostnames: Sequence[str] | None = None, bind: str = "127.0.0.1",
                     fixed_ports: bool = False, python: str = sys.executable,
                     config_path: str | None = None, publishes: bool = False,
                     ) -> list[PlannedProcess]:  # fmt: skip
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
        return [PlannedProcess(
            serve_role, p.replica, host_name(plan, p.host, hostnames),
            build_vllm_command(model_dir, p, cfg.vllm, served_model_name=model_role, host=bind),
            build_vllm_env(p, base_env={}), p.http_port, "serve", model_role,
        ) for p in planned]  # fmt: skip
    from launch.deploy.local import local_server_args, serve_command

    out = []
    for p in planned or [None]:
        port = p.http_port if (p is not None and fixed_ports) else None
        args = local_server_args(cfg, model_role, Path(run_dir), publishes=publishes)
        if bind != "127.0.0.1":
            args += ["--host", bind]
        command = serve_command(model_role, run_dir, port=port or 0, extra_args=args,
                                python=python, config_path=config_path)  # fmt: skip
        env = {} if p is None else server_env(p)
        if port is not None:
            env["SIMLOOP_HTTP_PORT"] = str(port)
        host = "localhost" if p is None else host_name(plan, p.host, hostnames)
        out.append(PlannedProcess(serve_role, 0 if p is None else p.replica, host, command, env,
                                  port, "serve", model_role))  # fmt: skip
    return out


def job_processes(cfg, job: str, roles: Sequence[str], run_dir: str | Path,
                  *, publishes: Sequence[str] = ()) -> list[PlannedProcess]:  # fmt: skip
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
    return out + [PlannedProcess(p.role, p.replica, host_name(plan, p.host), command,
                                 dict(p.env), None, "train") for p in trainers]  # fmt: skip


def add_dry_run_arguments(p) -> None:
    p.add_argument("--dry-run", action="store_true",
                   help="print the processes this job would start, start nothing")  # fmt: skip
    p.add_argument("--format", choices=["text", "json"], default="text",
                   help="--dry-run output: one process per line, or JSON")  # fmt: skip
    p.add_argument("--target", choices=["local", "gke"], default="local",
                   help="--dry-run: the processes this machine would start, or those the "
                        "GKE pods of the config start (`simloop gke render`'s plan)")  # fmt: skip


def print_dry_run(args, cfg, job: str, roles: Sequence[str], publishes: Sequence[str] = ()) -> int:
    """`--dry-run`: print `job_processes` (text, or `{"processes": [...]}` with
    `--format json`) and return 0. With `--target gke`, the processes the GKE pods start,
    exactly as `simloop gke render` puts them in its plan (the job is `gke.command`)."""
    if getattr(args, "target", "local") == "gke":
        from launch.deploy.gke import gke_processes
        from launch.errors import UsageError

        if job not in cfg.gke.command:
            raise UsageError(
                f"--target gke: the pods run gke.command {' '.join(cfg.gke.command)!r}, not "
                f"`simloop {job}`; dry-run that job (or set gke.command)"
            )
        return print_processes(args, [(None, p) for p in gke_processes(cfg)])
    procs = job_processes(cfg, job, roles, args.out or DRY_RUN_OUT, publishes=publishes)
    return print_processes(args, [(None, p) for p in procs])


def print_processes(args, procs: Sequence[tuple[str | None, PlannedProcess]]) -> int:
    """Print `(stage, process)` pairs as `--format` says (a stage, when given, prefixes the
    line and is a `stage` key in JSON) and return 0."""
    if args.format == "json":
        keys = ("role", "replica", "host", "command", "env", "port")
        rows = [{**({"stage": st} if st else {}), **{k: asdict(p)[k] for k in keys}}
                for st, p in procs]  # fmt: skip
        print(json.dumps({"processes": rows}, indent=1))
    else:
        print("\n".join(f"{st}: {p.line()}" if st else p.line() for st, p in procs))
    return 0
