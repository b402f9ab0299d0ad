"""The `fileops` task family: seeded, CPU-cheap workspace tasks of 3-8 commands whose later
commands read what earlier ones wrote, with exact rewards computed from the task's own
parameters (as `textops`), so a simulated shell can be scored exactly too. Issue 60's family:
a shell is a state machine (the next `cat` shows what the last `>` wrote), and these tasks
need it to be one.

Kinds (`FileopsConfig.kinds`), each with distractor files beside the ones that matter:
- `chain`: transform `input.txt` (a few words, one per line) into `a.txt`, `a.txt` into
  `b.txt`, then submit a property of `b.txt` (its first or last line, or its line count);
- `append`: append given lines to `log.txt` (which already holds some), then submit its line
  count or its last line;
- `move`: make `archive/`, move two of `inbox/`'s files into it (one renamed), then submit
  `archive/`'s listing (sorted, comma-separated);
- `fanout`: transform `input.txt` three ways into `a.txt`, `b.txt` and `c.txt`, then submit
  a property of `a.txt`, which the episode wrote three commands before it reads it (state
  distance 3);
- `relay` (a deep kind, drawn only when named): a `chain` of five or six transformations,
  `input.txt` into `a.txt`, `a.txt` into `b.txt`, ... `e.txt` or `f.txt`, then submit a
  property of the last: six or seven commands, eight with a mistake, each reading what the one
  before it wrote (turns 6-8, depths 5-7, which the other kinds never reach);
- `read` (a drill, drawn only when named): submit a property of one file, or its whole
  contents; one command, which copies from the file (lines of words, half of them numbered).
- `lookup` (a drill, drawn only when named): submit the line of one file that starts with a
  given word; one command, `grep '^word-' file`, whose output is found by content: every
  line is numbered (`word-NN`), and the number is in the file alone.

`generate_fileops(cfg)` makes the tasks; the `fileops` reward recomputes the truth from
`reward.params`; `FileopsSolver` is a scripted agent that solves them in a real shell, with
realistic mistakes on request (reading a file before it is written, a step out of order, a
typo'd command, a command that fails and is retried), for collecting real trajectories.
"""

from __future__ import annotations

import dataclasses
import random
import re
import string

from envs.config import FileopsConfig
from envs.rewards import RewardContext, register_reward
from envs.shell import TaskSetup
from envs.tasks import RewardSpec, Task
from envs.terminal import SUBMIT_MARKER
from envs.textops import submit_printed

WORDS = (
    "amber", "birch", "cedar", "delta", "ember", "fable", "grove", "harbor", "ivory", "jolly",
    "kayak", "lemon", "maple", "noble", "ocean", "pearl", "quill", "raven", "solar", "tulip",
    "umbra", "vivid", "willow", "xenon", "yarrow", "zephyr",
)  # fmt: skip

# A transformation of a file's lines: (shell command from SRC to DST, what it computes).
TRANSFORMS = {
    "sort": ("sort {src} > {dst}", lambda lines, p: sorted(lines)),
    "sort_reverse": ("sort -r {src} > {dst}", lambda lines, p: sorted(lines, reverse=True)),
    "reverse_order": ("tac {src} > {dst}", lambda lines, p: lines[::-1]),
    "upper": ("tr a-z A-Z < {src} > {dst}", lambda lines, p: [x.upper() for x in lines]),
    "head": ("head -n {k} {src} > {dst}", lambda lines, p: lines[: p["k"]]),
    "tail": ("tail -n {k} {src} > {dst}", lambda lines, p: lines[-p["k"] :]),
}
_DESCRIBE = {
    "sort": "its lines sorted alphabetically",
    "sort_reverse": "its lines sorted in reverse alphabetical order",
    "reverse_order": "its lines in reverse order (last line first)",
    "upper": "its lines in upper case",
    "head": "its first {k} lines",
    "tail": "its last {k} lines",
}
PROPERTIES = ("first_line", "last_line", "line_count")
_PROPERTY_COMMAND = {
    "first_line": "head -n 1 {f}",
    "last_line": "tail -n 1 {f}",
    "line_count": "wc -l < {f}",
    "contents": "cat {f}",
}
_PROPERTY_WORDS = {
    "first_line": "the first line of",
    "last_line": "the last line of",
    "line_count": "the number of lines of",
    "contents": "the contents of",
}


