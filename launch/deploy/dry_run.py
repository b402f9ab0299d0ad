"""`--dry-run [--format text|json] [--target local|gke]`: a job's process plan
(`launch/deploy/processes.py`) printed instead of started.

    simloop train-agent --config configs/v6e-8.yaml --dry-run --format json
    simloop train-agent --config configs/gke-v6e-8.yaml --dry-run --target gke

Text is one process per line (`role[replica] host=... port=... env: ... cmd: ...`); JSON is
`{"processes": [...]}`, each with role, replica, host, command, env and port. A job that runs
several stages (the demo) prefixes each with its stage.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict

from launch.deploy.processes import PlannedProcess, job_processes
from launch.errors import UsageError

DRY_RUN_OUT = "RUN_DIR"
"""The run directory a dry run without `--out` shows."""


def add_dry_run_arguments(
    p, *, what: str = "the processes this job would start, start nothing", target: bool = True
) -> None:
    """`--dry-run` (printing `what`) and `--format`; with `target`, also `--target`."""
    p.add_argument("--dry-run", action="store_true", help=f"print {what}")
    p.add_argument(
        "--format",
        choices=["text", "json"],
        default="text",
        help="--dry-run output: one process per line, or JSON",
    )
    if not target:
        return
    p.add_argument(
        "--target",
        choices=["local", "gke"],
        default="local",
        help="--dry-run: the processes this machine would start, or those the "
        "GKE pods of the config start (`simloop gke render`'s plan)",
    )


def print_dry_run(args, cfg, job: str, roles: Sequence[str], publishes: Sequence[str] = ()) -> int:
    """`--dry-run`: print `job_processes` (text, or `{"processes": [...]}` with
    `--format json`) and return 0. With `--target gke`, the processes the GKE pods start,
    exactly as `simloop gke render` puts them in its plan (the job is `gke.command`)."""
    if getattr(args, "target", "local") == "gke":
        from launch.deploy.gke import gke_processes

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
        rows = [
            {**({"stage": st} if st else {}), **{k: asdict(p)[k] for k in keys}} for st, p in procs
        ]
        print(json.dumps({"processes": rows}, indent=1))
    else:
        print("\n".join(f"{st}: {p.line()}" if st else p.line() for st, p in procs))
    return 0
