"""The two agent-facing APIs, read into one conversation and written back.

Anthropic Messages (`POST /v1/messages`) and OpenAI chat completions (`POST
/v1/chat/completions`) requests become a `Conversation`: the system text, the tools (as the
Qwen3 template lists them), the messages in an API-neutral form (`Msg`: user, assistant with
its tool calls, tool results, later system messages) and the sampling fields. A generated turn
goes back as each API's response body or its SSE stream, in the documented event order:

- Anthropic: `message_start`, `ping`, per content block `content_block_start` /
  `content_block_delta` (`text_delta` or `input_json_delta`) / `content_block_stop`, then
  `message_delta` (stop reason, output tokens) and `message_stop`.
- OpenAI: `chat.completion.chunk`s (the role, the text, each tool call, the finish reason,
  the usage when `stream_options.include_usage`), then `data: [DONE]`.

Requests the middleware cannot serve faithfully (images, server-side tools, an assistant
prefill, `n` > 1), roles the API does not allow, and the other API's parameters sent by mistake
(`stop` or `seed` to Anthropic, `stop_sequences` or `top_k` to OpenAI) are refused with
`BadRequest` naming the field and what is allowed; so are bodies that are not strict JSON
(`loads`: NaN and Infinity, nesting past `MAX_DEPTH`, lone surrogates). Fields that change
nothing here are accepted and ignored: `tool_choice` (the Qwen3 format cannot force a call),
`metadata`, `thinking` (see `middleware.enable_thinking`), `cache_control`,
`context_management`, `output_config`. A `system` message inside Anthropic `messages` (Claude
Code 2.1 sends one after the task) is a later system message, as an OpenAI one is.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rl.data.tools import ToolCall, function_spec, system_text

APIS = ("anthropic", "openai")
MAX_DEPTH = 64
"""JSON nesting a request may have (tool schemas run to ~10 levels; Python's own parser and
encoder recurse, so deeper input would end in a RecursionError, not an answer)."""
FOREIGN = {
    "anthropic": {
        "stop": "stop_sequences",
        "seed": None,
        "n": None,
        "max_completion_tokens": "max_tokens",
        "frequency_penalty": None,
        "presence_penalty": None,
        "logit_bias": None,
        "logprobs": None,
        "top_logprobs": None,
        "response_format": None,
        "stream_options": None,
    },
    "openai": {"stop_sequences": "stop", "top_k": None, "system": "a system message"},
}
"""Parameters of the other API that this one does not take, with this API's name for the same
thing (None: it has none). Ignoring them would sample differently from what the client asked."""


class BadRequest(ValueError):
    """A request the middleware refuses (HTTP 400), with the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Call:
    """A tool call as the API shows it: the id the middleware gave it, name, arguments."""

    id: str
    name: str
    arguments: Mapping[str, Any]

    def plain(self) -> ToolCall:
        return ToolCall(self.name, dict(self.arguments))


@dataclass(frozen=True)
class Msg:
    """One message, API-neutral. `role` is `user`, `assistant`, `tool` or `system` (a system
    message after the first turn, OpenAI only)."""

    role: str
    content: str = ""
    tool_calls: tuple[Call, ...] = ()
    tool_call_id: str | None = None


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass(frozen=True)
class Conversation:
    """A request, read: what the model is shown and how to sample its next turn."""

    api: str
    model: str
    system: str | None
    tools: tuple[dict[str, Any], ...]
    messages: tuple[Msg, ...]
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False
    header_key: str = field(init=False, default="")

    def __post_init__(self) -> None:
        key = json.dumps([self.system, list(self.tools)], sort_keys=True, ensure_ascii=False)
        object.__setattr__(self, "header_key", key)

    @property
    def system_text(self) -> str | None:
        """The system message's content: the system text and the tools section."""
        return system_text(self.system, list(self.tools))


@dataclass(frozen=True)
class Reply:
    """A generated turn as the API returns it."""

    content: str
    tool_calls: tuple[Call, ...]
    finish: str
    """`stop` (end of turn), `length` (max_tokens), `stop_sequence`, or `abort`."""
    stop_sequence: str | None
    input_tokens: int
    output_tokens: int

    def message(self) -> Msg:
        """The assistant message a harness sends back next time, as `Msg`."""
        return Msg("assistant", self.content, self.tool_calls)