def fileops_truth(params: dict) -> str:
    """The correct submission, from the task's reward params alone."""
    kind = params["kind"]
    if kind in ("chain", "relay"):
        lines = list(params["lines"])
        for step in params["steps"]:
            lines = TRANSFORMS[step["op"]][1](lines, step)
        return _property(lines, params["property"])
    if kind == "fanout":
        step = params["steps"][0]
        return _property(TRANSFORMS[step["op"]][1](list(params["lines"]), step), params["property"])
    if kind == "append":
        return _property([*params["existing"], *params["appended"]], params["property"])
    if kind == "move":
        moved = [new or old for old, new in params["moves"]]
        return ",".join(sorted(moved))
    if kind == "read":
        return _property(list(params["lines"]), params["property"])
    if kind == "lookup":
        return next(ln for ln in params["lines"] if ln.startswith(f"{params['word']}-"))
    raise ValueError(f"fileops kind {kind!r} is unknown")


def _property(lines: list[str], prop: str) -> str:
    if prop == "line_count":
        return str(len(lines))
    if prop == "contents":
        return "\n".join(lines)
    if not lines:
        return ""
    return lines[0] if prop == "first_line" else lines[-1]


def _words(rng: random.Random, cfg: FileopsConfig, n: int) -> list[str]:
    """`n` distinct words: drawn from the 26 (`cfg.words == "fixed"`, the same draws as
    always) or fresh lowercase strings of 4-7 letters (`"random"`). `"mixed"` is decided per
    task by `make_task`, never here."""
    if cfg.words == "fixed":
        return rng.sample(WORDS, n)
    return fresh_words(rng, n)


def fresh_words(rng: random.Random, n: int, shortest: int = 4) -> list[str]:
    """`n` distinct fresh lowercase strings of `shortest`-7 letters (the words no simulator
    can recall; `simloop lookup-drill` draws them from 3 letters)."""
    out: list[str] = []
    while len(out) < n:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(shortest, 7)))
        if word not in out:
            out.append(word)
    return out


def _distractors(rng: random.Random, cfg: FileopsConfig, taken: set[str]) -> dict[str, str]:
    """`cfg.distractors` files that no step reads or writes, with plausible names and content."""
    names = ["notes.txt", "a_old.txt", "backup/input.txt", "b.txt.bak", "todo.txt", "tmp/log.txt"]
    rng.shuffle(names)
    out = {}
    for name in names:
        if len(out) == cfg.distractors:
            break
        if name not in taken:
            out[name] = "\n".join(_words(rng, cfg, 3)) + "\n"
    return out


def _transform_step(
    rng: random.Random, op: str, lines: list[str], max_k: int | None = None
) -> dict:
    """A step of `op` (with a line count `k` for head and tail, at most `max_k`) on a file of
    `lines`."""
    step: dict = {"op": op}
    if op in ("head", "tail"):
        top = len(lines) - 1 if max_k is None else min(max_k, len(lines) - 1)
        step["k"] = rng.randint(2, max(2, top))
    return step


RELAY_FILES = ("a.txt", "b.txt", "c.txt", "d.txt", "e.txt", "f.txt")
"""What a `relay` (or `chain`) writes, step by step: `input.txt` into the first, and so on."""


def _in_a_row(steps: list[dict], prop: str) -> str:
    """The instruction of a `chain` or `relay`: each step from the file the last one wrote
    (`input.txt`, then `RELAY_FILES`), then submit `prop` of the last file."""
    files = ("input.txt", *RELAY_FILES)
    out = [
        f"{i + 1}. Write `{files[i]}` with {_DESCRIBE[s['op']].format(k=s.get('k'))} "
        f"into `{files[i + 1]}`."
        for i, s in enumerate(steps)
    ]
    out.append(f"{len(steps) + 1}. Submit {_PROPERTY_WORDS[prop]} `{files[len(steps)]}`.")
    return " ".join(out)


