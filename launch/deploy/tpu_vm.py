"""`simloop tpu-vm`: create, reach, drive and delete a Cloud TPU VM through `gcloud`.

    simloop tpu-vm create --config configs/v6e-8.yaml --tpu_vm.project my-proj --dry-run
    simloop tpu-vm ssh    --config configs/v6e-8.yaml [--worker 1]
    simloop tpu-vm run    --config configs/v6e-8.yaml -- python -m launch demo --out runs/demo
    simloop tpu-vm run    --config configs/v6e-32.yaml --planned    # the chip plan, per worker
    simloop tpu-vm copy   --config configs/v6e-8.yaml --remote runs/demo --local runs/demo
    simloop tpu-vm delete --config configs/v6e-8.yaml

The VM comes from the config (`tpu_vm:` and `chips.accelerator`). `--dry-run` prints the gcloud
commands, one per line, and runs nothing, so it works on any machine (no gcloud needed).

Quoting: every value reaches gcloud as its own argv element (no local shell). The one text a
shell reads is the remote `--command` of `run`, `cd REPO_DIR && CMD...`: each word of CMD and
the repo dir are quoted, so `;`, `$(...)` and quotes stay literal on the workers (for pipes or
`&&` there, run `-- bash -c '...'`). `copy` accepts plain remote paths only, because older scp
hands the remote path to a remote shell.

`run` runs its command once on every worker, as given. `run --planned` runs the chip plan
instead: each worker starts `python -m launch.deploy.tpu_worker` (`launch/deploy/tpu_worker.py`),
which starts the processes the plan puts on its host, servers with their own commands and each
trainer with the command after `--` (default `tpu_vm.command`), SIMLOOP_ROLE naming its role.
The workers read `--config` (and the overrides given here) from their own checkout at
`tpu_vm.repo_dir`, so give the config's path relative to it.

The process contract on the workers. A trainer role that spans several hosts
(`configs/v6e-32.yaml`: policy_train on workers 0-3, sim_train on workers 4-5) is one JAX job
of one process per worker, and each of those processes starts with `launch/distributed.py`'s
variables, as the local launcher would set them: SIMLOOP_COORDINATOR is the group's first
worker, by its internal IP address (the metadata server's `worker-network-endpoints`, which
JAX itself reads on a TPU VM; worker hostnames need not resolve across workers), at the
group's own port (`chips.tpu_port_base` + process groups + k: clear of every TPU process and
HTTP port), SIMLOOP_NUM_PROCESSES the group's workers and SIMLOOP_PROCESS_ID the worker's rank
in the group (0 on the first). `simloop` passes exactly those to `jax.distributed.initialize`
(nothing is detected from the TPU VM's metadata, which describes the whole slice), and process
0 alone writes the run directory. The TPU variables (TPU_PROCESS_ADDRESSES, TPU_WORKER_ID,
TPU_WORKER_HOSTNAMES, the bounds) name the same group. A role on one host (every server; a
trainer of one host's chips or fewer) gets none of the three: a one-process job.
`simloop plan-chips --config ... --format env` prints each process's values, `host-<i>`
standing for worker i's address. The workers share no disk: each process of a trainer group
reads the job's data on its own worker, and servers on other workers load published weights by
path, so a multi-host run's data and `--out` belong on storage that every worker mounts at the
same path.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from launch.config.schema import SimloopConfig
from launch.deploy.chips import PlanError, parse_accelerator

EXIT_USAGE = 2
ACTIONS = ("create", "ssh", "run", "copy", "delete")
_TPUS = ("gcloud", "compute", "tpus")

# Remote paths given to scp: older scp (the legacy protocol) lets the remote shell expand them.
_PLAIN_REMOTE = re.compile(r"^(~/)?[A-Za-z0-9._/+=@,-]+$")
_WORKER = re.compile(r"^(all|0|[1-9][0-9]*)$")
# Which action each flag applies to; it is an error anywhere else (not silently ignored).
_FLAG_ACTIONS = {"worker": ("ssh", "run", "copy"), "remote": ("copy",), "local": ("copy",)}
WORKER_ENTRY = ("python", "-m", "launch.deploy.tpu_worker")
"""What `run --planned` starts on every worker, around the trainers' command."""


