"""SimulatedShell against a real `simloop serve` subprocess (tiny random model, byte tokenizer).

The tiny model is untrained, so its observations are garbage: what is checked is the plumbing —
prompts rendered and sent as token ids, stop on end-of-turn, the token cap, pathology flags,
history, and the server's prefix reuse across turns.
"""

import dataclasses
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import pytest_asyncio

from envs.config import SimulatedShellConfig
from envs.shell import Observation, TaskSetup
from envs.simulated import SimulatedShell
from rl.data import ByteTokenizer, ChatRenderer
from serving.client import ClientConfig, InferenceClient
from tests.fakes import LossyClient, user_env

REPO = Path(__file__).resolve().parents[2]
SIMLOOP = Path(sys.executable).parent / "simloop"


@pytest.fixture(scope="module")
def server_url():
    env = user_env(cheap_compile=True)
    proc = subprocess.Popen(
        [SIMLOOP, "serve", "--preset", "tiny", "--port", "0", "--max-seq-len", "1024",
         "--num-slots", "4"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline, url = time.monotonic() + 120, None
    lines = []
    while time.monotonic() < deadline and url is None:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        url = m.group(1) if m else None
    if url is None:
        proc.kill()
        pytest.fail("simloop serve did not start:\n" + "".join(lines[-20:]))
    yield url
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


@pytest_asyncio.fixture
async def client(server_url):
    async with InferenceClient(ClientConfig(server_url, timeout_s=60)) as c:
        yield c


@pytest.mark.slow
async def test_simulated_shell_talks_to_a_real_server(client):
    cfg = SimulatedShellConfig(max_tokens=24, temperature=1.0, seed=3)
    renderer = ChatRenderer(ByteTokenizer())
    async with SimulatedShell(
        client, task_instruction="Reverse 'abc'.", config=cfg, renderer=renderer
    ) as shell:
        first = await shell.run("echo abc | rev", timeout_s=5)
        second = await shell.run("ls -la", timeout_s=5)
    for obs in (first, second):
        assert isinstance(obs, Observation)
        assert {"cap_hit", "think_leak", "repetition", "empty", "malformed"} <= set(obs.info)
        if obs.info["cap_hit"]:
            assert obs.truncated
    assert [c for c, _ in shell.history] == ["echo abc | rev", "ls -la"]
    assert second.info["prompt_tokens"] > first.info["prompt_tokens"]

    # Same seed, same session -> the same simulated observations (seeded per turn).
    async with SimulatedShell(
        client, task_instruction="Reverse 'abc'.", config=cfg, renderer=renderer
    ) as again:
        assert (await again.run("echo abc | rev", timeout_s=5)).output == first.output

    # Turn 2 extended turn 1's prompt: the server reused cached KV instead of re-prefilling.
    text, _ = await client.request("GET", "/metrics")
    cached = int(re.search(r"^simloop_cached_tokens_total (\d+)", text, re.M).group(1))
    assert cached > 0


@pytest.mark.slow
async def test_text_prompts_work_without_a_renderer(client):
    cfg = SimulatedShellConfig(max_tokens=8)
    async with SimulatedShell(client, task_instruction="t", config=cfg) as shell:
        obs = await shell.run("pwd", timeout_s=5)
    assert obs.info["prompt_tokens"] is None and "malformed" in obs.info


COMMANDS = ["echo abc | rev", "ls -la", "cat input.txt", "wc -c input.txt", "pwd", "echo done"]


async def _episode(client, cfg: SimulatedShellConfig) -> tuple[list[Observation], SimulatedShell]:
    renderer = ChatRenderer(ByteTokenizer())
    shell = SimulatedShell(
        client,
        task_instruction="t",
        config=cfg,
        renderer=renderer,
        setup=TaskSetup(files={"input.txt": "hello\n"}),
    )
    async with shell:
        return [await shell.run(c, timeout_s=5) for c in COMMANDS], shell


@pytest.mark.slow
async def test_simulator_sessions_give_the_stateless_observations(client):
    # A context that fills up: later prompts drop their oldest turns, so the session must
    # rewind to where the new prompt departs from what it holds (the system prompt).
    cfg = SimulatedShellConfig(
        max_tokens=24, temperature=0.0, max_context_tokens=300, system_prompt="", show_task=False
    )
    plain, _ = await _episode(client, cfg)
    cfg_s = dataclasses.replace(cfg, sessions=True)
    via, shell = await _episode(client, cfg_s)
    assert [o.output for o in via] == [o.output for o in plain]
    assert [o.exit_code for o in via] == [o.exit_code for o in plain]
    assert [o.info["prompt_tokens"] for o in via] == [o.info["prompt_tokens"] for o in plain]
    assert any(o.info.get("history_dropped") for o in via), "the context never filled up"
    assert shell._session is None  # closed with the episode
    listed, _ = await client.request("GET", "/v1/sessions")
    assert listed["data"] == []
    # Only what each prompt added was sent; after a drop, all but the system prompt.
    sent = [o.info["appended_tokens"] for o in via]
    assert sent[0] == via[0].info["prompt_tokens"]
    for o, n in zip(via[1:], sent[1:], strict=True):
        assert 0 < n < o.info["prompt_tokens"]
    assert sum(sent) < sum(o.info["prompt_tokens"] for o in via)


@pytest.mark.slow
async def test_a_compacting_simulator_session_runs_past_its_context(client):
    # markovian: the server keeps the prompt and the last turn; the whole history is sent.
    markovian = {"mode": "markovian", "n_protect_turns": 1}
    cfg = SimulatedShellConfig(
        max_tokens=24,
        temperature=0.0,
        max_context_tokens=300,
        system_prompt="",
        show_task=False,
        sessions=True,
        session_compaction=markovian,
    )
    obs, _ = await _episode(client, cfg)
    assert len(obs) == len(COMMANDS)
    assert not any(o.info.get("history_dropped") for o in obs)  # nothing dropped client-side
    assert max(o.info["prompt_tokens"] for o in obs) > 300 - 24  # past the stateless budget
    assert all(o.info["appended_tokens"] < o.info["prompt_tokens"] for o in obs[1:])


@pytest.mark.slow
async def test_a_forgotten_simulator_session_is_opened_again(client):
    cfg = SimulatedShellConfig(
        max_tokens=24, temperature=0.0, system_prompt="", show_task=False, sessions=True
    )
    renderer = ChatRenderer(ByteTokenizer())
    async with SimulatedShell(client, task_instruction="t", config=cfg, renderer=renderer) as shell:
        await shell.run("pwd", timeout_s=5)
        first = shell._session
        await client.close_session(first)  # as a TTL or memory pressure would
        again = await shell.run("ls", timeout_s=5)
        assert shell._session not in (None, first)
        assert again.info["appended_tokens"] == again.info["prompt_tokens"]  # all of it
    async with SimulatedShell(client, task_instruction="t", config=cfg, renderer=renderer) as plain:
        await plain.run("pwd", timeout_s=5)
        assert (await plain.run("ls", timeout_s=5)).output == again.output


@pytest.mark.slow
async def test_a_lost_answer_is_retried_from_the_turn_boundary(client, server_url):
    cfg = SimulatedShellConfig(
        max_tokens=24,
        temperature=0.0,
        max_context_tokens=300,
        system_prompt="",
        show_task=False,
        sessions=True,
    )
    plain, _ = await _episode(client, cfg)
    async with LossyClient(
        ClientConfig(server_url, timeout_s=60, backoff_s=0.01), lose={2, 5}
    ) as lossy:
        renderer = ChatRenderer(ByteTokenizer())
        shell = SimulatedShell(
            lossy,
            task_instruction="t",
            config=cfg,
            renderer=renderer,
            setup=TaskSetup(files={"input.txt": "hello\n"}),
        )
        async with shell:
            via = []
            for command in COMMANDS:
                via.append(await shell.run(command, timeout_s=5))
                if len(via) == 2:  # right after the retried call: the session holds the
                    listed, _ = await client.request("GET", "/v1/sessions")  # turn once
                    (held,) = [s for s in listed["data"] if s["id"] == shell._session]
                    assert held["session_tokens"] == len(shell._session_ids)
    # Each lost call was sent again after a rewind to what the session held before it, and
    # the episode is the one without losses: no turn appended twice, none dropped.
    assert lossy.generates == len(COMMANDS) + 2 and len(lossy.rewinds) >= 2
    assert [o.output for o in via] == [o.output for o in plain]
    assert [o.info["prompt_tokens"] for o in via] == [o.info["prompt_tokens"] for o in plain]