def _chain(rng: random.Random, cfg: FileopsConfig) -> tuple[dict, dict[str, str], str]:
    lines = _words(rng, cfg, rng.randint(cfg.min_lines, cfg.max_lines))
    steps: list[dict] = []
    for _ in range(2):
        op = rng.choice([o for o in TRANSFORMS if not steps or o != steps[-1]["op"]])
        steps.append(_transform_step(rng, op, lines, cfg.max_k))
    prop = rng.choice(PROPERTIES)
    params = {"kind": "chain", "lines": lines, "steps": steps, "property": prop}
    files = {"input.txt": "\n".join(lines) + "\n"}
    return params, files, _in_a_row(steps, prop)


def _relay(rng: random.Random, cfg: FileopsConfig) -> tuple[dict, dict[str, str], str]:
    lines = _words(rng, cfg, rng.randint(cfg.min_lines, cfg.max_lines))
    steps: list[dict] = []
    current = list(lines)
    for _ in range(rng.randint(5, len(RELAY_FILES))):
        op = rng.choice([o for o in TRANSFORMS if not steps or o != steps[-1]["op"]])
        steps.append(_transform_step(rng, op, current, cfg.max_k))
        current = TRANSFORMS[op][1](current, steps[-1])
    prop = rng.choice(PROPERTIES)
    params = {"kind": "relay", "lines": lines, "steps": steps, "property": prop}
    files = {"input.txt": "\n".join(lines) + "\n"}
    return params, files, _in_a_row(steps, prop)


def _append(rng: random.Random, cfg: FileopsConfig) -> tuple[dict, dict[str, str], str]:
    existing = _words(rng, cfg, rng.randint(1, cfg.max_lines))
    appended = [f"{w}-{rng.randint(10, 99)}" for w in _words(rng, cfg, rng.randint(2, 3))]
    prop = rng.choice(("last_line", "line_count"))
    params = {"kind": "append", "existing": existing, "appended": appended, "property": prop}
    files = {"log.txt": "\n".join(existing) + "\n"}
    steps = " ".join(
        f"{i + 1}. Append the line `{line}` to `log.txt`." for i, line in enumerate(appended)
    )
    instruction = f"{steps} {len(appended) + 1}. Submit {_PROPERTY_WORDS[prop]} `log.txt`."
    return params, files, instruction


def _move(rng: random.Random, cfg: FileopsConfig) -> tuple[dict, dict[str, str], str]:
    names = [f"{w}.txt" for w in _words(rng, cfg, rng.randint(3, 5))]
    first, second = rng.sample(names, 2)
    renamed = f"{second.removesuffix('.txt')}_{rng.choice(['old', 'v2', 'done'])}.txt"
    params = {"kind": "move", "inbox": names, "moves": [[first, None], [second, renamed]]}
    files = {f"inbox/{n}": f"{n.removesuffix('.txt')}\n" for n in names}
    instruction = (
        "1. Create the directory `archive`. "
        f"2. Move `inbox/{first}` into `archive`. "
        f"3. Move `inbox/{second}` into `archive`, renamed `{renamed}`. "
        "4. Submit the names in `archive`, sorted, separated by commas (no spaces)."
    )
    return params, files, instruction


def _fanout(rng: random.Random, cfg: FileopsConfig) -> tuple[dict, dict[str, str], str]:
    lines = _words(rng, cfg, rng.randint(cfg.min_lines, cfg.max_lines))
    steps = [_transform_step(rng, op, lines, cfg.max_k) for op in rng.sample(list(TRANSFORMS), 3)]
    prop = rng.choice(PROPERTIES)
    params = {"kind": "fanout", "lines": lines, "steps": steps, "property": prop}
    files = {"input.txt": "\n".join(lines) + "\n"}
    describe = [_DESCRIBE[s["op"]].format(k=s.get("k")) for s in steps]
    instruction = " ".join(
        f"{i + 1}. Write `input.txt` with {d} into `{f}`."
        for i, (d, f) in enumerate(zip(describe, ("a.txt", "b.txt", "c.txt"), strict=True))
    )
    instruction += f" 4. Submit {_PROPERTY_WORDS[prop]} `a.txt`."
    return params, files, instruction


