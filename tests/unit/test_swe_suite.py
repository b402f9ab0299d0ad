"""The built-in SWE suite (`envs/swe_suite.py`) in real bash: each task's tests fail as shipped,
its reference fix (as the agent's `git diff`) earns reward 1 from `swe_tests` in a fresh
shell, and an empty or test-editing diff earns 0."""

import pytest

from envs.config import LocalShellConfig
from envs.local import LocalShell
from envs.rewards import RewardContext, get_reward
from envs.swe import upload_commands
from envs.swe_suite import REFERENCE_FIXES, TASK_IDS, swe_suite

CFG = LocalShellConfig()


def ctx() -> RewardContext:
    return RewardContext(shell_factory=lambda setup: LocalShell(CFG, setup=setup), timeout_s=60)


async def diff_of(task, files: dict[str, str]) -> str:
    """The `git diff` of writing `files` into the task's fresh repository."""
    async with LocalShell(CFG, setup=task.setup) as shell:
        for path, text in files.items():
            for cmd in upload_commands(text, path):
                assert (await shell.run(cmd, timeout_s=30)).exit_code == 0
        out = await shell.run("git diff", timeout_s=30)
        assert out.exit_code == 0
        return out.output


@pytest.mark.asyncio
@pytest.mark.parametrize("task_id", TASK_IDS)
async def test_tests_fail_as_shipped_and_the_reference_fix_passes(task_id):
    (task,) = swe_suite([task_id])
    reward = get_reward(task.reward.name)
    async with LocalShell(CFG, setup=task.setup) as shell:
        failing = await shell.run(task.reward.params["test_command"], timeout_s=60)
    assert failing.exit_code != 0, failing.output
    assert await reward(task, "", ctx()) == 0.0
    fix = await diff_of(task, REFERENCE_FIXES[task_id])
    assert fix.startswith("diff --git")
    assert await reward(task, fix, ctx()) == 1.0


@pytest.mark.asyncio
async def test_editing_the_tests_buys_nothing():
    (task,) = swe_suite(["clamp"])
    gutted = {"tests/test_clamp.py": "import unittest\n"}  # no tests left: unittest passes
    diff = await diff_of(task, gutted)
    assert await get_reward(task.reward.name)(task, diff, ctx()) == 0.0


def test_unknown_ids_are_named():
    with pytest.raises(ValueError, match="nope"):
        swe_suite(["clamp", "nope"])
