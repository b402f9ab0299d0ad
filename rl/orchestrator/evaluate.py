"""Policy evaluation: a fixed task set, `samples` episodes per task, in one arm (the real shell
or the simulator), scored by the same reward the trainer sees.

Used by `simloop train-agent` before and after RL (held-out tasks) and by the demo; the
result is plain JSON (`EvalResult.to_dict`).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from envs.config import TerminalConfig
from envs.tasks import Task
from rl.data.outcome import success_trial, trial_metrics, unshaped_reward
from rl.data.trajectory import Trajectory
from rl.orchestrator.config import OrchestratorConfig
from rl.orchestrator.runner import Backends, RolloutRunner

EVAL_ARMS = ("real", "closed_loop")


@dataclass
class EvalResult:
    """Success of one policy version on one task set in one arm."""

    arm: str
    version: int | None
    tasks: int
    episodes: int
    success_rate: float
    """Share of all episodes (errors and truncations count as failures) that succeeded: a
    task reward >= 1 (in some trial, for multi-trial episodes); shaping never counts."""
    reward_mean: float
    """Mean task reward over all episodes (a missing one is 0), before any shaping."""
    statuses: dict[str, int] = field(default_factory=dict)
    by_kind: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per task kind (the textops operation, else the task family): episodes and success."""
    turns_mean: float = 0.0
    wall_s: float = 0.0
    actions: dict[str, float] = field(default_factory=dict)
    """The action distribution: share of the agent's commands by `command_key` (the programs
    of the command's last pipeline), most frequent first."""
    trials: dict[str, Any] = field(default_factory=dict)
    """Multi-trial episodes (`rl.data.outcome.trial_metrics`): success by trial k, the
    adaptation delta, turns per trial. Empty for single-trial episodes."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def task_kind(task: Task) -> str:
    return task.kind


def score(
    episodes: Sequence[Trajectory], tasks: Sequence[Task], arm: str, version: int | None
) -> EvalResult:
    """Aggregate finished episodes (a missing reward is a failure, never skipped), on the
    task's rewards: shaping (`env.terminal.shaping`) changes no number here."""
    kinds = {t.id: task_kind(t) for t in tasks}
    rewards = [float(unshaped_reward(e) or 0.0) for e in episodes]
    wins = [success_trial(e) is not None for e in episodes]
    per: dict[str, list[bool]] = defaultdict(list)
    for e, w in zip(episodes, wins, strict=True):
        per[kinds.get(e.task_id, "task")].append(w)
    n = max(len(episodes), 1)
    return EvalResult(
        arm=arm,
        version=version,
        tasks=len(tasks),
        episodes=len(episodes),
        success_rate=sum(wins) / n,
        reward_mean=sum(rewards) / n,
        statuses=dict(Counter(e.status for e in episodes)),
        by_kind={
            k: {"episodes": len(v), "success_rate": sum(v) / len(v)} for k, v in sorted(per.items())
        },
        turns_mean=sum(len(e.turns) for e in episodes) / n,
        actions=action_distribution(episodes),
        trials=trial_metrics(episodes) if any(e.trials for e in episodes) else {},
    )


def action_distribution(episodes: Sequence[Trajectory]) -> dict[str, float]:
    """Share of the commands the agent ran, by `command_key`, most frequent first (turns whose
    reply held no command count as `(no command)`)."""
    keys = Counter(
        command_key(t.command) if t.command is not None else "(no command)"
        for e in episodes
        for t in e.turns
    )
    total = sum(keys.values())
    return {k: c / total for k, c in keys.most_common()}


def top_actions(distributions: Sequence[dict[str, float]], top: int) -> list[str]:
    """The `top` commands with the largest summed share over several action distributions
    (the rows of a side-by-side table)."""
    totals: Counter[str] = Counter()
    for dist in distributions:
        totals.update(dist)
    return [k for k, _ in totals.most_common(top)]


