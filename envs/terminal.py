"""The terminal environment: one task, one shell, one agent reply per step.

    env = TerminalEnv(task, shell)
    prompt = await env.reset()
    result = await env.step(agent_text)   # StepResult(observation, done, reward, info)

Actions (mini-swe-agent convention): a reply must hold EXACTLY ONE ```bash block (think blocks
are ignored). Anything else is a format error: the observation explains the expected format and
the error is counted. Two ways to submit:

- `submit <answer>`: a block whose command starts with the word `submit`; the rest of the block
  is the answer, taken literally and never run. Exact inside a simulator.
- `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` as the first line of a block: the block runs, and
  when the output's first line is that marker, the rest of the output is the answer (e.g. the
  `git diff` of a swe task).

The episode ends on submission, at `max_turns`, when the observations shown exceed
`max_total_observation_chars`, after `max_format_errors`, or when the shell fails; `info["status"]`
says which. The reward comes from the task's reward function when the episode ends.

Reward shaping (`TerminalConfig.shaping`, per task family, off by default): when the episode
ends, `shaping_terms` counts its turns, commands and malformed replies against the family's
`ShapingConfig`; the step's `reward` is the task's reward plus the terms, and the result
carries both apart (`StepResult.task_reward`, `StepResult.shaping`). Success is decided on the
task's reward alone.

Several attempts (`TerminalConfig.trials` > 1): `TrialEnv` runs one `TerminalEnv` per trial,
each on a fresh shell from the same task setup (the identical starting workspace), and turns a
failed trial's end into one more observation, the feedback, so the agent keeps its whole
history into the next attempt:

    async with TrialEnv(task, shell_factory, config) as env:
        prompt = await env.reset()
        result = await env.step(agent_text)   # info["trial_end"] when a trial ended
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, Literal

from envs.backends import ShellFactory
from envs.config import ShapingConfig, TerminalConfig
from envs.rewards import RewardContext, compute_grade, task_verdict
from envs.shell import Observation, Shell, ShellError, setup_hash, truncate_middle
from envs.tasks import Task
from rl.data.outcome import SUCCESS_REWARD, shaped_reward
from rl.data.sim_format import strip_think

log = logging.getLogger(__name__)

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
_BLOCK = re.compile(r"```bash[ \t]*\n(.*?)```", re.S)
_SUBMIT = re.compile(r"\Asubmit(?:\s|\Z)")

Status = Literal[
    "running",
    "submitted",
    "max_turns",
    "max_observation_chars",
    "format_errors",
    "error",
    "trial_timeout",
]
OUTCOMES = {
    "submitted": "the submitted answer was not accepted",
    "max_turns": "the turn limit was reached without a submission",
    "trial_timeout": "the time limit was reached without a submission",
    "format_errors": "too many replies were not exactly one bash block",
    "max_observation_chars": "the output shown exceeded its limit",
}
"""How the feedback after a failed trial names why it ended (`{outcome}`)."""


class FormatError(ValueError):
    """The agent's reply is not exactly one bash block."""


@dataclass(frozen=True)
class Action:
    kind: Literal["command", "submit"]
    command: str
    """The bash block's content."""
    answer: str | None = None
    """For `submit <answer>`: the answer."""


def parse_action(text: str) -> Action:
    """The single action in an agent reply; `FormatError` says what is wrong."""
    visible, _ = strip_think(text)
    blocks = _BLOCK.findall(visible)
    if len(blocks) != 1:
        raise FormatError(f"found {len(blocks)} bash code blocks; expected exactly one")
    command = blocks[0].strip()
    if not command:
        raise FormatError("the bash code block is empty")
    if "\0" in command:  # no shell can take it as an argument (and bash drops it from input)
        raise FormatError("the command contains a NUL byte (\\0); a shell cannot run it")
    if _SUBMIT.match(command):
        return Action("submit", command, answer=command[len("submit") :].strip())
    return Action("command", command)


def marker_submission(output: str) -> str | None:
    """The answer of a marker submission: the output after a first line equal to the marker."""
    lines = output.lstrip().splitlines(keepends=True)
    if lines and lines[0].strip() == SUBMIT_MARKER:
        return "".join(lines[1:])
    return None


