"""Multi-trial episodes (issue 20): each trial starts from the identical workspace in real
bash while the agent keeps its history; feedback between trials names why the attempt failed
(and what a hidden-operation task's checker wanted), never the answer; per-trial rewards,
`first_success` / `per_trial` returns and per-trial advantages; the `trials` schema; success by
trial; and the scripted agents that bound in-context adaptation (one that adapts, one that
does not)."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest

from envs.config import LocalShellConfig, TerminalConfig, TextopsConfig
from envs.local import LocalShell
from envs.shell import TaskSetup
from envs.tasks import RewardSpec, Task
from envs.terminal import TrialEnv
from envs.textops import generate_textops, textops_truth
from rl.data import ByteTokenizer, ChatRenderer
from rl.data.outcome import trial_metrics
from rl.data.trajectory import Trajectory, Trial, validate
from rl.orchestrator.config import OrchestratorConfig
from rl.orchestrator.runner import Backends, RolloutRunner
from rl.orchestrator.scripted import ScriptedAgentClient, feedback_marker
from rl.train.config import PolicyLossConfig
from rl.train.rollouts import build_rl_batch

RENDERER = ChatRenderer(ByteTokenizer())
SHORT = "{instruction}\nReply with one ```bash block."


def local_factory(task: Task):
    return LocalShell(LocalShellConfig(), setup=task.setup)


def bash(command: str) -> str:
    return f"```bash\n{command}\n```"


TASK = Task(
    id="t-0",
    instruction="Submit the secret.",
    setup=TaskSetup(files={"secret.txt": "hunter2\n", "dir/notes.txt": "a\n"}),
    reward=RewardSpec("exact_match", {"expected": "hunter2"}),
)


async def test_every_trial_starts_from_the_identical_workspace_in_real_bash():
    cfg = TerminalConfig(trials=3, turns_per_trial=2, max_turns=9)
    async with TrialEnv(TASK, local_factory, cfg) as env:
        await env.reset()
        first = env.shell
        # Trial 1 wrecks the workspace, then submits a wrong answer.
        r = await env.step(bash("rm secret.txt && echo junk > dir/new.txt && ls -R"))
        assert not r.done and "trial_end" not in r.info
        r = await env.step(bash("submit nope"))
        assert not r.done and r.info["trial_end"]["status"] == "submitted"
        assert r.observation.startswith("Attempt 1 of 3 failed: the submitted answer")
        assert "hunter2" not in r.observation  # never the reference answer
        assert env.shell is not first  # a fresh shell for the new trial
        # Trial 2 sees the starting files again, and runs out of turns.
        r = await env.step(bash("cat secret.txt; ls dir"))
        assert "hunter2" in r.observation and "new.txt" not in r.observation
        r = await env.step(bash("true"))
        assert r.info["trial_end"]["status"] == "max_turns"
        assert "Attempt 2 of 3 failed: the turn limit was reached" in r.observation
        # Trial 3 succeeds: the episode ends, discounted twice (first_success, 0.6).
        r = await env.step(bash("submit hunter2"))
    assert r.done and r.reward == pytest.approx(0.36)
    hashes = {t["workspace_hash"] for t in env.trials}
    assert len(env.trials) == 3 and len(hashes) == 1 and len(next(iter(hashes))) == 64
    assert [(t["start_turn"], t["end_turn"], t["reward"]) for t in env.trials] == [
        (0, 2, 0.0),
        (2, 4, 0.0),
        (4, 5, 1.0),
    ]


async def test_max_turns_bounds_the_whole_episode_and_a_trial_gets_what_is_left():
    cfg = TerminalConfig(trials=2, max_turns=3)  # each trial may take 3: the episode too
    async with TrialEnv(TASK, local_factory, cfg) as env:
        await env.reset()
        assert env.max_turns == 3
        for _ in range(2):
            assert not (await env.step(bash("true"))).done
        r = await env.step(bash("true"))
    assert r.done and len(env.trials) == 1, r.info  # not a second trial of 3 more turns
    assert env.turns == 3 and env.trials[0]["status"] == "max_turns"
    async with TrialEnv(TASK, local_factory, cfg) as env:
        await env.reset()
        await env.step(bash("true"))
        r = await env.step(bash("submit nope"))  # trial 1 ends at turn 2: 1 turn is left
        assert not r.done and r.info["trial_end"]["status"] == "submitted"
        r = await env.step(bash("true"))
    statuses = [t["status"] for t in env.trials]
    assert r.done and env.turns == 3 and statuses == ["submitted", "max_turns"]


async def test_first_success_ends_the_episode_and_per_trial_returns_the_last_reward():
    async with TrialEnv(TASK, local_factory, TerminalConfig(trials=4)) as env:
        await env.reset()
        r = await env.step(bash("submit hunter2"))
    assert r.done and r.reward == 1.0 and len(env.trials) == 1
    cfg = TerminalConfig(trials=2, trial_reward="per_trial")
    async with TrialEnv(TASK, local_factory, cfg) as env:
        await env.reset()
        assert not (await env.step(bash("submit a"))).done
        r = await env.step(bash("submit b"))
    assert r.done and r.reward == 0.0 and [t["reward"] for t in env.trials] == [0.0, 0.0]


async def test_a_trial_past_its_wall_clock_limit_ends_and_the_next_begins():
    cfg = TerminalConfig(trials=2, trial_timeout_s=1e-9)
    async with TrialEnv(TASK, local_factory, cfg) as env:
        await env.reset()
        r = await env.step(bash("echo hi"))
        assert not r.done and r.info["trial_end"]["status"] == "trial_timeout"
        assert "the time limit was reached" in r.observation
        r = await env.step(bash("echo again"))
    assert r.done and [t["status"] for t in env.trials] == ["trial_timeout"] * 2


def test_trial_settings_are_validated_with_what_is_allowed():
    for kw, says in [
        (dict(trials=0), "trials=0 is invalid: a positive integer"),
        (dict(turns_per_trial=0), "None or an integer >= 1"),
        (dict(trial_timeout_s=-1), "None or a number of seconds > 0"),
        (dict(trial_reward="best"), "one of ['first_success', 'per_trial']"),
        (dict(trial_discount=1.5), "a number in (0, 1]"),
        (dict(trial_feedback_template="{answer}"), "whose only fields are {trial}"),
    ]:
        with pytest.raises(ValueError, match=r"\ATerminalConfig\.\w+=.* is invalid: ") as e:
            TerminalConfig(**kw)
        assert says in str(e.value)
    with pytest.raises(ValueError, match="hidden_op_prob=2 is invalid"):
        TextopsConfig(hidden_op_prob=2)


# ----- hidden operations and the scripted agents ---------------------------------------------


def test_hidden_ops_leave_other_configs_tasks_unchanged_and_verdicts_never_answer():
    plain = generate_textops(TextopsConfig(num_tasks=32, seed=3))
    again = generate_textops(TextopsConfig(num_tasks=32, seed=3, hidden_op_prob=0.0))
    assert plain == again
    hidden = generate_textops(TextopsConfig(num_tasks=32, seed=3, hidden_op_prob=1.0))
    from envs.rewards import task_verdict

    for task in hidden:
        params = dict(task.reward.params)
        if params["op"] == "write_read":  # nothing to hide: its instruction says it all
            assert "hidden" not in params
            continue
        assert params["hidden"] and "the checker wants" in task.instruction
        assert params["op"] not in task.instruction
        verdict = task_verdict(task, "x")
        assert verdict.startswith("The checker wanted")
        assert textops_truth(params) not in verdict.replace(params["text"], "")


def _runner(terminal, client, backends=None):
    ocfg = OrchestratorConfig(
        arm="real",
        max_context_tokens=2048,
        max_tokens_per_turn=200,
        group_size=1,
        max_staleness=None,
    )
    return RolloutRunner(
        ocfg, terminal, RENDERER, backends or Backends(real=local_factory), client=client
    )


@pytest.mark.parametrize("adapt", [True, False], ids=["adapts", "never-adapts"])
async def test_scripted_agents_bound_in_context_adaptation(adapt):
    """On hidden-operation tasks, an agent that reads the checker's verdict fails at most
    once; one that keeps its first guess gains nothing from a second trial."""
    ops = ["reverse", "upper", "sort", "count"]
    tasks = generate_textops(
        TextopsConfig(num_tasks=24, seed=5, ops=ops, from_file_prob=1.0, hidden_op_prob=1.0)
    )
    terminal = TerminalConfig(trials=2, turns_per_trial=1, prompt_template=SHORT)
    marker = feedback_marker(terminal.trial_feedback_template)
    client = ScriptedAgentClient(
        tasks, RENDERER.tokenizer, style="marker", adapt=adapt, trial_marker=marker
    )
    trajs = await _runner(terminal, client).run(tasks)
    first_guess = sum(t.reward.params["op"] == "reverse" for t in tasks) / len(tasks)
    m = trial_metrics(trajs)
    assert m["success_at"][0] == pytest.approx(first_guess)
    if adapt:
        assert m["success_at"][1] == 1.0 and m["adaptation_delta"] == 1.0 - first_guess
    else:
        assert m["success_at"][1] == m["success_at"][0] and m["adaptation_delta"] == 0.0
    for t in trajs:
        validate(t)
        assert len({x.workspace_hash for x in t.trials}) == 1
        assert t.trial_reward == "first_success"


async def test_multi_trial_trajectories_keep_one_token_stream_and_train_per_trial():
    """The feedback is observation tokens (mask 0) appended to the same stream; `per_trial`
    gives each trial's tokens the advantage of that trial's reward within its group."""
    tasks = generate_textops(TextopsConfig(num_tasks=1, seed=2, ops=["upper"], from_file_prob=1.0))
    terminal = TerminalConfig(
        trials=3, turns_per_trial=1, prompt_template=SHORT, trial_reward="per_trial"
    )
    marker = feedback_marker(terminal.trial_feedback_template)
    ocfg = OrchestratorConfig(
        arm="real",
        max_context_tokens=2048,
        max_tokens_per_turn=200,
        group_size=4,
        max_staleness=None,
        seed=11,
    )
    client = ScriptedAgentClient(
        tasks,
        RENDERER.tokenizer,
        style="marker",
        noise=0.5,
        noise_kinds=["typo"],
        seed=1,
        trial_marker=marker,
    )
    trajs = await RolloutRunner(
        ocfg, terminal, RENDERER, Backends(real=local_factory), client=client
    ).run(tasks)
    multi = [t for t in trajs if len(t.trials) > 1]
    assert multi, "the noise seed gives at least one failed first trial"
    for t in trajs:
        validate(t)
        for trial in t.trials[:-1]:  # every failed trial's turn shows the feedback
            turn = t.turns[trial.end_turn - 1]
            assert turn.env_messages[-1]["content"].endswith(marker)
            assert turn.info["trial_end"] == trial.index
    batch, stats = build_rl_batch(trajs, rows=4, seq_len=1024, cfg=PolicyLossConfig(), version=0)
    assert stats.used == 4
    for row, t in enumerate(trajs):
        for trial in t.trials:
            rewards = [x.trials[trial.index].reward for x in trajs if len(x.trials) > trial.index]
            mean = sum(rewards) / len(rewards)
            std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
            want = (trial.reward - mean) / (std + 1e-6)
            for turn in t.turns[trial.start_turn : trial.end_turn]:
                a, b = turn.token_span
                got = batch["advantages"][row, a - 1 : b - 1]  # column j holds token j + 1
                assert got == pytest.approx([want] * (b - a), abs=1e-5)
        observed = [j for j in range(1, len(t.token_ids)) if not t.loss_mask[j]]
        assert all(batch["advantages"][row, j - 1] == 0 for j in observed if j - 1 < 1024)


# ----- schema and metrics --------------------------------------------------------------------


def _traj(trials: list[Trial], turns: int = 3) -> Trajectory:
    from rl.data.trajectory import Turn

    return Trajectory(
        task_id="t",
        arm="real",
        env_backend="local",
        status="ok",
        reward=1.0,
        source="rendered",
        behavior_logprobs=None,
        policy_version=None,
        turns=[Turn(agent_text=f"r{i}") for i in range(turns)],
        trials=trials,
    )


def test_the_validator_knows_trials_and_old_trajectories_still_load():
    good = _traj([Trial(0, 0, 2, 0.0, "ok", None, "h"), Trial(1, 2, 3, 1.0, "ok", None, "h")])
    validate(good)
    data = good.to_dict()
    assert Trajectory.from_dict(json.loads(json.dumps(data))) == good
    old = dict(data)
    del old["trials"]
    assert Trajectory.from_dict(old).trials == []
    for trials, says in [
        ([Trial(1, 0, 3, 1.0, "ok")], r"trials\[0\]\.index=1 is invalid"),
        ([Trial(0, 1, 3, 1.0, "ok")], r"trials\[0\]\.start_turn=1 is invalid: 0"),
        ([Trial(0, 0, 4, 1.0, "ok")], r"trials\[0\]\.end_turn=4 is invalid"),
        ([Trial(0, 0, 2, 1.0, "ok")], "trials covering all 3 turns"),
        ([Trial(0, 0, 3, 1.0, "truncated")], r"trials\[0\]\.reason=None is invalid"),
        ([Trial(0, 0, 3, float("nan"), "ok")], r"trials\[0\]\.reward=nan is invalid"),
    ]:
        with pytest.raises(ValueError, match=says):
            validate(dataclasses.replace(good, trials=trials))
    with pytest.raises(ValueError, match=r"trials\[0\]: unknown key\(s\) \['answer'\]"):
        Trajectory.from_dict({**data, "trials": [{**data["trials"][0], "answer": "x"}]})


def test_success_by_trial_counts_every_episode():
    def ep(*rewards):
        trials = [Trial(i, i, i + 1, r, "ok", None, "h") for i, r in enumerate(rewards)]
        return _traj(trials, turns=len(rewards))

    m = trial_metrics([ep(1.0), ep(0.0, 1.0), ep(0.0, 0.0), ep(0.0, 1.0)])
    assert m["success_at"] == [0.25, 0.75] and m["adaptation_delta"] == 0.5
    assert m["reached"] == [4, 3] and m["turns_per_trial"] == [1.0, 1.0]
    single = trial_metrics([_traj([], 2)])
    assert single["trials"] == 1 and single["success_at"] == [1.0]


async def test_a_shell_that_fails_ends_the_episode_without_another_trial():
    class Broken:
        async def run(self, command, timeout_s):
            from envs.shell import ShellError

            raise ShellError("the sandbox is gone")

    @contextlib.asynccontextmanager
    async def factory(task):
        yield Broken()

    async with TrialEnv(TASK, factory, TerminalConfig(trials=3)) as env:
        await env.reset()
        r = await env.step(bash("ls"))
    assert r.done and r.info["status"] == "error" and len(env.trials) == 1
    assert r.info["trials"][0]["reason"].startswith("ShellError")


# ----- the demo's optional stage -------------------------------------------------------------


def test_the_demo_trials_stage_is_wired_summarised_and_reported(tmp_path, capsys):
    """`--demo.trials 2` adds stage `trials/` (its server in the dry run, with the stage's
    768-token context); its summary recounts success by trial from the stage's eval.json, and
    the report shows the table (the stage itself is train-agent, run end to end above and in
    the README's measured command)."""
    from launch.cli import main
    from launch.jobs.demo import _trials_summary
    from launch.report.page import _trials
    from rl.data import rundir
    from rl.orchestrator.evaluate import score

    assert main(["demo", "--out", str(tmp_path / "d"), "--demo.trials", "2", "--dry-run",
                 "--format", "json"]) == 0  # fmt: skip
    procs = json.loads(capsys.readouterr().out)["processes"]
    (server,) = [p for p in procs if p["stage"] == "trials"]
    assert server["command"][server["command"].index("--max-seq-len") + 1] == "768"

    def ep(*rewards):
        trials = [Trial(i, i, i + 1, r, "ok", None, "h") for i, r in enumerate(rewards)]
        return dataclasses.replace(_traj(trials, turns=len(rewards)), task_id=f"t{len(rewards)}")

    stage = tmp_path / "run" / "trials"
    stage.mkdir(parents=True)
    evals = {"before": [ep(0.0, 1.0), ep(0.0, 0.0)], "after": [ep(1.0), ep(0.0, 1.0)]}
    data = {label: {"real": score(e, [], "real", 1).to_dict()} for label, e in evals.items()}
    (stage / rundir.EVAL).write_text(json.dumps(data))
    s = _trials_summary(tmp_path / "run", {"trials": {}})
    assert s["trials"] == 2
    assert s["before"]["success_at"] == [0.0, 0.5] and s["before"]["adaptation_delta"] == 0.5
    assert s["after"]["success_at"] == [0.5, 1.0]
    page = _trials(data, ["real"], {"real": "real shell"})  # the report's table
    assert "Several trials per episode" in page and "by trial 2: 1.00" in page
    assert _trials_summary(tmp_path / "run", {}) is None  # no stage, no section
