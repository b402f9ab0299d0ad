"""A seeded grammar of text-utility commands over random words and files, run in real bash:
the data `simloop pretrain-sim` teaches the simulator to *compute* outputs from its context.

A textops agent's own trajectories show a simulator a few command shapes over a few hundred
words, and a small model memorises those instead of learning to read the word it is given
(see the note on issue 16). This grammar makes the word fresh in every example and varies the
command, so the only way to predict the output is to compute it from the files and the command:
`rev`, `tr`, `sort`, `fold`, `cut`, `head`, `wc`, `grep`, `sed`, `printf`, `cat`, `echo`, pipes,
`&&`, typos (command not found), missing files and bad options. About half the commands have the
textops agent's exact shapes (an `echo` of the submit marker, possibly misspelt, then
`tr -d '\\n' < input.txt | OP`), so the pretrained simulator already speaks the demo's dialect.

Every observation comes from `LocalShell` (`run_cases`): real bash, the same process, limits
and environment as the shell the simulator will stand in for. Nothing here computes an output.
"""

from __future__ import annotations

import asyncio
import random
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from envs.config import STRING_OPS, GrammarConfig, LocalShellConfig
from envs.shell import TaskSetup
from envs.terminal import SUBMIT_MARKER
from rl.data.sim_format import setup_description

LETTERS = string.ascii_lowercase
TEXTOPS_FILE = "input.txt"


@dataclass(frozen=True)
class Command:
    text: str
    kind: str
    """What the command computes: a textops operation (`reverse`, `upper`, `sort`, `count`)
    or `grammar:<last stage>`; fidelity is reported per kind."""


@dataclass
class Case:
    """One workspace (its files) and the commands run in it."""

    files: dict[str, str]
    commands: list[Command]
    session: bool = False
    """Also keep the first `GrammarConfig.session_turns` commands as one session."""


@dataclass
class CaseResult:
    case: Case
    outputs: list[tuple[str, int]] = field(default_factory=list)
    """(output, exit code) per command, from real bash."""


def random_word(rng: random.Random, cfg: GrammarConfig, *, min_len: int | None = None) -> str:
    n = rng.randint(min_len or cfg.min_len, cfg.max_len)
    alphabet = LETTERS
    if rng.random() < cfg.repeat_prob:
        alphabet = "".join(rng.sample(LETTERS, rng.randint(3, 6)))
    return "".join(rng.choice(alphabet) for _ in range(n))


def misspell(text: str, rng: random.Random) -> str:
    """Drop one character (the textops noise's typo)."""
    if len(text) < 2:
        return text
    i = rng.randrange(len(text))
    return text[:i] + text[i + 1 :]


# A program's name: the first word of a line or of a pipeline / `&&` stage.
_PROGRAM = re.compile(r"(?:^|\n|\|\s*|&&\s*)([A-Za-z][\w-]*)")


def misspell_program(text: str, rng: random.Random) -> str:
    """Drop one character of one program's name (`wc` -> `w`, `rev` -> `rv`): bash's `command
    not found`, or another program's answer; in the last stage, the pipeline's exit code."""
    spans = [m.span(1) for m in _PROGRAM.finditer(text)]
    if not spans:
        return misspell(text, rng)
    a, b = rng.choice(spans)
    i = rng.randrange(a, b)
    return text[:i] + text[i + 1 :]


def _typo(text: str, rng: random.Random, cfg: GrammarConfig) -> str:
    """The textops noise's typo; `cfg.program_typo_prob` of them in a program's name."""
    if cfg.program_typo_prob > 0 and rng.random() < cfg.program_typo_prob:
        return misspell_program(text, rng)
    return misspell(text, rng)  # (no draw above at 0: the seeded streams stay as they were)


