"""OpenAI's Responses API in the middleware (`serving/middleware/responses.py`), as Codex CLI
sends it: developer messages, function and namespace tools (hosted ones left out), function
calls and their outputs; written back as a response object and its stream."""

from __future__ import annotations

import json

import pytest

from serving.middleware.formats import BadRequest, Call, Reply
from serving.middleware.responses import parse_responses, response_events, response_object

FN = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}


def body(**over):
    base = {
        "model": "m",
        "stream": True,
        "input": [
            {"type": "message", "role": "developer", "content": [
                {"type": "input_text", "text": "You are Codex."}]},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "list the files"}]},
            {"type": "reasoning", "summary": [], "encrypted_content": None},
            {"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "Looking."}]},
            {"type": "function_call", "call_id": "call_1", "name": "exec_command",
             "arguments": json.dumps({"cmd": "ls"})},
            {"type": "function_call_output", "call_id": "call_1", "output": "a.txt\n"},
            {"type": "message", "role": "developer", "content": "later note"},
        ],
        "tools": [
            {"type": "function", "name": "exec_command", "description": "run", "strict": False,
             "parameters": FN},
            {"type": "namespace", "name": "multi_agent_v1", "tools": [
                {"type": "function", "name": "spawn_agent", "description": "spawn",
                 "parameters": FN}]},
            {"type": "web_search", "external_web_access": False},
        ],
        "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"summary": "auto"},
        "store": False, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k",
        "client_metadata": {"x": 1},
    }  # fmt: skip
    return {**base, **over}


def test_a_codex_request_reads_into_one_conversation():
    conv = parse_responses(body(), default_model="d", default_max_tokens=99)
    assert conv.api == "responses" and conv.stream and conv.sampling.max_tokens == 99
    assert conv.system == "You are Codex."
    assert [t["function"]["name"] for t in conv.tools] == ["exec_command", "spawn_agent"]
    roles = [(m.role, m.content) for m in conv.messages]
    assert roles == [
        ("user", "list the files"),
        ("assistant", "Looking."),
        ("tool", "a.txt\n"),
        ("system", "later note"),
    ]
    assert conv.messages[1].tool_calls == (Call("call_1", "exec_command", {"cmd": "ls"}),)
    assert conv.messages[2].tool_call_id == "call_1"
    plain = parse_responses({"input": "hi", "max_output_tokens": 5}, default_model="d",
                            default_max_tokens=9)  # fmt: skip
    assert plain.messages[0].content == "hi" and plain.sampling.max_tokens == 5


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"messages": []}, "its name here: input"),
        ({"max_tokens": 5}, "its name here: max_output_tokens"),
        ({"input": []}, "non-empty list"),
        ({"input": [{"type": "message", "role": "user", "content": [
            {"type": "input_image", "image_url": "x"}]}]}, "'input_image'"),
        ({"input": [{"type": "local_shell_call"}]}, "'local_shell_call'"),
        ({"input": [{"type": "message", "role": "user", "content": "x"},
                    {"type": "function_call", "name": "f", "arguments": "{"}]}, "not JSON"),
        ({"tools": [{"type": "mcp", "server_label": "x"}]}, "'mcp'"),
        ({"temperature": 3}, "temperature=3"),
    ],
)  # fmt: skip
def test_what_cannot_be_served_is_refused_by_name(over, needle):
    with pytest.raises(BadRequest, match=needle.replace("[", r"\[")):
        parse_responses(body(**over), default_model="d", default_max_tokens=9)


def test_the_reply_as_a_response_and_as_its_stream():
    call = Call("call_9", "exec_command", {"cmd": "pwd"})
    cut = Reply("partial", (), "length", None, 100, 24)
    obj = response_object(cut, response_id="resp_1", model="m")
    assert obj["status"] == "incomplete" and obj["incomplete_details"]["reason"] == (
        "max_output_tokens"
    )
    assert obj["output"][0]["content"][0] == {
        "type": "output_text",
        "text": "partial",
        "annotations": [],
    }
    assert obj["usage"]["total_tokens"] == 124
    events = response_events(
        Reply("ok", (call,), "stop", None, 10, 3), response_id="resp_2", model="m"
    )
    names = [name for name, _ in events]
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert all(d["type"] == name for name, d in events)
    done = events[-1][1]["response"]
    assert done["status"] == "completed"
    fc = done["output"][1]
    assert (fc["type"], fc["call_id"], json.loads(fc["arguments"])) == (
        "function_call",
        "call_9",
        {"cmd": "pwd"},
    )
    assert events[4][1]["delta"] == "ok"
