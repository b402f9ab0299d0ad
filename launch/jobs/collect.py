"""`simloop collect`: real trajectories from a scripted (optionally noisy) agent on the
config's task family (`env.family`).

    simloop collect --config configs/demo_cpu.yaml --out runs/collect
    simloop collect --config configs/demo_cpu.yaml --out runs/collect --collect.noise 0.3
    simloop collect --config configs/demo_cpu.yaml --out runs/long --collect.style explore \\
        --collect.commands 24 --env.terminal.max_turns 25     # long sessions

Runs `collect.episodes` episodes of the config's textops tasks in the real shell
(`env.shell.backend`: local or e2b) through the orchestrator, with `ScriptedAgentClient` in the
agent's seat, and writes `config.yaml`, `trajectories/collect-NNNNN.{jsonl,array_record}` and
`metrics.jsonl` into `--out`: the data `simloop train-sim` learns the terminal from. A model
agent collects with `simloop rollout` instead.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from launch.config import write_config
from launch.config.schema import SimloopConfig
from launch.errors import UsageError
from rl.data import rundir


def run(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    if not args.out:
        raise UsageError("--out DIR is required")
    c, turns = cfg.collect, cfg.env.terminal.max_turns
    if c.style == "explore" and turns <= c.commands:
        raise UsageError(
            f"collect.style=explore runs collect.commands={c.commands} commands and then "
            f"submits: env.terminal.max_turns={turns} must be at least {c.commands + 1}"
        )
    out = Path(args.out)
    write_config(cfg, out)
    summary = asyncio.run(collect(cfg, out))
    print(
        f"simloop collect: {summary['episodes']} episodes {summary['status']} "
        f"success {summary['success_rate']:.2f} -> {out / rundir.TRAJECTORIES}"
    )
    return 0 if summary["episodes"] else 1


def collect_tasks_config(cfg: SimloopConfig):
    """The family collected on (`env.family`: `env.textops` or `env.fileops`) with
    `collect.task_seed` / `collect.num_tasks` where set."""
    import dataclasses

    c, t = cfg.collect, getattr(cfg.env, cfg.env.family)
    return dataclasses.replace(
        t,
        seed=t.seed if c.task_seed is None else c.task_seed,
        num_tasks=t.num_tasks if c.num_tasks is None else c.num_tasks,
    )


async def collect(cfg: SimloopConfig, out: Path) -> dict:
    import dataclasses

    from rich.progress import Progress

    from launch.jobs.episodes import family_tasks, job_backends
    from rl.data import ChatRenderer, load_tokenizer
    from rl.orchestrator.runner import RolloutRunner
    from rl.orchestrator.scripted import ScriptedAgentClient, feedback_marker
    from rl.orchestrator.storage import TrajectoryWriter

    c = cfg.collect
    tasks = family_tasks(cfg.env.family, collect_tasks_config(cfg))
    renderer = ChatRenderer(load_tokenizer(cfg.agent.tokenizer))
    marker = feedback_marker(cfg.env.terminal.trial_feedback_template)
    client = ScriptedAgentClient(
        tasks,
        renderer.tokenizer,
        style=c.style,
        noise=c.noise,
        noise_kinds=c.noise_kinds,
        seed=cfg.run.seed,
        trial_marker=marker,
        commands=c.commands,
        fileops_mistakes=c.fileops_mistakes,
        fileops_checks=c.fileops_checks,
    )
    ocfg = dataclasses.replace(cfg.orchestrator, arm="real", group_size=1, max_staleness=None)
    writer = TrajectoryWriter(out, prefix="collect")
    episodes = [tasks[i % len(tasks)] for i in range(c.episodes)]
    with Progress() as progress:
        bar = progress.add_task("collect", total=len(episodes))

        def sink(traj) -> None:
            writer.add(traj)
            progress.advance(bar)

        runner = RolloutRunner(
            ocfg,
            cfg.env.terminal,
            renderer,
            job_backends(cfg),
            client=client,
            sinks=(sink,),
        )
        try:
            await runner.run(episodes)
        finally:
            writer.close()
            runner.metrics.write(rundir.MetricsLog(out), stage="collect", noise=c.noise)
    return runner.metrics.summary()
