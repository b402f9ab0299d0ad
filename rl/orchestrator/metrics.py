"""Rollout metrics: the batch-tail table (episodes still active at each turn index), latency
split between agent and env, tokens/s, pathology and status counts, success rate, episodes
aborted by a replica that went down, and the serving pools' state (live, load, ejections)."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from rl.data.outcome import unshaped_reward
from rl.data.rundir import MetricsLog


class RolloutMetrics:
    def __init__(self) -> None:
        self.started_at = time.perf_counter()
        self.active = 0
        self.peak_active = 0
        self.episodes = 0
        self.turns_reached: Counter[int] = Counter()
        """turn index -> episodes that played that turn (the tail of the batch)."""
        self.agent_s: Counter[int] = Counter()
        self.env_s: Counter[int] = Counter()
        self.generated_tokens = 0
        self.flags: Counter[str] = Counter()
        self.statuses: Counter[str] = Counter()
        self.arms: Counter[str] = Counter()
        """Episodes by the arm they ran in (`real`, `closed_loop`, ...): what reality cost."""
        self.rewards: list[float] = []
        """Rewards trained on (the task's plus any shaping terms)."""
        self.task_rewards: list[float] = []
        """The same episodes' task rewards, before shaping: success is counted on these."""
        self.masked = 0
        self.dropped_stale = 0
        """Episodes the rollout buffer did not train on: older than the staleness bound."""
        self.replica_down: Counter[str] = Counter()
        """Replica URL -> episodes it aborted by going down under them."""
        self.pools: dict[str, Any] = {}
        """Role -> `serving.pool.ReplicaPool` (anything with `stats()`), summarised as is."""

    def episode_started(self) -> None:
        self.active += 1
        self.peak_active = max(self.peak_active, self.active)

    def episode_ended(self) -> None:
        self.active -= 1

    def record(self, result) -> None:
        traj = result.trajectory
        self.episodes += 1
        self.statuses[traj.status] += 1
        self.arms[traj.arm] += 1
        if traj.replica_down:
            self.replica_down[traj.replica_down] += 1
        if traj.reward is not None and traj.status in ("ok", "truncated"):
            self.rewards.append(float(traj.reward))
            self.task_rewards.append(float(unshaped_reward(traj) or 0.0))
        for t in result.timings:
            self.turns_reached[t.turn] += 1
            self.agent_s[t.turn] += t.agent_s
            self.env_s[t.turn] += t.env_s
            self.generated_tokens += t.generated
        for turn in traj.turns:
            self.flags.update(turn.flags)

    def summary(self) -> dict[str, Any]:
        wall = time.perf_counter() - self.started_at
        turns = sum(self.turns_reached.values())
        ok = self.statuses.get("ok", 0)
        out = {
            "episodes": self.episodes,
            "wall_s": round(wall, 3),
            "status": dict(self.statuses),
            "arms": dict(self.arms),
            "success_rate": (
                sum(r > 0 for r in self.task_rewards) / self.episodes if self.episodes else 0.0
            ),
            "ok_rate": ok / self.episodes if self.episodes else 0.0,
            "mean_reward": sum(self.rewards) / len(self.rewards) if self.rewards else 0.0,
            "mean_task_reward": (
                sum(self.task_rewards) / len(self.task_rewards) if self.task_rewards else 0.0
            ),
            "turns": turns,
            "generated_tokens": self.generated_tokens,
            "tokens_per_s": self.generated_tokens / wall if wall > 0 else 0.0,
            "agent_s_per_turn": sum(self.agent_s.values()) / turns if turns else 0.0,
            "env_s_per_turn": sum(self.env_s.values()) / turns if turns else 0.0,
            "active_per_turn": [self.turns_reached[k] for k in sorted(self.turns_reached)],
            "pathologies": dict(self.flags),
            "peak_active": self.peak_active,
            "dropped_stale": self.dropped_stale,
            "replica_down": dict(self.replica_down),
        }
        if self.pools:
            out["pools"] = {role: p.stats() for role, p in self.pools.items()}
        return out

    def write(self, log: MetricsLog, **extra: Any) -> None:
        """Append the summary as one record of the run's metrics log."""
        log.write({"time": time.time(), **extra, **self.summary()})
