"""The simulator's prompt and target format: ONE definition shared by `SimulatedShell` (what the
simulator is asked) and the simulator's SFT data (what it is trained to answer).

A session renders as ChatML messages: a system message (the simulator's role, the task, the
files present at the start), then per earlier turn a user message (the command) and an
assistant message (the observation), then the new command. The observation text is

    <returncode>N</returncode>
    <output>
    ...
    </output>

Assistant turns carry an empty reasoning block (`reasoning_content=""`), so history renders as
`<think>\\n\\n</think>\\n\\n{observation}`: exactly what the simulator generated after the
thinking-disabled generation prompt. Rendering is thus append-only across turns.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Protocol

from rl.data.chat import Message
from rl.data.tokenizer import END_THINK, THINK

SIM_SYSTEM_PROMPT = """You are a Linux terminal. The user sends one shell command per message; \
each runs in a fresh `bash -c` in the same working directory, so only the filesystem persists \
between commands. Reply with exactly what running the command prints (stdout and stderr) and its \
exit status, in this format and nothing else:
<returncode>N</returncode>
<output>
...
</output>"""

_OBSERVATION = re.compile(
    r"\A\s*<returncode>(-?\d+)</returncode>\n<output>\n(.*)\n</output>\s*\Z", re.S
)
_HEADER = re.compile(r"\A\s*<returncode>(-?\d+)</returncode>\s*\n<output>\n?(.*)\Z", re.S)
_THINK_BLOCK = re.compile(re.escape(THINK) + r".*?" + re.escape(END_THINK) + r"\s*", re.S)


class ObservationFormatError(ValueError):
    """Text is not in the observation format."""


class HasOutput(Protocol):
    """An observation as the history needs it (`envs.shell.Observation` has both)."""

    @property
    def output(self) -> str: ...

    @property
    def exit_code(self) -> int: ...


def format_observation(output: str, exit_code: int) -> str:
    """The observation text the simulator must produce."""
    return f"<returncode>{int(exit_code)}</returncode>\n<output>\n{output}\n</output>"


def parse_observation(text: str) -> tuple[str, int]:
    """(output, exit_code) from observation text; `ObservationFormatError` when the text does not
    follow the format. Inverse of `format_observation` for any output and exit code."""
    m = _OBSERVATION.match(text)
    if m is None:
        raise ObservationFormatError(
            "expected '<returncode>N</returncode>\\n<output>\\n...\\n</output>', got "
            f"{text[:80]!r}{'...' if len(text) > 80 else ''}"
        )
    return m.group(2), int(m.group(1))


def parse_observation_prefix(text: str) -> tuple[str, int] | None:
    """Salvage an observation cut off before `</output>` (the simulator hit its token cap):
    (output so far, exit_code), or None when even the header is missing."""
    m = _HEADER.match(text)
    if m is None:
        return None
    output = m.group(2)
    # Drop a partially generated closing tag.
    for k in range(len("\n</output>"), 0, -1):
        if output.endswith("\n</output>"[:k]):
            output = output[:-k]
            break
    return output, int(m.group(1))


def strip_think(text: str) -> tuple[str, bool]:
    """Remove `<think>...</think>` blocks and stray think tags; returns (text, leaked)."""
    stripped = _THINK_BLOCK.sub("", text)
    if THINK in stripped:  # an unclosed block: everything after it is reasoning
        stripped = stripped[: stripped.index(THINK)]
    stripped = stripped.replace(END_THINK, "")
    return stripped, stripped != text


def setup_description(files: Mapping[str, str]) -> str:
    if not files:
        return ""
    parts = ["Files in the working directory at the start:"]
    for path, text in sorted(files.items()):
        parts.append(f"--- {path} ---\n{text}" + ("" if text.endswith("\n") else "\n"))
    return "\n".join(parts)


def kept_history(prefix_len: int, turn_lens: Sequence[int], suffix_len: int, budget: int) -> int:
    """How many of the newest history turns the simulator sees: whole turns, newest first,
    while the prompt (`prefix_len` system tokens + the kept turns + `suffix_len` for the
    current command and generation prompt) stays within `budget` tokens. The one rule for
    both sides: `SimulatedShell` asks with exactly the contexts `simloop train-sim` trains on
    (a turn is never cut in part, so a long history renders the same in training and serving).
    """
    room = budget - prefix_len - suffix_len
    kept = 0
    for n in reversed(turn_lens):
        if n > room:
            break
        room -= n
        kept += 1
    return kept


def render_sim_messages(
    task_instruction: str,
    history: Sequence[tuple[str, HasOutput]],
    command: str,
    *,
    setup_files: Mapping[str, str] | None = None,
    system_prompt: str | None = None,
    show_task: bool = True,
) -> list[Message]:
    """The simulator's chat for predicting the observation of `command`. Render it with
    `add_generation_prompt=True, enable_thinking=False`; the target is
    `format_observation(output, exit_code)` followed by the end-of-turn token.
    `system_prompt` (None: `SIM_SYSTEM_PROMPT`) and `show_task` come from
    `SimulatedShellConfig`, and training and serving must use the same values."""
    system = SIM_SYSTEM_PROMPT if system_prompt is None else system_prompt
    if show_task:
        system += f"\n\nThe user is working on this task:\n{task_instruction.strip()}"
    files = setup_description(setup_files or {})
    if files:
        system = f"{system}\n\n{files}" if system else files
    messages: list[Message] = [{"role": "system", "content": system}]
    for past_command, obs in history:
        messages.append({"role": "user", "content": past_command})
        messages.append(
            {
                "role": "assistant",
                "content": format_observation(obs.output, obs.exit_code),
                "reasoning_content": "",
            }
        )
    messages.append({"role": "user", "content": command})
    return messages
