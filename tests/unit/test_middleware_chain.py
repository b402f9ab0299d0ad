"""The middleware's pure layers: Qwen3 tool-call rendering and parsing (`rl.data.tools`), the
two APIs read into one conversation (`serving.middleware.formats`), and the token-exact chain
(`serving.middleware.chain`): extension, retry, divergence into a new segment, `segments_max`,
masks and trajectories, against ids worked out by hand with the byte tokenizer."""

import re

import pytest

from rl.data import ByteTokenizer
from rl.data.chat import ChatRenderer
from rl.data.tools import ToolCall, assistant_text, function_spec, parse_assistant, system_text
from rl.data.trajectory import to_json_line
from serving.middleware.chain import Rollout, SegmentsExceeded
from serving.middleware.formats import (
    BadRequest,
    Call,
    Reply,
    anthropic_events,
    loads,
    parse_anthropic,
    parse_openai,
)

TOK = ByteTokenizer()
R = ChatRenderer(TOK)
EOS = R.im_end_id
BASH = {
    "name": "bash",
    "description": "run a command",
    "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}},
}


# ----- tools ---------------------------------------------------------------------------------


def test_tool_call_text_is_qwen3s_layout_and_parses_back():
    calls = (ToolCall("bash", {"cmd": "ls -l"}), ToolCall("read", {"path": "a é.txt"}))
    text = assistant_text("Looking.", calls)
    assert text == (
        'Looking.\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls -l"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "read", "arguments": {"path": "a é.txt"}}\n</tool_call>'
    )
    parsed = parse_assistant(text)
    assert (parsed.content, parsed.tool_calls, parsed.reasoning) == ("Looking.", calls, None)
    assert assistant_text("", calls[:1]).startswith("<tool_call>\n")  # no text: no newline first


def test_parse_assistant_keeps_what_it_cannot_read_and_splits_reasoning():
    text = "<think>\nfirst ls\n</think>\n\nok <tool_call>\nnot json\n</tool_call> done"
    parsed = parse_assistant(text)
    assert parsed.reasoning == "first ls"
    assert parsed.tool_calls == ()
    assert parsed.content == "ok <tool_call>\nnot json\n</tool_call> done"
    # arguments written as a JSON string are read as the object they spell
    inner = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    assert parse_assistant(inner).tool_calls == (ToolCall("f", {"x": 1}),)


def test_system_text_lists_tools_after_the_system_prompt():
    spec = function_spec("bash", "run", {"type": "object"})
    assert system_text("sys", []) == "sys" and system_text(None, []) is None
    text = system_text("sys", [spec])
    assert text.startswith("sys\n\n# Tools\n\nYou may call one or more functions")
    assert (
        '\n<tools>\n{"type": "function", "function": {"name": "bash", "description": "run", '
        '"parameters": {"type": "object"}}}\n</tools>\n' in text
    )
    assert text.endswith("</tool_call>")
    assert system_text(None, [spec]).startswith("# Tools")


# ----- the APIs ------------------------------------------------------------------------------


def test_anthropic_request_becomes_messages_in_order():
    conv = parse_anthropic(
        {
            "model": "m",
            "max_tokens": 7,
            "system": [{"type": "text", "text": "S"}],
            "tools": [BASH],
            "stop_sequences": ["END"],
            "top_k": 5,
            "messages": [
                {"role": "user", "content": "do it"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "x"},
                        {"type": "text", "text": "ok"},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "bash",
                            "input": {"cmd": "ls"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "a.txt"}],
                        },
                        {"type": "text", "text": "and now?"},
                    ],
                },
            ],
        },
        default_model="d",
    )
    roles = [(m.role, m.content) for m in conv.messages]
    assert roles == [
        ("user", "do it"),
        ("assistant", "ok"),
        ("tool", "a.txt"),
        ("user", "and now?"),
    ]
    assert conv.messages[1].tool_calls == (Call("toolu_1", "bash", {"cmd": "ls"}),)
    assert conv.messages[2].tool_call_id == "toolu_1"
    assert (conv.sampling.max_tokens, conv.sampling.stop, conv.sampling.top_k) == (7, ("END",), 5)
    assert conv.system_text.startswith("S\n\n# Tools")