def loads(raw: bytes) -> Any:
    """A request body as strict JSON: UTF-8, no NaN or Infinity (not JSON, and a reward or a
    sampling field must be a number), at most `MAX_DEPTH` levels, no lone surrogate in any
    string (it cannot be encoded back to UTF-8, so no tokenizer can take it)."""

    def constant(name: str) -> Any:
        raise BadRequest(f"the request body is not JSON: {name} is not a JSON value")

    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=constant)
    except RecursionError as e:
        raise BadRequest(f"the request body is nested deeper than {MAX_DEPTH} levels") from e
    except UnicodeDecodeError as e:
        raise BadRequest(f"the request body is not UTF-8: {e}") from e
    except ValueError as e:
        if isinstance(e, BadRequest):
            raise
        raise BadRequest(f"the request body is not JSON: {e}") from e
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:  # iterative: the depth check must not recurse itself
        value, depth = stack.pop()
        if isinstance(value, str):
            _utf8(value)
            continue
        if not isinstance(value, dict | list):
            continue
        if depth > MAX_DEPTH:
            raise BadRequest(f"the request body is nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                _utf8(key)
                stack.append((item, depth + 1))
        else:
            stack.extend((item, depth + 1) for item in value)
    return body


def _utf8(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start : e.end].encode("unicode_escape").decode()
        raise BadRequest(
            f"the request body holds a lone surrogate ({bad}) at character "
            f"{e.start} of a string: not a character, so not text any model "
            "can read"
        ) from e


def _foreign(body: dict, api: str) -> None:
    for name, ours in FOREIGN[api].items():
        if name in body:
            other = "OpenAI chat" if api == "anthropic" else "Anthropic Messages"
            mine = "the Anthropic Messages API" if api == "anthropic" else "OpenAI chat"
            hint = f" (its name here: {ours})" if ours else ""
            raise BadRequest(
                f"{name} is a parameter of the {other} API, which {mine} does not take{hint}", name
            )


def new_call_id(api: str) -> str:
    return ("toolu_" if api == "anthropic" else "call_") + secrets.token_hex(12)


# ----- reading requests ------------------------------------------------------------------


def _obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadRequest(f"{where} must be a JSON object, got {type(value).__name__}", where)
    return value


def _int(body: dict, name: str, default: int | None, low: int = 1) -> int:
    value = body.get(name, default)
    if value is None:
        raise BadRequest(f"{name} is required: an integer >= {low}", name)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise BadRequest(f"{name}={value!r} is invalid: an integer >= {low}", name)
    return value


def _num(body: dict, name: str, default: float, low: float, high: float | None = None) -> float:
    value = body.get(name)
    if value is None:
        return default
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value < low
        or (high is not None and value > high)
    ):
        allowed = f"a number in [{low}, {high}]" if high is not None else f"a number >= {low}"
        raise BadRequest(f"{name}={value!r} is invalid: {allowed}", name)
    return float(value)


