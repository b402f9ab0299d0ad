"""SimulatedShell against an in-memory completion client; the shared simulator format."""

import asyncio
import random

import pytest

from envs.config import SimulatedShellConfig
from envs.shell import Observation, TaskSetup
from envs.simulated import (
    UNKNOWN_EXIT_CODE,
    Completion,
    CompletionClient,
    SimulatedShell,
    SimulatorError,
)
from rl.data.chat import ChatRenderer, render_text
from rl.data.sim_format import (
    SIM_SYSTEM_PROMPT,
    ObservationFormatError,
    format_observation,
    parse_observation,
    parse_observation_prefix,
    render_sim_messages,
    strip_think,
)
from rl.data.tokenizer import IM_END, ByteTokenizer


class FakeSimulator:
    """A `CompletionClient` that replays scripted replies (or raises scripted errors) and
    records every request."""

    def __init__(self, replies):
        self.replies = list(replies)
        self.calls: list[dict] = []

    async def complete(
        self,
        prompt,
        *,
        max_tokens,
        temperature,
        stop=None,
        stop_token_ids=None,
        seed=None,
        timeout_s=None,
    ):
        self.calls.append(
            {
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": temperature,
                "stop": stop,
                "stop_token_ids": stop_token_ids,
                "seed": seed,
                "timeout_s": timeout_s,
            }
        )
        reply = self.replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        if reply == "hang":
            await asyncio.sleep(3600)
        if isinstance(reply, str):
            return Completion(reply, list(reply.encode()), "stop")
        return reply


def obs_text(output: str, code: int = 0) -> str:
    return format_observation(output, code)


def test_format_and_parse_round_trip():
    rng = random.Random(0)
    pieces = ["a", "\n", " ", "<", ">", "/", "output", "</output>", "<returncode>", "日本", "\t"]
    cases = [("", 0), ("\n", 1), ("x\n\n", 2), ("</output>", 127), ("a\n</output>\nb", -1)]
    cases += [
        ("".join(rng.choice(pieces) for _ in range(rng.randrange(30))), rng.randrange(-5, 300))
        for _ in range(500)
    ]
    for output, code in cases:
        assert parse_observation(format_observation(output, code)) == (output, code)


@pytest.mark.parametrize(
    "text",
    [
        "hello",
        "<returncode>0</returncode>\nhello",
        "<returncode>x</returncode>\n<output>\nhi\n</output>",
        "<returncode>0</returncode>\n<output>\nhi\n</output>\ntrailing words",
        "<returncode>0</returncode>\n<output>\nhi",
    ],
)
def test_parse_rejects_malformed_text(text):
    with pytest.raises(ObservationFormatError, match="expected '<returncode>N"):
        parse_observation(text)


def test_parse_prefix_salvages_a_cut_observation():
    assert parse_observation_prefix("<returncode>2</returncode>\n<output>\nabc\n</out") == (
        "abc",
        2,
    )
    assert parse_observation_prefix("<returncode>0</returncode>\n<output>\nab") == ("ab", 0)
    assert parse_observation_prefix("no header") is None


def test_strip_think():
    assert strip_think("<think>\nhm\n</think>\n\nX") == ("X", True)
    assert strip_think("X<think>unclosed") == ("X", True)
    assert strip_think("plain") == ("plain", False)


def test_sim_messages_render_append_only():
    history = [("ls", Observation("a.txt\n", 0)), ("cat nope", Observation("no such\n", 1))]
    setup = {"a.txt": "alpha\n"}
    for k in range(len(history)):
        now = render_sim_messages("do it", history[:k], history[k][0], setup_files=setup)
        nxt = render_sim_messages("do it", history[: k + 1], "next", setup_files=setup)
        prompt = render_text(now, add_generation_prompt=True, enable_thinking=False)
        target = format_observation(history[k][1].output, history[k][1].exit_code)
        # What the simulator saw plus what it generated is the start of the next prompt.
        assert render_text(nxt).startswith(prompt + target + IM_END + "\n")
    system = render_sim_messages("do it", [], "ls", setup_files=setup)[0]["content"]
    assert "do it" in system and "--- a.txt ---\nalpha\n" in system


