"""OpenAI's Responses API (`POST /v1/responses`), the only one Codex CLI speaks (its chat
`wire_api` is gone since 0.1xx), read into the middleware's `Conversation` and written back.

Reading (`parse_responses`):
- `instructions` and leading `developer` / `system` messages are the system text; later ones
  are later system messages (Codex sends two developer messages, then the user's);
- `message` items with `input_text` / `output_text` parts (or a string), `function_call` items
  (their `arguments` a JSON string; consecutive ones join the assistant message before them)
  and `function_call_output` items (the tool results) become `Msg`s; `reasoning` items (which
  the middleware never writes) carry nothing the template shows and are skipped;
- `tools`: `function` tools, and the functions of a `namespace` tool under their own names;
  hosted tools the middleware cannot run (`web_search`, `file_search`, ...) are left out of
  the prompt, so the model is never offered them;
- `max_output_tokens` (default `middleware.default_max_tokens`), `temperature`, `top_p`,
  `stream`. Fields that change nothing here are ignored (`reasoning`, `store`, `include`,
  `tool_choice`, `parallel_tool_calls`, `prompt_cache_key`, `client_metadata`, `metadata`,
  `text`, `truncation`, `user`, `service_tier`); images and other input item types are
  refused naming the item.

Writing: `response_object` (the `response` object: a `message` output item with one
`output_text` part, then one `function_call` item per tool call; `status` `incomplete` with
`incomplete_details.reason: max_output_tokens` when the turn was cut) and `response_events`,
the stream in the documented order (`response.created`, `response.in_progress`, per item
`response.output_item.added` ... `response.output_item.done` with the part or argument
events between, then `response.completed` or `response.incomplete`), each with its
`sequence_number`.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from rl.data.tools import function_spec
from serving.middleware.formats import (
    BadRequest,
    Call,
    Conversation,
    Msg,
    Reply,
    Sampling,
    _int,
    _num,
    _obj,
)

HOSTED = ("web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use")
"""Tools the API's host runs itself: nothing here can, so the model is not offered them."""
REFUSED = {"max_tokens": "max_output_tokens", "messages": "input", "n": None, "stop": None}
"""Fields of the other APIs, with this one's name for the same thing (None: it has none)."""


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of text parts", "input")
    texts = []
    for i, part in enumerate(content):
        part = _obj(part, f"{where}[{i}]")
        if part.get("type") not in ("input_text", "output_text", "text") or not isinstance(
            part.get("text"), str
        ):
            raise BadRequest(
                f"{where}[{i}] has type {part.get('type')!r}: only input_text and output_text "
                "parts are supported here (no images or files)",
                "input",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _tools(raw: Any) -> tuple[dict[str, Any], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise BadRequest("tools must be a list", "tools")
    out = []
    for i, tool in enumerate(raw):
        tool = _obj(tool, f"tools[{i}]")
        kind = tool.get("type")
        if kind in HOSTED:
            continue
        members = tool.get("tools") if kind == "namespace" else [tool]
        if kind not in ("function", "namespace") or not isinstance(members, list):
            raise BadRequest(
                f"tools[{i}] has type {kind!r}: function or namespace tools (hosted tools "
                f"{list(HOSTED)} are left out)",
                "tools",
            )
        for j, fn in enumerate(members):
            fn = _obj(fn, f"tools[{i}].tools[{j}]")
            try:
                spec = function_spec(fn.get("name"), fn.get("description"), fn.get("parameters"))
            except ValueError as e:
                raise BadRequest(f"tools[{i}]: {e}", "tools") from e
            out.append(spec)
    return tuple(out)


def _call(item: dict, i: int) -> Call:
    name, args = item.get("name"), item.get("arguments") or "{}"
    if not isinstance(name, str) or not name:
        raise BadRequest(f"input[{i}] (function_call) needs a name", "input")
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except ValueError as e:
        raise BadRequest(f"input[{i}].arguments is not JSON: {e}", "input") from e
    if not isinstance(parsed, dict):
        raise BadRequest(f"input[{i}].arguments must be a JSON object", "input")
    return Call(str(item.get("call_id") or item.get("id") or ""), name, parsed)


def parse_responses(body: Any, *, default_model: str, default_max_tokens: int) -> Conversation:
    """A Responses API request (`POST /v1/responses`)."""
    body = _obj(body, "the request body")
    for name, ours in REFUSED.items():
        if name in body:
            hint = f" (its name here: {ours})" if ours else ""
            raise BadRequest(f"{name} is not a parameter of the Responses API{hint}", name)
    raw = body.get("input")
    if isinstance(raw, str):
        raw = [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise BadRequest("input must be a string or a non-empty list of items", "input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("instructions must be a string", "instructions")
    system_parts = [instructions] if instructions else []
    messages: list[Msg] = []
    for i, item in enumerate(raw):
        item = _obj(item, f"input[{i}]")
        kind = item.get("type", "message")
        if kind == "message":
            role, text = item.get("role"), _text(item.get("content"), f"input[{i}].content")
            if role in ("developer", "system"):
                if messages:
                    messages.append(Msg("system", text))
                else:
                    system_parts.append(text)
            elif role in ("user", "assistant"):
                messages.append(Msg(role, text))
            else:
                raise BadRequest(
                    f"input[{i}].role={role!r} is invalid: developer, system, user or assistant",
                    "input",
                )
        elif kind == "function_call":
            call = _call(item, i)
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                messages[-1] = Msg("assistant", last.content, (*last.tool_calls, call))
            else:
                messages.append(Msg("assistant", "", (call,)))
        elif kind == "function_call_output":
            output = item.get("output")
            text = _text(output, f"input[{i}].output") if output is not None else ""
            messages.append(Msg("tool", text, tool_call_id=str(item.get("call_id", ""))))
        elif kind == "reasoning":
            continue
        else:
            raise BadRequest(
                f"input[{i}] has type {kind!r}: message, function_call, "
                "function_call_output or reasoning items",
                "input",
            )
    if not messages:
        raise BadRequest("input has no user message", "input")
    if messages[-1].role == "assistant":
        raise BadRequest(
            "the last input item is the assistant's: the middleware only samples whole "
            "turns; end with a user message or a function_call_output",
            "input",
        )
    max_tokens = _int(body, "max_output_tokens", default_max_tokens)
    return Conversation(
        api="responses",
        model=str(body.get("model") or default_model),
        system="\n\n".join(system_parts) if system_parts else None,
        tools=_tools(body.get("tools")),
        messages=tuple(messages),
        sampling=Sampling(
            max_tokens=max_tokens,
            temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_num(body, "top_p", 1.0, 0.0, 1.0),
        ),
        stream=bool(body.get("stream", False)),
    )


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(12)


def _items(reply: Reply, response_id: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if reply.content or not reply.tool_calls:
        items.append(
            {
                "type": "message",
                "id": "msg_" + response_id.removeprefix("resp_"),
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": reply.content, "annotations": []}],
            }
        )
    for k, call in enumerate(reply.tool_calls):
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{response_id.removeprefix('resp_')}_{k}",
                "call_id": call.id,
                "name": call.name,
                "arguments": json.dumps(dict(call.arguments), ensure_ascii=False),
                "status": "completed",
            }
        )
    return items


def response_object(reply: Reply, *, response_id: str, model: str) -> dict[str, Any]:
    cut = reply.finish == "length" and not reply.tool_calls
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "model": model,
        "output": _items(reply, response_id),
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "tools": [],
        "usage": {
            "input_tokens": reply.input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": reply.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": reply.input_tokens + reply.output_tokens,
        },
    }


def response_events(reply: Reply, *, response_id: str, model: str) -> list[tuple[str, dict]]:
    """The stream of one reply, `(event name, data)` in order; its first two are
    `start_events` (sent before the reply exists)."""
    done = response_object(reply, response_id=response_id, model=model)
    events = _start(response_id, model)
    for index, item in enumerate(done["output"]):
        at = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            part = item["content"][0]
            events += [
                ("response.output_item.added",
                 {"output_index": index, "item": {**item, "status": "in_progress", "content": []}}),
                ("response.content_part.added",
                 {**at, "content_index": 0, "part": {**part, "text": ""}}),
                ("response.output_text.delta", {**at, "content_index": 0, "delta": part["text"]}),
                ("response.output_text.done", {**at, "content_index": 0, "text": part["text"]}),
                ("response.content_part.done", {**at, "content_index": 0, "part": part}),
            ]  # fmt: skip
        else:
            events += [
                ("response.output_item.added",
                 {"output_index": index,
                  "item": {**item, "status": "in_progress", "arguments": ""}}),
                ("response.function_call_arguments.delta", {**at, "delta": item["arguments"]}),
                ("response.function_call_arguments.done", {**at, "arguments": item["arguments"]}),
            ]  # fmt: skip
        events.append(("response.output_item.done", {"output_index": index, "item": item}))
    final = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
    events.append((final, {"response": done}))
    return _stamp(events)


def _start(response_id: str, model: str) -> list[tuple[str, dict]]:
    begun = {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "model": model,
        "output": [],
        "usage": None,
    }
    return [
        ("response.created", {"response": begun}),
        ("response.in_progress", {"response": begun}),
    ]


def _stamp(events: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    return [(name, {"type": name, "sequence_number": n, **data}) for n, (name, data) in
            enumerate(events)]  # fmt: skip


def start_events(*, response_id: str, model: str) -> list[tuple[str, dict]]:
    """`response.created` and `response.in_progress`: the stream's first two events."""
    return _stamp(_start(response_id, model))


def error_event(status: int, message: str, sequence_number: int) -> dict[str, Any]:
    """A stream's last event when the turn failed after the stream began."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {
        "type": "error",
        "sequence_number": sequence_number,
        "code": kind,
        "message": message,
        "param": None,
    }