def shaping_terms(
    cfg: ShapingConfig | None, *, turns: int, format_errors: int, calls: int
) -> dict[str, float]:
    """The shaping terms of an episode that took `turns` agent turns, sent `calls` commands to
    the shell and had `format_errors` malformed replies, by name and signed as they add to the
    reward: `format_bonus` (the bonus, or 0 after any malformed reply), `turn_penalty` (per
    turn beyond the budget), `call_penalty` (per command). A term whose weight is 0 is left
    out, so no shaping (`cfg` None or all zero) is `{}`."""
    if cfg is None:
        return {}
    terms: dict[str, float] = {}
    if cfg.format_bonus > 0:
        terms["format_bonus"] = cfg.format_bonus if format_errors == 0 else 0.0
    if cfg.per_turn_penalty > 0 and cfg.turn_budget is not None:
        terms["turn_penalty"] = 0.0 - cfg.per_turn_penalty * max(0, turns - cfg.turn_budget)
    if cfg.per_call_penalty > 0:
        terms["call_penalty"] = 0.0 - cfg.per_call_penalty * calls
    return terms


@dataclass(frozen=True)
class StepResult:
    observation: str
    """What the agent sees next (empty after a `submit` action)."""
    done: bool
    reward: float = 0.0
    """Once done, what training sees: the task's reward plus the shaping terms (the task's
    alone without shaping); 0.0 before."""
    info: dict[str, Any] = field(default_factory=dict)
    task_reward: float | None = None
    """Once done, the task's own reward (what decides success); None before."""
    shaping: dict[str, float] = field(default_factory=dict)
    """Once done, the shaping terms `reward` adds to `task_reward` (`shaping_terms`); empty
    without shaping."""


class TerminalEnv:
    """A task in a shell; the caller owns the shell (enters and closes it). `reward` is the
    task's; a finished step's reward adds the shaping terms of the task's family, if any."""

    def __init__(
        self,
        task: Task,
        shell: Shell,
        config: TerminalConfig | None = None,
        *,
        reward_context: RewardContext | None = None,
    ):
        self.task = task
        self.shell = shell
        self.config = config or TerminalConfig()
        self.reward_context = reward_context or RewardContext()
        self.shaping = self.config.shaping.get(task.family)
        self._reset = False
        self.turns = 0
        self.format_errors = 0
        self.calls = 0
        """Commands sent to the shell (a `submit <answer>` runs nothing)."""
        self.observation_chars = 0
        self.submission: str | None = None
        self.status: Status = "running"
        self.reward = 0.0

    @property
    def done(self) -> bool:
        return self.status != "running"

    async def reset(self) -> str:
        """The first user message: the task inside the prompt template."""
        self._reset = True
        self.turns = self.format_errors = self.observation_chars = self.calls = 0
        self.submission, self.status, self.reward = None, "running", 0.0
        return self.config.prompt_template.format(instruction=self.task.instruction)

    def render_observation(self, obs: Observation) -> str:
        """An observation as the agent sees it: the template, with the output's middle cut to
        `max_observation_chars`, and a note when the command timed out."""
        output, _ = truncate_middle(obs.output, self.config.max_observation_chars)
        if obs.info.get("timeout"):
            output += f"\n[{obs.info.get('reason', 'command timed out and was killed')}]"
        return self.config.observation_template.format(exit_code=obs.exit_code, output=output)

    async def step(self, text: str) -> StepResult:
        if not self._reset:
            raise RuntimeError("call reset() before step()")
        if self.done:
            raise RuntimeError(f"the episode is over (status {self.status!r}); call reset()")
        cfg = self.config
        self.turns += 1
        try:
            action = parse_action(text)
        except FormatError as e:
            self.format_errors += 1
            observation = cfg.format_error_template.format(reason=str(e))
            info: dict[str, Any] = {"format_error": str(e), "format_errors": self.format_errors}
            if self.format_errors >= cfg.max_format_errors:
                return await self._finish("format_errors", observation, info)
            return self._after_turn(observation, info)
        if action.kind == "submit":
            self.submission = action.answer
            return await self._finish("submitted", "", {"command": action.command})
        self.calls += 1
        try:
            obs = await self.shell.run(action.command, timeout_s=cfg.command_timeout_s)
        except ShellError as e:
            info = {"command": action.command, "reason": f"{type(e).__name__}: {e}"}
            return await self._finish("error", "", info)
        observation = self.render_observation(obs)
        info = {
            "command": action.command,
            "output": obs.output,
            "exit_code": obs.exit_code,
            "truncated": obs.truncated or len(obs.output) > cfg.max_observation_chars,
            "duration_s": obs.duration_s,
            "shell": obs.info,
        }
        submitted = marker_submission(obs.output)
        if submitted is not None:
            self.submission = submitted
            return await self._finish("submitted", observation, info)
        return self._after_turn(observation, info)

    def _after_turn(self, observation: str, info: dict[str, Any]) -> StepResult:
        self.observation_chars += len(observation)
        if self.observation_chars > self.config.max_total_observation_chars:
            return self._finish_sync("max_observation_chars", observation, info)
        if self.turns >= self.config.max_turns:
            return self._finish_sync("max_turns", observation, info)
        return StepResult(observation, False, 0.0, info)

    def _finish_sync(self, status: Status, observation: str, info: dict[str, Any]) -> StepResult:
        # Only limits end here: nothing was submitted, so the reward is 0 without scoring.
        self.status = status
        info = {**info, "status": status, "turns": self.turns}
        return self._ended(observation, info)

    def _ended(self, observation: str, info: dict[str, Any]) -> StepResult:
        """The episode's last step: the task's reward, shaped."""
        terms = shaping_terms(
            self.shaping, turns=self.turns, format_errors=self.format_errors, calls=self.calls
        )
        reward = shaped_reward(self.reward, terms)
        return StepResult(observation, True, reward, info, task_reward=self.reward, shaping=terms)

    async def _finish(self, status: Status, observation: str, info: dict[str, Any]) -> StepResult:
        self.status = status
        info = {**info, "status": status, "turns": self.turns}
        if status == "submitted":
            try:
                grade = await compute_grade(self.task, self.submission, self.reward_context)
                self.reward = grade.reward
                if grade.details:
                    info["grade"] = grade.details
            except ShellError as e:  # the grader's shell failed: no verdict, say so
                self.status = "error"
                info["status"] = "error"
                info["reason"] = f"reward: {type(e).__name__}: {e}"
                log.warning("task %s: reward failed: %s", self.task.id, e)
        return self._ended(observation, info)


