"""A scripted (optionally noisy) textops agent behind the `AgentClient` interface.

It stands where the agent server would, so scripted episodes run through the same orchestrator,
shells and trajectory format as model episodes: `simloop collect` uses it to gather real
trajectories for the simulator, and the RL warm start uses it for expert demonstrations.
With probability `noise` a turn's reply is perturbed (another operation's command, a typo, or a
wrong answer), so the collected data also shows the simulator failing commands and errors.
Replies are tokenised by the agent's tokenizer and returned with logprob 0 (the script is
deterministic given its random stream) and `weight_version` None.

Multi-trial episodes: given the feedback's `trial_marker`, each trial's script starts over.
A task whose instruction hides its operation (`TextopsConfig.hidden_op_prob`) is first
guessed (`GUESS`); an `adapt`ing agent then reads the checker's verdict in the feedback and
does what it names, one that does not keeps its guess (the ceiling and the floor of
in-context adaptation).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re
from collections.abc import Sequence
from types import SimpleNamespace

from envs.fileops import MISTAKES, SLIPS, FileopsSolver
from envs.tasks import RewardSpec, Task
from envs.textops import HIDEABLE, TRANSFORMS, TextopsSolver, wanted
from rl.data.tokenizer import IM_START, Tokenizer

NOISE_KINDS = ("other_op", "typo", "wrong_answer")
GUESS = "reverse"
"""The operation a scripted agent tries when the instruction does not name one."""


def feedback_marker(template: str) -> str:
    """The longest literal part of a trial feedback template: text only feedback holds."""
    return max(re.split(r"\{[a-z_]+\}", template), key=len).strip()


class ScriptedAgentClient:
    def __init__(
        self,
        tasks: Sequence[Task],
        tokenizer: Tokenizer,
        *,
        style: str = "two_step",
        noise: float = 0.0,
        noise_kinds: Sequence[str] = NOISE_KINDS,
        seed: int = 0,
        trial_marker: str | None = None,
        adapt: bool = True,
        commands: int = 8,
        fileops_mistakes: Sequence[str] | None = None,
        fileops_checks: float = 0.0,
    ):
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"noise={noise!r} is invalid: a probability in [0, 1]")
        if not noise_kinds or any(k not in NOISE_KINDS for k in noise_kinds):
            raise ValueError(
                f"noise_kinds={list(noise_kinds)!r} is invalid: a non-empty subset of "
                f"{list(NOISE_KINDS)}"
            )
        self.noise_kinds = tuple(noise_kinds)
        # A `fileops` episode's mistakes: those named, else every recovered one (and the
        # `other_op` slip where the noise kinds hold it).
        if fileops_mistakes is None:
            fileops_mistakes = MISTAKES + (SLIPS if "other_op" in self.noise_kinds else ())
        if not fileops_mistakes or any(m not in MISTAKES + SLIPS for m in fileops_mistakes):
            raise ValueError(
                f"fileops_mistakes={list(fileops_mistakes)!r} is invalid: a non-empty subset "
                f"of {list(MISTAKES + SLIPS)}"
            )
        self.fileops_mistakes = tuple(fileops_mistakes)
        if not 0.0 <= fileops_checks <= 1.0:
            raise ValueError(
                f"fileops_checks={fileops_checks!r} is invalid: a probability in [0, 1]"
            )
        self.fileops_checks = fileops_checks
        # Tasks with the same instruction (e.g. the same operation on a file's word) have the
        # same script: the plan depends only on what the instruction says.
        self.tasks = {t.instruction: t for t in tasks}
        self.tok, self.style, self.noise, self.seed = tokenizer, style, noise, seed
        self.trial_marker, self.adapt = trial_marker or None, adapt
        self.commands = commands  # the `explore` style's commands per episode
        self.calls = 0

    def _task(self, text: str) -> Task:
        for instruction, task in self.tasks.items():
            if instruction in text:
                return task
        raise ValueError("the prompt holds none of the scripted tasks' instructions")

    async def complete(
        self,
        prompt,
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        logprobs=None,
        timeout_s=None,
        **_,
    ):
        self.calls += 1
        text = self.tok.decode(list(prompt))
        task = self._task(text)
        turn = text.count(f"{IM_START}assistant") - 1
        if task.reward.name == "fileops":
            return self._reply(self._fileops(task, text, turn), max_tokens)
        trial = text.rsplit(self.trial_marker, 1)[-1] if self.trial_marker else text
        if task.reward.params.get("hidden"):
            task = self._guess(task, text)
        solver = TextopsSolver(task, style=self.style, commands=self.commands)
        solver._step = min(trial.count(f"{IM_START}assistant") - 1, len(solver.plan))
        last_user = text.rsplit(f"{IM_START}user\n", 1)[-1]
        reply = solver.act(last_user)
        key = f"{self.seed}:{seed}:{task.id}:{turn}".encode()
        rng = random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))
        if rng.random() < self.noise:
            reply = perturb(reply, rng, self.noise_kinds)
        return self._reply(reply, max_tokens)

    def _fileops(self, task: Task, text: str, turn: int) -> str:
        """A `fileops` task's reply: `FileopsSolver`'s, its mistake (if any) drawn once per
        episode with probability `noise` (seeded by the task)."""
        solver = FileopsSolver(
            task,
            noise=self.noise,
            seed=self.seed,
            style="marker" if self.style == "marker" else "two_step",
            mistakes=self.fileops_mistakes,
            checks=self.fileops_checks,
        )
        solver._step = min(turn, len(solver.commands))
        return solver.act(text.rsplit(f"{IM_START}user\n", 1)[-1])

    def _reply(self, reply: str, max_tokens: int) -> SimpleNamespace:
        gen = self.tok.encode(reply)[: max_tokens - 1] + [self.tok.eos_id]
        return SimpleNamespace(
            text=self.tok.decode(gen[:-1]),
            token_ids=gen,
            finish_reason="stop",
            logprobs=[0.0] * len(gen),
            token_versions=None,
            weight_version=None,
        )

    def _guess(self, task: Task, text: str) -> Task:
        """`task` with the operation this agent would do: the last verdict's (adapting) or
        `GUESS`."""
        params = dict(task.reward.params)
        op = GUESS
        if self.adapt:
            # The verdicts name the operation in `envs.textops.wanted`'s words; the last wins.
            found = []
            for name in HIDEABLE:
                if name == "count":
                    for m in re.finditer(r"number of times the letter '(.)' occurs", text):
                        found.append((m.start(), name, m.group(1)))
                else:
                    phrase = wanted({"op": name})
                    found += [(m.start(), name, None) for m in re.finditer(re.escape(phrase), text)]
            if found:
                _, op, char = max(found)
                if char is not None:
                    params["char"] = char
        params["op"] = op
        return dataclasses.replace(task, reward=RewardSpec(task.reward.name, params))


def perturb(reply: str, rng: random.Random, kinds: Sequence[str] = NOISE_KINDS) -> str:
    """One plausible mistake (of one of `kinds`) in a scripted reply."""
    kind = rng.choice(list(kinds))
    if kind == "other_op":
        for name, cmd in TRANSFORMS.items():
            if cmd in reply:
                other = rng.choice([c for n, c in TRANSFORMS.items() if n != name])
                return reply.replace(cmd, other)
        kind = "typo"
    if kind == "wrong_answer" and "submit " in reply:
        return reply.replace("submit ", "submit x", 1)
    # typo: drop one character inside the code block
    start, end = reply.find("```bash\n") + 8, reply.rfind("\n```")
    if end - start < 2:
        return reply
    i = rng.randrange(start, end)
    return reply[:i] + reply[i + 1 :]