async def test_text_prompt_request_and_history():
    client = FakeSimulator([obs_text("hi\n"), obs_text("", 1)])
    assert isinstance(client, CompletionClient)
    cfg = SimulatedShellConfig(max_tokens=77, temperature=0.5, seed=10)
    setup = TaskSetup(files={"in.txt": "x\n"})
    async with SimulatedShell(client, task_instruction="say hi", setup=setup, config=cfg) as sh:
        first = await sh.run("echo hi", timeout_s=5)
        second = await sh.run("false", timeout_s=5)
    assert (first.output, first.exit_code, second.exit_code) == ("hi\n", 0, 1)
    assert not any(first.info[k] for k in ("cap_hit", "think_leak", "repetition", "malformed"))
    call = client.calls[1]
    expected = render_sim_messages("say hi", [("echo hi", first)], "false", setup_files=setup.files)
    assert call["prompt"] == render_text(
        expected, add_generation_prompt=True, enable_thinking=False
    )
    assert call["prompt"].endswith("<think>\n\n</think>\n\n")
    assert (call["max_tokens"], call["temperature"], call["stop"]) == (77, 0.5, [IM_END])
    assert [c["seed"] for c in client.calls] == [10, 11]
    assert sh.history == [("echo hi", first), ("false", second)]


async def test_configured_system_prompt_and_hidden_task_reach_the_request():
    client = FakeSimulator([obs_text("X\n")])
    cfg = SimulatedShellConfig(system_prompt="", show_task=False)
    setup = TaskSetup(files={"in.txt": "x\n"})
    async with SimulatedShell(
        client, task_instruction="secret task", setup=setup, config=cfg
    ) as sh:
        await sh.run("cat in.txt", timeout_s=5)
    prompt = client.calls[0]["prompt"]
    assert "secret task" not in prompt and SIM_SYSTEM_PROMPT not in prompt
    assert prompt.startswith("<|im_start|>system\nFiles in the working directory at the start:")
    expected = render_sim_messages(
        "secret task", [], "cat in.txt", setup_files=setup.files, system_prompt="", show_task=False
    )
    assert prompt == render_text(expected, add_generation_prompt=True, enable_thinking=False)


async def test_token_prompt_drops_oldest_turns_to_fit_context():
    tok = ByteTokenizer()
    renderer = ChatRenderer(tok)
    client = FakeSimulator([obs_text("x" * 200)] * 3 + [obs_text("ok")])
    cfg = SimulatedShellConfig(max_tokens=100, max_context_tokens=1000)
    sh = SimulatedShell(client, task_instruction="t", config=cfg, renderer=renderer)
    for i in range(4):
        obs = await sh.run(f"cmd{i}", timeout_s=5)
    call = client.calls[-1]
    assert isinstance(call["prompt"], list) and call["stop_token_ids"] == [tok.eos_id]
    assert len(call["prompt"]) + call["max_tokens"] <= 1000
    assert obs.info["history_dropped"] >= 1
    assert "cmd0" not in tok.decode(call["prompt"]) and "cmd2" in tok.decode(call["prompt"])


CAP = Completion("<returncode>0</returncode>\n<output>\nabcabc", [1] * 50, "length")


