"""Importers: trajectory files written by other agent frameworks -> simloop `Trajectory`s (arm
`imported`, `source="rendered"`: text only, no logprobs, optionally a token view rendered with
the agent's tokenizer).

- `swe-agent`: SWE-agent `.traj` JSON. `trajectory` steps (`action`, `observation`, `response`,
  `thought`, `execution_time`) are the turns; `history` (the chat transcript) gives the prompt,
  the task statement and the messages the agent was shown. Plain-command, XML (`<command>`) and
  function-calling variants all import; a function call is rendered after the thought the way
  Qwen3 renders tool calls (`<tool_call>\\n{"name", "arguments"}\\n</tool_call>`). SWE-agent
  records no return codes: `exit_code` stays None. A function-calling file may hold only
  `history` (no `trajectory`): each agent message is then a turn, its content the thought, its
  tool call the command (a `bash` call's `command` argument; for other tools the message's
  `action`, SWE-agent's rendering, as in the steps, else the call as a command line) and the
  `role: "tool"` message answering the call (`tool_call_id(s)`) the observation, without
  SWE-agent's trailing state lines (`(Open file: ...)`, `bash-$`). A plain or XML file needs
  its `trajectory`.
- `chat`: a JSON list of OpenAI-style chat messages, or an object with `messages`. A command is
  the one ```bash block of an assistant message, or its tool call's `command` argument;
  `<returncode>N</returncode>` / `<output>` observations give return codes (details in
  `rl.data.importers_common`). An object whose `trajectory_format` is `mini-swe-agent-*` imports
  as `mini-swe-agent`.
- `mini-swe-agent`: mini-swe-agent's `*.traj.json` (`trajectory_format` `mini-swe-agent-1` or
  `-1.1`): `messages`, `info.exit_status`, `info.submission`; see `rl.data.importers_mini`.

Errors are `TrajectoryImportError`, whose message names the file and the field it could not read.
A batch import (`import_files`) reports every file that fails, for whatever reason, and imports
the others. Only regular files are read (a FIFO, device or folder is a named failure, never a
hang). A lone UTF-16 surrogate (a `\\ud800`-style JSON escape without its partner, which no
UTF-8 shard can hold) is replaced by U+FFFD and counted in `meta["replaced_lone_surrogates"]`;
every imported trajectory is serialised and encoded once before it is accepted, so a record the
shard writer would reject fails its own file instead of the whole shard. Text is scanned in
linear time (no backtracking regex over an observation).
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rl import validate
from rl.data.chat import ChatRenderer, Message
from rl.data.importers_common import (
    Item,
    Reader,
    TrajectoryImportError,
    answers,
    call_command,
    chat_turns,
    imported,
    split_prompt,
    task_statement,
    tool_call_text,
    with_tool_calls,
)
from rl.data.importers_mini import MINI_FORMAT_PREFIX, import_mini_swe_agent
from rl.data.trajectory import Trajectory, Turn, render_token_view, to_json_line

__all__ = [
    "FORMATS",
    "IMPORTERS",
    "PATTERNS",
    "ImportConfig",
    "ImportReport",
    "TrajectoryImportError",
    "expand_paths",
    "import_chat",
    "import_file",
    "import_files",
    "import_mini_swe_agent",
    "import_swe_agent",
]

FORMATS = ("swe-agent", "chat", "mini-swe-agent")
PATTERNS = {"swe-agent": "*.traj", "chat": "*.json", "mini-swe-agent": "*.traj.json"}
"""Which files a folder argument contributes, per format."""

_SWE_STATE = re.compile(r"\([A-Z][\w ]*: ")
"""The start of one of SWE-agent's state lines after an observation (`(Open file: ...)`,
`(Current directory: ...)`, then the `bash-$` prompt)."""
_SWE_NO_OUTPUT = "Your command ran successfully and did not produce any output."
_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")
"""A JSON escape of a UTF-16 surrogate: only such files can parse to lone surrogates."""
_LONE = re.compile("[\ud800-\udfff]")
_FILE_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFDIR: "a folder",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}
_UNEXPECTED = (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError)


@dataclass(frozen=True)
class ImportConfig:
    """`simloop import`: which format, and how the token view is rendered."""

    format: Literal["swe-agent", "chat", "mini-swe-agent"] = "swe-agent"
    """`swe-agent` (.traj files), `chat` (OpenAI chat message JSON) or `mini-swe-agent`
    (.traj.json files)."""
    enable_thinking: bool = False
    """The generation prompt of the token view; match how the agent is run (Qwen3 with thinking
    off appends an empty think block to the prompt)."""
    shard_size: int = 1000
    """Trajectories per JSONL shard under `<out>/trajectories/`."""

    def __post_init__(self) -> None:
        validate.one_of(self, "format", FORMATS, allowed=f"one of {FORMATS}")
        validate.boolean(self, "enable_thinking")
        validate.positive_int(self, "shard_size")


@dataclass
class ImportReport:
    """A batch import: what imported and, per failed file, why."""

    imported: list[tuple[Path, Trajectory]] = field(default_factory=list)
    failed: list[tuple[Path, str]] = field(default_factory=list)


def _action_of(raw_message: dict) -> str:
    action = raw_message.get("action")
    return action.strip() if isinstance(action, str) else ""


def _swe_status(exit_status: Any) -> tuple[str, str | None]:
    if not isinstance(exit_status, str) or not exit_status:
        return "aborted", "the source recorded no exit status"
    if exit_status == "submitted":
        return "ok", None
    reason = f"swe-agent exit_status {exit_status!r}"
    limits = ("exit_cost", "exit_context", "exit_format", "exit_total_execution_time")
    if any(limit in exit_status for limit in limits):
        return "truncated", reason
    return "error", reason


def _swe_state_start(text: str) -> int | None:
    """Where SWE-agent's trailing state lines start in `text` (which ends before `bash-$`):
    lines `(Name: ...)`, the first of them possibly the end of a line of output. Scans lines
    from the end, in linear time (the equivalent regex backtracks exponentially)."""
    start, end = None, len(text)
    while end > 0 and text[end - 1] == ")":
        line_at = text.rfind("\n", 0, end) + 1
        line = text[line_at:end]
        if _SWE_STATE.match(line) and _SWE_STATE.match(line).end() < len(line):
            start = line_at - 1 if line_at else 0  # with the newline before it
            end = line_at - 1
            continue
        for at in (i for i, ch in enumerate(line) if ch == "("):  # a state line after output
            found = _SWE_STATE.match(line, at)
            if found is not None and found.end() < len(line):
                return line_at + at
        break
    return start


def _swe_observation(content: str) -> str:
    """A tool message's observation without SWE-agent's state lines (what the command printed)."""
    text = content.rstrip()
    if text.endswith("bash-$"):
        body = text[: -len("bash-$")]
        body = body[:-1] if body.endswith("\n") else body
        start = _swe_state_start(body)
        if start is not None:
            content = content[:start]
    return "" if content == _SWE_NO_OUTPUT else content


def _swe_turns_from_steps(
    r: Reader, steps: list, messages: list[tuple[Message, dict]], agent_at: list[int]
) -> tuple[list[Turn], int]:
    """The steps as turns, each matched to its agent message in the transcript; and how many
    matched."""
    function_calling = any(raw.get("tool_calls") for _, raw in messages)
    turns: list[Turn] = []
    cursor = 0  # next unmatched assistant message in `agent_at`
    from_history = 0
    for i, step in enumerate(steps):
        where = f"trajectory[{i}]"
        if not isinstance(step, dict):
            raise r.error(where, f"expected a step object, got {type(step).__name__}")
        action = r.get(step, "action", where, str)
        observation = r.get(step, "observation", where, (str, type(None)))
        response = r.get(step, "response", where, str, required=False)
        thought = r.get(step, "thought", where, str, required=False)
        agent_text = response if response is not None else (thought or "")
        timings = {}
        if step.get("execution_time") is not None:
            try:
                timings["env_s"] = float(step["execution_time"])
            except (TypeError, ValueError) as e:
                raise r.error(f"{where}.execution_time", f"not a number: {e}") from e
        # The transcript is not always aligned with the steps (it may lack some): match by
        # action, and fall back to the step's own observation as what the agent saw.
        match = next(
            (
                k
                for k in range(cursor, len(agent_at))
                if _action_of(messages[agent_at[k]][1]) == action.strip()
            ),
            None,
        )
        env_messages: list[Message] = []
        info_turn: dict[str, Any] = {}
        if match is not None:
            from_history += 1
            at = agent_at[match]
            cursor = match + 1
            end = agent_at[cursor] if cursor < len(agent_at) else len(messages)
            env_messages = [m for m, raw in messages[at + 1 : end] if m["role"] in ("user", "tool")]
            calls = messages[at][1].get("tool_calls")
            if calls:
                calls_text, _ = tool_call_text(calls, r, f"history[{at}].tool_calls")
                agent_text = with_tool_calls(agent_text, calls_text)
        else:
            if function_calling:
                info_turn["tool_call"] = "missing from the history"
            if observation is not None and i + 1 < len(steps):
                role = "tool" if function_calling else "user"
                env_messages = [{"role": role, "content": observation}]
        turns.append(
            Turn(
                agent_text=agent_text,
                command=action.strip() or None,
                observation=observation,
                env_messages=env_messages,
                timings=timings,
                info=info_turn,
            )
        )
    return turns, from_history


def _swe_turns_from_history(
    r: Reader, messages: list[tuple[Message, dict]], agent_at: list[int]
) -> list[Turn]:
    """A function-calling transcript's agent messages as turns (see the module docstring)."""
    turns: list[Turn] = []
    for n, at in enumerate(agent_at):
        message, raw = messages[at]
        end = agent_at[n + 1] if n + 1 < len(agent_at) else len(messages)
        env = [(m, x) for m, x in messages[at + 1 : end] if m["role"] in ("user", "tool")]
        agent_text, command, call_id = message["content"], None, None
        if raw.get("tool_calls"):
            calls_text, first = tool_call_text(raw["tool_calls"], r, f"history[{at}].tool_calls")
            agent_text = with_tool_calls(agent_text, calls_text)
            if first is not None:
                call_id, command = first["id"], call_command(first)
                if first["name"] != "bash" and _action_of(raw):
                    command = raw["action"]  # SWE-agent's own rendering, as in its steps
        elif _action_of(raw):  # e.g. an autosubmission without a tool call
            command = raw["action"]
        command = (command or "").strip() or None
        observation = None
        if command is not None and env:
            answer = next((m for m, x in env if answers(x, call_id)), env[0][0])
            observation = _swe_observation(answer["content"])
        turns.append(
            Turn(
                agent_text=agent_text,
                command=command,
                observation=observation,
                env_messages=[m for m, _ in env],
                flags=[] if command is not None else ["format_error"],
            )
        )
    return turns


