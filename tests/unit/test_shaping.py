"""Reward shaping (`env.terminal.shaping`): off by default and then nothing changes; each term
on scripted episodes in real bash (one trial and several); the task's reward kept apart on the
trajectory, so success rates are exact whatever the shaping; the batch statistics that log
the terms; the config's checks and its YAML / command-line form."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from envs.config import LocalShellConfig, ShapingConfig, TerminalConfig, TextopsConfig
from envs.local import LocalShell
from envs.shell import TaskSetup
from envs.tasks import RewardSpec, Task
from envs.terminal import TerminalEnv, TrialEnv, shaping_terms
from envs.textops import generate_textops, textops_truth
from launch.config.loading import ConfigError, dump_config, load_config
from launch.config.schema import SimloopConfig
from launch.report.thesis import success_rate as thesis_success_rate
from rl.data import ByteTokenizer, ChatRenderer
from rl.data.outcome import shaped_reward, success_trial, unshaped_reward
from rl.data.trajectory import Trajectory, read_jsonl, validate, write_jsonl
from rl.orchestrator.config import OrchestratorConfig
from rl.orchestrator.evaluate import score
from rl.orchestrator.runner import Backends, RolloutRunner
from rl.train.config import PolicyLossConfig
from rl.train.rollouts import build_rl_batch

RENDERER = ChatRenderer(ByteTokenizer())
TASK = Task(
    id="f-0",
    instruction="Submit the secret.",
    family="fileops",
    setup=TaskSetup(files={"secret.txt": "hunter2\n"}),
    reward=RewardSpec("exact_match", {"expected": "hunter2"}),
)
# Powers of two: every sum below is exact in floating point, so results compare with ==.
SHAPING = ShapingConfig(
    format_bonus=0.25, turn_budget=2, per_turn_penalty=0.125, per_call_penalty=0.0625
)
SHAPED = TerminalConfig(shaping={"fileops": SHAPING})


def bash(command: str) -> str:
    return f"```bash\n{command}\n```"


def local(task: Task) -> LocalShell:
    return LocalShell(LocalShellConfig(), setup=task.setup)


async def play(replies: list[str], config: TerminalConfig, task: Task = TASK) -> list:
    """The step results of `replies` in a `TerminalEnv` on a real shell (until it ends)."""
    results = []
    async with local(task) as shell:
        env = TerminalEnv(task, shell, config)
        await env.reset()
        for reply in replies:
            results.append(await env.step(reply))
            if env.done:
                break
    return results


async def test_shaping_off_leaves_every_step_as_it_was():
    replies = ["no block", bash("cat secret.txt"), bash("echo hi"), bash("submit hunter2")]
    base = await play(replies, TerminalConfig())
    final = base[-1]
    assert final.done and final.reward == final.task_reward == 1.0 and final.shaping == {}
    for config in (
        TerminalConfig(shaping={"textops": SHAPING}),  # another family's shaping
        TerminalConfig(shaping={"fileops": ShapingConfig()}),  # every weight 0
        TerminalConfig(shaping={"fileops": ShapingConfig(turn_budget=1)}),  # a budget, no cost
    ):
        got = await play(replies, config)
        assert [(r.done, r.reward, r.task_reward, r.shaping) for r in got] == [
            (r.done, r.reward, r.task_reward, r.shaping) for r in base
        ]
        assert [r.observation for r in got] == [r.observation for r in base]
    assert shaping_terms(None, turns=9, format_errors=0, calls=9) == {}
    assert shaping_terms(ShapingConfig(), turns=9, format_errors=0, calls=9) == {}


@pytest.mark.parametrize(
    ("replies", "config", "task_reward", "terms"),
    [
        # 4 turns (2 beyond the budget), 3 commands, no malformed reply: every term.
        ([bash("cat secret.txt"), bash("echo x"), bash("true"), bash("submit hunter2")], SHAPED,
         1.0, {"format_bonus": 0.25, "turn_penalty": -0.25, "call_penalty": -0.1875}),
        # A malformed reply loses the bonus; a `submit` runs nothing, so is no call.
        (["two\n" + bash("ls") + bash("pwd"), bash("cat secret.txt"), bash("submit nope")],
         SHAPED, 0.0, {"format_bonus": 0.0, "turn_penalty": -0.125, "call_penalty": -0.0625}),
        # A marker submission's block runs in the shell: one call, within the turn budget.
        ([bash("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; cat secret.txt")], SHAPED,
         1.0, {"format_bonus": 0.25, "turn_penalty": 0.0, "call_penalty": -0.0625}),
        # The turn limit ends the episode unscored: still shaped.
        ([bash("true")] * 3, TerminalConfig(max_turns=3, shaping={"fileops": SHAPING}),
         0.0, {"format_bonus": 0.25, "turn_penalty": -0.125, "call_penalty": -0.1875}),
        # Only the weights set are terms.
        ([bash("true"), bash("submit hunter2")],
         TerminalConfig(shaping={"fileops": ShapingConfig(per_call_penalty=0.5)}),
         1.0, {"call_penalty": -0.5}),
    ],
)  # fmt: skip
async def test_each_term_of_a_scripted_episode(replies, config, task_reward, terms):
    final = (await play(replies, config))[-1]
    assert final.done and final.task_reward == task_reward
    assert final.shaping == terms
    assert final.reward == task_reward + sum(terms.values())
    assert all(str(v) != "-0.0" for v in final.shaping.values())  # no signed zeros in JSON


async def test_several_trials_are_shaped_once_over_the_whole_episode():
    cfg = TerminalConfig(trials=2, max_turns=10, shaping={"fileops": SHAPING})
    async with TrialEnv(TASK, local, cfg) as env:
        await env.reset()
        assert not (await env.step("no block")).done
        r = await env.step(bash("submit nope"))  # trial 1 fails: no shaping yet
        assert not r.done and r.shaping == {} and r.task_reward is None
        assert not (await env.step(bash("cat secret.txt"))).done
        r = await env.step(bash("submit hunter2"))
    # Trial records keep the task's rewards: success by trial k is exact.
    assert [t["reward"] for t in env.trials] == [0.0, 1.0]
    # 4 turns in all (2 beyond the budget), 1 command, 1 malformed reply (in trial 1).
    terms = {"format_bonus": 0.0, "turn_penalty": -0.25, "call_penalty": -0.0625}
    assert r.done and r.task_reward == 0.6 and r.shaping == terms  # first_success: 1.0 * 0.6
    assert r.reward == shaped_reward(0.6, terms) == pytest.approx(0.6 - 0.3125, abs=1e-15)


# ----- success stays exact ---------------------------------------------------------------------


class SubmittingClient:
    """An agent server that submits at once: the right answer for the tasks in `right`, a
    wrong one for the others. Every reply is well formed."""

    def __init__(self, tasks, right):
        self.tok = ByteTokenizer()
        self.tasks = {t.instruction: t for t in tasks}
        self.right = {t.id for t in right}

    async def complete(self, prompt, *, max_tokens, **_):
        task = next(t for i, t in self.tasks.items() if i in self.tok.decode(prompt))
        answer = textops_truth(dict(task.reward.params)) if task.id in self.right else "wrong"
        gen = self.tok.encode(bash(f"submit {answer}")) + [self.tok.eos_id]
        return SimpleNamespace(
            text=bash(f"submit {answer}"),
            token_ids=gen,
            finish_reason="stop",
            logprobs=[-0.5] * len(gen),
            token_versions=[0] * len(gen),
            weight_version=0,
        )


async def run_episodes(terminal: TerminalConfig, tasks, right) -> tuple[list[Trajectory], dict]:
    runner = RolloutRunner(
        OrchestratorConfig(arm="real", group_size=2),
        terminal,
        RENDERER,
        Backends(real=local),
        client=SubmittingClient(tasks, right),
    )
    return await runner.run(tasks), runner.metrics.summary()


async def test_a_format_bonus_that_lifts_a_failure_to_1_changes_no_success_rate(tmp_path):
    tasks = generate_textops(TextopsConfig(num_tasks=2, seed=1))
    right = tasks[:1]
    lift = TerminalConfig(shaping={"textops": ShapingConfig(format_bonus=1.0)})
    plain, plain_metrics = await run_episodes(TerminalConfig(), tasks, right)
    shaped, shaped_metrics = await run_episodes(lift, tasks, right)
    for t in plain:
        validate(t)
        assert t.reward == t.task_reward and t.shaping == {}
    for t in shaped:
        validate(t)
        won = t.task_id == right[0].id
        assert t.task_reward == (1.0 if won else 0.0) and t.shaping == {"format_bonus": 1.0}
        assert t.reward == t.task_reward + 1.0  # a failure trains on 1.0: "success" shaped
        assert unshaped_reward(t) == t.task_reward
        assert (success_trial(t) is not None) == won
    # Evaluation, the RL batch, rollout metrics and the report: all on the task's reward.
    before, after = score(plain, tasks, "real", 0), score(shaped, tasks, "real", 0)
    assert after.success_rate == before.success_rate == 0.5
    assert after.reward_mean == before.reward_mean == 0.5
    assert after.by_kind == before.by_kind
    assert shaped_metrics["success_rate"] == plain_metrics["success_rate"] == 0.5
    assert shaped_metrics["mean_reward"] == 1.5 and shaped_metrics["mean_task_reward"] == 0.5
    assert thesis_success_rate(shaped) == thesis_success_rate(plain) == 0.5
    seq_len = max(len(t.token_ids) for t in shaped)
    cfg = PolicyLossConfig()
    _, stats = build_rl_batch(shaped, rows=4, seq_len=seq_len, cfg=cfg, version=0)
    _, base = build_rl_batch(plain, rows=4, seq_len=seq_len, cfg=cfg, version=0)
    assert stats.success_rate == base.success_rate == 0.5
    assert (stats.reward_mean, stats.task_reward_mean) == (1.5, 0.5)
    assert (base.reward_mean, base.task_reward_mean, base.shaping) == (0.5, 0.5, {})
    record = stats.to_dict()
    assert record["shaping_format_bonus"] == 1.0 and "shaping" not in record
    assert not any(k.startswith("shaping") for k in base.to_dict())
    # The fields survive the JSONL shards the runs write.
    write_jsonl(tmp_path / "s.jsonl", shaped)
    assert read_jsonl(tmp_path / "s.jsonl") == shaped


def test_batch_stats_average_each_term_over_the_used_episodes():
    def traj(task: float, shaping: dict[str, float], group: str) -> Trajectory:
        gen = [5, 6, 7]
        return Trajectory(
            task_id=group,
            arm="real",
            env_backend="local",
            status="ok",
            reward=shaped_reward(task, shaping),
            group_id=group,
            token_ids=[1, 2, *gen],
            loss_mask=[0, 0, 1, 1, 1],
            behavior_logprobs=[None, None, -0.5, -0.5, -0.5],
            policy_version=[None, None, 0, 0, 0],
            task_reward=task,
            shaping=shaping,
        )

    eps = [
        traj(1.0, {"call_penalty": -0.5, "format_bonus": 0.25}, "a"),
        traj(0.0, {"call_penalty": -0.25}, "a"),
        traj(1.0, {}, "b"),  # another family, not shaped: counts 0 for each term
        traj(0.0, {}, "b"),
    ]
    _, stats = build_rl_batch(eps, rows=4, seq_len=8, cfg=PolicyLossConfig(), version=0)
    assert stats.shaping == {"call_penalty": -0.1875, "format_bonus": 0.0625}
    assert stats.task_reward_mean == 0.5 and stats.success_rate == 0.5
    assert stats.reward_mean == (0.75 - 0.25 + 1.0 + 0.0) / 4


# ----- the trajectory's fields ----------------------------------------------------------------


def shaped_trajectory() -> Trajectory:
    shaping = {"format_bonus": 0.1, "turn_penalty": -0.2, "call_penalty": -0.3}
    return Trajectory(
        task_id="f-0",
        arm="real",
        env_backend="local",
        status="ok",
        reward=shaped_reward(1.0, shaping),
        task_reward=1.0,
        shaping=shaping,
    )


def test_task_reward_and_shaping_round_trip_through_json_and_jsonl(tmp_path):
    traj = shaped_trajectory()
    validate(traj)
    line = json.loads(json.dumps(traj.to_dict()))
    assert line["task_reward"] == 1.0 and list(line["shaping"]) == list(traj.shaping)
    assert Trajectory.from_dict(line) == traj
    write_jsonl(tmp_path / "t.jsonl", [traj])
    assert read_jsonl(tmp_path / "t.jsonl") == [traj]
    # A record written before shaping existed has neither: the reward is the task's.
    old = {k: v for k, v in line.items() if k not in ("task_reward", "shaping")}
    old["reward"] = 1.0
    loaded = Trajectory.from_dict(old)
    assert (loaded.task_reward, loaded.shaping, unshaped_reward(loaded)) == (None, {}, 1.0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"reward": 1.0}, r"reward=1.0 is invalid: .*task_reward \(1.0\) plus the shaping terms"),
        ({"task_reward": None}, r"task_reward=None is invalid: a number when shaping is set"),
        ({"task_reward": float("nan")}, r"task_reward=nan is invalid: a finite number or null"),
        ({"shaping": {"format_bonus": float("inf")}},
         r"shaping\['format_bonus'\]=inf is invalid: a finite number"),
        ({"shaping": {"": 0.0}}, r"shaping='' is invalid: term names that are non-empty strings"),
        ({"shaping": [0.1]}, r"shaping=\[0.1\] is invalid: a mapping from term names"),
    ],
)  # fmt: skip
def test_bad_shaping_fields_are_named_with_what_is_allowed(change, message):
    traj = shaped_trajectory()
    for name, value in change.items():
        setattr(traj, name, value)
    with pytest.raises(ValueError, match=message):
        validate(traj)


# ----- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ShapingConfig(format_bonus=-0.1), r"ShapingConfig.format_bonus=-0.1 is invalid: "
         r"a finite number >= 0"),
        (lambda: ShapingConfig(per_call_penalty=float("inf")), r"per_call_penalty=inf"),
        (lambda: ShapingConfig(per_turn_penalty=float("nan")), r"per_turn_penalty=nan"),
        (lambda: ShapingConfig(per_turn_penalty=True), r"per_turn_penalty=True"),
        (lambda: ShapingConfig(turn_budget=0), r"turn_budget=0 is invalid: None or a positive"),
        (lambda: ShapingConfig(turn_budget=2.5), r"turn_budget=2.5 is invalid"),
        (lambda: ShapingConfig(per_turn_penalty=0.1), r"per_turn_penalty=0.1 is invalid: 0 "
         r"unless turn_budget is set"),
        (lambda: TerminalConfig(shaping={"chess": ShapingConfig()}), r"TerminalConfig.shaping="
         r"'chess' is invalid: a task family as key, one of \['textops', 'fileops', 'swe'\]"),
        (lambda: TerminalConfig(shaping={"textops": {"format_bonus": 0.1}}),
         r"shaping.textops=\{'format_bonus': 0.1\} is invalid: a ShapingConfig"),
        (lambda: TerminalConfig(shaping=[]), r"shaping=\[\] is invalid: a mapping"),
        (lambda: TerminalConfig(trials=2, trial_reward="per_trial",
                                shaping={"textops": ShapingConfig(format_bonus=0.1)}),
         r"off with trials > 1 and trial_reward per_trial"),
    ],
)  # fmt: skip
def test_bad_shaping_settings_say_what_is_allowed(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_shaping_from_yaml_and_the_command_line(tmp_path):
    assert SimloopConfig().env.terminal.shaping == {}  # off by default
    cfg = load_config(
        SimloopConfig, None, ["--env.terminal.shaping", "{fileops: {format_bonus: 0.1}}"]
    )
    assert cfg.env.terminal.shaping == {"fileops": ShapingConfig(format_bonus=0.1)}
    dotted = load_config(
        SimloopConfig,
        None,
        ["--env.terminal.shaping.textops.turn_budget", "3",
         "--env.terminal.shaping.textops.per_turn_penalty", "0.05"],
    )  # fmt: skip
    assert dotted.env.terminal.shaping == {
        "textops": ShapingConfig(turn_budget=3, per_turn_penalty=0.05)
    }
    (tmp_path / "c.yaml").write_text(dump_config(cfg))
    assert load_config(SimloopConfig, tmp_path / "c.yaml") == cfg
    for value, message in [
        ("{chess: {format_bonus: 0.1}}", r"shaping='chess' is invalid: a task family as key"),
        ("{fileops: {bonus: 0.1}}", r"unknown key 'env.terminal.shaping.fileops.bonus' in "
         r"ShapingConfig: allowed keys are \['format_bonus', 'per_call_penalty'"),
        ("{fileops: {format_bonus: true}}", r"'env.terminal.shaping.fileops.format_bonus'=True "
         r"is invalid: a number, not true/false"),
        ("{fileops: 3}", r"'env.terminal.shaping.fileops' must be a mapping of ShapingConfig"),
        ("{fileops: {per_call_penalty: -1}}", r"per_call_penalty=-1.0 is invalid"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            load_config(SimloopConfig, None, ["--env.terminal.shaping", value])
