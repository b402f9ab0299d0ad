"""`simloop rollout`: run a rollout job and write its trajectories into the run directory.

    simloop rollout --config configs/demo_cpu.yaml --out runs/rollout
    simloop rollout --config configs/demo_cpu.yaml --out runs/sim --orchestrator.arm closed_loop
    simloop rollout --config configs/demo_cpu.yaml --out runs/replay --orchestrator.arm replay \\
        --replay runs/rollout/trajectories

Tasks are the config's `env.textops` family, or `--tasks FILE.jsonl`. Servers come from
`agent.server_url` / `simulator.server_url`; unset ones are started locally for the job
(`launch/deploy/local.py`, with `serve.backend`: `jax` or `vllm`); `--dry-run [--format json]`
prints those processes and starts nothing. Writes `config.yaml`,
`trajectories/rollout-NNNNN.{jsonl,array_record}`, `metrics.jsonl` and `logs/` into `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from pathlib import Path

from launch.config import write_config
from launch.config.schema import SimloopConfig
from launch.deploy.dry_run import print_dry_run
from launch.errors import UsageError
from launch.jobs.episodes import check_servers
from rl.data import rundir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tasks", metavar="FILE", help="tasks JSONL (default: the textops family)")
    p.add_argument(
        "--replay",
        nargs="+",
        metavar="PATH",
        help="recorded trajectories (JSONL files or folders), replay arm",
    )


def _needs(arm: str) -> tuple[bool, bool]:
    """(agent server, simulator server)."""
    return arm != "replay", arm in ("closed_loop", "replay", "mixed")


def run(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    arm = cfg.orchestrator.arm
    if arm == "gated":
        raise UsageError(
            "orchestrator.arm=gated routes an RL run's episodes by the simulator's "
            "live fidelity: use `simloop train-agent`; rollout takes real, "
            "closed_loop, mixed or replay"
        )
    need_agent, need_sim = _needs(arm)
    roles = [r for r, needed in (("agent", need_agent), ("simulator", need_sim)) if needed]
    if getattr(args, "dry_run", False):
        return print_dry_run(args, cfg, "rollout", roles)
    if not args.out:
        raise UsageError("--out DIR is required")
    out = Path(args.out)
    if arm == "replay" and not args.replay:
        raise UsageError("the replay arm needs --replay PATH...")
    check_servers(cfg, roles)
    write_config(cfg, out)
    summary = asyncio.run(_rollout(cfg, out, args))
    print(
        f"simloop rollout: {summary['episodes']} episodes {summary['status']} "
        f"success {summary['success_rate']:.2f}, {summary['tokens_per_s']:.0f} tok/s -> "
        f"{out / rundir.TRAJECTORIES}"
    )
    return 0 if summary["episodes"] else 1


async def _rollout(cfg: SimloopConfig, out: Path, args) -> dict:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from envs.tasks import load_tasks
    from envs.textops import generate_textops
    from launch.deploy.local import role_clients
    from launch.jobs.episodes import job_backends
    from rl.data import ChatRenderer, load_tokenizer
    from rl.data.trajectory import load_trajectories
    from rl.orchestrator.runner import RolloutRunner
    from rl.orchestrator.storage import TrajectoryWriter

    # A rollout job has no trainer to advance versions: the staleness bound (an RL setting)
    # would stop it after one batch.
    ocfg = dataclasses.replace(cfg.orchestrator, max_staleness=None)
    tasks = load_tasks(args.tasks) if args.tasks else generate_textops(cfg.env.textops)
    agent_renderer = ChatRenderer(load_tokenizer(cfg.agent.tokenizer))
    need_agent, need_sim = _needs(ocfg.arm)
    roles = [r for r, needed in (("agent", need_agent), ("simulator", need_sim)) if needed]
    async with role_clients(cfg, out, roles, who="rollout") as clients:
        backends = job_backends(cfg, clients.get("simulator"))
        replay = load_trajectories(args.replay) if args.replay else None
        total = len(replay) if replay is not None else len(tasks) * ocfg.group_size
        writer = TrajectoryWriter(out)
        columns = [
            TextColumn("[bold]rollout[/] {task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
        ]
        with Progress(*columns) as progress:
            bar = progress.add_task(ocfg.arm, total=total)

            def sink(traj) -> None:
                writer.add(traj)
                m = runner.metrics
                statuses = " ".join(f"{k}={v}" for k, v in sorted(m.statuses.items()))
                rate = m.summary()["tokens_per_s"]
                text = f"{ocfg.arm} ({statuses}) active={m.active} tok/s={rate:.0f}"
                progress.update(bar, advance=1, description=text)

            runner = RolloutRunner(
                ocfg,
                cfg.env.terminal,
                agent_renderer,
                backends,
                client=clients.get("agent"),
                sinks=(sink,),
            )
            try:
                await runner.run(tasks, replay=replay)
            finally:
                writer.close()
                runner.metrics.write(rundir.MetricsLog(out), stage="rollout", arm=ocfg.arm)
    return runner.metrics.summary()