class TrialEnv:
    """`config.trials` attempts at one task (see the module docstring). Each trial is a
    `TerminalEnv` limited to `turns_per_trial` turns (default `max_turns`) and
    `trial_timeout_s` seconds, on its own fresh shell. The episode ends on the first success
    (task reward >= `SUCCESS_REWARD`), after the last trial, or when a shell fails; its reward
    follows `config.trial_reward`. `trials` holds one record per trial, in env terms.

    Shaping (`config.shaping`) is the episode's, not each trial's: the trials' envs shape
    nothing and their records keep the task's rewards (so success by trial k is exact); when
    the episode ends its terms count all of its turns, commands and malformed replies, across
    every trial, and are added once to the episode's reward (`first_success`: the discounted
    task reward; `per_trial` refuses shaping, see `TerminalConfig`)."""

    def __init__(
        self,
        task: Task,
        shell_factory: ShellFactory,
        config: TerminalConfig | None = None,
        *,
        reward_context: RewardContext | None = None,
    ):
        self.task, self.factory = task, shell_factory
        self.config = config or TerminalConfig()
        per_trial = self.config.turns_per_trial or self.config.max_turns
        self.trial_config = dataclasses.replace(self.config, max_turns=per_trial, shaping={})
        self.shaping = self.config.shaping.get(task.family)
        self.reward_context = reward_context
        self.max_turns = min(per_trial * self.config.trials, self.config.max_turns)
        """Agent turns the whole episode may take: `max_turns` bounds it, whatever the trials
        would add up to (a trial gets what is left of it, at most `turns_per_trial`)."""
        self.trials: list[dict[str, Any]] = []
        self.turns = 0
        self.format_errors = 0
        """Malformed replies of the trials that ended (for shaping)."""
        self.calls = 0
        """Commands the trials that ended sent to their shells (for shaping)."""
        self.env: TerminalEnv | None = None
        self._stack: AsyncExitStack | None = None
        self._trial_started = 0.0

    async def __aenter__(self) -> TrialEnv:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._close_shell()

    async def _close_shell(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    async def _start_trial(self) -> str:
        """A fresh shell from the task setup, and a new trial record; returns the prompt."""
        await self._close_shell()
        self._stack = AsyncExitStack()
        shell = await self._stack.enter_async_context(self.factory(self.task))
        workspace = ""  # a single-trial episode records no trials: nothing to hash
        if self.config.trials > 1:
            hash_fn = getattr(shell, "workspace_hash", None)
            workspace = await hash_fn() if callable(hash_fn) else setup_hash(self.task.setup)
        left = self.max_turns - self.turns
        config = self.trial_config
        if left < config.max_turns:
            config = dataclasses.replace(config, max_turns=left)
        self.env = TerminalEnv(self.task, shell, config, reward_context=self.reward_context)
        self.trials.append(
            {
                "index": len(self.trials),
                "start_turn": self.turns,
                "end_turn": self.turns,
                "reward": None,
                "status": "running",
                "workspace_hash": workspace,
            }
        )
        self._trial_started = time.monotonic()
        return await self.env.reset()

    async def reset(self) -> str:
        """Start the first trial; the first user message."""
        self.trials, self.turns = [], 0
        self.format_errors = self.calls = 0
        return await self._start_trial()

    @property
    def shell(self) -> Shell:
        if self.env is None:
            raise RuntimeError("call reset() before using the shell")
        return self.env.shell

    async def step(self, text: str) -> StepResult:
        if self.env is None:
            raise RuntimeError("call reset() before step()")
        result = await self.env.step(text)
        self.turns += 1
        limit = self.config.trial_timeout_s
        if not result.done and limit is not None and time.monotonic() - self._trial_started > limit:
            self.env.status = "trial_timeout"
            info = {**result.info, "status": "trial_timeout", "turns": self.env.turns}
            result = StepResult(result.observation, True, 0.0, info, task_reward=0.0)
        if not result.done:
            return result
        status = result.info.get("status", "error")
        trial = self.trials[-1]
        task_reward = float(result.task_reward or 0.0)  # the trial envs shape nothing
        trial.update(
            end_turn=self.turns,
            reward=task_reward,
            status=status,
            submission=self.env.submission,
        )
        self.format_errors += self.env.format_errors
        self.calls += self.env.calls
        if "reason" in result.info:
            trial["reason"] = result.info["reason"]
        # the last trial, or no turn left for another (`max_turns` bounds the episode)
        last = len(self.trials) == self.config.trials or self.turns >= self.max_turns
        if task_reward >= SUCCESS_REWARD or last or status == "error":
            info = {
                **result.info,
                "trial_end": dict(trial),
                "trials": [dict(t) for t in self.trials],
            }
            return self._ended(result.observation, info)
        feedback = self.feedback(trial)
        await self._start_trial()  # the identical starting workspace, a fresh shell
        observation = f"{result.observation}\n\n{feedback}" if result.observation else feedback
        info = {**result.info, "trial_end": dict(trial), "feedback": feedback}
        return StepResult(observation, False, 0.0, info)

    def _ended(self, observation: str, info: dict[str, Any]) -> StepResult:
        """The episode's last step: its reward (`episode_reward`), shaped once."""
        task_reward = self.episode_reward()
        terms = shaping_terms(
            self.shaping, turns=self.turns, format_errors=self.format_errors, calls=self.calls
        )
        reward = shaped_reward(task_reward, terms)
        return StepResult(observation, True, reward, info, task_reward=task_reward, shaping=terms)

    def feedback(self, trial: dict[str, Any]) -> str:
        """The user message after a failed trial (`trial_feedback_template`)."""
        verdict = task_verdict(self.task, trial.get("submission"))
        return self.config.trial_feedback_template.format(
            trial=trial["index"] + 1,
            trials=self.config.trials,
            outcome=OUTCOMES.get(trial["status"], trial["status"]),
            verdict=f" {verdict}" if verdict else "",
            submission=(trial.get("submission") or "").strip(),
        )

    def episode_reward(self) -> float:
        """The episode's task reward, before shaping. `first_success`: the successful trial's
        reward times `trial_discount` per trial before it (the best such value without a
        success); `per_trial`: the last trial's."""
        rewards = [t["reward"] or 0.0 for t in self.trials]
        if self.config.trial_reward == "per_trial":
            return rewards[-1]
        d = self.config.trial_discount
        return max(r * d**k for k, r in enumerate(rewards))