@pytest.mark.parametrize(
    "reply, flags, output, code",
    [
        (CAP, {"cap_hit"}, "abcabc", 0),
        ("<think>\nI guess\n</think>\n\n" + obs_text("ok\n", 0), {"think_leak"}, "ok\n", 0),
        (obs_text("loop\n" * 100, 0), {"repetition"}, "loop\n" * 100, 0),
        ("", {"empty", "malformed"}, "", UNKNOWN_EXIT_CODE),
        ("just some text", {"malformed"}, "just some text", UNKNOWN_EXIT_CODE),
        (obs_text("done\n", 3) + IM_END, set(), "done\n", 3),
    ],
    ids=["cap_hit", "think_leak", "repetition", "empty", "malformed", "stop_text_kept"],
)
async def test_pathology_flags(reply, flags, output, code):
    sh = SimulatedShell(FakeSimulator([reply]), task_instruction="t")
    obs = await sh.run("cmd", timeout_s=5)
    names = {"cap_hit", "think_leak", "repetition", "empty", "malformed"}
    assert {k for k in names if obs.info[k]} == flags
    assert (obs.output, obs.exit_code) == (output, code)
    assert obs.truncated == ("cap_hit" in flags)


@pytest.mark.parametrize(
    "reply, match",
    [
        (ConnectionError("refused"), "request failed: ConnectionError"),
        (Completion("", [], "abort"), "finish_reason='abort'"),
        ("hang", "no observation within 0.1s"),
    ],
)
async def test_transport_failures_raise_instead_of_inventing(reply, match):
    cfg = SimulatedShellConfig(request_timeout_s=0.1)
    sh = SimulatedShell(FakeSimulator([reply]), task_instruction="t", config=cfg)
    with pytest.raises(SimulatorError, match=match):
        await sh.run("ls", timeout_s=5)
    assert sh.history == []


def test_config_validation():
    with pytest.raises(ValueError, match=r"max_context_tokens=50 is invalid: greater than"):
        SimulatedShellConfig(max_tokens=100, max_context_tokens=50)
    with pytest.raises(ValueError, match=r"max_prompt_tokens=10 is invalid: set only with"):
        SimulatedShellConfig(max_prompt_tokens=10)
    with pytest.raises(ValueError, match=r"max_prompt_tokens=901 is invalid: .* \(1000 - 100\)"):
        SimulatedShellConfig(max_tokens=100, max_context_tokens=1000, max_prompt_tokens=901)
    with pytest.raises(ValueError, match=r"max_prompt_tokens=0 is invalid"):
        SimulatedShellConfig(max_tokens=100, max_context_tokens=1000, max_prompt_tokens=0)
    assert SimulatedShellConfig(max_tokens=100, max_context_tokens=1000).prompt_budget == 900
    assert (
        SimulatedShellConfig(
            max_tokens=100, max_context_tokens=1000, max_prompt_tokens=256
        ).prompt_budget
        == 256
    )
    assert SimulatedShellConfig(max_tokens=100).prompt_budget is None
    with pytest.raises(ValueError, match="needs a renderer"):
        SimulatedShell(
            FakeSimulator([]),
            task_instruction="t",
            config=SimulatedShellConfig(max_context_tokens=4096),
        )


def test_simulator_session_settings_are_checked():
    with pytest.raises(ValueError, match=r"session_compaction=.* only with sessions: true"):
        SimulatedShellConfig(session_compaction={"mode": "markovian"})
    with pytest.raises(ValueError, match=r"sessions=1 is invalid: true or false"):
        SimulatedShellConfig(sessions=1)
    assert SimulatedShellConfig(sessions=True, session_compaction={"mode": "budget"}).compacting
    assert not SimulatedShellConfig(sessions=True, session_compaction={"mode": "none"}).compacting


async def test_sessions_fall_back_to_completions_on_a_server_without_them():
    # FakeSimulator has no open_session (like a vLLM client): stateless, same requests.
    cfg = SimulatedShellConfig(max_tokens=16, sessions=True)
    fake = FakeSimulator([obs_text("x")])
    async with SimulatedShell(
        fake, task_instruction="t", config=cfg, renderer=ChatRenderer(ByteTokenizer())
    ) as shell:
        obs = await shell.run("echo x", timeout_s=5)
    assert obs.output == "x" and len(fake.calls) == 1 and "appended_tokens" not in obs.info
