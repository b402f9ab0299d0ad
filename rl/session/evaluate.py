"""The held-out evaluation of a served policy (`train-agent` before and after RL,
`eval-agent`): every arm of `AgentEvalConfig.arms`, written to `eval.json`, `metrics.jsonl`
and `trajectories/eval-*`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from envs.config import TerminalConfig
from rl.data import rundir
from rl.orchestrator.config import OrchestratorConfig
from rl.train.config import AgentEvalConfig

EVAL_SEED_OFFSET = 1_000_003
"""Evaluation samples at `run.seed + EVAL_SEED_OFFSET`: never the training episodes' seeds."""


async def evaluate_agent(
    *,
    out: Path,
    label: str,
    version: int | None,
    agent: Any,
    backends: Callable[[], Any],
    renderer,
    tasks: list,
    metrics: rundir.MetricsLog,
    eval_cfg: AgentEvalConfig,
    orchestrator: OrchestratorConfig,
    terminal: TerminalConfig,
    seed: int,
    who: str = "train-agent",
) -> dict:
    """Evaluate the policy `agent` serves (`version`, None when unknown) on `tasks`, in each
    arm with fresh shell `backends()`; results are saved under `label`. `who` names the
    subcommand in the progress lines."""
    from rl.orchestrator.evaluate import evaluate_policy
    from rl.orchestrator.storage import TrajectoryWriter

    title = f"{label} RL" if who == "train-agent" else label
    policy = "policy" if version is None else f"policy v{version}"
    saved = rundir.read_evals(out)
    results = {}
    for arm in eval_cfg.arms:
        writer = TrajectoryWriter(out, prefix=f"eval-{label}-{arm}")
        try:
            r = await evaluate_policy(
                orchestrator,
                terminal,
                renderer,
                backends(),
                agent,
                tasks,
                arm=arm,
                samples=eval_cfg.samples,
                seed=seed + EVAL_SEED_OFFSET,
                version=version,
                sink=writer.add,
            )
        finally:
            writer.close()
        results[arm] = r.to_dict()
        metrics.write({"stage": "eval", "label": label, **results[arm]})
        kinds = " ".join(f"{k} {v['success_rate']:.2f}" for k, v in r.by_kind.items())
        print(
            f"simloop {who}: eval {title}, {arm}: {policy} success {r.success_rate:.3f} over "
            f"{r.episodes} episodes ({kinds}) in {r.wall_s:.0f}s",
            flush=True,
        )
    saved[label] = results
    if rundir.is_writer():
        (out / rundir.EVAL).write_text(json.dumps(saved, indent=1))
    return results
