"""The terminal env: action parsing, format errors, limits, submissions and rewards, with real
episodes in LocalShell (textops, swe) and one in the simulated shell."""

import pytest

from envs.config import TEXTOPS_OPS, LocalShellConfig, TerminalConfig, TextopsConfig
from envs.local import LocalShell
from envs.rewards import RewardContext
from envs.shell import Observation
from envs.simulated import Completion, SimulatedShell
from envs.swe import make_swe_task
from envs.tasks import RewardSpec, Task
from envs.terminal import FormatError, TerminalEnv, marker_submission, parse_action
from envs.textops import TextopsSolver, generate_textops, textops_truth
from rl.data.sim_format import format_observation


def bash(cmd: str) -> str:
    return f"Let me think.\n\n```bash\n{cmd}\n```\n"


def test_parse_action():
    assert parse_action(bash("ls -la")).command == "ls -la"
    assert parse_action(bash("submit  abc ")).answer == "abc"
    assert parse_action(bash("submit")).answer == ""
    assert parse_action(bash("submit line1\nline2")).answer == "line1\nline2"
    assert parse_action(bash("submitter --x")).kind == "command"
    hidden = "<think>\n" + bash("rm -rf /") + "</think>\n" + bash("pwd")
    assert parse_action(hidden).command == "pwd"  # blocks inside reasoning do not count
    for bad, reason in [
        ("no block at all", "found 0 bash code blocks"),
        (bash("ls") + bash("pwd"), "found 2 bash code blocks"),
        ("```bash\n\n```", "empty"),
        ("```python\nprint(1)\n```", "found 0"),
    ]:
        with pytest.raises(FormatError, match=reason):
            parse_action(bad)


def test_marker_submission():
    assert marker_submission("COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\ndiff --git a\n") == (
        "diff --git a\n"
    )
    assert marker_submission("\n  COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT  \n") == ""
    assert marker_submission("output\nCOMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT") is None


async def run_episode(env: TerminalEnv, agent) -> list:
    observation = await env.reset()
    results = []
    while not env.done:
        result = await env.step(agent(observation))
        results.append(result)
        observation = result.observation
    return results


async def test_scripted_agent_solves_textops_in_local_shell():
    tasks = [
        task
        for op in TEXTOPS_OPS
        for task in generate_textops(TextopsConfig(num_tasks=3, seed=3, ops=[op]))
    ]
    tasks += generate_textops(TextopsConfig(num_tasks=5, seed=4, from_file_prob=1.0))
    assert any(t.setup.files for t in tasks) and any(not t.setup.files for t in tasks)
    for task in tasks:
        async with LocalShell(setup=task.setup) as sh:
            env = TerminalEnv(task, sh)
            results = await run_episode(env, TextopsSolver(task).act)
        final = results[-1]
        assert final.done and final.info["status"] == "submitted", (task, final)
        assert final.reward == 1.0, (task.instruction, env.submission)
        assert env.submission.strip() == textops_truth(dict(task.reward.params))


async def test_an_exploring_agent_runs_its_commands_then_solves_the_task():
    """`explore`: `commands` commands in all (the others' operations on the same word first,
    the same ones for the same task), then the submission of what the last one printed."""
    tasks = generate_textops(TextopsConfig(num_tasks=4, seed=5, from_file_prob=0.5))
    for task in tasks:
        plan = TextopsSolver(task, style="explore", commands=6).plan
        assert len(plan) == 6 and plan == TextopsSolver(task, style="explore", commands=6).plan
        assert plan[-len(TextopsSolver(task).plan) :] == TextopsSolver(task).plan
        async with LocalShell(setup=task.setup) as sh:
            env = TerminalEnv(task, sh, TerminalConfig(max_turns=7))
            results = await run_episode(env, TextopsSolver(task, style="explore", commands=6).act)
        assert len(results) == 7 and results[-1].reward == 1.0, (task.instruction, results[-1])
    assert len({tuple(TextopsSolver(t, style="explore").plan) for t in tasks}) == len(tasks)
    with pytest.raises(ValueError, match="commands=0 is invalid"):
        TextopsSolver(tasks[0], style="explore", commands=0)


async def test_wrong_answer_gets_zero():
    task = generate_textops(TextopsConfig(num_tasks=1, seed=0, ops=["reverse"]))[0]
    async with LocalShell(setup=task.setup) as sh:
        env = TerminalEnv(task, sh)
        await env.reset()
        result = await env.step(bash("submit definitely-wrong"))
    assert result.done and result.reward == 0.0 and result.observation == ""


async def test_malformed_actions_get_format_error_observation_and_are_counted():
    task = Task("t", "anything", reward=RewardSpec("exact_match", {"expected": "x"}))
    cfg = TerminalConfig(max_format_errors=3, max_turns=10)
    async with LocalShell() as sh:
        env = TerminalEnv(task, sh, cfg)
        await env.reset()
        first = await env.step("I will just talk.")
        assert not first.done and first.info["format_errors"] == 1
        assert "Format error: found 0 bash code blocks" in first.observation
        assert "```bash\n<command>\n```" in first.observation
        ok = await env.step(bash("echo fine"))
        assert ok.observation == "<returncode>0</returncode>\n<output>\nfine\n\n</output>"
        await env.step(bash("a") + bash("b"))
        last = await env.step("still no block")
    assert last.done and last.info["status"] == "format_errors" and last.reward == 0.0
    assert env.format_errors == 3 and env.turns == 4