def _stops(value: Any, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise BadRequest(f"{name} must be a list of non-empty strings", name)
    return tuple(value)


def _sampling(body: dict, max_tokens: int, *, top_k: bool, stop_name: str) -> Sampling:
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise BadRequest(f"seed={seed!r} is invalid: an integer", "seed")
    return Sampling(
        max_tokens=max_tokens,
        temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_num(body, "top_p", 1.0, 0.0, 1.0),
        top_k=int(_num(body, "top_k", 0, 0)) if top_k else 0,
        stop=_stops(body.get(stop_name), stop_name),
        seed=seed,
    )


def _text_blocks(value: Any, where: str) -> str:
    """A string, or a list of text blocks joined by newlines."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise BadRequest(f"{where} must be a string or a list of text blocks", where)
    texts = []
    for i, block in enumerate(value):
        block = _obj(block, f"{where}[{i}]")
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise BadRequest(
                f"{where}[{i}] has type {block.get('type')!r}: only text blocks are supported "
                "here (no images or documents)",
                where,
            )
        texts.append(block["text"])
    return "\n".join(texts)


def parse_anthropic(body: Any, *, default_model: str) -> Conversation:
    """An Anthropic Messages request (`POST /v1/messages`)."""
    body = _obj(body, "the request body")
    _foreign(body, "anthropic")
    max_tokens = _int(body, "max_tokens", None)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages must be a non-empty list", "messages")
    system = body.get("system")
    system = None if system is None else _text_blocks(system, "system")
    tools = tuple(_anthropic_tool(t, i) for i, t in enumerate(body.get("tools") or []))
    messages: list[Msg] = []
    for i, m in enumerate(raw):
        m = _obj(m, f"messages[{i}]")
        role = m.get("role")
        if role not in ("user", "assistant", "system"):
            raise BadRequest(
                f"messages[{i}].role={role!r} is invalid: user, assistant or system", "messages"
            )
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise BadRequest(
                f"messages[{i}].content must be a string or a list of blocks", "messages"
            )
        if role == "system":  # a later system message (Claude Code sends one after the task)
            messages.append(Msg("system", _text_blocks(blocks, f"messages[{i}].content")))
        elif role == "assistant":
            messages.append(_anthropic_assistant(blocks, i))
        else:
            messages.extend(_anthropic_user(blocks, i))
    if messages and messages[-1].role == "assistant":
        raise BadRequest(
            "the last message is the assistant's (a prefill): the middleware only "
            "samples whole turns; end with a user message",
            "messages",
        )
    return Conversation(
        api="anthropic",
        model=str(body.get("model") or default_model),
        system=system,
        tools=tools,
        messages=tuple(messages),
        sampling=_sampling(body, max_tokens, top_k=True, stop_name="stop_sequences"),
        stream=bool(body.get("stream", False)),
    )


def _anthropic_tool(tool: Any, i: int) -> dict[str, Any]:
    tool = _obj(tool, f"tools[{i}]")
    kind = tool.get("type")
    if kind not in (None, "custom") or "input_schema" not in tool:
        raise BadRequest(
            f"tools[{i}] (type {kind!r}) is not a custom tool with an input_schema: "
            "server-side tools run on Anthropic's servers, which this is not",
            "tools",
        )
    try:
        return function_spec(tool.get("name"), tool.get("description"), tool["input_schema"])
    except ValueError as e:
        raise BadRequest(f"tools[{i}]: {e}", "tools") from e


def _anthropic_assistant(blocks: list, i: int) -> Msg:
    texts, calls = [], []
    for j, b in enumerate(blocks):
        b = _obj(b, f"messages[{i}].content[{j}]")
        kind = b.get("type")
        if kind == "text":
            texts.append(str(b.get("text", "")))
        elif kind == "tool_use":
            args = b.get("input", {})
            if not isinstance(args, dict) or not isinstance(b.get("name"), str):
                raise BadRequest(
                    f"messages[{i}].content[{j}]: a tool_use needs a name and an input object",
                    "messages",
                )
            calls.append(Call(str(b.get("id", "")), b["name"], args))
        elif kind in ("thinking", "redacted_thinking"):
            continue  # reasoning the harness echoes back; the chain holds the sampled ids
        else:
            raise BadRequest(
                f"messages[{i}].content[{j}] has type {kind!r}: an assistant "
                "message holds text, tool_use or thinking blocks",
                "messages",
            )
    return Msg("assistant", "".join(texts), tuple(calls))


def _anthropic_user(blocks: list, i: int) -> list[Msg]:
    out: list[Msg] = []
    texts: list[str] = []
    for j, b in enumerate(blocks):
        b = _obj(b, f"messages[{i}].content[{j}]")
        kind = b.get("type")
        if kind == "text":
            texts.append(str(b.get("text", "")))
            continue
        if kind != "tool_result":
            raise BadRequest(
                f"messages[{i}].content[{j}] has type {kind!r}: a user message "
                "holds text and tool_result blocks (no images or documents)",
                "messages",
            )
        if texts:
            out.append(Msg("user", "\n".join(texts)))
            texts = []
        content = b.get("content", "")
        text = _text_blocks(content, f"messages[{i}].content[{j}].content")
        out.append(Msg("tool", text, tool_call_id=str(b.get("tool_use_id", ""))))
    if texts or not out:
        out.append(Msg("user", "\n".join(texts)))
    return out


def parse_openai(body: Any, *, default_model: str, default_max_tokens: int) -> Conversation:
    """An OpenAI chat completions request (`POST /v1/chat/completions`)."""
    body = _obj(body, "the request body")
    _foreign(body, "openai")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages must be a non-empty list", "messages")
    if body.get("n", 1) != 1:
        raise BadRequest(
            f"n={body.get('n')!r} is invalid: 1 (a rollout is one chain of turns)", "n"
        )
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _int(body, name, default_max_tokens)
    tools = tuple(_openai_tool(t, i) for i, t in enumerate(body.get("tools") or []))
    system_parts: list[str] = []
    messages: list[Msg] = []
    for i, m in enumerate(raw):
        m = _obj(m, f"messages[{i}]")
        role = m.get("role")
        content = m.get("content")
        text = "" if content is None else _text_blocks(content, f"messages[{i}].content")
        if role in ("system", "developer"):
            if messages:
                messages.append(Msg("system", text))
            else:
                system_parts.append(text)
        elif role == "user":
            messages.append(Msg("user", text))
        elif role == "assistant":
            calls = tuple(_openai_call(c, i, j) for j, c in enumerate(m.get("tool_calls") or []))
            messages.append(Msg("assistant", text, calls))
        elif role == "tool":
            messages.append(Msg("tool", text, tool_call_id=str(m.get("tool_call_id", ""))))
        else:
            raise BadRequest(
                f"messages[{i}].role={role!r} is invalid: system, developer, user, "
                "assistant or tool",
                "messages",
            )
    if not messages:
        raise BadRequest("messages has no user message", "messages")
    if messages[-1].role == "assistant":
        raise BadRequest(
            "the last message is the assistant's: the middleware only samples whole "
            "turns; end with a user or tool message",
            "messages",
        )
    options = body.get("stream_options") or {}
    return Conversation(
        api="openai",
        model=str(body.get("model") or default_model),
        system="\n\n".join(system_parts) if system_parts else None,
        tools=tools,
        messages=tuple(messages),
        sampling=_sampling(body, max_tokens, top_k=False, stop_name="stop"),
        stream=bool(body.get("stream", False)),
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
    )


def _openai_tool(tool: Any, i: int) -> dict[str, Any]:
    tool = _obj(tool, f"tools[{i}]")
    fn = tool.get("function")
    if tool.get("type") != "function" or not isinstance(fn, dict):
        raise BadRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
    try:
        return function_spec(fn.get("name"), fn.get("description"), fn.get("parameters"))
    except ValueError as e:
        raise BadRequest(f"tools[{i}]: {e}", "tools") from e


def _openai_call(call: Any, i: int, j: int) -> Call:
    call = _obj(call, f"messages[{i}].tool_calls[{j}]")
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BadRequest(f"messages[{i}].tool_calls[{j}] needs a function with a name", "messages")
    args = fn.get("arguments") or "{}"
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except ValueError as e:
        raise BadRequest(
            f"messages[{i}].tool_calls[{j}].function.arguments is not JSON: {e}", "messages"
        ) from e
    if not isinstance(parsed, dict):
        raise BadRequest(
            f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object", "messages"
        )
    return Call(str(call.get("id", "")), fn["name"], parsed)


# ----- writing responses -----------------------------------------------------------------


def _anthropic_stop(reply: Reply) -> str:
    if reply.tool_calls:
        return "tool_use"
    return {"length": "max_tokens", "stop_sequence": "stop_sequence"}.get(reply.finish, "end_turn")


def _anthropic_blocks(reply: Reply) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if reply.content or not reply.tool_calls:
        blocks.append({"type": "text", "text": reply.content})
    for c in reply.tool_calls:
        blocks.append({"type": "tool_use", "id": c.id, "name": c.name, "input": dict(c.arguments)})
    return blocks


def anthropic_message(reply: Reply, *, msg_id: str, model: str) -> dict[str, Any]:
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": _anthropic_blocks(reply),
        "stop_reason": _anthropic_stop(reply),
        "stop_sequence": reply.stop_sequence,
        "usage": {"input_tokens": reply.input_tokens, "output_tokens": reply.output_tokens},
    }


def anthropic_events(reply: Reply, *, msg_id: str, model: str) -> list[tuple[str, dict]]:
    """The SSE events of one streamed reply, `(event name, data)` in order."""
    start = anthropic_message(reply, msg_id=msg_id, model=model)
    start.update(content=[], stop_reason=None, stop_sequence=None)
    start["usage"] = {"input_tokens": reply.input_tokens, "output_tokens": 0}
    events: list[tuple[str, dict]] = [
        ("message_start", {"type": "message_start", "message": start}),
        ("ping", {"type": "ping"}),
    ]
    for index, block in enumerate(_anthropic_blocks(reply)):
        if block["type"] == "text":
            empty = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": block["text"]}
        else:
            empty = {**block, "input": {}}
            delta = {
                "type": "input_json_delta",
                "partial_json": json.dumps(block["input"], ensure_ascii=False),
            }
        events += [
            ("content_block_start",
             {"type": "content_block_start", "index": index, "content_block": empty}),
            ("content_block_delta",
             {"type": "content_block_delta", "index": index, "delta": delta}),
            ("content_block_stop", {"type": "content_block_stop", "index": index}),
        ]  # fmt: skip
    events += [
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {
                    "stop_reason": _anthropic_stop(reply),
                    "stop_sequence": reply.stop_sequence,
                },
                "usage": {"output_tokens": reply.output_tokens},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    return events


def _openai_finish(reply: Reply) -> str:
    if reply.tool_calls:
        return "tool_calls"
    return "length" if reply.finish == "length" else "stop"


def _openai_calls(reply: Reply) -> list[dict[str, Any]]:
    return [
        {
            "id": c.id,
            "type": "function",
            "function": {
                "name": c.name,
                "arguments": json.dumps(dict(c.arguments), ensure_ascii=False),
            },
        }
        for c in reply.tool_calls
    ]


def _usage(reply: Reply) -> dict[str, int]:
    return {
        "prompt_tokens": reply.input_tokens,
        "completion_tokens": reply.output_tokens,
        "total_tokens": reply.input_tokens + reply.output_tokens,
    }


def openai_completion(reply: Reply, *, msg_id: str, model: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or None}
    if reply.tool_calls:
        message["tool_calls"] = _openai_calls(reply)
    return {
        "id": msg_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": _openai_finish(reply),
                "logprobs": None,
            }
        ],
        "usage": _usage(reply),
    }


def openai_chunks(reply: Reply, *, msg_id: str, model: str, include_usage: bool) -> list[dict]:
    """The `chat.completion.chunk`s of one streamed reply, in order (`[DONE]` not included)."""
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        out = {
            "id": msg_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        if include_usage:
            out["usage"] = None
        return out

    chunks = [chunk({"role": "assistant", "content": ""})]
    if reply.content:
        chunks.append(chunk({"content": reply.content}))
    for index, call in enumerate(_openai_calls(reply)):
        chunks.append(chunk({"tool_calls": [{"index": index, **call}]}))
    chunks.append(chunk({}, _openai_finish(reply)))
    if include_usage:
        chunks.append(
            {
                "id": msg_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "usage": _usage(reply),
            }
        )
    return chunks


def error_body(api: str, status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """An error in the API's own shape."""
    if api == "anthropic":
        kinds = {
            400: "invalid_request_error",
            401: "authentication_error",
            404: "not_found_error",
            409: "invalid_request_error",
            413: "request_too_large",
            429: "rate_limit_error",
            503: "overloaded_error",
            504: "api_error",
        }
        return {
            "type": "error",
            "error": {"type": kinds.get(status, "api_error"), "message": message},
        }
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