def import_swe_agent(data: Any, path: str | os.PathLike) -> Trajectory:
    """A SWE-agent `.traj` object (parsed JSON) as a text-only trajectory."""
    r = Reader(path)
    if not isinstance(data, dict):
        raise r.error("(root)", f"expected a JSON object, got {type(data).__name__}")
    steps = r.get(data, "trajectory", "", list, required=False)
    history = r.get(data, "history", "", list)
    info = r.get(data, "info", "", dict, required=False) or {}
    messages: list[tuple[Message, dict]] = []
    for i, m in enumerate(history):
        messages.append((r.message(m, f"history[{i}]"), m))
    agent_at = [i for i, (m, raw) in enumerate(messages) if m["role"] == "assistant"]
    agent_at = [i for i in agent_at if not messages[i][1].get("is_demo")]
    first_agent = agent_at[0] if agent_at else len(messages)
    prompt = [m for m, _ in messages[:first_agent]]
    task = [
        m for m, raw in messages[:first_agent] if m["role"] == "user" and not raw.get("is_demo")
    ]
    function_calling = any(raw.get("tool_calls") for _, raw in messages)
    if steps is None and not function_calling:
        raise r.error("trajectory", "is missing (and 'history' holds no tool calls to import)")
    if not task:
        raise r.error("history", "no user message with the task before the first agent turn")
    if steps is not None:
        turns, from_history = _swe_turns_from_steps(r, steps, messages, agent_at)
    else:
        if not agent_at:
            raise r.error("history", "no assistant message: nothing the agent did")
        turns = _swe_turns_from_history(r, messages, agent_at)
        from_history = len(turns)
    status, reason = _swe_status(info.get("exit_status"))
    variant = "function_calling" if function_calling else "plain"
    if not function_calling and any("<command>" in t.agent_text for t in turns):
        variant = "xml"
    return imported(
        Path(path).stem,
        "swe-agent",
        status=status,
        reason=reason,
        instruction=task_statement(task[0]["content"]),
        prompt=prompt,
        turns=turns,
        meta={
            "source_file": str(path),
            "source_format": "swe-agent",
            "variant": variant,
            "turns_from": "trajectory" if steps is not None else "history",
            "exit_status": info.get("exit_status"),
            "turns_matched_in_history": from_history,
        },
    )