async def evaluate_policy(
    ocfg: OrchestratorConfig,
    terminal: TerminalConfig,
    renderer,
    backends: Backends,
    client,
    tasks: Sequence[Task],
    *,
    arm: str = "real",
    samples: int = 4,
    seed: int = 0,
    version: int | None = None,
    sink: Callable[[Trajectory], None] | None = None,
) -> EvalResult:
    """Run `samples` episodes of every task in `arm` with the policy `client` serves.

    Sampling uses the rollout settings of `ocfg` (temperature, limits) with a fixed seed, so
    two versions are compared on the same tasks and the same random streams."""
    if arm not in EVAL_ARMS:
        raise ValueError(f"evaluation arm {arm!r} is invalid: one of {list(EVAL_ARMS)}")
    if not tasks:
        raise ValueError("evaluation needs at least one task")
    if not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples={samples!r} is invalid: a positive integer")
    cfg = dataclasses.replace(
        ocfg, arm=arm, group_size=samples, max_staleness=None, seed=seed, mixed_real_fraction=0.0
    )
    runner = RolloutRunner(
        cfg, terminal, renderer, backends, client=client, sinks=() if sink is None else (sink,)
    )
    began = time.perf_counter()
    episodes = await runner.run(list(tasks))
    result = score(episodes, tasks, arm, version)
    result.wall_s = time.perf_counter() - began
    return result


# ----- arm (c): simulator fidelity from replayed trajectories ---------------------------------


def command_key(command: str, max_programs: int = 4) -> str:
    """A short name for a command, to group fidelity by: the programs of its last non-empty
    line's pipeline (`tr -d '\\n' < input.txt | rev` -> `tr | rev`)."""
    lines = [ln.strip() for ln in command.strip().splitlines() if ln.strip()]
    if not lines:
        return "(empty)"
    programs = []
    for stage in lines[-1].split("|"):
        words = [w for w in stage.split() if w[:1] not in "<>" and "=" not in w[:1]]
        if words:
            programs.append(words[0].split("/")[-1])
    return " | ".join(programs[:max_programs]) or "(empty)"


def replay_fidelity(
    trajectories: Sequence[Trajectory],
    *,
    context_edges: Sequence[int] = (256, 512, 1024, 2048),
    depth_edges: Sequence[int] = (1, 4, 8, 16),
    state_edges: Sequence[int] = (2, 3, 5, 8),
    top_commands: int = 8,
) -> dict[str, Any]:
    """Fidelity of the simulator from arm (c) replays: every turn with both a real and a
    simulated observation is one pair. Returns pair metrics (exact match, masked exact match,
    return-code agreement, similarity, length ratio), the simulated observations' hygiene
    rates (cap hit, think leak, repetition, empty, malformed) next to the same rates of the
    real observations, and pair metrics by prompt length, by depth (the turns of the session
    before the command: the same axis whether or not the simulator's context was compacted or
    cut), by state distance (`envs.shellstate`: the turns since the episode last wrote a
    file the command reads; `state_dependent` is the share of observations with one, and
    `state_distance_3plus` their pairs at distance >= 3), by command and by the replayed
    task's kind (`task_kind`, e.g. the textops operation)."""
    from envs.fidelity import (
        Hygiene,
        compare_observations,
        observation_hygiene,
        summarize_by,
        summarize_hygiene,
        summarize_pairs,
    )
    from envs.shellstate import state_distances

    pairs, keyed, deep, sim_hygiene, real_hygiene, stateful = [], [], [], [], [], []
    by_command: dict[str, list] = defaultdict(list)
    by_kind: dict[str, list] = defaultdict(list)
    malformed = 0
    statuses = Counter(t.status for t in trajectories)
    for traj in trajectories:
        distances = state_distances([turn.command for turn in traj.turns])
        for depth, turn in enumerate(traj.turns):
            if turn.sim_observation is None or turn.observation is None:
                continue
            m = compare_observations(
                turn.sim_observation, turn.observation, turn.sim_exit_code, turn.exit_code
            )
            pairs.append(m)
            deep.append((depth, m))
            if distances[depth] is not None:
                stateful.append((distances[depth], m))
            flags = set(turn.flags)
            sim_hygiene.append(
                Hygiene(
                    cap_hit="cap_hit" in flags,
                    think_leak="think_leak" in flags,
                    repetition="repetition" in flags,
                    empty="empty" in flags,
                )
            )
            malformed += "malformed" in flags
            real_hygiene.append(observation_hygiene(turn.observation))
            tokens = (turn.info or {}).get("prompt_tokens")
            if isinstance(tokens, int):
                keyed.append((tokens, m))
            by_command[command_key(turn.command or "")].append(m)
            if traj.task_kind:
                by_kind[traj.task_kind].append(m)
    ranked = sorted(by_command.items(), key=lambda kv: -len(kv[1]))
    commands = {k: summarize_pairs(v) for k, v in ranked[:top_commands]}
    rest = [m for _, v in ranked[top_commands:] for m in v]
    if rest:
        commands["(other)"] = summarize_pairs(rest)
    hygiene = summarize_hygiene(sim_hygiene)
    if pairs:
        hygiene["malformed"] = malformed / len(pairs)
    return {
        "trajectories": len(trajectories),
        "statuses": dict(statuses),
        "pairs": summarize_pairs(pairs),
        "hygiene": hygiene,
        "real_hygiene": summarize_hygiene(real_hygiene),
        "by_context": summarize_by(keyed, list(context_edges)),
        "by_depth": summarize_by(deep, list(depth_edges)),
        "by_state_distance": summarize_by(stateful, list(state_edges)),
        "state_dependent": {
            "count": len(stateful),
            "share": len(stateful) / len(pairs) if pairs else 0.0,
        },
        "state_distance_3plus": summarize_pairs([m for d, m in stateful if d >= 3]),
        "by_command": commands,
        "by_kind": {k: summarize_pairs(v) for k, v in sorted(by_kind.items())},
    }


