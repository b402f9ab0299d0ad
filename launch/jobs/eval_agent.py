"""`simloop eval-agent`: one trained agent in the real shell and in the simulator.

    simloop eval-agent --config configs/demo_cpu.yaml --out runs/eval-agent \\
        --agent.weights runs/demo/agent/weights/final \\
        --simulator.weights runs/demo/sim/weights/final

The tasks, samples and arms are `train_agent.eval`'s: the held-out textops tasks that
train-agent evaluates before and after RL, with the same seed, so the numbers compare. It
starts a local agent server on `agent.weights` (or uses `agent.server_url`) and, for the
`closed_loop` arm, a simulator server on `simulator.weights` (or `simulator.server_url`).
Writes `eval.json` (`{"eval": {arm: result}}`), `metrics.jsonl` and `trajectories/eval-*`, and
prints success by arm and operation, the transfer gap (simulator minus real) and the action
distribution of each arm side by side. `--dry-run [--format json]` prints the servers it
would start (`serve.backend`: `jax` or `vllm`), and starts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from launch.config import write_config
from launch.config.schema import SimloopConfig
from launch.deploy.dry_run import print_dry_run
from launch.errors import UsageError
from launch.jobs.episodes import check_servers
from rl.data import rundir

LABEL = "eval"


def run(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    if getattr(args, "dry_run", False):
        return print_dry_run(args, cfg, "eval-agent", _roles(cfg))
    if not args.out:
        raise UsageError("--out DIR is required")
    if cfg.agent.weights is None and cfg.agent.server_url is None:
        raise UsageError(
            "set agent.weights to a trained agent (train-agent writes "
            "RUN/weights/final), e.g. --agent.weights runs/demo/agent/weights/final, or "
            "agent.server_url to a server that already serves it"
        )
    ecfg = cfg.train_agent.eval
    if ecfg.tasks == 0:
        raise UsageError("train_agent.eval.tasks is 0: nothing to evaluate")
    sim = cfg.simulator
    if "closed_loop" in ecfg.arms and sim.weights is None and sim.server_url is None:
        raise UsageError(
            "the closed_loop arm needs a trained simulator: set "
            "simulator.weights (train-sim writes RUN/weights/final) or simulator.server_url, "
            "or evaluate in the real shell only with --train_agent.eval.arms '[real]'"
        )
    for role in ("agent", "simulator"):
        weights = getattr(cfg, role).weights
        if weights is not None and not Path(weights).exists():
            raise UsageError(f"{role}.weights={weights!r} does not exist")
    check_servers(cfg, _roles(cfg))
    out = Path(args.out)
    write_config(cfg, out)
    results = evaluate_checkpoint(cfg, out)
    print_eval(results)
    print(f"simloop eval-agent: -> {out / rundir.EVAL}")
    return 0


def _roles(cfg: SimloopConfig) -> list[str]:
    """The model roles whose servers the arms need."""
    return ["agent", "simulator"] if "closed_loop" in cfg.train_agent.eval.arms else ["agent"]


def evaluate_checkpoint(cfg: SimloopConfig, out: Path) -> dict[str, dict]:
    """Start the servers the arms need (unless their URLs are set), evaluate, return
    `{arm: EvalResult dict}`."""
    return asyncio.run(_evaluate(cfg, out))


async def _evaluate(cfg: SimloopConfig, out: Path) -> dict[str, dict]:
    from launch.deploy.local import role_clients
    from launch.jobs.episodes import agent_tasks, evaluate_agent
    from rl.data import ChatRenderer, load_tokenizer

    renderer = ChatRenderer(load_tokenizer(cfg.agent.tokenizer))
    _, tasks = agent_tasks(cfg)
    async with role_clients(cfg, out, _roles(cfg), who="eval-agent") as clients:
        return await evaluate_agent(
            cfg,
            out,
            LABEL,
            None,
            clients,
            renderer,
            tasks,
            rundir.MetricsLog(out),
            who="eval-agent",
        )


def transfer_gap(results: dict[str, dict]) -> float | None:
    """Success in the simulator minus success in the real shell (None without both arms)."""
    if "real" not in results or "closed_loop" not in results:
        return None
    return results["closed_loop"]["success_rate"] - results["real"]["success_rate"]


def print_eval(results: dict[str, dict[str, Any]], top: int = 8) -> None:
    """Success by arm and operation, the transfer gap, and the action distributions."""
    from rich.console import Console
    from rich.table import Table

    from rl.orchestrator.evaluate import top_actions

    console = Console()
    arms = list(results)
    table = Table(title="agent success (held-out tasks)")
    table.add_column("")
    for arm in arms:
        table.add_column(arm, justify="right")
    table.add_row("all", *(f"{results[a]['success_rate']:.3f}" for a in arms))
    kinds = sorted({k for a in arms for k in results[a]["by_kind"]})
    for k in kinds:
        cells = [results[a]["by_kind"].get(k, {}).get("success_rate") for a in arms]
        table.add_row(k, *("-" if c is None else f"{c:.3f}" for c in cells))
    table.add_row("episodes", *(str(results[a]["episodes"]) for a in arms))
    console.print(table)
    gap = transfer_gap(results)
    if gap is not None:
        console.print(f"transfer gap (simulator - real): {gap:+.3f}")
    actions = Table(title=f"action distribution (top {top} commands)")
    actions.add_column("command")
    for arm in arms:
        actions.add_column(arm, justify="right")
    dists = [results[a].get("actions", {}) for a in arms]
    for k in top_actions(dists, top):
        actions.add_row(k, *(f"{d.get(k, 0.0):.3f}" for d in dists))
    console.print(actions)
