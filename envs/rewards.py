"""Reward functions by name: a task's `RewardSpec.name` picks one, its `params` configure it.

A reward function is `async fn(task, submission, ctx) -> float`: `submission` is the agent's
final answer (None when it never submitted), `ctx` gives what some rewards need, such as a
factory for a fresh shell; it may return a `Grade` (the reward and what decided it, which the
trajectory keeps). Built in: `exact_match` (here), `textops` (envs.textops), `swe_tests`
(envs.swe) and `swe_bench` (envs.swe_file); `register_reward` adds more.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from envs.shell import Shell, TaskSetup
from envs.tasks import Task


@dataclass(frozen=True)
class RewardContext:
    """What a reward function may use besides the task and the submission."""

    shell_factory: Callable[[TaskSetup], Shell] | None = None
    """Returns a fresh, unstarted shell with the given setup (for rewards that run tests)."""
    timeout_s: float = 300.0
    """Budget of each command a reward runs."""


@dataclass(frozen=True)
class Grade:
    """A reward with what decided it, for the trajectory (a reward function may return one in
    place of a float; `compute_grade` always does)."""

    reward: float
    details: dict = field(default_factory=dict)
    """JSON-able: e.g. `swe_bench`'s per-test results."""


RewardFn = Callable[[Task, str | None, RewardContext], Awaitable["float | Grade"]]
VerdictFn = Callable[[Task, str | None], str | None]
"""What a reward's checker says about a failed submission, for the feedback between trials:
an explanation of its decision, never the reference answer (None: nothing to say)."""

_REGISTRY: dict[str, RewardFn] = {}
_VERDICTS: dict[str, VerdictFn] = {}
_BUILTIN_MODULES = ("envs.textops", "envs.swe", "envs.swe_file")


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make `fn` the reward called `name`."""

    def register(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"reward {name!r} is already registered ({_REGISTRY[name]!r})")
        _REGISTRY[name] = fn
        return fn

    return register


def register_verdict(name: str) -> Callable[[VerdictFn], VerdictFn]:
    """Decorator: make `fn` the checker's verdict of the reward called `name`."""

    def register(fn: VerdictFn) -> VerdictFn:
        _VERDICTS[name] = fn
        return fn

    return register


def task_verdict(task: Task, submission: str | None) -> str:
    """The checker's verdict on a failed submission of `task` ("" when its reward has none)."""
    _load_builtins()
    fn = _VERDICTS.get(task.reward.name)
    return (fn(task, submission) or "") if fn is not None else ""


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:  # they register on import
        importlib.import_module(module)


def reward_names() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def get_reward(name: str) -> RewardFn:
    _load_builtins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"reward {name!r} is unknown: one of {sorted(_REGISTRY)}") from None


async def compute_grade(
    task: Task, submission: str | None, ctx: RewardContext | None = None
) -> Grade:
    """The task's reward for `submission` and what decided it (0.0 when nothing was
    submitted)."""
    fn = get_reward(task.reward.name)
    if submission is None:
        return Grade(0.0, {"submitted": False})
    out = await fn(task, submission, ctx or RewardContext())
    return out if isinstance(out, Grade) else Grade(float(out))


async def compute_reward(
    task: Task, submission: str | None, ctx: RewardContext | None = None
) -> float:
    """The task's reward for `submission` (0.0 when nothing was submitted)."""
    return (await compute_grade(task, submission, ctx)).reward


@register_reward("exact_match")
async def exact_match(task: Task, submission: str | None, ctx: RewardContext) -> float:
    """1.0 when the submission equals `params["expected"]`, surrounding whitespace ignored."""
    if "expected" not in task.reward.params:
        raise ValueError(f"task {task.id!r}: reward exact_match needs params.expected")
    expected = str(task.reward.params["expected"])
    return 1.0 if submission is not None and submission.strip() == expected.strip() else 0.0
