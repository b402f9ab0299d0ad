"""Importers: trajectory files written by other agent frameworks -> simloop `Trajectory`s (arm
`imported`, `source="rendered"`: text only, no logprobs, optionally a token view rendered with
the agent's tokenizer).

- `swe-agent`: SWE-agent `.traj` JSON. `trajectory` steps (`action`, `observation`, `response`,
  `thought`, `execution_time`) are the turns; `history` (the chat transcript) gives the prompt,
  the task statement and the messages the agent was shown. Plain-command, XML (`<command>`) and
  function-calling variants all import; a function call is rendered after the thought the way
  Qwen3 renders tool calls (`<tool_call>\\n{"name", "arguments"}\\n</tool_call>`). SWE-agent
  records no return codes: `exit_code` stays None.
- `chat`: a JSON list of OpenAI-style chat messages, or an object with `messages` (mini-swe-agent
  trajectories). A command is the one ```bash block of an assistant message, or its tool call's
  `command` argument; `<returncode>N</returncode>` / `<output>` observations give return codes.

Errors are `TrajectoryImportError`, whose message names the file and the field it could not read.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rl.data.chat import ChatRenderer, Message
from rl.data.trajectory import Trajectory, Turn, render_token_view, validate

FORMATS = ("swe-agent", "chat")
PATTERNS = {"swe-agent": "*.traj", "chat": "*.json"}
"""Which files a folder argument contributes, per format."""

_ROLE_ALIASES = {"developer": "system", "function": "tool"}
_BLOCK = re.compile(r"```(?:bash|sh|shell)?[ \t]*\n(.*?)```", re.S)
_RETURNCODE = re.compile(r"<returncode>\s*(-?\d+)\s*</returncode>")
_OUTPUT = re.compile(r"<output>\n?(.*?)\n?</output>", re.S)


class TrajectoryImportError(ValueError):
    """A file could not be imported; `path` and `field` say where."""

    def __init__(self, path: str | os.PathLike, field: str, message: str):
        self.path, self.field = str(path), field
        super().__init__(f"{path}: field '{field}': {message}")


@dataclass(frozen=True)
class ImportConfig:
    """`simloop import`: which format, and how the token view is rendered."""

    format: Literal["swe-agent", "chat"] = "swe-agent"
    """`swe-agent` (.traj files) or `chat` (mini-swe-agent / OpenAI chat message JSON)."""
    enable_thinking: bool = False
    """The generation prompt of the token view; match how the agent is run (Qwen3 with thinking
    off appends an empty think block to the prompt)."""
    shard_size: int = 1000
    """Trajectories per JSONL shard under `<out>/trajectories/`."""

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"ImportConfig.format={self.format!r} is invalid: one of {FORMATS}")
        think = self.enable_thinking
        if not isinstance(think, bool):
            raise ValueError(f"ImportConfig.enable_thinking={think!r} is invalid: true or false")
        size = self.shard_size
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"ImportConfig.shard_size={size!r} is invalid: a positive integer")


@dataclass
class ImportReport:
    """A batch import: what imported and, per failed file, why."""

    imported: list[tuple[Path, Trajectory]] = field(default_factory=list)
    failed: list[tuple[Path, str]] = field(default_factory=list)


class _Reader:
    """Typed field access whose errors name the file and the field."""

    def __init__(self, path: str | os.PathLike):
        self.path = path

    def error(self, where: str, message: str) -> TrajectoryImportError:
        return TrajectoryImportError(self.path, where, message)

    def get(self, obj: dict, key: str, where: str, kind: type | tuple, *, required=True) -> Any:
        name = f"{where}.{key}" if where else key
        if key not in obj:
            if required:
                raise self.error(name, "is missing")
            return None
        value = obj[key]
        if not isinstance(value, kind):
            kinds = kind if isinstance(kind, tuple) else (kind,)
            expected = " or ".join(k.__name__ for k in kinds)
            raise self.error(name, f"expected {expected}, got {type(value).__name__}")
        return value

    def content(self, value: Any, where: str) -> str:
        """Message content: a string, a list of text parts, or null."""
        if value is None:
            return ""
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            parts = []
            for i, part in enumerate(value):
                if isinstance(part, str):
                    parts.append(part)
                elif isinstance(part, dict) and isinstance(part.get("text"), str):
                    parts.append(part["text"])
                else:
                    raise self.error(f"{where}[{i}]", "expected a text part")
            return "".join(parts)
        raise self.error(where, f"expected a string or text parts, got {type(value).__name__}")

    def message(self, m: Any, where: str) -> Message:
        if not isinstance(m, dict):
            raise self.error(where, f"expected a message object, got {type(m).__name__}")
        role = m.get("role")
        role = _ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in ("system", "user", "assistant", "tool"):
            raise self.error(f"{where}.role", f"{m.get('role')!r} is not a chat role")
        return {"role": role, "content": self.content(m.get("content"), f"{where}.content")}


def _imported(task_id: str, backend: str, **fields: Any) -> Trajectory:
    """The fields every imported trajectory shares: text only, no sampler record."""
    return Trajectory(
        task_id=task_id,
        arm="imported",
        env_backend=backend,
        group_id=task_id,
        source="rendered",
        behavior_logprobs=None,
        policy_version=None,
        **fields,
    )


def _task_statement(text: str) -> str:
    """The task without SWE-agent's trailing how-to (everything from `INSTRUCTIONS:` on)."""
    cut = text.find("\nINSTRUCTIONS:")
    return (text[:cut] if cut >= 0 else text).strip()


