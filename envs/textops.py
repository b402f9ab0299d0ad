"""The `textops` task family: seeded, CPU-cheap tasks whose answer is computed from the task
itself (reverse, upper-case, sort characters, count a character, write-then-read a file), so the
reward stays exact even when the shell is the simulator.

`generate_textops(TextopsConfig)` makes the tasks; the `textops` reward recomputes the truth from
`reward.params`; `TextopsSolver` is a scripted agent that solves any of them in a real shell
(for tests and for collecting real trajectories to train the simulator on).
"""

from __future__ import annotations

import dataclasses
import functools
import random
import re

from envs.config import TRANSFORM_OPS, TextopsConfig
from envs.rewards import RewardContext, register_reward, register_verdict
from envs.shell import Observation, ShellLifecycle, TaskSetup
from envs.tasks import RewardSpec, Task
from envs.terminal import SUBMIT_MARKER

INPUT_FILE = "input.txt"
_ALPHABET = "abcdefghijklmnopqrstuvwxyz"
_OUTPUT = re.compile(r"<output>\n(.*)\n</output>", re.S)

# The pipeline stage that computes each string-to-string operation from the word on stdin.
TRANSFORMS = {
    "reverse": "rev",
    "upper": "tr a-z A-Z",
    "sort": "fold -w1 | sort | tr -d '\\n'",
}
assert tuple(TRANSFORMS) == TRANSFORM_OPS

_DESCRIBE = {
    "reverse": "reversed (last character first)",
    "upper": "in upper case",
    "sort": "with its characters sorted alphabetically",
}


def textops_truth(params: dict) -> str:
    """The correct answer, from the task's reward params alone."""
    op, text = params["op"], params["text"]
    if op == "reverse":
        return text[::-1]
    if op == "upper":
        return text.upper()
    if op == "sort":
        return "".join(sorted(text))
    if op == "count":
        return str(text.count(params["char"]))
    if op == "write_read":
        return text
    raise ValueError(f"textops op {op!r} is unknown")


HIDEABLE = ("reverse", "upper", "sort", "count")
"""Operations an instruction may leave unnamed (`TextopsConfig.hidden_op_prob`)."""


def misreport(turns: list, word: str, ops) -> tuple[list, int]:
    """`turns` (`rl.data.trajectory.Turn`s of an episode on `word`) as a shell that believes
    `ops`' pipeline stages (`TRANSFORMS`) print their input unchanged would have answered: in
    each turn whose command ran such a stage and succeeded, the word stands where the stage's
    output stood, in the observation and in what the agent was shown. Returns the turns (the
    others as they were) and how many were rewritten. A simulator trained on the result is
    wrong about those operations and right about the rest: `simloop demo --experiment gating`'s
    weak simulator."""
    out, changed = [], 0
    for turn in turns:
        printed = [
            textops_truth({"op": op, "text": word})
            for op in ops
            if TRANSFORMS[op] in (turn.command or "")
        ]
        answers = [a for a in printed if a != word and a in (turn.observation or "")]
        if turn.exit_code != 0 or not answers:
            out.append(turn)
            continue
        fix = functools.partial(_unsay, answers=answers, word=word)
        messages = [
            {**m, "content": fix(m["content"])} if isinstance(m.get("content"), str) else m
            for m in turn.env_messages
        ]
        out.append(
            dataclasses.replace(turn, observation=fix(turn.observation), env_messages=messages)
        )
        changed += 1
    return out, changed


def _unsay(text: str, answers: list[str], word: str) -> str:
    for answer in answers:
        text = text.replace(answer, word)
    return text


def _instruction(op: str, params: dict, from_file: bool) -> str:
    word = f"the word in the file `{INPUT_FILE}`" if from_file else f"the word '{params['text']}'"
    if params.get("hidden"):
        return f"Submit {word}, transformed the way the checker wants."
    if op in _DESCRIBE:
        return f"Submit {word} {_DESCRIBE[op]}."
    if op == "count":
        letter = params["char"]
        return f"Count how many times the letter '{letter}' occurs in {word}; submit the number."
    path = params["path"]
    return (
        f"Create the file `{path}` containing exactly {word} followed by a newline, then read "
        "the file back and submit its content."
    )


def make_task(index: int, rng: random.Random, cfg: TextopsConfig) -> Task:
    op = rng.choice(list(cfg.ops))
    text = "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(cfg.min_len, cfg.max_len)))
    params: dict = {"op": op, "text": text}
    if op == "count":
        # Mostly a letter that occurs, sometimes one that does not (answer 0).
        params["char"] = rng.choice(text) if rng.random() < 0.8 else rng.choice(_ALPHABET)
    if op == "write_read":
        params["path"] = f"notes/{rng.choice(['out', 'memo', 'copy'])}_{index}.txt"
    from_file = rng.random() < cfg.from_file_prob
    # Drawn only when asked for: the task stream of a config without hidden ops is unchanged.
    if cfg.hidden_op_prob > 0 and op in HIDEABLE and rng.random() < cfg.hidden_op_prob:
        params["hidden"] = True
    setup = TaskSetup(files={INPUT_FILE: text + "\n"}) if from_file else TaskSetup()
    return Task(
        id=f"textops-{cfg.seed}-{index}",
        instruction=_instruction(op, params, from_file),
        setup=setup,
        reward=RewardSpec("textops", {**params, "from_file": from_file}),
        family="textops",
    )


def generate_textops(cfg: TextopsConfig | None = None) -> list[Task]:
    """`cfg.num_tasks` tasks; the same config gives the same tasks."""
    cfg = cfg or TextopsConfig()
    rng = random.Random(cfg.seed)
    return [make_task(i, rng, cfg) for i in range(cfg.num_tasks)]


