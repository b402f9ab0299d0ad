"""SimulatedShell against a real `simloop serve` subprocess (tiny random model, byte tokenizer).

The tiny model is untrained, so its observations are garbage: what is checked is the plumbing —
prompts rendered and sent as token ids, stop on end-of-turn, the token cap, pathology flags,
history, and the server's prefix reuse across turns.
"""

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import pytest_asyncio

from envs.config import SimulatedShellConfig
from envs.shell import Observation
from envs.simulated import SimulatedShell
from rl.data import ByteTokenizer, ChatRenderer
from serving.client import ClientConfig, InferenceClient
from tests.fakes import user_env

REPO = Path(__file__).resolve().parents[2]
SIMLOOP = Path(sys.executable).parent / "simloop"


@pytest.fixture(scope="module")
def server_url():
    env = user_env()
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
    async with SimulatedShell(client, task_instruction="Reverse 'abc'.", config=cfg,
                              renderer=renderer) as shell:  # fmt: skip
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
    async with SimulatedShell(client, task_instruction="Reverse 'abc'.", config=cfg,
                              renderer=renderer) as again:  # fmt: skip
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