DRILL_FILES = ("notes.txt", "log.txt", "data.txt", "list.txt")
"""The one file a drill task (`read`, `lookup`) holds is one of these."""


def _read(rng: random.Random, cfg: FileopsConfig) -> tuple[dict, dict[str, str], str]:
    name = rng.choice(DRILL_FILES)
    words = _words(rng, cfg, rng.randint(1, cfg.max_lines))
    lines = [f"{w}-{rng.randint(10, 99)}" if rng.random() < 0.5 else w for w in words]
    prop = rng.choice((*PROPERTIES, "contents"))
    params = {"kind": "read", "file": name, "lines": lines, "property": prop}
    files = {name: "\n".join(lines) + "\n"}
    return params, files, f"1. Submit {_PROPERTY_WORDS[prop]} `{name}`."


def _lookup(rng: random.Random, cfg: FileopsConfig) -> tuple[dict, dict[str, str], str]:
    name = rng.choice(DRILL_FILES)
    words = _words(rng, cfg, rng.randint(2, cfg.max_lines))
    lines = [f"{w}-{rng.randint(10, 99)}" for w in words]
    word = rng.choice(words)
    params = {"kind": "lookup", "file": name, "lines": lines, "word": word}
    files = {name: "\n".join(lines) + "\n"}
    return params, files, f"1. Submit the line of `{name}` that starts with `{word}-`."


_KINDS = {
    "chain": _chain,
    "append": _append,
    "move": _move,
    "fanout": _fanout,
    "relay": _relay,
    "read": _read,
    "lookup": _lookup,
}


def make_task(index: int, rng: random.Random, cfg: FileopsConfig) -> Task:
    kind = rng.choice(list(cfg.kinds))
    if cfg.words == "mixed":
        cfg = dataclasses.replace(cfg, words=rng.choice(("fixed", "random")))
    params, files, instruction = _KINDS[kind](rng, cfg)
    files = {**files, **_distractors(rng, cfg, set(files))}
    return Task(
        id=f"fileops-{cfg.seed}-{index}",
        instruction=instruction,
        setup=TaskSetup(files=files),
        reward=RewardSpec("fileops", params),
        family="fileops",
        metadata={"kind": kind, "words": cfg.words},
    )


def generate_fileops(cfg: FileopsConfig | None = None) -> list[Task]:
    """`cfg.num_tasks` tasks; the same config gives the same tasks."""
    cfg = cfg or FileopsConfig()
    rng = random.Random(cfg.seed)
    return [make_task(i, rng, cfg) for i in range(cfg.num_tasks)]


def split_fileops(cfg: FileopsConfig, eval_tasks: int) -> tuple[list[Task], list[Task]]:
    """(training tasks, held-out evaluation tasks): a prefix-stable stream, as textops'."""
    n = cfg.num_tasks
    tasks = generate_fileops(dataclasses.replace(cfg, num_tasks=n + eval_tasks))
    return tasks[:n], tasks[n:]


@register_reward("fileops")
async def fileops_reward(task: Task, submission: str | None, ctx: RewardContext) -> float:
    """1.0 when the submission (surrounding whitespace ignored) equals the computed truth."""
    if submission is None:
        return 0.0
    return 1.0 if submission.strip() == fileops_truth(dict(task.reward.params)) else 0.0