def import_chat(data: Any, path: str | os.PathLike) -> Trajectory:
    """A chat transcript (a message list, or an object with `messages`) as a trajectory; a
    mini-swe-agent trajectory (`trajectory_format`) as `import_mini_swe_agent` reads it."""
    r = Reader(path)
    if isinstance(data, list):
        raw_messages, info, top = data, {}, {}
    elif isinstance(data, dict):
        version = data.get("trajectory_format")
        if isinstance(version, str) and version.startswith(MINI_FORMAT_PREFIX):
            return import_mini_swe_agent(data, path)
        raw_messages = r.get(data, "messages", "", list)
        info, top = r.get(data, "info", "", dict, required=False) or {}, data
    else:
        raise r.error("(root)", "expected a message list or an object with 'messages'")
    key = "messages" if isinstance(data, dict) else "(root)"
    items: list[Item] = []
    for i, m in enumerate(raw_messages):
        items.append((r.message(m, f"{key}[{i}]"), m, f"{key}[{i}]"))
    prompt, task, agent_at = split_prompt(r, items, key)
    turns = chat_turns(r, items, agent_at)
    exit_status = info.get("exit_status", top.get("exit_status"))
    if exit_status is None:
        status, reason = "aborted", "the source recorded no exit status"
    elif str(exit_status).lower() in ("submitted", "ok", "success"):
        status, reason = "ok", None
    elif "limit" in str(exit_status).lower():
        status, reason = "truncated", f"exit_status {exit_status!r}"
    else:
        status, reason = "error", f"exit_status {exit_status!r}"
    reward = top.get("reward", info.get("reward"))
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
        raise r.error("reward", f"expected a number, got {type(reward).__name__}")
    task_id = top.get("instance_id") or info.get("instance_id") or Path(path).stem
    return imported(
        str(task_id),
        "chat",
        status=status,
        reason=reason,
        reward=None if reward is None else float(reward),
        instruction=task_statement(task),
        prompt=prompt,
        turns=turns,
        meta={"source_file": str(path), "source_format": "chat", "exit_status": exit_status},
    )


