"""What the importers (`rl.data.importers`, `rl.data.importers_mini`) share: the error type, typed
field access whose errors name the file and the field, tool-call rendering, and the turns of a
chat transcript.

Chat transcripts (`chat_turns`): one turn per assistant message; the messages up to the next one
are what the agent was shown. The command is, in order of preference, the message's
`extra.actions` (mini-swe-agent 2 records the commands it ran there; any after the first go to
the turn's `info["more_commands"]`), its first tool call (the `command` argument, or a rendering
of the call for other tools), or its one ```bash (or ```mswea_bash_command) block; a reply with
none is flagged `format_error`. The observation is the message answering the command (the tool
message with the call's id, else the first one): `extra.raw_output`/`extra.returncode` where
recorded, else the `<returncode>N</returncode>` / `<output>` convention, else a
`{"returncode", "output"}` JSON object, else the text as it stands.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
from typing import Any

from rl.data.chat import Message
from rl.data.trajectory import Trajectory, Turn

_ROLE_ALIASES = {"developer": "system", "function": "tool"}
_BLOCK = re.compile(r"```(?:bash|sh|shell|mswea_bash_command)?[ \t]*\n(.*?)```", re.S)
_RETURNCODE = re.compile(r"<returncode>\s*(-?\d+)\s*</returncode>")

Item = tuple[Message, dict, str]
"""A transcript message: as read, as stored (a JSON object), and where (e.g. `messages[3]`)."""


class TrajectoryImportError(ValueError):
    """A file could not be imported; `path` and `field` say where."""

    def __init__(self, path: str | os.PathLike, field: str, message: str):
        self.path, self.field = str(path), field
        super().__init__(f"{path}: field '{field}': {message}")


class Reader:
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

    def loads(self, text: str, where: str) -> Any:
        """JSON inside a field (e.g. tool-call arguments)."""
        try:
            return json.loads(text)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, or a number too long
            raise self.error(where, f"not valid JSON: {e}") from e

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


def imported(task_id: str, backend: str, **fields: Any) -> Trajectory:
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


def task_statement(text: str) -> str:
    """The task without SWE-agent's trailing how-to (everything from `INSTRUCTIONS:` on)."""
    cut = text.find("\nINSTRUCTIONS:")
    return (text[:cut] if cut >= 0 else text).strip()