def plan(params: dict) -> list[str]:
    """The commands that do a task's steps, in order; the last one prints the answer."""
    kind = params["kind"]
    if kind in ("chain", "relay"):
        files = ["input.txt", *RELAY_FILES]
        cmds = [
            TRANSFORMS[s["op"]][0].format(src=files[i], dst=files[i + 1], k=s.get("k"))
            for i, s in enumerate(params["steps"])
        ]
        last = files[len(params["steps"])]
        return [*cmds, _PROPERTY_COMMAND[params["property"]].format(f=last)]
    if kind == "fanout":
        cmds = [
            TRANSFORMS[s["op"]][0].format(src="input.txt", dst=dst, k=s.get("k"))
            for s, dst in zip(params["steps"], ("a.txt", "b.txt", "c.txt"), strict=True)
        ]
        return [*cmds, _PROPERTY_COMMAND[params["property"]].format(f="a.txt")]
    if kind == "append":
        cmds = [f"echo '{line}' >> log.txt" for line in params["appended"]]
        return [*cmds, _PROPERTY_COMMAND[params["property"]].format(f="log.txt")]
    if kind == "read":
        return [_PROPERTY_COMMAND[params["property"]].format(f=params["file"])]
    if kind == "lookup":
        return [f"grep '^{params['word']}-' {params['file']}"]
    (first, _), (second, renamed) = params["moves"]
    return [
        "mkdir archive",
        f"mv inbox/{first} archive/",
        f"mv inbox/{second} archive/{renamed}",
        "ls archive | paste -sd, -",
    ]


MISTAKES = ("early_read", "out_of_order", "typo", "failed_retry", "garble")
"""What `FileopsSolver` gets wrong, with probability `noise` per task (one mistake each):
`early_read`, reading the step's output file before writing it; `out_of_order`, running a
step before the one whose file it reads; `typo`, a misspelt command (command not found), then
the right one; `failed_retry`, a step run with a wrong path (it fails), then the right one;
`garble`, a step garbled the way a small model garbles it (`GARBLES`: a flag turned into a
word, a file name stuttered, a lost `>`, a stray operand, a broken program name, a stray line),
then the right one. An append is never run twice (it would change the answer): there
`out_of_order` becomes `failed_retry`, and a garbled append never writes `log.txt`."""

SLIPS = ("other_op",)
"""Mistakes `FileopsSolver` does not recover from, drawn only when asked for (`mistakes=`):
`other_op`, a `chain` or `relay` step (or `fanout`'s `a.txt`) run with another transformation (so
the answer is wrong), as textops' scripted agent picks another operation. Other kinds make
a recovered mistake instead."""


def _bash(command: str) -> str:
    return f"```bash\n{command}\n```"


FILEOPS_STYLES = ("two_step", "marker")
"""How `FileopsSolver` submits: `two_step`, `submit <what the last command printed>` in a
turn of its own; `marker`, the last command runs behind `echo COMPLETE_TASK_AND_SUBMIT_
FINAL_OUTPUT`, whose output is the submission (no answer copied by the agent)."""


class FileopsSolver:
    """A scripted agent: `act(last_observation)` returns the assistant's text. It runs the
    task's `plan`, with one of `mistakes` inserted with probability `noise` (each of
    `MISTAKES` is recovered from; `SLIPS` are not), then submits (`style`). With `checks`
    (a probability per write), it looks at what it wrote (`CHECK_READS`) as it goes."""

    def __init__(
        self,
        task: Task,
        *,
        noise: float = 0.0,
        seed: int = 0,
        style: str = "two_step",
        mistakes: tuple[str, ...] = MISTAKES,
        checks: float = 0.0,
    ):
        if task.reward.name != "fileops":
            raise ValueError(f"FileopsSolver solves fileops tasks, not {task.reward.name!r}")
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"FileopsSolver noise={noise!r} is invalid: a probability in [0, 1]")
        if not 0.0 <= checks <= 1.0:
            raise ValueError(f"FileopsSolver checks={checks!r} is invalid: a probability in [0, 1]")
        if style not in FILEOPS_STYLES:
            raise ValueError(f"FileopsSolver style={style!r} is invalid: one of {FILEOPS_STYLES}")
        unknown = [m for m in mistakes if m not in MISTAKES + SLIPS]
        if not mistakes or unknown:
            raise ValueError(
                f"FileopsSolver mistakes={mistakes!r} is invalid: drawn from {MISTAKES + SLIPS}"
            )
        rng = random.Random(f"{seed}:{task.id}")
        params = dict(task.reward.params)
        steps = plan(params)
        # A one-command plan (`read`, `lookup`) has no step before its answer to get wrong.
        self.mistake = rng.choice(mistakes) if len(steps) > 1 and rng.random() < noise else None
        if self.mistake == "other_op":
            if params["kind"] in ("chain", "relay", "fanout"):
                self.commands = _other_op(params, rng)
            else:
                self.mistake = rng.choice(MISTAKES)
        if self.mistake != "other_op":
            self.commands = _with_mistake(steps, self.mistake, rng)
        if checks:  # its own stream: the mistakes above are drawn as without checks
            self.commands = _with_checks(
                self.commands, steps, checks, random.Random(f"{seed}:{task.id}:checks")
            )
        self.style = style
        if style == "marker":
            self.commands[-1] = f"echo {SUBMIT_MARKER}\n{self.commands[-1]}"
        self._step = 0

    def act(self, last_observation: str | None) -> str:
        if self._step < len(self.commands):
            cmd = self.commands[self._step]
            self._step += 1
            note = "Submit." if cmd.startswith(f"echo {SUBMIT_MARKER}") else "Next step."
            return f"{note}\n\n{_bash(cmd)}"
        return submit_printed(last_observation, "The last command printed the answer.")


