"""`simloop eval-sim`: arm (c), the simulator's fidelity on real trajectories.

    simloop eval-sim --config configs/demo_cpu.yaml --out runs/eval-sim \\
        --eval_sim.trajectories '[runs/collect/trajectories]' \\
        --eval_sim.heldout_tasks runs/sim/heldout_tasks.json \\
        --simulator.weights runs/sim/weights/final

The recorded commands of each real trajectory are sent to the simulator one by one, with the
session so far, and every simulated observation is scored against the real one. Writes
`fidelity.json` (pair metrics, hygiene next to the real observations' rates, by context length
and by command), the replays in `trajectories/replay-*` (real and simulated observation side by
side per turn), `metrics.jsonl` and `logs/` into `--out`, and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

from launch.config import write_config
from launch.config.schema import SimloopConfig
from launch.deploy.dry_run import print_dry_run
from launch.errors import UsageError
from rl.data import rundir


def select_trajectories(cfg: SimloopConfig) -> list:
    """The real trajectories to replay: `eval_sim.trajectories`, only the tasks listed in
    `eval_sim.heldout_tasks` (if set), at most `eval_sim.max_trajectories`; simulated ones
    and ones without a command with an observation are left out."""
    from rl.data.trajectory import load_trajectories

    ecfg = cfg.eval_sim
    trajs = load_trajectories(ecfg.trajectories)
    if ecfg.heldout_tasks is not None:
        path = Path(ecfg.heldout_tasks)
        if not path.exists():
            raise ValueError(f"eval_sim.heldout_tasks: {path} does not exist")
        keep = set(json.loads(path.read_text()))
        trajs = [t for t in trajs if t.task_id in keep]
    trajs = [
        t
        for t in trajs
        if t.env_backend != "simulated"
        and any(u.command is not None and u.observation is not None for u in t.turns)
    ]
    if ecfg.max_trajectories is not None:
        trajs = trajs[: ecfg.max_trajectories]
    return trajs


def run(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    if getattr(args, "dry_run", False):
        return print_dry_run(args, cfg, "eval-sim", ["simulator"])
    if not args.out:
        raise UsageError("--out DIR is required")
    if not cfg.eval_sim.trajectories:
        raise UsageError(
            "eval_sim.trajectories is empty: point it at real trajectories "
            "(from `simloop collect` / `simloop import`), e.g. "
            "--eval_sim.trajectories '[runs/collect/trajectories]'"
        )
    try:
        trajs = select_trajectories(cfg)
    except (ValueError, OSError) as e:
        raise UsageError(str(e)) from e
    if not trajs:
        raise UsageError(
            "no real trajectory with a recorded command and observation "
            "to replay (check eval_sim.trajectories and eval_sim.heldout_tasks)"
        )
    out = Path(args.out)
    write_config(cfg, out)
    result = eval_sim(cfg, out, trajs)
    print_fidelity(result)
    print(f"simloop eval-sim: -> {out / rundir.FIDELITY}")
    return 0


def eval_sim(cfg: SimloopConfig, out: Path, trajs: list) -> dict[str, Any]:
    """Replay `trajs` against the simulator (`simulator.server_url`, or a local server),
    write and return the fidelity result."""
    return asyncio.run(_replay(cfg, out, trajs))


async def _replay(cfg: SimloopConfig, out: Path, trajs: list) -> dict[str, Any]:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from launch.deploy.local import role_clients
    from launch.jobs.episodes import job_backends
    from rl.data import ChatRenderer, load_tokenizer
    from rl.orchestrator.evaluate import replay_fidelity
    from rl.orchestrator.runner import RolloutRunner
    from rl.orchestrator.storage import TrajectoryWriter

    ocfg = dataclasses.replace(cfg.orchestrator, arm="replay", max_staleness=None)
    renderer = ChatRenderer(load_tokenizer(cfg.agent.tokenizer))
    async with role_clients(cfg, out, ["simulator"], who="eval-sim") as clients:
        writer = TrajectoryWriter(out, prefix="replay")
        columns = [
            TextColumn("[bold]eval-sim[/] {task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
        ]
        with Progress(*columns) as progress:
            bar = progress.add_task("replaying", total=len(trajs))

            def sink(traj) -> None:
                writer.add(traj)
                progress.advance(bar)

            backends = job_backends(cfg, clients["simulator"])
            runner = RolloutRunner(ocfg, cfg.env.terminal, renderer, backends, sinks=(sink,))
            try:
                replays = await runner.run([], replay=trajs)
            finally:
                writer.close()
                runner.metrics.write(rundir.MetricsLog(out), stage="eval_sim", arm="replay")
    result = replay_fidelity(
        replays, context_edges=cfg.eval_sim.context_edges, depth_edges=cfg.eval_sim.depth_edges
    )
    if cfg.env.shell.simulated.workspace:
        # (in a thread: the real-bash replays run their own event loop)
        result["workspace"] = await asyncio.to_thread(_workspace_fidelity, cfg, replays)
    result["wall_s"] = runner.metrics.summary()["wall_s"]
    (out / rundir.FIDELITY).write_text(json.dumps(result, indent=1))
    # The headline scores also go to the metrics log (and so to TensorBoard / W&B).
    rundir.MetricsLog(out).write(
        {"stage": "fidelity", "pairs": result["pairs"], "hygiene": result["hygiene"]}
    )
    return result


def _workspace_fidelity(cfg: SimloopConfig, replays: list) -> dict[str, Any]:
    """Workspace mode: the simulator's own files against the real ones, turn by turn
    (`rl.orchestrator.evaluate.workspace_fidelity`); the real workspaces come from running
    each replay's commands again in real bash (`envs.workspace`, ~20 replays a second)."""
    from envs.workspace import cached_workspaces
    from rl.orchestrator.evaluate import workspace_fidelity

    ok = [t for t in replays if t.status == "ok"]
    states, failed, _ = cached_workspaces(
        ok, config=cfg.env.shell.local, use_cache=cfg.env.shell.simulated.replay_cache
    )
    result = workspace_fidelity(ok, states)
    result["real_replays_failed"] = failed
    return result