def _tool_call_text(calls: Any, r: _Reader, where: str) -> tuple[str, dict[str, Any] | None]:
    """Qwen3-style `<tool_call>` blocks for OpenAI tool calls, and the first call."""
    if isinstance(calls, str):
        try:
            calls = json.loads(calls)
        except json.JSONDecodeError as e:
            raise r.error(where, f"not valid JSON: {e}") from e
    if not isinstance(calls, list):
        raise r.error(where, f"expected a list of tool calls, got {type(calls).__name__}")
    blocks, first = [], None
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise r.error(f"{where}[{i}].function", "expected {'name', 'arguments'}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise r.error(f"{where}[{i}].function.arguments", f"not valid JSON: {e}") from e
        call_obj = {"name": fn["name"], "arguments": args}
        first = first or call_obj
        blocks.append(f"<tool_call>\n{json.dumps(call_obj, ensure_ascii=False)}\n</tool_call>")
    return "\n".join(blocks), first


def _with_tool_calls(text: str, calls_text: str) -> str:
    return f"{text.rstrip()}\n\n{calls_text}" if text.strip() else calls_text


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


def import_swe_agent(data: Any, path: str | os.PathLike) -> Trajectory:
    """A SWE-agent `.traj` object (parsed JSON) as a text-only trajectory."""
    r = _Reader(path)
    if not isinstance(data, dict):
        raise r.error("(root)", f"expected a JSON object, got {type(data).__name__}")
    steps = r.get(data, "trajectory", "", list)
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
    if not task:
        raise r.error("history", "no user message with the task before the first agent turn")
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
            (k for k in range(cursor, len(agent_at))
             if _action_of(messages[agent_at[k]][1]) == action.strip()),
            None,
        )  # fmt: skip
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
                calls_text, _ = _tool_call_text(calls, r, f"history[{at}].tool_calls")
                agent_text = _with_tool_calls(agent_text, calls_text)
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
    status, reason = _swe_status(info.get("exit_status"))
    variant = "function_calling" if function_calling else "plain"
    if not function_calling and any("<command>" in t.agent_text for t in turns):
        variant = "xml"
    return _imported(
        Path(path).stem,
        "swe-agent",
        status=status,
        reason=reason,
        instruction=_task_statement(task[0]["content"]),
        prompt=prompt,
        turns=turns,
        meta={
            "source_file": str(path),
            "source_format": "swe-agent",
            "variant": variant,
            "exit_status": info.get("exit_status"),
            "turns_matched_in_history": from_history,
        },
    )


def _chat_command(text: str) -> str | None:
    blocks = _BLOCK.findall(text)
    return (blocks[0].strip() or None) if len(blocks) == 1 else None


def _chat_observation(content: str) -> tuple[str, int | None]:
    code = _RETURNCODE.search(content)
    out = _OUTPUT.search(content)
    if out is not None:
        return out.group(1), int(code.group(1)) if code else None
    if code is not None:
        return _RETURNCODE.sub("", content, count=1).strip("\n"), int(code.group(1))
    return content, None