CHECK_READS = ("cat {f}", "tail -n 1 {f}", "head -n 1 {f}", "wc -l < {f}", "tail -n 2 {f}")
"""How `FileopsSolver` checks a file it wrote (`checks`), as an agent verifying its work
does; a directory is listed (`ls`)."""
MAX_CHECKS = 2
"""Checks per episode at most."""
MAX_COMMANDS = 8
"""Checks never take an episode past this many commands (a `relay` with a mistake has 8)."""


def _with_checks(
    commands: list[str], steps: list[str], prob: float, rng: random.Random
) -> list[str]:
    """`commands` with a read inserted after a plan step that writes, with probability `prob`
    each (`MAX_CHECKS` at most, none past `MAX_COMMANDS` commands; never after the last one):
    the file just written half the time, else one written earlier (or a starting file the plan
    read), so the reads come at several state distances."""
    out: list[str] = []
    written: list[str] = []
    inputs = [f for f in ("input.txt", "log.txt") if any(f in s for s in steps)]
    n, budget = 0, min(MAX_CHECKS, max(0, MAX_COMMANDS - len(commands)))
    for command in commands:
        out.append(command)
        # Only a plan step that writes; the answer's command (`steps[-1]`) writes nothing.
        target = _written(command) if command in steps[:-1] else None
        if target is None:
            continue
        written.append(target)
        if n == budget or rng.random() >= prob:
            continue
        older = [f for f in dict.fromkeys(written[:-1] + inputs) if f != target]
        f = target if not older or rng.random() < 0.5 else rng.choice(older)
        out.append(f"ls {f}" if f.endswith("/") else rng.choice(CHECK_READS).format(f=f))
        n += 1
    return out


def _other_op(params: dict, rng: random.Random) -> list[str]:
    """A chain's (or fanout's) plan with one transformation that its answer depends on swapped
    for another (never fixed)."""
    i = 0 if params["kind"] == "fanout" else rng.randrange(len(params["steps"]))
    step = params["steps"][i]
    op = rng.choice([o for o in TRANSFORMS if o != step["op"]])
    swapped = {"op": op, "k": step.get("k", 2)}
    steps = [*params["steps"][:i], swapped, *params["steps"][i + 1 :]]
    return plan({**params, "steps": steps})


def _with_mistake(steps: list[str], mistake: str | None, rng: random.Random) -> list[str]:
    if mistake is None:
        return list(steps)
    i = rng.randrange(len(steps) - 1)  # never the last (it prints the answer)
    step = steps[i]
    appends = ">>" in step  # not idempotent: a step done twice would change the answer
    if mistake == "early_read":
        target = _written(step)
        return [*steps[:i], f"cat {target}" if target else "ls", *steps[i:]]
    if mistake == "out_of_order" and not appends and i + 1 < len(steps) - 1:
        return [*steps[:i], steps[i + 1], *steps[i:]]  # fails (or reads stale), redone after
    if mistake == "typo":
        word, _, rest = step.partition(" ")
        typo = word[:-2] + word[-1] + word[-2] if len(word) > 2 else word + word[-1]
        return [*steps[:i], f"{typo} {rest}".strip(), *steps[i:]]
    if mistake == "garble":
        return [*steps[:i], _garble(step, rng), *steps[i:]]
    # failed_retry (and out_of_order where no step may run early): a wrong path, which fails
    candidates = [j for j in range(len(steps) - 1) if ".txt" in steps[j]]
    j = rng.choice(candidates) if candidates else i
    wrong = steps[j].replace(">> ", ">> missing/") if ">>" in steps[j] else steps[j]
    wrong = wrong.replace(".txt", "_.txt", 1) if wrong == steps[j] else wrong
    return [*steps[:j], wrong, *steps[j:]]