class TpuVmError(ValueError):
    """A request that cannot be turned into gcloud commands; the message says what would."""


@dataclass(frozen=True)
class TpuVmOptions:
    """The per-call choices of `simloop tpu-vm` (the VM itself comes from the config)."""

    worker: str | None = None
    """`0`, `1`, ... or `all`; default `0` (ssh, copy) or `all` (run)."""
    remote: str | None = None
    """copy: the directory on worker 0; relative paths start at `tpu_vm.repo_dir`."""
    local: str | None = None
    """copy: where it lands here."""
    command: tuple[str, ...] | None = None
    """run: the command's words (what came after `--`)."""
    planned: bool = False
    """run: each worker starts its share of the chip plan (`launch.deploy.tpu_worker`), the
    trainers running `command` (default `tpu_vm.command`)."""
    config_path: str | None = None
    """run --planned: the `--config` path, which the workers read relative to `repo_dir`."""
    overrides: tuple[str, ...] = ()
    """run --planned: the dotted overrides given here, which the workers apply too."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The tpu-vm flags; `action` and `--config` come from the CLI itself."""
    p.add_argument("--dry-run", action="store_true", help="print the gcloud commands, run none")
    p.add_argument("--worker", help="ssh/copy: worker index (default 0); run: default all")
    p.add_argument("--remote", metavar="DIR", help="copy: directory on worker 0 (under repo_dir)")
    p.add_argument("--local", metavar="DIR", help="copy: where the directory lands here")
    p.add_argument(
        "--planned",
        action="store_true",
        help="run: each worker starts the chip plan's processes on its host, the "
        "trainers running the command (default tpu_vm.command)",
    )
    # Filled by `launch.cli.main` with the words after `--` (None when there is no `--`).
    p.set_defaults(remote_command=None)


def _location(cfg: SimloopConfig) -> list[str]:
    vm = cfg.tpu_vm
    out = ["--zone", vm.zone]
    if vm.project is not None:
        out += ["--project", vm.project]
    return out


def _check_value(field: str, value: str | None) -> None:
    """Config strings that become gcloud flag values: a leading `-` would read as a flag."""
    if value is not None and (not value or value.startswith("-")):
        raise TpuVmError(
            f"tpu_vm.{field}={value!r} is invalid: a non-empty value not starting with '-'"
        )


def _tpu_accelerator(cfg: SimloopConfig) -> str:
    name = cfg.chips.accelerator
    try:
        acc = parse_accelerator(name)
    except PlanError as e:
        raise TpuVmError(f"chips.accelerator: {e}") from e
    if not acc.is_tpu:
        raise TpuVmError(
            f"chips.accelerator={name!r} is not a TPU: a TPU VM needs a TPU type such as "
            "v6e-8, v6e-32, v5litepod-8 or v5p-8 (set chips.accelerator in the config or "
            "--chips.accelerator v6e-8)"
        )
    return name


def _worker(cfg: SimloopConfig, worker: str, allow_all: bool = True) -> str:
    allowed = "0, 1, ... (a worker index) or all" if allow_all else "0, 1, ... (a worker index)"
    if not _WORKER.match(worker) or (worker == "all" and not allow_all):
        raise TpuVmError(f"--worker {worker!r} is invalid: {allowed}")
    if worker == "all":
        return worker
    try:
        acc = parse_accelerator(cfg.chips.accelerator)
    except PlanError:
        return worker  # not a type we know the hosts of: gcloud checks the index
    if acc.is_tpu and int(worker) >= acc.hosts:
        last = "0" if acc.hosts == 1 else f"0..{acc.hosts - 1}"
        raise TpuVmError(
            f"--worker {worker} is not a worker of {acc.name}: it has {acc.hosts} host(s), "
            f"so one of {last}" + (" or all" if allow_all else "")
        )
    return worker


def remote_dir(repo_dir: str) -> str:
    """`repo_dir` for a remote shell: quoted, except a leading `~` that must stay expandable."""
    if repo_dir == "~":
        return "~"
    if repo_dir.startswith("~/"):
        rest = repo_dir[2:]
        return "~/" + shlex.quote(rest) if rest else "~"
    return shlex.quote(repo_dir)


def remote_command(repo_dir: str, words: Sequence[str]) -> str:
    """The `--command` text of `run`: `cd REPO_DIR && WORD...`, every user piece quoted."""
    return f"cd {remote_dir(repo_dir)} && {shlex.join(words)}"


