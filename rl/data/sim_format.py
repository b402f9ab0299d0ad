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

import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

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


# ----- the prompt layout a simulator was trained on ----------------------------------------

PROMPT_LAYOUT_FILE = "sim_prompt.json"
"""Beside a simulator's weights (`simloop train-sim` writes it): the prompt layout flags it was
trained with (`SimulatedShellConfig.prompt_layout`), which it must be served with."""


def prompt_layout_record(layout: Mapping[str, bool]) -> str:
    """The text of `PROMPT_LAYOUT_FILE` for `layout` (written with the weights:
    `rl.model.params_io.save_params`'s `extra_files`)."""
    return json.dumps(dict(layout), indent=1, sort_keys=True) + "\n"


def layout_mismatches(
    weights: str | os.PathLike, layout: Mapping[str, bool]
) -> list[tuple[str, bool, bool]]:
    """What serving the weights in `weights` with `layout` would change from the prompts they
    were trained on: `(flag, trained, served)` for each flag that differs (none when the
    weights record no layout: trained before the record existed, or not by `train-sim`)."""
    path = Path(weights) / PROMPT_LAYOUT_FILE
    if not path.is_file():
        return []
    trained = json.loads(path.read_text())
    return [
        (flag, bool(trained[flag]), bool(layout[flag]))
        for flag in sorted(trained)
        if flag in layout and bool(trained[flag]) != bool(layout[flag])
    ]


# ----- workspace mode: the simulator keeps the files itself ----------------------------------

SIM_WORKSPACE_SYSTEM_PROMPT = """You are a Linux terminal. The working directory holds the files \
listed below. The user sends one shell command, which runs in a fresh `bash -c` there. Reply with \
exactly what running it prints (stdout and stderr) and its exit status, then every file it \
created, changed or removed, in this format and nothing else:
<returncode>N</returncode>
<output>
...
</output>
<changes>
--- path ---
(the file's whole new content)
--- path --- appended
(the lines added at the end of a file)
--- path/ ---     (a new empty directory)
--- path --- removed
</changes>
Leave out the changes block when no file changed."""

WORKSPACE_HEADER = "Files in the working directory:"
_NO_NEWLINE = "\\ no newline at end of file"
_CHANGES = re.compile(r"\n<changes>\n(.*)</changes>\s*\Z", re.S)
_ENTRY = re.compile(r"^--- (.+?) ---(?: (removed|appended))?$")


class Change(NamedTuple):
    """One entry of a changes block: `path`'s new content, or the text `append`ed to it, or
    (`content` None) its removal."""

    path: str
    content: str | None
    append: bool = False


Workspace = dict[str, str]
"""A working directory as the simulator sees it: path -> content for every file, and
`dir/` -> "" for every empty directory (a directory holding files is implied by them)."""


def normalize_workspace(files: Mapping[str, str]) -> Workspace:
    """`files` with each `dir/` entry dropped where files or directories below it exist
    (the order kept: it is the prompt's, `workspace_description`)."""
    out = dict(files)
    for path in [p for p in out if p.endswith("/")]:
        if any(q != path and q.startswith(path) for q in out):
            del out[path]
    return out


def _file_block(path: str, content: str) -> str:
    if path.endswith("/"):
        return f"--- {path} ---\n"
    if content and not content.endswith("\n"):
        content += f"\n{_NO_NEWLINE}\n"
    return f"--- {path} ---\n{content}"


def start_workspace(files: Mapping[str, str]) -> Workspace:
    """A workspace at the start of an episode: its files in path order."""
    return normalize_workspace({p: files[p] for p in sorted(files)})


def named_paths(files: Mapping[str, str], command: str) -> list[str]:
    """The workspace's paths that `command` names, in the workspace's order: a path written
    in it as a whole word (a directory without its `/`), bounded by anything but a letter,
    digit, `_`, `.`, `-` or `/` (so `a.txt` is named in `wc -l < a.txt` and `cat a.txt>b`,
    not in `aa.txt` or `x/a.txt`), and each path under a directory so named (`ls archive`
    names `archive/notes.txt`). Text matching only: nothing here knows what a program does
    with a path."""

    def named(name: str) -> bool:
        return re.search(rf"(?<![\w./-]){re.escape(name)}(?![\w./-])", command) is not None

    def prefixes(path: str) -> list[str]:  # `d/e/f` -> d, d/e, d/e/f
        parts = path.rstrip("/").split("/")
        return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]

    return [path for path in files if any(named(p) for p in prefixes(path) if p)]