def workspace_fidelity(
    replays: Sequence[Trajectory],
    real_states: Callable[[Trajectory], Sequence[dict[str, str]] | None],
    *,
    top_commands: int = 8,
) -> dict[str, Any]:
    """How a workspace-mode simulator keeps the files, from arm (c) replays (each turn's
    `info["sim_changes"]`: the changes block it wrote, None for none) against the real
    workspaces (`real_states(replay)`: [at the start, after each replayed command], as
    `envs.workspace.replay_workspaces` reads them). Its own files start as the task's and take
    each block it wrote, as `SimulatedShell` applies them (a block that does not parse
    changes nothing).

    Returns `state_exact` (turns after which its files equal the real ones), `write_exact`
    (turns that changed files, in reality or by its account, taken with its files right
    before: the share that left them right), observation exact match with its files right
    and with them wrong before the command, and `first_wrong_write` by command: where each
    replay first lost the state (`writes`: that command's writes from a right state,
    `wrong`: those that left it wrong). Replays without `sim_changes` (not workspace mode)
    or without real states are left out (`skipped`)."""
    from envs.fidelity import compare_observations
    from rl.data.sim_format import apply_written_block, start_workspace

    turns = state_right = writes = writes_right = skipped = 0
    obs_right: list[bool] = []
    obs_wrong: list[bool] = []
    by_command: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for traj in replays:
        scored = [t for t in traj.turns if t.sim_observation is not None]
        states = real_states(traj) if scored else None
        if (
            not scored
            or any("sim_changes" not in (t.info or {}) for t in scored)
            or states is None
            or len(states) != len(scored) + 1
        ):
            skipped += 1
            continue
        mine = start_workspace(states[0])
        for k, turn in enumerate(scored):
            before_right = dict(mine) == dict(states[k])
            body = turn.info["sim_changes"]
            if body is not None:
                mine, _ = apply_written_block(mine, body)
            after_right = dict(mine) == dict(states[k + 1])
            exact = compare_observations(
                turn.sim_observation, turn.observation, turn.sim_exit_code, turn.exit_code
            ).exact_masked
            (obs_right if before_right else obs_wrong).append(exact)
            turns += 1
            state_right += after_right
            if before_right and (body is not None or states[k] != states[k + 1]):
                writes += 1
                writes_right += after_right
                counts = by_command[command_key(turn.command or "")]
                counts[0] += 1
                counts[1] += not after_right

    def rate(num: float, den: int) -> float | None:
        return num / den if den else None

    ranked = sorted(by_command.items(), key=lambda kv: (-kv[1][1], -kv[1][0], kv[0]))
    return {
        "replays": len(replays) - skipped,
        "skipped": skipped,
        "turns": turns,
        "state_exact": rate(state_right, turns),
        "writes": writes,
        "write_exact": rate(writes_right, writes),
        "observation_exact_state_right": rate(sum(obs_right), len(obs_right)),
        "observation_exact_state_wrong": rate(sum(obs_wrong), len(obs_wrong)),
        "turns_state_wrong": len(obs_wrong),
        "first_wrong_write": {k: {"writes": n, "wrong": w} for k, (n, w) in ranked[:top_commands]},
    }