IMPORTERS = {
    "swe-agent": import_swe_agent,
    "chat": import_chat,
    "mini-swe-agent": import_mini_swe_agent,
}


def import_file(
    path: str | os.PathLike,
    fmt: str,
    renderer: ChatRenderer | None = None,
    *,
    enable_thinking: bool = False,
    tokenizer_name: str | None = None,
) -> Trajectory:
    """One file as a validated trajectory; with a renderer, also its token view. Every failure
    is a `TrajectoryImportError` naming the file (a shape no importer check caught, too)."""
    if fmt not in IMPORTERS:
        raise ValueError(f"format={fmt!r} is invalid: one of {FORMATS}")
    path = Path(path)
    text = _read_regular(path)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, or a number too long
        raise TrajectoryImportError(path, "(file)", f"not valid JSON: {e}") from e
    where = "(unknown)"
    try:
        data, replaced = _replace_lone_surrogates(data) if _SURROGATE.search(text) else (data, 0)
        traj = IMPORTERS[fmt](data, path)
        if replaced:
            traj.meta["replaced_lone_surrogates"] = replaced
        if renderer is not None:
            where = "(token view)"
            render_token_view(traj, renderer, enable_thinking=enable_thinking)
            traj.tokenizer = tokenizer_name
        where = "(trajectory)"
        to_json_line(traj).encode("utf-8")  # validates; what the shard will hold must encode
    except TrajectoryImportError:
        raise
    except _UNEXPECTED as e:
        message = str(e) if where == "(trajectory)" else f"{type(e).__name__}: {e}"
        raise TrajectoryImportError(path, where, message) from e
    return traj