async def test_turn_limit_ends_the_episode():
    task = Task("t", "loop", reward=RewardSpec("exact_match", {"expected": "x"}))
    async with LocalShell() as sh:
        env = TerminalEnv(task, sh, TerminalConfig(max_turns=3))
        results = await run_episode(env, lambda obs: bash("echo again"))
        with pytest.raises(RuntimeError, match="episode is over"):
            await env.step(bash("echo more"))
    assert [r.done for r in results] == [False, False, True]
    assert results[-1].info["status"] == "max_turns" and results[-1].reward == 0.0


async def test_observation_limits_and_custom_format():
    task = Task("t", "print a lot", reward=RewardSpec("exact_match", {"expected": "x"}))
    cfg = TerminalConfig(
        max_observation_chars=200,
        max_total_observation_chars=500,
        observation_template="rc={exit_code}\n{output}",
        command_timeout_s=0.5,
    )
    async with LocalShell() as sh:
        env = TerminalEnv(task, sh, cfg)
        await env.reset()
        slow = await env.step(bash("sleep 30"))
        big = await env.step(bash("seq 1 5000"))
        bigger = await env.step(bash("seq 1 5000"))
    assert slow.observation.startswith("rc=124\n") and "timed out after 0.5s" in slow.observation
    assert big.info["truncated"] and "characters of output truncated" in big.observation
    assert big.observation.startswith("rc=0\n1\n2\n") and big.observation.endswith("5000\n")
    assert not big.done and bigger.done
    assert bigger.info["status"] == "max_observation_chars"


async def test_marker_submission_runs_and_is_scored():
    task = Task("t", "say abc", reward=RewardSpec("exact_match", {"expected": "abc"}))
    async with LocalShell() as sh:
        env = TerminalEnv(task, sh)
        await env.reset()
        result = await env.step(bash("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && echo abc"))
    assert result.done and result.info["status"] == "submitted" and result.reward == 1.0
    assert env.submission == "abc\n"


CALC_FILES = {
    "calc.py": "def add(a, b):\n    return a - b\n",
    "test_calc.sh": "python3 -c 'import calc; assert calc.add(2, 3) == 5'\n",
}


def swe_task():
    return make_swe_task(
        "swe-calc",
        "calc.add subtracts; make it add. Tests: `bash test_calc.sh`.",
        CALC_FILES,
        "bash test_calc.sh",
        protected=("test_calc.sh",),
        timeout_s=30,
    )


SUBMIT_DIFF = bash("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff")


@pytest.mark.parametrize(
    "edit, reward",
    [
        ("sed -i 's/a - b/a + b/' calc.py", 1.0),
        ("sed -i 's/a - b/a * b/' calc.py", 0.0),
        ("echo true > test_calc.sh", 0.0),  # editing the protected test cannot buy the reward
    ],
    ids=["fix", "wrong-fix", "edits-the-test"],
)
async def test_swe_reward_applies_diff_in_a_fresh_shell(edit, reward):
    task = swe_task()
    fresh: list[LocalShell] = []

    def factory(setup):
        fresh.append(LocalShell(LocalShellConfig(), setup=setup))
        return fresh[-1]

    ctx = RewardContext(shell_factory=factory, timeout_s=30)
    async with LocalShell(setup=task.setup) as sh:
        env = TerminalEnv(task, sh, reward_context=ctx)
        await env.reset()
        edited = await env.step(bash(edit))
        assert edited.info["exit_code"] == 0
        result = await env.step(SUBMIT_DIFF)
    assert result.info["status"] == "submitted" and "diff --git" in env.submission
    assert result.reward == reward
    assert len(fresh) == 1 and fresh[0] is not sh  # graded elsewhere


class ScriptedSimulator:
    """A fake simulator server that answers each command from a table."""

    def __init__(self, table: dict[str, Observation]):
        self.table = table

    async def complete(self, prompt, *, max_tokens, temperature, **kwargs):
        command = prompt.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        obs = self.table[command]
        return Completion(format_observation(obs.output, obs.exit_code), [], "stop")


async def test_textops_reward_is_exact_in_the_simulated_shell():
    task = generate_textops(TextopsConfig(num_tasks=1, seed=5, ops=["upper"], from_file_prob=1))[0]
    solver = TextopsSolver(task)
    command = solver.plan[0]
    truth = textops_truth(dict(task.reward.params))
    for printed, reward in [(truth, 1.0), (truth.lower() + "x", 0.0)]:
        sim = ScriptedSimulator({command: Observation(printed, 0)})
        shell = SimulatedShell(sim, task_instruction=task.instruction, setup=task.setup)
        env = TerminalEnv(task, shell)
        results = await run_episode(env, TextopsSolver(task).act)
        assert results[-1].reward == reward


async def test_shell_failure_ends_the_episode_with_error_status():
    class Broken:
        async def complete(self, prompt, **kwargs):
            raise ConnectionError("simulator down")

    task = Task("t", "x", reward=RewardSpec("exact_match", {"expected": "x"}))
    env = TerminalEnv(task, SimulatedShell(Broken(), task_instruction="x"))
    await env.reset()
    result = await env.step(bash("ls"))
    assert result.done and result.info["status"] == "error"
    assert "simulator down" in result.info["reason"] and result.reward == 0.0


def test_terminal_config_validation():
    with pytest.raises(ValueError, match=r"TerminalConfig.observation_template='x' is invalid"):
        TerminalConfig(observation_template="x")
    with pytest.raises(ValueError, match=r"TerminalConfig.max_turns=0 is invalid"):
        TerminalConfig(max_turns=0)