def test_anthropic_takes_a_system_message_mid_conversation_as_claude_code_sends_it():
    conv = parse_anthropic(
        {
            "max_tokens": 3,
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "system", "content": [{"type": "text", "text": "remember b"}]},
                {"role": "user", "content": "c"},
            ],
        },
        default_model="d",
    )
    assert [(m.role, m.content) for m in conv.messages] == [
        ("user", "a"),
        ("system", "remember b"),
        ("user", "c"),
    ]
    with pytest.raises(BadRequest, match=r"messages\[0\]\.role='tool' is invalid: user, "):
        parse_anthropic(
            {"max_tokens": 3, "messages": [{"role": "tool", "content": "x"}]}, default_model="d"
        )


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens is required"),
        ({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens=0"),
        ({"max_tokens": 5, "messages": []}, "non-empty list"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {}}]}]}, "'image'"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"},
                                        {"role": "assistant", "content": "pre"}]}, "prefill"),
        ({"max_tokens": 5, "tools": [{"type": "web_search_20250305", "name": "w"}],
          "messages": [{"role": "user", "content": "x"}]}, "server-side tools"),
        ({"max_tokens": 5, "temperature": 9, "messages": [{"role": "user", "content": "x"}]},
         "temperature=9"),
        ({"max_tokens": 5, "messages": [{"role": "bot", "content": "x"}]},
         "user, assistant or system"),
        ({"max_tokens": 5, "top_k": float("inf"), "messages": [{"role": "user", "content": "x"}]},
         "top_k=inf"),
        ({"max_tokens": 5, "top_p": float("nan"), "messages": [{"role": "user", "content": "x"}]},
         "top_p=nan"),
        ({"max_tokens": 5, "stop": ["x"], "messages": [{"role": "user", "content": "x"}]},
         "stop is a parameter of the OpenAI chat API, which the Anthropic Messages API does "
         "not take (its name here: stop_sequences)"),
        ({"max_tokens": 5, "seed": 1, "messages": [{"role": "user", "content": "x"}]},
         "seed is a parameter of the OpenAI"),
    ],
)  # fmt: skip
def test_anthropic_bad_requests_name_the_field(body, needle):
    with pytest.raises(BadRequest, match=re.escape(needle)):
        parse_anthropic(body, default_model="d")


def test_openai_request_and_its_refusals():
    conv = parse_openai(
        {
            "messages": [
                {"role": "system", "content": "S"},
                {"role": "user", "content": [{"type": "text", "text": "go"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "bash", "arguments": '{"cmd": "ls"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
            ],
            "tools": [{"type": "function", "function": {"name": "bash", "parameters": {}}}],
            "stop": "X",
        },
        default_model="d",
        default_max_tokens=11,
    )
    assert conv.system == "S" and conv.sampling.max_tokens == 11 and conv.sampling.stop == ("X",)
    assert conv.messages[1].tool_calls == (Call("call_1", "bash", {"cmd": "ls"}),)
    bad_args = {
        "messages": [
            {"role": "user", "content": "x"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{nope"}}
                ],
            },
            {"role": "tool", "content": "r"},
        ]
    }
    with pytest.raises(BadRequest, match="arguments is not JSON"):
        parse_openai(bad_args, default_model="d", default_max_tokens=5)
    with pytest.raises(BadRequest, match="n=2"):
        parse_openai(
            {"n": 2, "messages": [{"role": "user", "content": "x"}]},
            default_model="d",
            default_max_tokens=5,
        )
    for name, value in [("stop_sequences", ["x"]), ("top_k", 5), ("system", "S")]:
        with pytest.raises(BadRequest, match=f"{name} is a parameter of the Anthropic") as e:
            parse_openai(
                {name: value, "messages": [{"role": "user", "content": "x"}]},
                default_model="d",
                default_max_tokens=5,
            )
        assert e.value.param == name


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b'{"reward": NaN}', "NaN is not a JSON value"),
        (b'{"reward": -Infinity}', "-Infinity is not a JSON value"),
        (b"[" * 100_000, "nested deeper than 64"),  # Python's parser: RecursionError
        (b'{"a":' * 65 + b"1" + b"}" * 65, "nested deeper than 64"),  # parses; the walk refuses
        (b'{"content": "a\\ud800b"}', "lone surrogate (\\ud800) at character 1"),
        (b'{"\\udfff": 1}', "lone surrogate (\\udfff)"),
        (b'{"content": "\xff"}', "not UTF-8"),
        (b"{nope", "not JSON"),
    ],
)
def test_loads_refuses_what_is_not_strict_json_by_name(raw, needle):
    with pytest.raises(BadRequest, match=re.escape(needle)):
        loads(raw)


def test_loads_takes_json_up_to_the_depth_and_paired_surrogates():
    assert loads(b'{"a":' * 63 + b"[1]" + b"}" * 63) is not None  # 64 levels
    assert loads(b'{"t": "\\ud83d\\ude00 \\u00e9"}') == {"t": "\U0001f600 \u00e9"}