def _marker(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.6:
        return SUBMIT_MARKER
    if r < 0.85:
        return misspell(SUBMIT_MARKER, rng)
    parts = [
        "".join(rng.choice(string.ascii_uppercase) for _ in range(rng.randint(2, 8)))
        for _ in range(rng.randint(1, 4))
    ]
    return "_".join(parts)


# The lowercase letters of the simulator's prompt around the word of a count (the files header
# and the agent's count command), as often as they occur there: a count of one of them sees
# it in the prompt but must count only the word's.
_AROUND_THE_WORD = [
    c
    for c in setup_description({TEXTOPS_FILE: ""})
    + f"echo tr -d '\\n' < {TEXTOPS_FILE} | tr -cd '' | wc -c"
    if c in LETTERS
]


def _letter(rng: random.Random, word: str, present: float = 0.8, near_miss: float = 0.0) -> str:
    """A letter of `word` (`present` of the time), else one the prompt holds around the word
    but the word does not (`near_miss` of the rest), else any letter. No draw is made for a
    share of 0, so the seeded streams made before these shares existed stay as they were."""
    if word and rng.random() < present:
        return rng.choice(word)
    if near_miss > 0 and rng.random() < near_miss:
        return rng.choice([c for c in _AROUND_THE_WORD if c not in word] or LETTERS)
    return rng.choice(LETTERS)


# One pipeline stage: (stage text, kind), given the word that flows into it (for letters).
Stage = Callable[[random.Random, str], tuple[str, str]]


def _op(rng: random.Random, cfg: GrammarConfig) -> str:
    """A textops operation, weighted as `cfg.op_weights` says."""
    if cfg.op_weights is None:  # the draw of the seeded streams made before the weights
        return rng.choice(STRING_OPS)
    return rng.choices(STRING_OPS, [cfg.op_weights.get(op, 1.0) for op in STRING_OPS])[0]


def _textops_stage(op: str, rng: random.Random, word: str, cfg: GrammarConfig) -> str:
    if op == "reverse":
        return "rev"
    if op == "upper":
        return "tr a-z A-Z"
    if op == "sort":
        return "fold -w1 | sort | tr -d '\\n'"
    letter = _letter(rng, word, cfg.count_present_prob, cfg.count_near_miss_prob)
    return f"tr -cd '{letter}' | wc -c"


def _filter(rng: random.Random, word: str) -> tuple[str, str]:
    c, d = _letter(rng, word), rng.choice(LETTERS)
    i = rng.randint(1, max(1, len(word)))
    j = rng.randint(i, max(i, len(word) + 2))
    choices = [
        ("rev", "rev"),
        ("tr a-z A-Z", "upper"),
        ("tr A-Z a-z", "lower"),
        ("fold -w1 | sort | tr -d '\\n'", "sort"),
        (f"tr -cd '{c}' | wc -c", "count"),
        ("wc -c", "wc"),
        ("wc -l", "wc"),
        ("fold -w1", "fold"),
        ("fold -w1 | sort -r | tr -d '\\n'", "sort"),
        (f"cut -c{i}-{j}", "cut"),
        (f"head -c {i}", "head"),
        (f"grep -o {c} | wc -l", "grep"),
        (f"grep -c {c}", "grep"),
        (f"sed 's/{c}/{d}/g'", "sed"),
        (f"tr {c} {d}", "tr"),
        (f"tr -d {c}", "tr"),
    ]
    text, kind = rng.choice(choices)
    return text, kind


def _source(rng: random.Random, files: dict[str, str], word: str) -> tuple[str, str]:
    """A command that prints text (and the word it prints, for the next stage's letters)."""
    path = rng.choice(sorted(files))
    content = files[path].strip("\n")
    k = rng.randint(1, max(1, len(content)))
    choices = [
        (f"cat {path}", content),
        (f"tr -d '\\n' < {path}", content.replace("\n", "")),
        (f"printf '%s' {word}", word),
        (f"printf '%s\\n' {word}", word),
        (f"echo {word}", word),
        (f"echo -n {word}", word),
        (f"head -c {k} {path}", content[:k]),
        (f"head -n 1 {path}", content.split("\n")[0]),
    ]
    return rng.choice(choices)


def _error(rng: random.Random, files: dict[str, str], word: str) -> Command:
    r = rng.random()
    if r < 0.4:  # a misspelt program
        stage, _ = _filter(rng, word)
        name, _, rest = stage.partition(" ")
        bad = misspell(name, rng) if len(name) > 2 else name + rng.choice(LETTERS)
        return Command(f"tr -d '\\n' < {TEXTOPS_FILE} | {bad} {rest}".rstrip(), "grammar:error")
    if r < 0.75:  # a missing file
        missing = rng.choice(["input.tx", "inpt.txt", "nope.txt", "words.txt", "out.txt"])
        if missing in files:
            missing = "missing.txt"
        prog = rng.choice(["cat", "head -n 1", "wc -c", "sort", "rev"])
        return Command(f"{prog} {missing}", "grammar:error")
    opt = rng.choice(["-q", "-z", "-y", "--nope"])  # a bad option
    prog = rng.choice(["rev", "fold", "cut", "wc", "tr"])
    return Command(f"{prog} {opt} {TEXTOPS_FILE}", "grammar:error")


def sample_bare_command(rng: random.Random, cfg: GrammarConfig) -> Command:
    """A command over a word it carries itself (no files)."""
    word = random_word(rng, cfg)
    if rng.random() < cfg.textops_prob:
        op = _op(rng, cfg)
        src = rng.choice([f"printf '%s' '{word}'", f"printf '%s' {word}", f"echo -n {word}"])
        text, kind = f"{src} | {_textops_stage(op, rng, word, cfg)}", f"bare:{op}"
    else:
        src = rng.choice([f"printf '%s' {word}", f"printf '%s\\n' {word}", f"echo {word}"])
        stage, kind = _filter(rng, word)
        text, kind = f"{src} | {stage}", f"bare:{kind}"
    if rng.random() < 0.15:
        text = f"echo {_marker(rng)}\n{text}"
    if rng.random() < 0.05:
        text, kind = misspell(text, rng), "bare:typo"
    return Command(text, kind)


def sample_command(rng: random.Random, cfg: GrammarConfig, files: dict[str, str]) -> Command:
    if TEXTOPS_FILE not in files:
        return sample_bare_command(rng, cfg)
    word = files[TEXTOPS_FILE].strip("\n")
    if rng.random() < cfg.error_prob:
        return _error(rng, files, word)
    if rng.random() < cfg.textops_prob:
        op = _op(rng, cfg)
        text = f"tr -d '\\n' < {TEXTOPS_FILE} | {_textops_stage(op, rng, word, cfg)}"
        kind = op
        if rng.random() < 0.75:
            text = f"echo {_marker(rng)}\n{text}"
        if rng.random() < cfg.typo_prob:  # the textops noise's typo, anywhere in the command
            text, kind = _typo(text, rng, cfg), f"{op}:typo"
        return Command(text, kind)
    src, flowing = _source(rng, files, random_word(rng, cfg))
    parts, kind = [src], "grammar:source"
    for _ in range(rng.choice([1, 1, 1, 2])):
        stage, kind = _filter(rng, flowing)
        parts.append(stage)
    text = " | ".join(parts)
    if rng.random() < 0.3:
        text = f"echo {_marker(rng)}\n{text}"
    elif rng.random() < 0.1:
        text = f"echo {random_word(rng, cfg)} && {text}"
    return Command(text, f"grammar:{kind}")


def sample_case(rng: random.Random, cfg: GrammarConfig) -> Case:
    if rng.random() < cfg.bare_prob:
        commands = [sample_bare_command(rng, cfg) for _ in range(cfg.commands_per_case)]
        return Case({}, commands, session=rng.random() < cfg.session_prob)
    files = {TEXTOPS_FILE: random_word(rng, cfg) + "\n"}
    if rng.random() < 0.25:
        lines = [random_word(rng, cfg) for _ in range(rng.randint(2, 4))]
        files["words.txt"] = "\n".join(lines) + "\n"
    commands = [sample_command(rng, cfg, files) for _ in range(cfg.commands_per_case)]
    return Case(files, commands, session=rng.random() < cfg.session_prob)


def sample_cases(cfg: GrammarConfig, n: int, *, offset: int = 0) -> list[Case]:
    """Cases `offset .. offset+n-1` of the seeded stream (each case has its own seed, so a
    prefix never depends on `n`)."""
    return [sample_case(random.Random(f"{cfg.seed}:{i}"), cfg) for i in range(offset, offset + n)]


async def run_cases(
    cases: Sequence[Case],
    shell_config: LocalShellConfig | None = None,
    *,
    concurrency: int = 8,
    timeout_s: float = 10.0,
    progress: Callable[[int, int], None] | None = None,
) -> list[CaseResult]:
    """Run every case's commands in real bash (`LocalShell`, one workspace per case)."""
    from envs.local import LocalShell

    sem = asyncio.Semaphore(concurrency)
    results: list[CaseResult | None] = [None] * len(cases)
    done = 0

    async def one(i: int, case: Case) -> None:
        nonlocal done
        async with sem:
            shell = LocalShell(shell_config, TaskSetup(files=dict(case.files)))
            try:
                await shell.start()
                res = CaseResult(case)
                for cmd in case.commands:
                    obs = await shell.run(cmd.text, timeout_s=timeout_s)
                    res.outputs.append((obs.output, obs.exit_code))
                results[i] = res
            finally:
                await shell.close()
        done += 1
        if progress is not None:
            progress(done, len(cases))

    await asyncio.gather(*(one(i, c) for i, c in enumerate(cases)))
    return [r for r in results if r is not None]