def import_chat(data: Any, path: str | os.PathLike) -> Trajectory:
    """A chat transcript (a message list, or an object with `messages`) as a trajectory."""
    r = _Reader(path)
    if isinstance(data, list):
        raw_messages, info, top = data, {}, {}
    elif isinstance(data, dict):
        raw_messages = r.get(data, "messages", "", list)
        info, top = r.get(data, "info", "", dict, required=False) or {}, data
    else:
        raise r.error("(root)", "expected a message list or an object with 'messages'")
    key = "messages" if isinstance(data, dict) else "(root)"
    messages = [r.message(m, f"{key}[{i}]") for i, m in enumerate(raw_messages)]
    agent_at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not agent_at:
        raise r.error(key, "no assistant message: nothing the agent did")
    prompt = messages[: agent_at[0]]
    task = [m for m in prompt if m["role"] == "user"]
    if not task:
        raise r.error(key, "no user message with the task before the first assistant message")
    turns: list[Turn] = []
    for n, at in enumerate(agent_at):
        raw = raw_messages[at]
        where = f"{key}[{at}]"
        text = messages[at]["content"]
        if isinstance(raw.get("reasoning_content"), str):
            text = f"<think>\n{raw['reasoning_content'].strip()}\n</think>\n\n{text}"
        command, flags = None, []
        if raw.get("tool_calls"):
            calls_text, first = _tool_call_text(raw["tool_calls"], r, f"{where}.tool_calls")
            text = _with_tool_calls(text, calls_text)
            if first is not None:
                args = first["arguments"]
                cmd = args.get("command") if isinstance(args, dict) else None
                command = cmd if isinstance(cmd, str) else f"{first['name']} {json.dumps(args)}"
        else:
            command = _chat_command(text)
            if command is None:
                flags.append("format_error")
        end = agent_at[n + 1] if n + 1 < len(agent_at) else len(messages)
        env_messages: list[Message] = [
            {"role": "tool" if m["role"] == "tool" else "user", "content": m["content"]}
            for m in messages[at + 1 : end]
        ]
        observation, exit_code = None, None
        if command is not None and env_messages:
            observation, exit_code = _chat_observation(env_messages[0]["content"])
        turns.append(
            Turn(
                agent_text=text,
                command=command,
                observation=observation,
                exit_code=exit_code,
                env_messages=env_messages,
                flags=flags,
            )
        )
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
    return _imported(
        str(task_id),
        "chat",
        status=status,
        reason=reason,
        reward=None if reward is None else float(reward),
        instruction=_task_statement(task[0]["content"]),
        prompt=prompt,
        turns=turns,
        meta={"source_file": str(path), "source_format": "chat", "exit_status": exit_status},
    )


IMPORTERS = {"swe-agent": import_swe_agent, "chat": import_chat}


def import_file(
    path: str | os.PathLike,
    fmt: str,
    renderer: ChatRenderer | None = None,
    *,
    enable_thinking: bool = False,
    tokenizer_name: str | None = None,
) -> Trajectory:
    """One file as a validated trajectory; with a renderer, also its token view."""
    if fmt not in IMPORTERS:
        raise ValueError(f"format={fmt!r} is invalid: one of {FORMATS}")
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TrajectoryImportError(path, "(file)", f"cannot read: {e}") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TrajectoryImportError(path, "(file)", f"not valid JSON: {e}") from e
    traj = IMPORTERS[fmt](data, path)
    if renderer is not None:
        render_token_view(traj, renderer, enable_thinking=enable_thinking)
        traj.tokenizer = tokenizer_name
    try:
        validate(traj)
    except ValueError as e:
        raise TrajectoryImportError(path, "(trajectory)", str(e)) from e
    return traj


def expand_paths(paths: Iterable[str | os.PathLike], fmt: str) -> list[Path]:
    """Files to import: files as given, folders searched recursively for the format's pattern.
    Missing paths are kept, so that the import reports them as failures."""
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
    """Import every file (`options` as for `import_file`); a file that fails is reported and
    the others still import."""
    report = ImportReport()
    for path in expand_paths(paths, fmt):
        try:
            traj = import_file(path, fmt, renderer, **options)
        except TrajectoryImportError as e:  # per-file failures are the report's content
            report.failed.append((path, str(e)))
            continue
        report.imported.append((path, traj))
    return report
