"""`simloop rollout`: run a rollout job and write its trajectories into the run directory.

    simloop rollout --config configs/demo_cpu.yaml --out runs/rollout
    simloop rollout --config configs/demo_cpu.yaml --out runs/sim --orchestrator.arm closed_loop
    simloop rollout --config configs/demo_cpu.yaml --out runs/replay --orchestrator.arm replay \\
        --replay runs/rollout/trajectories

Tasks are the config's `env.textops` family, or `--tasks FILE.jsonl`. Servers come from
`agent.server_url` / `simulator.server_url`; unset ones are started locally for the job
(`launch/local.py`). Writes `config.yaml`, `trajectories/rollout-NNNNN.{jsonl,array_record}`,
`metrics.jsonl` and `logs/` into `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import sys
from pathlib import Path

from launch.config import write_config
from launch.schema import SimloopConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tasks", metavar="FILE", help="tasks JSONL (default: the textops family)")
    p.add_argument("--replay", nargs="+", metavar="PATH",
                   help="recorded trajectories (JSONL files or folders), replay arm")  # fmt: skip


def _needs(arm: str) -> tuple[bool, bool]:
    """(agent server, simulator server)."""
    return arm != "replay", arm in ("closed_loop", "replay", "mixed")


def run(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    if not args.out:
        print("simloop rollout: --out DIR is required", file=sys.stderr)
        return 2
    out = Path(args.out)
    arm = cfg.orchestrator.arm
    if arm == "replay" and not args.replay:
        print("simloop rollout: the replay arm needs --replay PATH...", file=sys.stderr)
        return 2
    write_config(cfg, out)
    from launch.local import LocalServer

    need_agent, need_sim = _needs(arm)
    with contextlib.ExitStack() as stack:
        urls = {}
        for role, needed in (("agent", need_agent), ("simulator", need_sim)):
            url = getattr(cfg, role).server_url
            if needed and url is None:
                print(f"simloop rollout: starting a local {role} server ...", flush=True)
                url = stack.enter_context(LocalServer.start(role, out)).url
            urls[role] = url
        summary = asyncio.run(_rollout(cfg, out, urls, args))
    print(f"simloop rollout: {summary['episodes']} episodes {summary['status']} "
          f"success {summary['success_rate']:.2f}, {summary['tokens_per_s']:.0f} tok/s -> "
          f"{out / 'trajectories'}")  # fmt: skip
    return 0 if summary["episodes"] else 1


async def _rollout(cfg: SimloopConfig, out: Path, urls: dict, args) -> dict:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from envs.tasks import load_tasks
    from envs.textops import generate_textops
    from launch.backends import shell_backends
    from rl.data import ChatRenderer, load_tokenizer
    from rl.data.trajectory import load_trajectories
    from rl.orchestrator.runner import RolloutRunner
    from rl.orchestrator.storage import TrajectoryWriter
    from serving.client import ClientConfig, InferenceClient

    # A rollout job has no trainer to advance versions: the staleness bound (an RL setting)
    # would stop it after one batch.
    ocfg = dataclasses.replace(cfg.orchestrator, max_staleness=None)
    tasks = load_tasks(args.tasks) if args.tasks else generate_textops(cfg.env.textops)
    agent_renderer = ChatRenderer(load_tokenizer(cfg.agent.tokenizer))
    timeout = ocfg.request_timeout_s
    async with contextlib.AsyncExitStack() as stack:
        clients = {}
        for role, url in urls.items():
            if url is not None:
                client = InferenceClient(ClientConfig(url, timeout_s=timeout))
                clients[role] = await stack.enter_async_context(client)
                await client.wait_healthy(timeout_s=120)
        backends = shell_backends(cfg, clients.get("simulator"))
        replay = load_trajectories(args.replay) if args.replay else None
        total = len(replay) if replay is not None else len(tasks) * ocfg.group_size
        writer = TrajectoryWriter(out)
        columns = [TextColumn("[bold]rollout[/] {task.description}"), BarColumn(),
                   TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn()]  # fmt: skip
        with Progress(*columns) as progress:
            bar = progress.add_task(ocfg.arm, total=total)

            def sink(traj) -> None:
                writer.add(traj)
                m = runner.metrics
                statuses = " ".join(f"{k}={v}" for k, v in sorted(m.statuses.items()))
                rate = m.summary()["tokens_per_s"]
                text = f"{ocfg.arm} ({statuses}) active={m.active} tok/s={rate:.0f}"
                progress.update(bar, advance=1, description=text)

            runner = RolloutRunner(ocfg, cfg.env.terminal, agent_renderer, backends,
                                   client=clients.get("agent"), sink=sink)  # fmt: skip
            try:
                await runner.run(tasks, replay=replay)
            finally:
                writer.close()
                runner.metrics.write(out / "metrics.jsonl", stage="rollout", arm=ocfg.arm)
    return runner.metrics.summary()