def print_fidelity(result: dict[str, Any]) -> None:
    """The fidelity result as rich tables (overall, hygiene, by context length, by command)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()

    def num(d: dict, key: str, fmt: str = ".3f") -> str:
        v = d.get(key)
        return "n/a" if v is None else format(v, fmt)  # e.g. no recorded return codes

    p, h, r = result["pairs"], result["hygiene"], result["real_hygiene"]
    if not p.get("count"):
        console.print("eval-sim: no (real, simulated) observation pairs were produced")
        return
    t = Table(title=f"Simulator fidelity, arm (c): {p['count']} observations")
    for col in ("exact", "exact (masked)", "return code", "similarity", "length ratio"):
        t.add_column(col, justify="right")
    t.add_row(
        num(p, "exact"),
        num(p, "exact_masked"),
        num(p, "exit_code_agreement"),
        num(p, "similarity"),
        num(p, "length_ratio_geomean", ".2f"),
    )
    console.print(t)
    failed = {k: v for k, v in result.get("statuses", {}).items() if k != "ok"}
    if failed:
        console.print(
            f"replays that did not finish (their turns are not scored): {failed}; "
            "see trajectories/replay-* for the reasons"
        )
    t = Table(title="Observation hygiene (rates)")
    t.add_column("")
    names = ("cap_hit", "think_leak", "repetition", "empty", "malformed")
    for name in names:
        t.add_column(name.replace("_", " "), justify="right")
    t.add_row("simulated", *(f"{h.get(n, 0.0):.3f}" for n in names))
    t.add_row("real", *(f"{r.get(n, 0.0):.3f}" if n in r else "-" for n in names))
    console.print(t)
    for key, title, label in (
        ("by_context", "By prompt length (tokens)", "prompt tokens"),
        ("by_depth", "By depth (turns before the command)", "turns"),
        ("by_state_distance", "By state distance (turns since the file it reads was written)",
         "turns"),
        ("by_command", "By command", "command"),
    ):  # fmt: skip
        t = Table(title=title)
        for col in (label, "n", "exact (masked)", "return code", "similarity"):
            t.add_column(col, justify="right" if col != label else "left")
        for name, s in result.get(key, {}).items():
            t.add_row(
                name,
                str(s["count"]),
                num(s, "exact_masked"),
                num(s, "exit_code_agreement"),
                num(s, "similarity"),
            )
        console.print(t)
    ws = result.get("workspace")
    if ws and ws.get("turns"):
        console.print(
            f"Workspace kept by the simulator ({ws['replays']} replays, {ws['turns']} turns): "
            f"its files right after {num(ws, 'state_exact')} of the turns; "
            f"{num(ws, 'write_exact')} of {ws['writes']} writes from right files left them right; "
            f"observations exact {num(ws, 'observation_exact_state_right')} with its files "
            f"right before, {num(ws, 'observation_exact_state_wrong')} with them wrong "
            f"({ws['turns_state_wrong']} turns)"
        )
        t = Table(title="Where the files first went wrong (writes from right files)")
        for col in ("command", "writes", "wrong"):
            t.add_column(col, justify="right" if col != "command" else "left")
        for name, s in ws["first_wrong_write"].items():
            t.add_row(name, str(s["writes"]), str(s["wrong"]))
        console.print(t)
