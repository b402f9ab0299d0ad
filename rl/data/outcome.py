"""What an episode achieved, read off its trajectory: success (on the task's reward, never the
shaped one), multi-trial success by trial k, and the reward shaping adds
(`env.terminal.shaping`: `reward` is the task's reward plus the `shaping` terms; `task_reward`
is the task's own).

The functions take anything shaped like `rl.data.trajectory.Trajectory` (`Episode`), so this
module sits below it: the trajectory's validator checks `reward` with `shaped_reward`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

SUCCESS_REWARD = 1.0
"""An episode (or trial) succeeds when its task reward reaches this (textops and SWE rewards
are 0 or 1; a multi-trial episode's discounted reward may be lower, its trial's is not)."""


class _TrialRecord(Protocol):
    @property
    def index(self) -> int: ...

    @property
    def reward(self) -> float | None: ...

    @property
    def start_turn(self) -> int: ...

    @property
    def end_turn(self) -> int: ...


class Episode(Protocol):
    """What these functions read of a trajectory."""

    @property
    def reward(self) -> float | None: ...

    @property
    def task_reward(self) -> float | None: ...

    @property
    def trials(self) -> Sequence[_TrialRecord]: ...

    @property
    def turns(self) -> Sequence[Any]: ...


def shaped_reward(task_reward: float, shaping: Mapping[str, float]) -> float:
    """The reward training sees: the task's plus the shaping terms (exactly the task's
    without any)."""
    return task_reward + math.fsum(shaping.values()) if shaping else task_reward


def unshaped_reward(traj: Episode) -> float | None:
    """The episode's task reward, without shaping: `task_reward`, else `reward` (which then
    holds no shaping)."""
    return traj.task_reward if traj.task_reward is not None else traj.reward


def success_trial(traj: Episode) -> int | None:
    """The index of the trial that succeeded (0 for a successful single-trial episode), or
    None when the episode did not succeed. Decided on the task's reward, never the shaped
    one (trials record the task's)."""
    if traj.trials:
        return next(
            (t.index for t in traj.trials if t.reward is not None and t.reward >= SUCCESS_REWARD),
            None,
        )
    return 0 if (unshaped_reward(traj) or 0.0) >= SUCCESS_REWARD else None


def trial_metrics(episodes: Iterable[Episode], trials: int | None = None) -> dict[str, Any]:
    """Multi-trial numbers over `episodes` (every episode counts; a failure is a failure):
    `success_at[k-1]`, the share that succeeded by trial k; `adaptation_delta`, success by
    trial 2 minus by trial 1; `turns_per_trial[k-1]`, the mean turns of trial k over the
    episodes that reached it; `reached[k-1]`, how many did."""
    eps = list(episodes)
    k_max = trials or max([len(t.trials) or 1 for t in eps], default=1)
    n = max(len(eps), 1)
    won = [success_trial(t) for t in eps]
    success_at = [sum(w is not None and w < k for w in won) / n for k in range(1, k_max + 1)]
    turns: list[list[int]] = [[] for _ in range(k_max)]
    for t in eps:
        spans = [(x.start_turn, x.end_turn) for x in t.trials] or [(0, len(t.turns))]
        for k, (a, b) in enumerate(spans[:k_max]):
            turns[k].append(b - a)
    return {
        "trials": k_max,
        "success_at": success_at,
        "adaptation_delta": success_at[1] - success_at[0] if k_max > 1 else 0.0,
        "turns_per_trial": [sum(v) / len(v) if v else 0.0 for v in turns],
        "reached": [len(v) for v in turns],
    }