def test_anthropic_stream_events_follow_the_documented_order():
    reply = Reply("hi", (Call("toolu_9", "bash", {"cmd": "ls"}),), "stop", None, 12, 3)
    events = anthropic_events(reply, msg_id="msg_1", model="m")
    names = [e for e, _ in events]
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[5][1]["content_block"] == {
        "type": "tool_use",
        "id": "toolu_9",
        "name": "bash",
        "input": {},
    }
    assert events[6][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"cmd": "ls"}'}
    assert events[8][1]["delta"]["stop_reason"] == "tool_use"


# ----- the chain -----------------------------------------------------------------------------


def ask(*messages, system="S", tools=(BASH,)):
    return parse_anthropic(
        {"max_tokens": 8, "system": system, "tools": list(tools), "messages": list(messages)},
        default_model="d",
    )


def sample(rollout: Rollout, conv, text: str, *, eos: bool = True, version: int = 3):
    """Plan, then commit `text` as the sampled turn (with `<|im_end|>` unless `eos=False`)."""
    plan = rollout.plan(conv, R, segments_max=2, enable_thinking=False)
    ids = TOK.encode_text(text) + ([EOS] if eos else [])
    parsed = parse_assistant(text)
    calls = tuple(Call(f"toolu_{i}", c.name, c.arguments) for i, c in enumerate(parsed.tool_calls))
    reply = Reply(
        parsed.content, calls, "stop" if eos else "length", None, len(plan.prompt_ids), len(ids)
    )
    rollout.commit(
        plan,
        reply,
        token_ids=ids,
        logprobs=[-0.5] * len(ids),
        versions=[version] * len(ids),
        text=text,
        eos_id=EOS,
    )
    return plan, reply, ids


def returned(reply: Reply) -> dict:
    """The assistant message an Anthropic harness sends back."""
    blocks = [{"type": "text", "text": reply.content}] if reply.content else []
    blocks += [
        {"type": "tool_use", "id": c.id, "name": c.name, "input": dict(c.arguments)}
        for c in reply.tool_calls
    ]
    return {"role": "assistant", "content": blocks}


def test_chain_extends_with_sampled_ids_verbatim_and_equals_a_full_render():
    rollout = Rollout("r", api="anthropic")
    u1 = {"role": "user", "content": "list files"}
    call_text = 'sure\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>'
    plan1, reply1, gen1 = sample(rollout, ask(u1), call_text)
    system = {"role": "system", "content": ask(u1).system_text}
    assert plan1.kind == "new"
    assert plan1.prompt_ids == R.render(
        [system, u1], add_generation_prompt=True, enable_thinking=False
    )
    seg = rollout.segments[0]
    n1 = len(plan1.prompt_ids)
    assert seg.token_ids == plan1.prompt_ids + gen1
    assert seg.loss_mask == [0] * n1 + [1] * len(gen1)
    assert seg.logprobs == [None] * n1 + [-0.5] * len(gen1)
    assert seg.versions == [None] * n1 + [3] * len(gen1)

    result = {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": reply1.tool_calls[0].id, "content": "a.txt"}
        ],
    }
    plan2, _, gen2 = sample(rollout, ask(u1, returned(reply1), result), "done", version=4)
    assert plan2.kind == "extend" and len(rollout.segments) == 1
    # Only the new message was rendered; the chain equals rendering the whole conversation,
    # the sampled turn included (the byte tokenizer spells text one way), with the empty think
    # block the generation prompt put before it (Qwen3's own template would drop it: drift).
    tool = {"role": "tool", "content": "a.txt"}
    sampled = {"role": "assistant", "content": call_text, "reasoning_content": ""}
    full = R.render([system, u1, sampled, tool], add_generation_prompt=True, enable_thinking=False)
    assert plan2.prompt_ids == full
    assert plan2.appended == full[len(plan1.prompt_ids) + len(gen1) :]
    assert seg.token_ids == full + gen2
    span1, span2 = seg.turns[0].span, seg.turns[1].span
    assert span1 == (n1, n1 + len(gen1)) and span2 == (len(full), len(full) + len(gen2))
    assert sum(seg.loss_mask) == len(gen1) + len(gen2)
    assert seg.turns[0].env_messages == [tool]


def test_a_retried_request_resamples_the_last_turn_from_the_same_ids():
    rollout = Rollout("r", api="anthropic")
    u1 = {"role": "user", "content": "hi"}
    plan1, _, _ = sample(rollout, ask(u1), "first")
    plan2, _, gen2 = sample(rollout, ask(u1), "second")
    assert plan2.kind == "retry" and plan2.prompt_ids == plan1.prompt_ids
    seg = rollout.segments[0]
    assert len(seg.turns) == 1 and seg.token_ids == plan1.prompt_ids + gen2
    assert seg.turns[0].text == "second"


