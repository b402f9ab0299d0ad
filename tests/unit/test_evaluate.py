"""Policy evaluation (`rl.orchestrator.evaluate`): real episodes in a real LocalShell, scored
with the reward the trainer sees, broken down by task kind."""

from __future__ import annotations

import dataclasses

import pytest

from envs.config import LocalShellConfig, TerminalConfig, TextopsConfig
from envs.local import LocalShell
from envs.textops import generate_textops
from rl.data import ByteTokenizer, ChatRenderer
from rl.data.trajectory import Trajectory
from rl.orchestrator.config import OrchestratorConfig
from rl.orchestrator.evaluate import evaluate_policy, score, task_kind
from rl.orchestrator.runner import Backends
from rl.orchestrator.scripted import ScriptedAgentClient
from rl.train.config import AgentEvalConfig

TOK = ByteTokenizer()
TERMINAL = TerminalConfig(max_turns=2)
OCFG = OrchestratorConfig(max_context_tokens=4096, max_tokens_per_turn=256)


def _tasks(n: int = 6):
    return generate_textops(TextopsConfig(num_tasks=n, ops=["reverse", "upper", "sort"], seed=3))


def _backends() -> Backends:
    return Backends(real=lambda task: LocalShell(LocalShellConfig(), setup=task.setup))


async def _evaluate(tasks, noise: float, samples: int = 2, **kw):
    client = ScriptedAgentClient(
        tasks, TOK, style="marker", noise=noise, noise_kinds=("other_op",), seed=0
    )
    return await evaluate_policy(
        OCFG, TERMINAL, ChatRenderer(TOK), _backends(), client, tasks, samples=samples, **kw
    )


async def test_an_expert_scores_one_and_a_wrong_operation_scores_zero():
    tasks = _tasks()
    kept: list[Trajectory] = []
    expert = await _evaluate(tasks, noise=0.0, version=7, sink=kept.append)
    assert expert.success_rate == 1.0 and expert.reward_mean == 1.0
    assert expert.episodes == len(kept) == 2 * len(tasks) and expert.tasks == len(tasks)
    assert expert.version == 7 and expert.arm == "real" and expert.statuses == {"ok": 12}
    kinds = {task_kind(t) for t in tasks}
    assert set(expert.by_kind) == kinds
    assert sum(v["episodes"] for v in expert.by_kind.values()) == 12
    # Every reply runs another operation's command: every episode fails, none is skipped.
    wrong = await _evaluate(tasks, noise=1.0)
    assert wrong.success_rate == 0.0 and wrong.episodes == 12
    assert all(v["success_rate"] == 0.0 for v in wrong.by_kind.values())
    assert wrong.to_dict()["by_kind"] == wrong.by_kind


def test_missing_rewards_count_as_failures():
    tasks = _tasks(2)
    ok = Trajectory(tasks[0].id, "real", "local", "ok", reward=1.0)
    lost = Trajectory(tasks[1].id, "real", "local", "error", reward=None)
    r = score([ok, lost], tasks, "real", 3)
    assert r.success_rate == 0.5 and r.statuses == {"ok": 1, "error": 1}
    assert r.by_kind[task_kind(tasks[1])]["success_rate"] == 0.0


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"arm": "replay"}, "evaluation arm 'replay' is invalid"),
        ({"samples": 0}, "samples=0 is invalid"),
    ],
)
async def test_bad_arguments_say_what_is_allowed(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        await _evaluate(_tasks(1), noise=0.0, **kwargs)
    with pytest.raises(ValueError, match="at least one task"):
        await evaluate_policy(OCFG, TERMINAL, ChatRenderer(TOK), _backends(), None, [])


def test_eval_config_validation():
    assert AgentEvalConfig().arms == ["real"]
    with pytest.raises(ValueError, match="AgentEvalConfig.arms"):
        AgentEvalConfig(arms=["replay"])
    with pytest.raises(ValueError, match="AgentEvalConfig.samples"):
        AgentEvalConfig(samples=0)
    assert dataclasses.replace(AgentEvalConfig(), tasks=0).tasks == 0


def test_held_out_tasks_follow_the_training_tasks():
    from launch.config.loading import load_config
    from launch.config.schema import SimloopConfig
    from launch.jobs.episodes import agent_tasks

    cfg = load_config(
        SimloopConfig, None, ["--env.textops.num_tasks", "10", "--train_agent.eval.tasks", "5"]
    )
    train, held = agent_tasks(cfg)
    assert len(train) == 10 and len(held) == 5
    assert [t.id for t in train] == [t.id for t in generate_textops(cfg.env.textops)]
    assert not {t.id for t in train} & {t.id for t in held}