_PATH_WORD = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.[A-Za-z]\w*)(?![\w./-])")
ABSENT_HEADER = "Not in the working directory:"


def absent_names(files: Mapping[str, str], command: str) -> list[str]:
    """The file names `command` gives that name nothing in the workspace, in the order it
    gives them, each once: a word shaped like a file name (`name.ext`, maybe under
    directories: `b.txt`, `c.txtxt`, `archive/x_v2.txt`), bounded as in `named_paths`, that is
    neither a path in `files` nor a directory of one. Text matching only: nothing here knows
    whether the command reads the name or writes it, or what bash would print."""
    dirs = {d.rstrip("/") for d in _dirs(files)}
    out: list[str] = []
    for name in _PATH_WORD.findall(command):
        if name not in files and name not in dirs and name not in out:
            out.append(name)
    return out


def workspace_description(
    files: Mapping[str, str], *, command: str | None = None, absent_in: str | None = None
) -> str:
    """The current workspace in the simulator's prompt, in the workspace's order: the start's
    files by path, then each file as it was last written, newest last (`apply_changes`), so
    the file a command most likely reads (the one just written) sits right before it.
    Given `command` (`SimulatedShellConfig.workspace_named_last`), the files it names
    (`named_paths`) move after the others, in their order, so the file a command reads sits
    right before it however long ago it was written. Lossless either way: `parse_changes`
    reads the same blocks back (in the prompt's order). Given `absent_in`, a command
    (`SimulatedShellConfig.workspace_named_absent`) naming files that are not there
    (`absent_names`), one line after the files says which (`ABSENT_HEADER`), so whether
    the file a command reads exists is read off the line right before it, not searched for
    among the file blocks; without such names, no line."""
    named = [] if command is None else named_paths(files, command)
    order = [p for p in files if p not in named] + named
    body = "".join(_file_block(p, files[p]) for p in order)
    text = f"{WORKSPACE_HEADER}\n{body}" if body else f"{WORKSPACE_HEADER}\n(empty)\n"
    missing = [] if absent_in is None else absent_names(files, absent_in)
    return text + (f"{ABSENT_HEADER} {', '.join(missing)}\n" if missing else "")


def _dirs(files: Mapping[str, str]) -> set[str]:
    """Every directory of a workspace (`dir/`), implied by its files or listed empty."""
    out = set()
    for path in files:
        parts = path.rstrip("/").split("/")
        out.update("/".join(parts[:i]) + "/" for i in range(1, len(parts)))
        if path.endswith("/"):
            out.add(path)
    return out


def workspace_changes(before: Mapping[str, str], after: Mapping[str, str]) -> str:
    """The changes block body from workspace `before` to `after` (both normalized), in path
    order: each file written (new or different content), each new empty directory, each
    directory gone (which takes everything below it) and each other file gone. A directory
    that stays is no change, whether files still fill it or not."""
    old_dirs, new_dirs = _dirs(before), _dirs(after)
    gone_dirs = old_dirs - new_dirs
    top_gone = {d for d in gone_dirs if not any(d != e and d.startswith(e) for e in gone_dirs)}
    parts = []
    for path in sorted(set(before) | set(after) | top_gone):
        if path in top_gone:
            parts.append(f"--- {path} --- removed\n")
        elif any(path.startswith(d) for d in top_gone):
            continue  # removed with its directory
        elif path.endswith("/"):
            if path in after and path not in old_dirs:
                parts.append(_file_block(path, ""))
        elif path in after:
            old, new = before.get(path), after[path]
            if old and old.endswith("\n") and new != old and new.startswith(old):
                # lines added at the end: only they are written (an append, a `>>`)
                parts.append(
                    _file_block(path, new[len(old) :]).replace(" ---\n", " --- appended\n", 1)
                )
            elif old != new:
                parts.append(_file_block(path, new))
        else:
            parts.append(f"--- {path} --- removed\n")
    return "".join(parts)


def format_workspace_reply(output: str, exit_code: int, changes: str) -> str:
    """What a workspace-mode simulator must write: the observation, then its changes block
    (`workspace_changes`) when any file changed."""
    obs = format_observation(output, exit_code)
    return f"{obs}\n<changes>\n{changes}</changes>" if changes else obs


