"""The `simloop` command line (also `python -m launch`).

    simloop --help
    simloop config --config configs/demo_cpu.yaml --agent.model.num_layers 4

Every subcommand takes `--config FILE` plus dotted overrides (`--train.lr 1e-4`), and the whole
config is validated before anything imports JAX.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from launch.config import ConfigError, dump_config, load_config
from launch.schema import SimloopConfig

EXIT_USAGE = 2

# name -> (one-line help, writes a run directory)
SUBCOMMANDS: dict[str, tuple[str, bool]] = {
    "demo": ("the whole pipeline on CPU with tiny models, in minutes", True),
    "collect": ("run agents in real shells (local / E2B) and store trajectories", True),
    "import": ("convert SWE-agent .traj / chat JSON files into simloop trajectories", True),
    "train-sim": ("supervised fine-tuning of the simulator on real trajectories", True),
    "eval-sim": ("arm (c): replay real commands against the simulator, score fidelity", True),
    "train-agent": ("SFT warm start, then RL in closed loop with the simulator", True),
    "eval-agent": ("the agent in real and simulated shells: success and transfer gap", True),
    "rollout": ("run a rollout job and write trajectories", True),
    "report": ("write a self-contained report.html for a run directory", False),
    "serve": ("the OpenAI/vLLM-compatible inference server (JAX engine)", False),
    "plan-chips": ("plan TPU chip partitions and per-process environments", False),
    "gke": ("render GKE JobSet manifests from a config", False),
    "tpu-vm": ("create / ssh / run / copy / delete TPU VMs through gcloud", False),
    "e2b": ("E2B sandbox housekeeping: `sweep` kills orphaned simloop sandboxes", False),
    "config": ("validate a config with its overrides and print it resolved", False),
}

ACTIONS = {
    "gke": ["render"],
    "tpu-vm": ["create", "ssh", "run", "copy", "delete"],
    "e2b": ["sweep"],
}

Handler = Callable[[argparse.Namespace, SimloopConfig], int]


def _config_cmd(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    sys.stdout.write(dump_config(cfg))
    return 0


def _serve_cmd(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    from launch import serve

    return serve.run(args, cfg)


def _import_cmd(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    from launch import import_cmd

    return import_cmd.run(args, cfg)


def _rollout_cmd(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    from launch import rollout

    return rollout.run(args, cfg)


def _e2b_cmd(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    import asyncio

    from envs.e2b import sweep

    if args.action != "sweep":
        print("simloop e2b: say which action: sweep", file=sys.stderr)
        return EXIT_USAGE
    if not os.environ.get("E2B_API_KEY"):
        print("simloop e2b sweep: E2B_API_KEY is not set", file=sys.stderr)
        return EXIT_USAGE
    killed = asyncio.run(sweep(args.run_id, config=cfg.env.shell.e2b,
                               older_than_s=args.older_than_s))  # fmt: skip
    scope = f"run {args.run_id!r}" if args.run_id else "all simloop runs"
    print(f"simloop e2b sweep: killed {len(killed)} sandbox(es) of {scope}")
    for sandbox_id in killed:
        print(f"  {sandbox_id}")
    return 0


def _collect_cmd(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    from launch import collect

    return collect.run(args, cfg)


def _train_sim_cmd(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    from launch import train

    return train.run_train_sim(args, cfg)


def _eval_sim_cmd(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    from launch import eval_sim

    return eval_sim.run(args, cfg)


def _demo_cmd(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    from launch import demo

    return demo.run(args, cfg)


def _report_cmd(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    from launch import report

    return report.run(args, cfg)


def _eval_agent_cmd(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    from launch import eval_agent

    return eval_agent.run(args, cfg)


def _train_agent_cmd(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    from launch import train

    return train.run_train_agent(args, cfg)


def _plan_chips_cmd(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    from launch import chips

    return chips.run(args, cfg)


def _gke_cmd(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    from launch import gke

    return gke.run(args, cfg)


def _tpu_vm_cmd(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    from launch import tpu_vm

    return tpu_vm.run(args, cfg)


HANDLERS: dict[str, Handler] = {
    "gke": _gke_cmd,
    "tpu-vm": _tpu_vm_cmd,
    "plan-chips": _plan_chips_cmd,
    "collect": _collect_cmd,
    "train-sim": _train_sim_cmd,
    "train-agent": _train_agent_cmd,
    "eval-sim": _eval_sim_cmd,
    "eval-agent": _eval_agent_cmd,
    "demo": _demo_cmd,
    "report": _report_cmd,
    "config": _config_cmd,
    "serve": _serve_cmd,
    "e2b": _e2b_cmd,
    "import": _import_cmd,
    "rollout": _rollout_cmd,
}


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
        if name == "e2b":
            p.add_argument("--run-id", help="only sandboxes tagged with this run (default: all)")
            p.add_argument("--older-than-s", type=float, default=0.0,
                           help="only sandboxes started at least this long ago")  # fmt: skip
        if name == "demo":
            p.add_argument("--quick", action="store_true",
                           help="a CI-sized run (minutes): demo.quick_overrides")  # fmt: skip
        if name == "report":
            p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (`simloop demo`)")
        if name == "serve":
            from launch.serve import add_arguments

            add_arguments(p)
        if name == "rollout":
            from launch.rollout import add_arguments as add_rollout_arguments

            add_rollout_arguments(p)
        if name == "plan-chips":
            from launch.chips import add_arguments as add_chips_arguments

            add_chips_arguments(p)
        if name == "gke":
            from launch.gke import add_arguments as add_gke_arguments

            add_gke_arguments(p)
        if name == "tpu-vm":
            from launch.tpu_vm import add_arguments as add_tpu_vm_arguments

            add_tpu_vm_arguments(p)
        if name == "import":
            from launch.import_cmd import add_arguments as add_import_arguments

            add_import_arguments(p)
    return parser


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
        from launch.serve import flag_overrides

        rest = flag_overrides(args) + list(rest)
    try:
        cfg = load_config(SimloopConfig, args.config, rest)
    except ConfigError as e:
        print(f"simloop {args.command}: config error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.command in ("train-sim", "train-agent", "demo"):
        # A cpu-N chip plan: this process holds the N fake devices the trainers are planned
        # on (before anything imports JAX).
        from launch.chips import cpu_device_flag

        flag = cpu_device_flag(cfg, os.environ)
        if flag is not None:
            os.environ["XLA_FLAGS"] = flag
    return HANDLERS[args.command](args, cfg)


if __name__ == "__main__":
    raise SystemExit(main())
