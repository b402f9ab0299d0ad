"""Tool calling in the Qwen3 chat format: what the model sees and what it writes.

- The tools go into the system message after the system text, as a `# Tools` section with one
  JSON function signature per line inside `<tools></tools>`, and instructions to answer with
  `<tool_call>` blocks (the layout of Qwen3's chat template, so a pretrained Qwen3 sees the
  format it was trained on).
- An assistant turn that calls tools is its text, then per call
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (calls after the text or
  after another call start on a new line).
- A tool's result is a `tool` message (`rl.data.chat` wraps it in `<tool_response>`).

`parse_assistant(text)` reads a generated turn back: its reasoning (`<think>...</think>`), its
text and its tool calls. A `<tool_call>` block whose body is not a JSON object with a string
`name` stays in the text, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call the assistant made: the function's name and its JSON arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ParsedTurn:
    """A generated assistant turn, read back."""

    content: str
    """The text outside the reasoning and the tool-call blocks, stripped."""
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str | None = None
    """What stood inside a leading `<think>...</think>` (None: there was none)."""


def function_spec(name: str, description: str | None, parameters: Any) -> dict[str, Any]:
    """A tool as the template lists it: `{"type": "function", "function": {...}}`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a tool's name must be a non-empty string, got {name!r}")
    if parameters is not None and not isinstance(parameters, dict):
        raise ValueError(f"tool {name!r}: its parameters must be a JSON schema object")
    function: dict[str, Any] = {"name": name}
    if description:
        function["description"] = description
    function["parameters"] = parameters if parameters is not None else {"type": "object"}
    return {"type": "function", "function": function}


def _json(value: Any) -> str:
    # Jinja's `tojson` in HF's template environment: non-ASCII kept, default separators.
    return json.dumps(value, ensure_ascii=False)


def system_text(system: str | None, tools: list[dict[str, Any]]) -> str | None:
    """The system message's content: `system` alone without tools (None: no system message),
    else `system` (when given) followed by the tools section."""
    if not tools:
        return system
    head = f"{system}\n\n" if system else ""
    listed = "\n".join(_json(t) for t in tools)
    return (
        f"{head}# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def tool_call_text(call: ToolCall) -> str:
    body = f'{{"name": {_json(call.name)}, "arguments": {_json(call.arguments)}}}'
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def assistant_text(content: str, tool_calls: tuple[ToolCall, ...] | list[ToolCall] = ()) -> str:
    """An assistant message's body as the template renders it."""
    parts = [content] if content else []
    parts += [tool_call_text(c) for c in tool_calls]
    return "\n".join(parts)


def parse_assistant(text: str) -> ParsedTurn:
    """Reasoning, text and tool calls of a generated turn (see the module docstring)."""
    reasoning = None
    think = _THINK.match(text)
    if think:
        reasoning = think.group(1).strip()
        text = text[think.end() :]
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for m in _CALL.finditer(text):
        call = _call_from_json(m.group(1))
        if call is None:
            continue  # not a call we can read: it stays in the text
        kept.append(text[last : m.start()])
        last = m.end()
        calls.append(call)
    kept.append(text[last:])
    return ParsedTurn(content="".join(kept).strip(), tool_calls=tuple(calls), reasoning=reasoning)


def _call_from_json(body: str) -> ToolCall | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = data.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name=data["name"], arguments=args)