GARBLES = (
    "flag_word",
    "bad_count",
    "stutter",
    "lost_redirect",
    "stray_arg",
    "bad_name",
    "stray_line",
)
"""How `garble` breaks a command; one or two of them, each where it applies. Taken from what
the stateful demo's agent wrote after RL in the simulator (e.g. `head in 2 input.txtxt a.txt`,
`sort input.txt T`, `heac -n 2 a.txt > b.txt`, `tac a.txt > b.txt` followed by `Nextxt b.txt`):
a simulator that never saw them answered them with silence where bash prints errors."""
_STRAYS = ("T", "in", "a.txt", "txt")
_JUNK_LINES = ("Next.", "Nextxt b.txt", "txt", "Neac a.txt")


def _garble_once(command: str, kind: str, rng: random.Random) -> str | None:
    """`command` broken one way (`kind`, of `GARBLES`), or None where that does not apply. A
    garbled append never writes `log.txt`, and a garbled `mv` never moves its file (either would
    change the answer): appends take only a broken name or a stuttered target, `mv` no
    stuttered target."""
    words = command.split(" ")
    appends, moves = ">>" in command, words[0] == "mv"
    if appends and kind not in ("bad_name", "stutter"):
        return None
    if kind == "flag_word" and re.search(r" -[nr]\b", command):
        return re.sub(r" -[nr]\b", " " + rng.choice(("in", "n", "T")), command, count=1)
    if kind == "bad_count" and re.search(r" -n \d+", command):
        return re.sub(r" -n \d+", " -n " + rng.choice(("v", "txt", "T", "")), command, count=1)
    if kind == "stutter":
        names = [j for j, w in enumerate(words) if w.endswith(".txt")]
        if appends:  # the target, so the append goes elsewhere
            names = names[-1:]
        elif moves:  # the source, so the move fails
            names = names[:1]
        if not names:
            return None
        j = rng.choice(names)
        words[j] = words[j][:-4] + rng.choice((".txtxt", "xtxt", ".txtxtxt", ".t.txt"))
        return " ".join(words)
    if kind == "lost_redirect" and " > " in command:
        head, _, tail = command.rpartition(" > ")
        return f"{head} {tail}"
    if kind == "stray_arg":
        stray = rng.choice(_STRAYS)
        if " > " in command:
            head, _, tail = command.rpartition(" > ")
            return f"{head} {stray} > {tail}"
        return f"{command} {stray}"
    if kind == "bad_name":
        prog = words[0]
        broken = rng.choice(
            [prog[:k] for k in range(1, len(prog))] + [prog + rng.choice("ct"), "Next", "txt"]
        )
        return " ".join([broken, *words[1:]])
    if kind == "stray_line":
        return f"{command}\n{rng.choice(_JUNK_LINES)}"
    return None


def _garble(command: str, rng: random.Random) -> str:
    """`command` with one or two of `GARBLES` applied (never unchanged)."""
    out = command
    for _ in range(rng.choice((1, 1, 2))):
        kinds = list(GARBLES)
        rng.shuffle(kinds)
        for kind in kinds:
            broken = _garble_once(out, kind, rng)
            if broken is not None and broken != out:
                out = broken
                break
    return out


def _written(command: str) -> str | None:
    """The file a plan step writes (`> f`, `>> f`, `mv ... f`), or None."""
    m = re.search(r">>?\s*(\S+)\s*$", command)
    if m:
        return m.group(1)
    if command.startswith("mv "):
        return command.split()[-1]
    return None