def _read_regular(path: Path) -> str:
    """The text of a regular file; anything else (a FIFO, a device, a folder) is refused
    before it is read, so that it can neither block the import nor feed it endlessly."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO without a writer: no wait
    except OSError as e:
        raise TrajectoryImportError(path, "(file)", f"cannot read: {e}") from e
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = _FILE_KINDS.get(stat.S_IFMT(mode), "of an unknown kind")
        message = f"cannot read: not a regular file ({kind}), skipped"
        raise TrajectoryImportError(path, "(file)", message)
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read().decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TrajectoryImportError(path, "(file)", f"cannot read: {e}") from e


def _replace_lone_surrogates(data: Any) -> tuple[Any, int]:
    """`data` with every lone surrogate (a `\\ud800`-style escape with no partner, which no
    UTF-8 file can hold) replaced by U+FFFD, in keys and values; and how many were replaced.
    Iterative: as deep as the JSON parser allowed, without recursion."""
    replaced = 0

    def fix(s: str) -> str:
        nonlocal replaced
        fixed, n = _LONE.subn("\ufffd", s)
        replaced += n
        return fixed

    root = [data]
    stack: list[tuple[Any, Any]] = [(root, 0)]
    while stack:
        parent, key = stack.pop()
        value = parent[key]
        if isinstance(value, str):
            parent[key] = fix(value)
        elif isinstance(value, list):
            stack.extend((value, i) for i in range(len(value)))
        elif isinstance(value, dict):
            items = [(fix(k), v) for k, v in value.items()]
            value.clear()
            value.update(items)
            stack.extend((value, k) for k, _ in items)
    return root[0], replaced


def expand_paths(paths: Iterable[str | os.PathLike], fmt: str) -> list[Path]:
    """Files to import: files as given, folders searched recursively for the format's pattern.
    Missing paths are kept, so that the import reports them as failures."""
    if fmt not in PATTERNS:
        raise ValueError(f"format={fmt!r} is invalid: one of {FORMATS}")
    out: list[Path] = []
    for p in map(Path, paths):
        out.extend(sorted(p.rglob(PATTERNS[fmt])) if p.is_dir() else [p])
    return list(dict.fromkeys(out))


def import_files(
    paths: Sequence[str | os.PathLike],
    fmt: str,
    renderer: ChatRenderer | None = None,
    **options: Any,
) -> ImportReport:
    """Import every file (`options` as for `import_file`); a file that fails is reported, with a
    message naming it and what was wrong, and the others still import."""
    report = ImportReport()
    for path in expand_paths(paths, fmt):
        try:
            traj = import_file(path, fmt, renderer, **options)
        except TrajectoryImportError as e:  # per-file failures are the report's content
            report.failed.append((path, str(e)))
            continue
        except Exception as e:  # noqa: BLE001 - one odd file must not end the batch
            report.failed.append((path, f"{path}: {type(e).__name__}: {e}"))
            continue
        report.imported.append((path, traj))
    return report