def test_divergence_starts_a_segment_whose_rendered_history_is_masked():
    rollout = Rollout("r", api="anthropic")
    u1 = {"role": "user", "content": "hi"}
    _, reply1, _ = sample(rollout, ask(u1), "one")
    u2 = {"role": "user", "content": "more"}
    sample(rollout, ask(u1, returned(reply1), u2), "two")
    # The harness compacted its history: the first exchange replaced by a summary.
    summary = {"role": "user", "content": "summary: said one"}
    plan3, _, gen3 = sample(rollout, ask(summary, returned(reply1), u2), "three")
    assert plan3.kind == "new" and len(rollout.segments) == 2
    seg = rollout.segments[1]
    assert seg.loss_mask == [0] * len(plan3.prompt_ids) + [1] * len(gen3)  # "one" not trained
    # Changing the tools (another agent's conversation) diverges too; a third segment is one
    # more than segments_max=2 allows.
    with pytest.raises(SegmentsExceeded, match="segments_max is 2"):
        rollout.plan(ask(u1, tools=()), R, segments_max=2, enable_thinking=False)
    with pytest.raises(SegmentsExceeded):  # and the rollout stays ended
        rollout.plan(ask(u1, returned(reply1), u2), R, segments_max=2, enable_thinking=False)
    trajs = rollout.trajectories(reward=1.0, status="ok", reason=None, reward_mode="all_segments")
    assert [t.status for t in trajs] == ["truncated", "truncated"]
    assert "segments_max" in trajs[0].reason


def test_trajectories_per_segment_and_reward_modes():
    rollout = Rollout("rollout-7", api="openai")
    u1 = {"role": "user", "content": "hi"}
    sample(rollout, ask(u1), "cut here", eos=False)  # max_tokens: the chain closes the turn
    seg = rollout.segments[0]
    assert seg.token_ids[-1] == EOS and seg.loss_mask[-1] == 0 and seg.logprobs[-1] is None
    sample(rollout, ask({"role": "user", "content": "other"}), "b")
    all_ = rollout.trajectories(
        reward=0.5, status="ok", reason=None, reward_mode="all_segments", task_id="t1", group_id="g"
    )
    last = rollout.trajectories(reward=0.5, status="ok", reason=None, reward_mode="last_segment")
    for t in all_ + last:
        to_json_line(t)  # validates: masks equal the turns' spans, logprobs where sampled
        assert t.rollout_id == "rollout-7" and t.reward == 0.5 and t.source == "sampler"
    assert [t.meta["segment"] for t in all_] == [0, 1] and all_[0].task_id == "t1"
    assert not any(t.exclusion for t in all_)
    assert last[0].exclusion.kind == "earlier_segment" and last[1].exclusion is None
    assert all_[0].turns[0].info["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"max_rollouts": 0}, "max_rollouts=0 is invalid: an integer >= 1"),
        ({"max_waiting_requests": -1}, "max_waiting_requests=-1 is invalid"),
        ({"admin_port": 8300}, "admin_port=8300 is invalid: another port"),
        ({"admin_port": 70000}, "admin_port=70000 is invalid"),
        ({"admin_port": 0, "admin_socket": "/tmp/a.sock"}, "null when admin_socket is set"),
        ({"admin_socket": "/" + "x" * 120}, "a Unix socket's limit"),
        ({"admin_token": ""}, "admin_token='' is invalid"),
    ],
)
def test_middleware_config_refuses_bad_limits_and_admin_listeners(fields, needle):
    from serving.middleware.config import MiddlewareConfig

    with pytest.raises(ValueError, match=re.escape(needle)):
        MiddlewareConfig(**fields)


def test_a_harness_meta_cannot_set_a_control_field():
    """`meta` from the harness is provenance: a key the trainer would decide on is refused at
    the boundary (400 naming it), never written into a trajectory."""
    from serving.middleware.app import HTTPFailure, _finish_fields

    ok = _finish_fields({"reward": 1.0, "meta": {"harness": "command", "kind": "x"}})
    assert ok["meta"] == {"harness": "command", "kind": "x"}
    for key in ("dropped", "exclusion", "group_index"):
        with pytest.raises(HTTPFailure, match=rf"meta\['{key}'\] is invalid: meta is provenance"):
            _finish_fields({"reward": 1.0, "meta": {key: True, "harness": "command"}})
