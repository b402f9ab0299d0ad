"""RL episodes from unmodified harnesses (`train_agent.tasks: swe`): the middleware in front
of the agent server, and a `HarnessSource` running `harness.kind` against it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from rl.orchestrator.harness import HarnessConfig


class HarnessUnusable(RuntimeError):
    """No launcher can run the configured harness here (the job reports it and exits)."""


@dataclass(frozen=True)
class HarnessSetup:
    """What RL through harnesses takes from the job: the harness settings and the middleware,
    `middleware(agent_client, on_written)`: an async context that serves the agent's APIs in
    front of `agent_client`, hands every finished rollout's trajectories to `on_written`, and
    yields an object with `.url` and `.admin` (the rollouts' admin access)."""

    config: HarnessConfig
    middleware: Callable[[Any, Callable[[list], None]], Any]


@contextlib.asynccontextmanager
async def harness_source(
    setup: HarnessSetup,
    real_backend,
    agent_client,
    tasks: list,
    *,
    group_size: int,
    batch_size: int,
    seq_len: int,
    max_staleness: int,
    steps: int,
    seed: int,
) -> AsyncIterator[Any]:
    """An episode source of `steps` batches of `batch_size` rollouts (`group_size` per task)
    of the harness in sandboxes of `real_backend`, at most `max_staleness` versions behind the
    trainer, their segments packed into `batch_size` rows of `seq_len`."""
    from rl.orchestrator.harness import (
        HarnessRunner,
        HarnessSource,
        HarnessUnavailable,
        pick_launcher,
    )

    hcfg = setup.config
    try:
        launcher = await pick_launcher(hcfg, real_backend, tasks[0])
    except HarnessUnavailable as e:
        raise HarnessUnusable(str(e)) from e

    def written(trajectories) -> None:  # the middleware's sink -> the source (bound below)
        source.collect(trajectories)

    async with setup.middleware(agent_client, written) as running:
        runner = HarnessRunner(hcfg, real_backend, running.url, launcher, admin=running.admin)
        source = HarnessSource(
            runner,
            tasks,
            group_size=group_size,
            groups=batch_size // group_size,
            rows=batch_size,
            seq_len=seq_len,
            steps=steps,
            max_staleness=max_staleness,
            seed=seed,
        )
        print(
            f"simloop train-agent: RL through {hcfg.kind} on {len(tasks)} swe tasks, "
            f"{batch_size // group_size} x {group_size} rollouts per step, max_staleness "
            f"{max_staleness} (middleware {running.url})",
            flush=True,
        )
        yield source


def harness_summary(source) -> dict:
    """Rollouts, their statuses and mean reward, trajectories written, segments dropped."""
    results = source.results
    rewards = [r.reward for r in results if r.reward is not None]
    statuses: dict[str, int] = {}
    for r in results:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    return {
        "rollouts": len(results),
        "statuses": statuses,
        "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        "trajectories": sum(r.finish.get("trajectories") or 0 for r in results),
        "dropped_segments": source.dropped_segments,
        "dropped_stale": source.dropped_stale,
    }
