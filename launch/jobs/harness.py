"""`simloop harness`: an unmodified agent harness (first: mini-swe-agent) on SWE-style tasks,
through `simloop middleware`, each run graded in a second clean sandbox.

    simloop harness --config configs/demo_cpu.yaml --out runs/harness
    simloop harness --config configs/demo_cpu.yaml --out runs/harness \\
        --harness.tasks '[clamp, slugify]' --harness.samples 4 --harness.step_limit 6

Per task (`harness.tasks` of the built-in suite, `envs/swe_suite.py`; all by default) it runs
`harness.samples` rollouts: each starts a sandbox from the task (`env.shell.backend`: local
bash or E2B), runs the harness in it against the middleware (its API key is the rollout id),
kills it past `harness.wall_s` (`timeout`), grades its `git diff` in a fresh sandbox (the
tests restored, then run) and finishes the rollout with that reward, so its token-exact
segments land in `--out/trajectories/middleware-*.jsonl`. The agent server is
`agent.server_url`, or one started here (`--dry-run` prints it). The local sandbox must reach
the middleware and run the harness, so `harness_shell` shares the host's network with it,
shows it this Python's environment and interpreter read-only (`env.shell.local.visible_paths`:
add what else a `command` harness needs, e.g. the folder of its script; the project tree and
the run directory stay out of its sight) and lets it spend `harness.wall_s` of CPU time; every
other containment stays, and the middleware's admin routes (finishing a rollout, with its
reward) are not reachable from it. Writes `harness.json` (per rollout: reward, status, wall
seconds, diff size, segments) and `metrics.jsonl`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path

from launch.config import write_config
from launch.config.schema import SimloopConfig
from launch.deploy.dry_run import print_dry_run
from launch.errors import UsageError
from launch.jobs.episodes import check_servers
from rl.data import rundir


def harness_shell(cfg: SimloopConfig) -> SimloopConfig:
    """The config with a local sandbox a harness can run in: it reaches the middleware over
    the network, sees this Python's environment and its interpreter (read-only) besides the
    configured `visible_paths`, and may spend `harness.wall_s` of CPU time. Nothing else of
    the host: not the working directory, which holds the project (its tests and grader)."""
    from rl.orchestrator.harness import NPM_PACKAGES, npm_root

    shell = cfg.env.shell
    if shell.backend != "local":
        return cfg
    python = [p for p in (sys.prefix, sys.base_prefix) if p not in ("/usr", "/")]
    if cfg.harness.kind in NPM_PACKAGES:  # the installed harness (its folder may not exist yet)
        cache = npm_root(cfg.harness).parent
        cache.mkdir(parents=True, exist_ok=True)
        python.append(str(cache))
    visible = list(dict.fromkeys([*shell.local.visible_paths, *python]))
    local = dataclasses.replace(
        shell.local,
        isolate_network=False,
        visible_paths=visible,
        cpu_time_s=max(shell.local.cpu_time_s, int(cfg.harness.wall_s) + 1),
    )
    env = dataclasses.replace(cfg.env, shell=dataclasses.replace(shell, local=local))
    return dataclasses.replace(cfg, env=env)


def swe_tasks(cfg: SimloopConfig) -> list:
    """The SWE tasks a harness job runs: the instances of `harness.task_file` (or
    `train_agent.tasks: file:PATH`), else the built-in suite; `harness.tasks` picks by id.
    Invalid lines of a task file are reported on stderr, each with its line and field, and
    left out; UsageError when nothing is left."""
    from envs.swe_file import load_task_file
    from envs.swe_suite import swe_suite

    path = cfg.harness.task_file or cfg.train_agent.task_file
    if path is None:
        try:
            return swe_suite(cfg.harness.tasks or None)
        except ValueError as e:
            raise UsageError(f"harness.tasks: {e}") from e
    try:
        loaded = load_task_file(path)
    except OSError as e:
        raise UsageError(f"task file {path}: {e.strerror or e}") from e
    for error in loaded.errors:
        print(f"simloop: skipping {error}", file=sys.stderr)
    tasks = loaded.tasks
    if cfg.harness.tasks:
        by_id = {t.id: t for t in tasks}
        unknown = [i for i in cfg.harness.tasks if i not in by_id]
        if unknown:
            raise UsageError(f"harness.tasks: {unknown} are not instances of {path}")
        tasks = [by_id[i] for i in cfg.harness.tasks]
    if not tasks:
        raise UsageError(f"task file {path}: no valid instance ({len(loaded.errors)} skipped)")
    return tasks


def run(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    if getattr(args, "dry_run", False):
        return print_dry_run(args, cfg, "harness", ["agent"])
    if not args.out:
        raise UsageError("--out DIR is required")
    tasks = swe_tasks(cfg)
    out = Path(args.out)
    check_servers(cfg, ["agent"])
    cfg = harness_shell(cfg)
    write_config(cfg, out)
    summary = asyncio.run(run_harness(cfg, out, tasks))
    print(
        f"simloop harness: {summary['rollouts']} rollouts, mean reward "
        f"{summary['reward_mean']:.2f}, statuses {summary['statuses']}, "
        f"{summary['trajectories']} trajectories -> {out / rundir.TRAJECTORIES}"
    )
    return 0


async def run_harness(cfg: SimloopConfig, out: Path, tasks: list) -> dict:
    from envs.backends import shell_backends
    from launch.deploy.local import role_clients
    from launch.errors import JobError
    from launch.jobs.middleware import running_middleware
    from rl.orchestrator.harness import HarnessRunner, HarnessUnavailable, pick_launcher

    hcfg = cfg.harness
    backends = shell_backends(cfg.env.shell, run_id=cfg.run.name)
    try:
        launcher = await pick_launcher(hcfg, backends.real, tasks[0])
    except HarnessUnavailable as e:
        raise JobError(str(e)) from e
    metrics = rundir.MetricsLog(out)
    results = []
    async with role_clients(cfg, out, ["agent"], who="harness") as clients:
        async with running_middleware(cfg, out, clients["agent"]) as (_, url, admin):
            runner = HarnessRunner(hcfg, backends.real, url, launcher, admin=admin)
            total = len(tasks) * hcfg.samples
            print(f"simloop harness: {hcfg.kind} x {total} rollouts through {url}", flush=True)

            async def group(i: int, task) -> None:
                for r in await runner.run_group(task, f"g{i}", hcfg.samples):
                    results.append(r)
                    metrics.write({"stage": "harness", **r.summary()})
                    failed = r.finish.get("error")  # not written with this reward
                    note = f" FINISH FAILED: {failed}" if failed else ""
                    print(
                        f"  {r.rollout_id}: {r.status} reward={r.reward} "
                        f"exit={r.exit_code} {r.wall_s:.1f}s "
                        f"segments={len(r.finish.get('segments', []))}{note}",
                        flush=True,
                    )

            await asyncio.gather(*(group(i, t) for i, t in enumerate(tasks)))
    rewards = [r.reward for r in results if r.reward is not None]
    statuses: dict[str, int] = {}
    for r in results:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    summary = {
        "harness": hcfg.kind,
        "rollouts": len(results),
        "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        "statuses": statuses,
        "trajectories": sum(r.finish.get("trajectories") or 0 for r in results),
        "results": [r.summary() for r in results],
    }
    (out / "harness.json").write_text(json.dumps(summary, indent=1))
    return summary
