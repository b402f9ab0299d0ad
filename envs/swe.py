"""The `swe`-style task family: the agent edits a repository and submits its diff (mini-swe-agent
style: `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff`); the reward applies that diff in
a FRESH shell with the task's setup and runs the task's test command there, so nothing the agent
did besides the diff can influence the verdict.

Reward params: `test_command` (required; exit 0 means solved), `timeout_s` (optional),
`protected` (optional list of setup files, e.g. the tests, restored after the diff is applied so
that editing them cannot buy the reward).
"""

from __future__ import annotations

import base64
import logging
import shlex

from envs.rewards import RewardContext, register_reward
from envs.shell import TaskSetup
from envs.tasks import RewardSpec, Task

log = logging.getLogger(__name__)

DIFF_FILE = ".simloop_agent.diff"
_CHUNK = 48_000  # base64 characters per command: far below the kernel's 128 KiB argument limit


def upload_commands(text: str, path: str) -> list[str]:
    """Shell commands that write `text` to `path` exactly, through any `Shell` (base64 in
    chunks, so no quoting and no argument-size limit can corrupt it)."""
    b64 = base64.b64encode(text.encode()).decode()
    dst, tmp = shlex.quote(path), shlex.quote(f"{path}.b64")
    cmds = [f": > {tmp}"]
    cmds += [f"printf '%s' '{b64[i : i + _CHUNK]}' >> {tmp}" for i in range(0, len(b64), _CHUNK)]
    cmds.append(f"base64 -d {tmp} > {dst} && rm -f {tmp}")
    return cmds


APPLY_COMMAND = (
    f"(git apply --whitespace=nowarn {DIFF_FILE} || patch -p1 --forward --batch < {DIFF_FILE})"
    f" && rm -f {DIFF_FILE}"
)


@register_reward("swe_tests")
async def swe_tests_reward(task: Task, submission: str | None, ctx: RewardContext) -> float:
    """1.0 when the submitted diff applies in a fresh shell and the test command exits 0."""
    params = task.reward.params
    if "test_command" not in params:
        raise ValueError(f"task {task.id!r}: reward swe_tests needs params.test_command")
    if ctx.shell_factory is None:
        raise ValueError(f"task {task.id!r}: reward swe_tests needs RewardContext.shell_factory")
    if submission is None or not submission.strip():
        return 0.0
    diff = submission if submission.endswith("\n") else submission + "\n"
    timeout_s = float(params.get("timeout_s", ctx.timeout_s))
    restore: list[str] = []
    for path in params.get("protected", ()):
        if path not in task.setup.files:
            raise ValueError(f"task {task.id!r}: protected file {path!r} is not a setup file")
        restore += upload_commands(task.setup.files[path], path)
    async with ctx.shell_factory(task.setup) as shell:
        for cmd in [*upload_commands(diff, DIFF_FILE), APPLY_COMMAND, *restore]:
            obs = await shell.run(cmd, timeout_s=ctx.timeout_s)
            if obs.exit_code != 0:
                log.info("task %s: the diff does not apply: %s", task.id, obs.output[-500:])
                return 0.0
        obs = await shell.run(str(params["test_command"]), timeout_s=timeout_s)
        return 1.0 if obs.exit_code == 0 else 0.0


GIT_INIT = (
    "git init -q && git add -A && "
    "git -c user.name=simloop -c user.email=simloop@localhost commit -qm 'task setup'"
)


def make_swe_task(
    task_id: str,
    instruction: str,
    files: dict[str, str],
    test_command: str,
    *,
    setup_commands: tuple[str, ...] = (),
    protected: tuple[str, ...] = (),
    timeout_s: float | None = None,
) -> Task:
    """A swe-style task: `files` committed to a fresh git repository (so `git diff` shows the
    agent's changes), then `setup_commands`."""
    params: dict = {"test_command": test_command}
    if protected:
        params["protected"] = list(protected)
    if timeout_s is not None:
        params["timeout_s"] = timeout_s
    return Task(
        id=task_id,
        instruction=instruction,
        setup=TaskSetup(files=files, commands=(GIT_INIT, *setup_commands)),
        reward=RewardSpec("swe_tests", params),
        family="swe",
    )