@register_reward("textops")
async def textops_reward(task: Task, submission: str | None, ctx: RewardContext) -> float:
    """1.0 when the submission (surrounding whitespace ignored) equals the computed truth."""
    if submission is None:
        return 0.0
    return 1.0 if submission.strip() == textops_truth(dict(task.reward.params)) else 0.0


def wanted(params: dict) -> str:
    """What the checker wants, in words (the operation, never its result)."""
    op = params["op"]
    if op == "count":
        return f"the number of times the letter '{params['char']}' occurs in the word"
    if op in _DESCRIBE:
        return f"the word {_DESCRIBE[op]}"
    return "the word, written to the file and read back"


@register_verdict("textops")
def textops_verdict(task: Task, submission: str | None) -> str | None:
    """A task whose instruction hides the operation gets it named after a failed attempt."""
    params = dict(task.reward.params)
    return f"The checker wanted {wanted(params)}." if params.get("hidden") else None


def split_textops(cfg: TextopsConfig, eval_tasks: int) -> tuple[list[Task], list[Task]]:
    """(training tasks, held-out evaluation tasks): `cfg.num_tasks` tasks, then `eval_tasks`
    more from the same seeded generator (a prefix-stable stream, so the training tasks do not
    depend on how many are held out)."""
    n = cfg.num_tasks
    tasks = generate_textops(dataclasses.replace(cfg, num_tasks=n + eval_tasks))
    return tasks[:n], tasks[n:]


def _bash(command: str) -> str:
    return f"```bash\n{command}\n```"


def submit_printed(last_observation: str | None, note: str) -> str:
    """A scripted agent's submission of what the last command printed: the output inside the
    default observation template, else the whole observation."""
    text = last_observation or ""
    m = _OUTPUT.search(text)
    answer = (m.group(1) if m else text).strip()
    return f"{note}\n\n{_bash('submit ' + answer)}"


SOLVER_STYLES = ("two_step", "marker", "explore")


class TextopsSolver:
    """A scripted agent. `act(last_observation)` returns the assistant's text.

    - `two_step`: the command(s) that compute the answer, then `submit` with what the shell
      printed (the answer is copied from the observation).
    - `marker`: one block that starts with `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` and
      computes the answer, which the env takes from the output: a one-turn episode whose reply
      depends only on the task's operation (and path), the easiest demonstrations to learn.
    - `explore`: `two_step` after `commands` commands in all: the others run the other
      operations (a random letter's count, `cat`) on the same word first, in an order seeded
      by the task. Long sessions of short, checkable observations: what a simulator must
      keep simulating as its context grows (issue 19's fidelity by context length)."""

    def __init__(self, task: Task, style: str = "two_step", commands: int = 8):
        if task.reward.name != "textops":
            raise ValueError(f"TextopsSolver solves textops tasks, not {task.reward.name!r}")
        if style not in SOLVER_STYLES:
            raise ValueError(f"TextopsSolver style={style!r} is invalid: one of {SOLVER_STYLES}")
        if isinstance(commands, bool) or not isinstance(commands, int) or commands < 1:
            raise ValueError(f"TextopsSolver commands={commands!r} is invalid: an integer >= 1")
        self.params, self.style = dict(task.reward.params), style
        self.plan = self._commands()  # the commands run before submitting
        if style == "marker":
            self.plan = ["\n".join([f"echo {SUBMIT_MARKER}", " && ".join(self.plan)])]
        if style == "explore":
            rng = random.Random(task.id)
            self.plan = [self._other(rng) for _ in range(commands - len(self.plan))] + self.plan
        self._step = 0

    def _source(self) -> str:
        p = self.params
        return f"tr -d '\\n' < {INPUT_FILE}" if p["from_file"] else f"printf '%s' '{p['text']}'"

    def _other(self, rng: random.Random) -> str:
        """One exploring command on the task's word: an operation's pipeline or `cat`."""
        op = rng.choice([*TRANSFORMS, "count", "cat"])
        if op in TRANSFORMS:
            return f"{self._source()} | {TRANSFORMS[op]}"
        if op == "count":
            return f"{self._source()} | tr -cd '{rng.choice(_ALPHABET)}' | wc -c"
        return f"cat {INPUT_FILE}" if self.params["from_file"] else f"echo {self.params['text']}"

    def _commands(self) -> list[str]:
        p = self.params
        src = self._source()
        op = p["op"]
        if op in TRANSFORMS:
            return [f"{src} | {TRANSFORMS[op]}"]
        if op == "count":
            return [f"{src} | tr -cd '{p['char']}' | wc -c"]
        path = p["path"]
        return [f"mkdir -p $(dirname {path}) && {{ {src}; echo; }} > {path}", f"cat {path}"]

    def act(self, last_observation: str | None) -> str:
        if self.style == "marker":
            return _bash(self.plan[0])
        if self._step < len(self.plan):
            cmd = self.plan[self._step]
            self._step += 1
            return f"I run the next step.\n\n{_bash(cmd)}"
        return submit_printed(last_observation, "The shell printed the answer.")


class TextopsAnswerShell(ShellLifecycle):
    """An in-memory shell for a textops task: every command prints the task's answer, so an
    agent that submits what it saw succeeds. For tests and benches of the layers above the
    shell (no bash process runs)."""

    def __init__(self, task: Task):
        self.answer = textops_truth(dict(task.reward.params))

    async def run(self, command: str, timeout_s: float) -> Observation:
        return Observation(output=self.answer, exit_code=0)

    async def close(self) -> None:
        pass
