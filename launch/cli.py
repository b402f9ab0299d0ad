"""The `simloop` command line (also `python -m launch`).

    simloop --help
    simloop config --config configs/demo_cpu.yaml --agent.model.num_layers 4

Every subcommand takes `--config FILE` plus dotted overrides (`--train.lr 1e-4`), and the whole
config is validated before anything imports JAX.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from launch.config.loading import ConfigError, dump_config, load_config
from launch.config.schema import SimloopConfig

EXIT_USAGE = 2

# name -> (one-line help, writes a run directory)
SUBCOMMANDS: dict[str, tuple[str, bool]] = {
    "demo": ("the whole pipeline on CPU with tiny models, in minutes", True),
    "collect": ("run agents in real shells (local / E2B) and store trajectories", True),
    "import": ("convert SWE-agent .traj / chat JSON files into simloop trajectories", True),
    "pretrain-sim": ("the simulator learns bash output on a real-bash utility grammar", True),
    "train-sim": ("supervised fine-tuning of the simulator on real trajectories", True),
    "eval-sim": ("arm (c): replay real commands against the simulator, score fidelity", True),
    "deepen": ("a deeper copy of trained weights that computes the same (block expansion)", False),
    "widen": ("a wider copy of trained weights that computes the same (width expansion)", False),
    "lookup-drill": (
        "teach trained weights to find a line by its content, or count lines (a warm-up)",
        False,
    ),
    "train-agent": ("SFT warm start, then RL in closed loop with the simulator", True),
    "eval-agent": ("the agent in real and simulated shells: success and transfer gap", True),
    "rollout": ("run a rollout job and write trajectories", True),
    "middleware": (
        "Anthropic / OpenAI APIs for off-the-shelf agents, token-exact trajectories",
        True,
    ),
    "harness": (
        "run an unmodified agent (mini-swe-agent) on SWE tasks through the middleware",
        True,
    ),
    "report": ("write a self-contained report.html for a run directory", False),
    "serve": ("the OpenAI/vLLM-compatible inference server (JAX engine)", False),
    "plan-chips": ("plan TPU chip partitions and per-process environments", False),
    "gke": ("render GKE JobSet manifests from a config", False),
    "rehearse": ("a TPU config's whole job on CPU: every pod's processes, tiny models", True),
    "tpu-vm": ("create / ssh / run / copy / delete TPU VMs through gcloud", False),
    "e2b": ("E2B sandbox housekeeping: `sweep` kills orphaned simloop sandboxes", False),
    "config": ("validate a config with its overrides and print it resolved", False),
}

ACTIONS = {
    "gke": ["render"],
    "tpu-vm": ["create", "ssh", "run", "copy", "delete"],
    "e2b": ["sweep"],
}

# name -> the module whose `run(args, cfg)` does it (imported only when that command runs)
MODULES: dict[str, str] = {
    "demo": "launch.jobs.demo",
    "collect": "launch.jobs.collect",
    "import": "launch.jobs.import_trajectories",
    "pretrain-sim": "launch.jobs.pretrain_sim",
    "train-sim": "launch.jobs.train_sim",
    "eval-sim": "launch.jobs.eval_sim",
    "deepen": "launch.jobs.deepen",
    "widen": "launch.jobs.widen",
    "lookup-drill": "launch.jobs.lookup_drill",
    "train-agent": "launch.jobs.train_agent",
    "eval-agent": "launch.jobs.eval_agent",
    "rollout": "launch.jobs.rollout",
    "middleware": "launch.jobs.middleware",
    "harness": "launch.jobs.harness",
    "report": "launch.report.page",
    "serve": "launch.jobs.serve",
    "plan-chips": "launch.deploy.chips",
    "gke": "launch.deploy.gke",
    "rehearse": "launch.jobs.rehearse",
    "tpu-vm": "launch.deploy.tpu_vm",
    "e2b": "launch.jobs.e2b_sweep",
}
# commands that start processes: `--dry-run [--format text|json]` prints them instead
DRY_RUN = (
    "rollout",
    "train-agent",
    "eval-sim",
    "eval-agent",
    "demo",
    "middleware",
    "harness",
    "pretrain-sim",
    "train-sim",
)
# commands whose module adds flags of its own (`add_arguments(parser)`)
OWN_FLAGS = (
    "serve",
    "rollout",
    "plan-chips",
    "gke",
    "tpu-vm",
    "import",
    "e2b",
    "rehearse",
    "deepen",
    "widen",
    "lookup-drill",
)
# The embedded default (docs/architecture.md §6): `simloop demo` without --config runs the CPU
# demo's config.
DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo_cpu.yaml"
TRACEBACK_ENV = "SIMLOOP_TRACEBACK"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="simloop",
        description="Train LLM terminal agents with RL against a learned terminal simulator.",
        epilog="Each subcommand takes --config FILE plus dotted overrides (--section.key VALUE).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, writes_run_dir) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--config", metavar="FILE", help="YAML config (defaults apply if omitted)")
        if writes_run_dir:
            p.add_argument("--out", metavar="DIR", help="run directory to write into")
        if name in ACTIONS:
            p.add_argument("action", nargs="?", choices=ACTIONS[name])
        if name == "demo":
            p.add_argument(
                "--quick",
                action="store_true",
                help="a CI-sized run (minutes): demo.quick_overrides",
            )
            p.add_argument(
                "--experiment",
                choices=["thesis", "stateful", "gating"],
                default="thesis",
                help="thesis (default): RL in the simulator vs the real shell; "
                "stateful: the same on fileops tasks, whose later commands read what "
                "earlier ones wrote (demo.stateful_overrides); "
                "gating: real-only vs ungated vs fidelity-gated RL from a weak "
                "simulator",
            )
        if name == "report":
            p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (`simloop demo`)")
        if name in OWN_FLAGS:
            importlib.import_module(MODULES[name]).add_arguments(p)
        if name in DRY_RUN:
            from launch.deploy.dry_run import add_dry_run_arguments

            add_dry_run_arguments(p)
    return parser


COMPILING = ("serve", "pretrain-sim", "train-sim", "train-agent", "demo")
"""Commands whose own process compiles for its devices: they use the persistent compilation
cache (`launch/compile_cache.py`; a `simloop serve` engine runs on one device). Others start
no JAX backend of their own (a rollout on a TPU host must not claim the servers' chips)."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    remote_command = None
    if argv[:1] == ["tpu-vm"] and "--" in argv:
        # `simloop tpu-vm run ... -- CMD...`: the words after `--` are the remote command, not
        # config overrides, so they never reach parse_known_args.
        cut = argv.index("--")
        argv, remote_command = argv[:cut], argv[cut + 1 :]
    args, rest = parser.parse_known_args(argv)
    args.overrides = list(rest)  # the dotted overrides as given (`demo` re-applies them)
    if remote_command is not None:
        args.remote_command = remote_command
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    if args.command == "serve":
        from launch.jobs.serve import flag_overrides

        rest = flag_overrides(args) + list(rest)
    if args.command == "demo" and args.config is None:
        if not DEMO_CONFIG.exists():
            return _fail(
                args.command, f"no --config given and {DEMO_CONFIG} is missing", EXIT_USAGE
            )
        args.config = str(DEMO_CONFIG)
    try:
        cfg = load_config(SimloopConfig, args.config, rest)
    except ConfigError as e:
        return _fail(args.command, f"config error: {e}", EXIT_USAGE)
    if args.command == "config":
        from launch.config.schema import serving_features

        sys.stdout.write(dump_config(cfg))
        # As YAML comments, so that the output still loads as a config.
        sys.stdout.write("# serving, per role:\n")
        sys.stdout.writelines(f"#   {line}\n" for line in serving_features(cfg))
        return 0
    if args.command in ("pretrain-sim", "train-sim", "train-agent", "demo"):
        # A cpu-N chip plan: this process holds the N fake devices the trainers are planned
        # on (before anything imports JAX).
        from launch.deploy.chips import cpu_device_flag

        flag = cpu_device_flag(cfg, os.environ)
        if flag is not None:
            os.environ["XLA_FLAGS"] = flag
    if args.command in ("pretrain-sim", "train-sim", "train-agent", "demo"):
        code = _processes(args, cfg, argv)
        if code is not None:
            return code
    if args.command == "train-agent" and not getattr(args, "dry_run", False):
        # On one TPU host the trainer takes only its planned chips, so the servers it starts
        # get theirs (without this libtpu gives it the whole host).
        from launch.deploy.chips import trainer_tpu_env

        os.environ.update(trainer_tpu_env(cfg, "agent", os.environ))
    if args.command in COMPILING and not getattr(args, "dry_run", False):
        from launch.compile_cache import enable_compile_cache

        enable_compile_cache(cfg.run, single_device=args.command == "serve")
    return _dispatch(args, cfg)


MULTI_PROCESS = ("pretrain-sim", "train-sim", "train-agent")
"""The jobs that run as several JAX processes (`launch/distributed.py`)."""


def _processes(args: argparse.Namespace, cfg: SimloopConfig, argv: list[str]) -> int | None:
    """Multi-process jobs: as the local launcher (`run.processes` > 1 and no process
    environment yet), start the job's processes and return their outcome; as one of them, join
    the job's JAX runtime and return None (go on). None too for a one-process job."""
    from launch import distributed

    try:
        penv = distributed.from_environ(os.environ)
    except ValueError as e:
        return _fail(args.command, str(e), EXIT_USAGE)
    n = cfg.run.processes
    if (penv is not None or n > 1) and args.command not in MULTI_PROCESS:
        return _fail(
            args.command,
            f"runs as one process (run.processes={n}, "
            f"{distributed.PROCESSES_ENV}={os.environ.get(distributed.PROCESSES_ENV)}): "
            f"only {', '.join(MULTI_PROCESS)} run as several JAX processes"
            + (
                " (the demo is a one-machine CPU experiment: run its stages' jobs, "
                "train-sim and train-agent, with --run.processes instead)"
                if args.command == "demo"
                else ""
            ),
            EXIT_USAGE,
        )
    # train-agent's own dry run lists its servers too: it shows them for one process
    if (
        getattr(args, "dry_run", False)
        and args.command in MULTI_PROCESS
        and (n > 1 or args.command != "train-agent")
    ):
        if getattr(args, "target", "local") != "local":
            return _fail(
                args.command,
                "--dry-run --target gke: the pods' processes are "
                "`simloop gke render`'s plan; this dry run shows the local ones",
                EXIT_USAGE,
            )
        rows = distributed.dry_run_rows(argv, n, _devices_per_process(cfg, n, args.command))
        if rows is None:
            return _fail(args.command, _split_error(cfg, n, args.command), EXIT_USAGE)
        print(distributed.format_rows(rows, args.format))
        return 0
    if penv is None and n > 1:
        per = _devices_per_process(cfg, n, args.command)
        if per is None:
            return _fail(args.command, _split_error(cfg, n, args.command), EXIT_USAGE)
        grace = cfg.run.heartbeat_timeout_s + 30.0
        return distributed.run_local(argv, n, per, getattr(args, "out", None), grace_s=grace)
    if penv is not None and not getattr(args, "dry_run", False):
        distributed.initialize(penv, heartbeat_timeout_s=cfg.run.heartbeat_timeout_s)
    return None


JOB_TRAINER = {"train-agent": "policy_train", "train-sim": "sim_train", "pretrain-sim": "sim_train"}
"""The chip role whose devices a multi-process job's processes hold."""


def _devices_per_process(cfg: SimloopConfig, n: int, command: str) -> int | None:
    """Fake CPU devices for each of `n` local processes of `command`: its trainer role's chips
    of a `cpu-N` plan, split evenly (the job's servers are processes of their own, as on a
    slice, where a trainer's hosts hold its chips and no server's)."""
    if not cfg.chips.accelerator.startswith("cpu-"):
        return None
    chips = cfg.chips.roles.get(JOB_TRAINER[command], 0)
    return chips // n if chips and chips % n == 0 else None


def _split_error(cfg: SimloopConfig, n: int, command: str) -> str:
    role = JOB_TRAINER[command]
    return (
        f"run.processes={n} starts local processes that split the chips of "
        f"chips.roles.{role} of a cpu-N plan evenly, but chips.accelerator is "
        f"{cfg.chips.accelerator!r} and chips.roles.{role} is "
        f"{cfg.chips.roles.get(role)}"
    )


def _fail(command: str, message: str, code: int) -> int:
    print(f"simloop {command}: {message}", file=sys.stderr)
    return code


def _dispatch(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    """Run the command's module. A user's mistake (a bad flag value, a missing file, a plan
    the hardware cannot hold) ends in one line naming it and exit 2 (1 for a job that could
    not do its work), never a traceback; set SIMLOOP_TRACEBACK=1 to see one anyway."""
    from launch.deploy.chips import PlanError
    from launch.errors import JobError

    try:
        if SUBCOMMANDS[args.command][1]:  # its metrics log: W&B too when run.wandb says so
            from rl.data.metrics_sinks import configure_wandb

            r = cfg.run
            configure_wandb(r.wandb, project=r.wandb_project, group=r.name, mode=r.wandb_mode)
        return importlib.import_module(MODULES[args.command]).run(args, cfg)
    except JobError as e:
        if os.environ.get(TRACEBACK_ENV):
            raise
        return _fail(args.command, str(e), e.exit_code)
    except (ConfigError, PlanError, ValueError, OSError) as e:
        # Validation errors name the field, the value and what is allowed; OSError names the
        # path. Anything else is a bug and keeps its traceback.
        if os.environ.get(TRACEBACK_ENV):
            raise
        return _fail(args.command, f"{type(e).__name__}: {e}", EXIT_USAGE)
    except KeyboardInterrupt:
        return _fail(args.command, "interrupted", 130)


if __name__ == "__main__":
    raise SystemExit(main())