def _remote_path(repo_dir: str, path: str) -> str:
    if not path.startswith(("/", "~")):
        path = repo_dir.rstrip("/") + "/" + path
    if not _PLAIN_REMOTE.match(path) or path.startswith("-"):
        raise TpuVmError(
            f"--remote resolves to {path!r}, which is not a plain path: letters, digits and "
            ". _ - / + = @ , only, optionally starting with ~/ (relative paths start at "
            "tpu_vm.repo_dir)"
        )
    return path


def _create(cfg: SimloopConfig) -> list[str]:
    vm = cfg.tpu_vm
    acc = _tpu_accelerator(cfg)
    if vm.queued:
        argv = [*_TPUS, "queued-resources", "create", vm.name, "--node-id", vm.name]
        argv += [*_location(cfg), "--accelerator-type", acc]
        argv += ["--runtime-version", vm.runtime_version]
    else:
        argv = [*_TPUS, "tpu-vm", "create", vm.name, *_location(cfg)]
        argv += ["--accelerator-type", acc, "--version", vm.runtime_version]
    argv += ["--spot"] if vm.spot else []
    argv += ["--reserved"] if vm.reserved else []
    for flag, value in (
        ("--network", vm.network),
        ("--subnetwork", vm.subnetwork),
        ("--service-account", vm.service_account),
    ):
        if value is not None:
            argv += [flag, value]
    return argv


def _check_flags(action: str, opts: TpuVmOptions) -> None:
    for name, actions in _FLAG_ACTIONS.items():
        if getattr(opts, name) is not None and action not in actions:
            raise TpuVmError(f"--{name} applies to {', '.join(actions)} only, not to {action}")
    if opts.command is not None and action != "run":
        raise TpuVmError(f"only run takes a command after '--' (got one for {action})")
    if opts.planned and action != "run":
        raise TpuVmError(f"--planned applies to run only, not to {action}")


def _planned_words(cfg: SimloopConfig, opts: TpuVmOptions) -> list[str]:
    """`run --planned`'s remote command: the worker entry, given the config as here, around the
    trainers' command."""
    command = opts.command or cfg.tpu_vm.command
    if not command:
        raise TpuVmError(
            "run --planned needs the trainers' command: after '--' (e.g. -- simloop train-agent "
            "--config configs/v6e-8.yaml --out runs/NAME) or in tpu_vm.command"
        )
    if not opts.config_path:
        raise TpuVmError(
            "run --planned needs --config: every worker plans the chips from the same file "
            "(its path relative to tpu_vm.repo_dir)"
        )
    return [*WORKER_ENTRY, "--config", opts.config_path, *opts.overrides, "--", *command]


def build_commands(action: str, cfg: SimloopConfig, opts: TpuVmOptions) -> list[list[str]]:
    """The gcloud argv lists that carry out `action`, in order. Raises `TpuVmError`."""
    if action not in ACTIONS:
        raise TpuVmError(f"unknown action {action!r}: one of {', '.join(ACTIONS)}")
    _check_flags(action, opts)
    vm = cfg.tpu_vm
    for field in ("project", "runtime_version", "network", "subnetwork", "service_account"):
        _check_value(field, getattr(vm, field))
    if not vm.repo_dir or vm.repo_dir.startswith("-"):
        raise TpuVmError(
            f"tpu_vm.repo_dir={vm.repo_dir!r} is invalid: a directory such as ~/simloop"
        )
    ssh = [*_TPUS, "tpu-vm", "ssh", vm.name, *_location(cfg)]
    if action == "create":
        return [_create(cfg)]
    if action == "ssh":
        return [[*ssh, f"--worker={_worker(cfg, opts.worker or '0')}"]]
    if action == "run":
        words = _planned_words(cfg, opts) if opts.planned else opts.command
        if not words:
            raise TpuVmError(
                "run needs the command after '--', e.g. simloop tpu-vm run -- python -m launch "
                "demo --out runs/demo"
            )
        worker = _worker(cfg, opts.worker or "all")
        return [[*ssh, f"--worker={worker}", "--command", remote_command(vm.repo_dir, words)]]
    if action == "copy":
        if not opts.remote or not opts.local:
            missing = " and ".join(f for f in ("--remote", "--local") if not getattr(opts, f[2:]))
            raise TpuVmError(
                f"copy needs {missing}: --remote DIR (on the worker; relative to "
                "tpu_vm.repo_dir) --local DIR (here)"
            )
        if opts.local.startswith("-"):
            raise TpuVmError(f"--local {opts.local!r} is invalid: a path not starting with '-'")
        source = f"{vm.name}:{_remote_path(vm.repo_dir, opts.remote)}"
        worker = _worker(cfg, opts.worker or "0", allow_all=False)
        scp = [*_TPUS, "tpu-vm", "scp", "--recurse", source, opts.local]
        return [[*scp, *_location(cfg), f"--worker={worker}"]]
    if vm.queued:  # delete; --force also deletes the queued resource's running node
        return [
            [*_TPUS, "queued-resources", "delete", vm.name, *_location(cfg), "--force", "--quiet"]
        ]
    return [[*_TPUS, "tpu-vm", "delete", vm.name, *_location(cfg), "--quiet"]]