def split_changes(text: str) -> tuple[str, str | None]:
    """(observation text, changes body or None when the reply has no changes block)."""
    m = _CHANGES.search(text)
    if m is None or "</output>" not in text[: m.start() + 1]:
        return text, None
    return text[: m.start()], m.group(1)


def parse_changes(body: str) -> list[Change]:
    """The `Change`s of a changes body (or of a workspace description without its header);
    `ObservationFormatError` when it is not one."""
    entries: list[tuple[str, list[str] | None, bool]] = []
    lines = body.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    current: list[str] | None = None
    for line in lines:
        m = _ENTRY.match(line)
        if m is None:
            if current is None:
                raise ObservationFormatError(f"changes: expected '--- path ---', got {line[:60]!r}")
            current.append(line)
            continue
        path, kind = m.group(1), m.group(2)
        if not path or path.startswith("/") or ".." in path.split("/"):
            raise ObservationFormatError(f"changes: path {path!r} is not inside the workspace")
        if kind == "appended" and path.endswith("/"):
            raise ObservationFormatError(f"changes: directory {path!r} cannot be appended to")
        if kind == "removed":
            entries.append((path, None, False))
            current = None
        else:
            current = []
            entries.append((path, current, kind == "appended"))
    out = []
    for path, body_lines, append in entries:
        if body_lines is None:
            out.append(Change(path, None))
            continue
        if path.endswith("/"):
            if body_lines:
                raise ObservationFormatError(f"changes: directory {path!r} has content")
            out.append(Change(path, ""))
            continue
        if body_lines and body_lines[-1] == _NO_NEWLINE:
            out.append(Change(path, "\n".join(body_lines[:-1]), append))
        else:
            out.append(Change(path, "".join(f"{ln}\n" for ln in body_lines), append))
    return out


def apply_changes(files: Mapping[str, str], changes: Sequence[Change]) -> Workspace:
    """The workspace after `changes` (`parse_changes`): a path written takes its new content
    (or, appended, its old content and the text) and moves to the end (newest last); a
    removed path goes with everything below it, and its directory stays (listed empty, at
    the end, when nothing is left in it). The result is normalized."""
    out = dict(files)
    for path, content, append in changes:
        if content is not None:
            old = out.pop(path, "")
            out[path] = old + content if append else content
            continue
        base = path.rstrip("/")
        for p in [p for p in out if p.rstrip("/") == base or p.startswith(base + "/")]:
            del out[p]
        parent = base.rpartition("/")[0]
        if parent and not any(p.startswith(parent + "/") for p in out):
            out[parent + "/"] = ""
    return normalize_workspace(out)


def apply_written_block(files: Mapping[str, str], body: str) -> tuple[Workspace, bool]:
    """(the workspace after a changes block a simulator wrote, whether the block parsed): a
    block that does not parse changes nothing. What `SimulatedShell` keeps, and what arm (c)
    follows when it checks the simulator's files against the real ones."""
    try:
        return apply_changes(files, parse_changes(body)), True
    except ObservationFormatError:
        return dict(files), False


def render_workspace_messages(
    task_instruction: str,
    workspace: Mapping[str, str],
    command: str,
    *,
    system_prompt: str | None = None,
    show_task: bool = True,
    named_last: bool = False,
    named_absent: bool = False,
) -> list[Message]:
    """The workspace-mode simulator's chat for `command`: the system message (instructions,
    the task when `show_task`, the workspace as it is now, the files `command` names last
    when `named_last`, the names it gives that are not there when `named_absent`) and the
    command; no history, since each command runs in a fresh
    `bash -c` and only the files carry over. The target is `format_workspace_reply(...)`
    followed by the end-of-turn token."""
    system = SIM_WORKSPACE_SYSTEM_PROMPT if system_prompt is None else system_prompt
    if show_task:
        system += f"\n\nThe user is working on this task:\n{task_instruction.strip()}"
    files = workspace_description(
        workspace,
        command=command if named_last else None,
        absent_in=command if named_absent else None,
    )
    system = f"{system}\n\n{files}" if system else files
    return [{"role": "system", "content": system}, {"role": "user", "content": command}]


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