def tool_call_text(calls: Any, r: Reader, where: str) -> tuple[str, dict[str, Any] | None]:
    """Qwen3-style `<tool_call>` blocks for OpenAI tool calls, and the first call
    (`name`, `arguments` parsed, `id`)."""
    if isinstance(calls, str):
        calls = r.loads(calls, where)
    if not isinstance(calls, list):
        raise r.error(where, f"expected a list of tool calls, got {type(calls).__name__}")
    blocks, first = [], None
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise r.error(f"{where}[{i}].function", "expected {'name', 'arguments'}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            args = r.loads(args, f"{where}[{i}].function.arguments") if args.strip() else {}
        call_obj = {"name": fn["name"], "arguments": args}
        first = first or {**call_obj, "id": call.get("id")}
        blocks.append(f"<tool_call>\n{json.dumps(call_obj, ensure_ascii=False)}\n</tool_call>")
    return "\n".join(blocks), first


def with_tool_calls(text: str, calls_text: str) -> str:
    return f"{text.rstrip()}\n\n{calls_text}" if text.strip() else calls_text


def call_command(call: dict[str, Any]) -> str:
    """The command of a tool call: a `bash` call's `command`; other tools as a command line,
    the tool's name and then its argument values, shell-quoted (SWE-agent's own rendering)."""
    args = call["arguments"]
    if call["name"] == "bash" and isinstance(args, dict) and isinstance(args.get("command"), str):
        return args["command"]
    values = args.values() if isinstance(args, dict) else [args]
    words = [v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for v in values]
    return " ".join([call["name"], *map(shlex.quote, words)])


def answers(raw: dict, call_id: Any) -> bool:
    """Whether a tool message answers the call `call_id` (`tool_call_id`, or SWE-agent's
    `tool_call_ids`)."""
    if call_id is None:
        return False
    ids = raw.get("tool_call_ids")
    return raw.get("tool_call_id") == call_id or (isinstance(ids, list) and call_id in ids)


def chat_command(text: str) -> str | None:
    blocks = _BLOCK.findall(text)
    return (blocks[0].strip() or None) if len(blocks) == 1 else None


def enclosed(text: str, opening: str, closing: str) -> str | None:
    """The text between the first `opening` and the first `closing` after it, or None. Linear
    time: a lazy `opening(.*?)closing` regex rescans the rest of the text from every `opening`
    when `closing` is missing (quadratic: 128 KB of `<output>` took 15 s)."""
    start = text.find(opening)
    if start < 0:
        return None
    start += len(opening)
    end = text.find(closing, start)
    return None if end < 0 else text[start:end]


def chat_observation(content: str) -> tuple[str, int | None]:
    code = _RETURNCODE.search(content)
    out = enclosed(content, "<output>", "</output>")
    if out is not None:  # without one newline after <output> and before </output>
        out = out[1:] if out.startswith("\n") else out
        out = out[:-1] if out.endswith("\n") else out
        return out, int(code.group(1)) if code else None
    if code is not None:
        return _RETURNCODE.sub("", content, count=1).strip("\n"), int(code.group(1))
    if content.lstrip().startswith("{"):
        try:
            obj = json.loads(content)
        except (ValueError, RecursionError):
            obj = None
        if (
            isinstance(obj, dict)
            and isinstance(obj.get("output"), str)
            and _is_int(obj.get("returncode"))
        ):
            return obj["output"], obj["returncode"]
    return content, None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def extra_of(raw: dict) -> dict:
    """mini-swe-agent 2's per-message metadata (`{}` where absent)."""
    extra = raw.get("extra")
    return extra if isinstance(extra, dict) else {}


def split_prompt(r: Reader, items: list[Item], key: str) -> tuple[list[Message], str, list[int]]:
    """The prompt (messages before the first agent turn), the task (its first user message) and
    the positions of the agent's messages."""
    agent_at = [k for k, (m, _, _) in enumerate(items) if m["role"] == "assistant"]
    if not agent_at:
        raise r.error(key, "no assistant message: nothing the agent did")
    prompt = [m for m, _, _ in items[: agent_at[0]]]
    task = [m for m in prompt if m["role"] == "user"]
    if not task:
        raise r.error(key, "no user message with the task before the first assistant message")
    return prompt, task[0]["content"], agent_at


def _actions(raw: dict, r: Reader, where: str) -> list[tuple[str, Any]] | None:
    """`extra.actions` as (command, tool_call_id) pairs; None where not recorded."""
    actions = extra_of(raw).get("actions")
    if actions is None:
        return None
    if not isinstance(actions, list):
        raise r.error(f"{where}.extra.actions", f"expected list, got {type(actions).__name__}")
    out = []
    for i, action in enumerate(actions):
        command = action.get("command") if isinstance(action, dict) else None
        if not isinstance(command, str):
            raise r.error(f"{where}.extra.actions[{i}].command", "expected a command string")
        out.append((command, action.get("tool_call_id")))
    return out


def _observation(message: Message, raw: dict) -> tuple[str | None, int | None]:
    extra = extra_of(raw)
    if extra.get("interrupt_type"):  # a format error or an interruption: no command output
        return None, None
    out, code = chat_observation(message["content"])
    if isinstance(extra.get("raw_output"), str):
        out = extra["raw_output"]
    return out, extra["returncode"] if _is_int(extra.get("returncode")) else code


def chat_turns(r: Reader, items: list[Item], agent_at: list[int]) -> list[Turn]:
    """One turn per assistant message (see the module docstring)."""
    turns: list[Turn] = []
    for n, at in enumerate(agent_at):
        message, raw, where = items[at]
        text = message["content"]
        if isinstance(raw.get("reasoning_content"), str):
            text = f"<think>\n{raw['reasoning_content'].strip()}\n</think>\n\n{text}"
        first = None
        if raw.get("tool_calls"):
            calls_text, first = tool_call_text(raw["tool_calls"], r, f"{where}.tool_calls")
            text = with_tool_calls(text, calls_text)
        commands = _actions(raw, r, where)
        if commands is None and first is not None:
            commands = [(call_command(first), first["id"])]
        elif commands is None:
            block = chat_command(message["content"])
            commands = [(block, None)] if block is not None else []
        command, call_id = commands[0] if commands else (None, None)
        end = agent_at[n + 1] if n + 1 < len(agent_at) else len(items)
        env = items[at + 1 : end]
        env_messages: list[Message] = [
            {"role": "tool" if m["role"] == "tool" else "user", "content": m["content"]}
            for m, _, _ in env
        ]
        observation, exit_code, timings, info = None, None, {}, {}
        flags = [] if command is not None else ["format_error"]
        if command is not None and env:
            answer, answer_raw, _ = next((x for x in env if answers(x[1], call_id)), env[0])
            observation, exit_code = _observation(answer, answer_raw)
            sent, seen = extra_of(raw).get("timestamp"), extra_of(answer_raw).get("timestamp")
            if _is_number(sent) and _is_number(seen):
                timings["env_s"] = max(0.0, float(seen) - float(sent))
            exception = extra_of(answer_raw).get("exception_info")
            if isinstance(exception, str) and exception:
                info["exception"] = exception
                if "Timeout" in str(extra_of(answer_raw).get("exception_type", "")):
                    flags.append("timeout")
        if len(commands) > 1:
            info["more_commands"] = [c for c, _ in commands[1:]]
        turns.append(
            Turn(
                agent_text=text,
                command=command,
                observation=observation,
                exit_code=exit_code,
                env_messages=env_messages,
                timings=timings,
                flags=flags,
                info=info,
            )
        )
    return turns