def next_steps(cfg: SimloopConfig, config_path: str | None) -> str:
    """What to do after `create`: putting the code on the workers is left to the user."""
    vm = cfg.tpu_vm
    where = " ".join(shlex.quote(a) for a in _location(cfg))
    cfg_flag = f" --config {shlex.quote(config_path)}" if config_path else ""
    clone = f"git clone REPO_URL {remote_dir(vm.repo_dir)}"
    lines = []
    if vm.queued:
        lines += [
            f"Requested queued resource {vm.name}; it waits for capacity. Its node is up when",
            f"this says ACTIVE:  gcloud compute tpus queued-resources describe {vm.name} {where}",
            "Then:",
        ]
    else:
        lines += [f"TPU VM {vm.name} ({cfg.chips.accelerator}) is up. Next steps:"]
    lines += [
        f"  put the project at {vm.repo_dir} on every worker, e.g.",
        f"    gcloud compute tpus tpu-vm ssh {vm.name} {where} --worker=all "
        f"--command {shlex.quote(clone)}",
        f"  simloop tpu-vm run{cfg_flag} -- pip install -e '.[tpu]'",
        f"  simloop tpu-vm run{cfg_flag} -- python -m launch train-agent --out runs/NAME ...",
        f"  simloop tpu-vm run{cfg_flag} --planned   (multi-host: the chip plan, per worker)",
        f"  simloop tpu-vm copy{cfg_flag} --remote runs/NAME --local runs/NAME",
        f"  simloop tpu-vm delete{cfg_flag}    (the VM is billed until it is deleted)",
    ]
    return "\n".join(lines)


def execute(commands: Sequence[Sequence[str]]) -> int:
    """Run the commands in order (stdio inherited, so output streams); stop at a failure."""
    if shutil.which(commands[0][0]) is None:
        print(
            "simloop tpu-vm: `gcloud` is not on PATH. Install the Google Cloud SDK "
            "(https://cloud.google.com/sdk/docs/install), run `gcloud init`, then retry "
            "(or add --dry-run to only print the commands).",
            file=sys.stderr,
        )
        return EXIT_USAGE
    for argv in commands:
        try:
            rc = subprocess.run(list(argv), check=False).returncode
        except KeyboardInterrupt:  # the child got the same Ctrl-C; exit like a shell does
            return 130
        if rc != 0:
            return rc
    return 0


def run(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    if args.action is None:
        print(f"simloop tpu-vm: say which action: {', '.join(ACTIONS)}", file=sys.stderr)
        return EXIT_USAGE
    words = getattr(args, "remote_command", None)
    opts = TpuVmOptions(
        worker=args.worker,
        remote=args.remote,
        local=args.local,
        command=tuple(words) if words is not None else None,
        planned=getattr(args, "planned", False),
        config_path=args.config,
        overrides=tuple(getattr(args, "overrides", ())),
    )
    try:
        commands = build_commands(args.action, cfg, opts)
    except TpuVmError as e:
        print(f"simloop tpu-vm {args.action}: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.dry_run:
        for argv in commands:
            print(shlex.join(argv))
        return 0
    rc = execute(commands)
    if rc == 0 and args.action == "create":
        print(next_steps(cfg, args.config))
    return rc
