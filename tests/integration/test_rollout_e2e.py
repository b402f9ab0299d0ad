"""End to end: a tiny agent and a tiny simulator served by two real `simloop serve` processes,
32 textops episodes in each arm through `simloop rollout`, every trajectory validated; and a
fault test that kills the agent server mid-run.

The tiny models are untrained, so episodes mostly end `truncated` (format errors): what is
checked is that every episode ends with a valid trajectory and an explained status.
"""

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from envs.config import LocalShellConfig, TerminalConfig, TextopsConfig
from envs.local import LocalShell
from envs.textops import generate_textops
from launch.config.loading import load_config, write_config
from launch.config.schema import SimloopConfig
from launch.deploy.local import LocalServer
from rl.data import ByteTokenizer, ChatRenderer
from rl.data.trajectory import read_jsonl, validate
from rl.orchestrator.admission import AdmissionController
from rl.orchestrator.config import OrchestratorConfig
from rl.orchestrator.runner import Backends, RolloutRunner
from serving.client import ClientConfig, InferenceClient
from tests.fakes import free_port, user_env, wait_until

REPO = Path(__file__).resolve().parents[2]
SIMLOOP = Path(sys.executable).parent / "simloop"
SMALL = ["--orchestrator.max_tokens_per_turn", "48", "--env.terminal.max_turns", "3",
         "--env.terminal.max_format_errors", "3", "--env.shell.simulated.max_tokens", "48",
         "--serve.engine.max_seq_len", "2048", "--serve.engine.num_slots", "16",
         "--serve.engine.prefill_chunk", "128"]  # fmt: skip


def _env():
    return user_env()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    run = tmp_path_factory.mktemp("servers")
    cfg = load_config(SimloopConfig, REPO / "configs/demo_cpu.yaml", SMALL)
    write_config(cfg, run)
    with LocalServer.start("agent", run) as agent, LocalServer.start("simulator", run) as sim:
        yield {"agent": agent.url, "simulator": sim.url}


def _rollout(out: Path, servers, *extra: str) -> list:
    cmd = [SIMLOOP, "rollout", "--config", "configs/demo_cpu.yaml", "--out", str(out),
           "--agent.server_url", servers["agent"], "--simulator.server_url",
           servers["simulator"], "--env.textops.num_tasks", "32", "--orchestrator.group_size", "1",
           *SMALL, *extra]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    shards = sorted((out / "trajectories").glob("*.jsonl"))
    assert shards and (out / "metrics.jsonl").exists() and (out / "config.yaml").exists()
    assert len(list((out / "trajectories").glob("*.array_record"))) == len(shards)
    return [t for s in shards for t in read_jsonl(s, check=True)]


@pytest.mark.slow
def test_32_episodes_per_arm_all_validate(servers, tmp_path):
    real = _rollout(tmp_path / "real", servers, "--orchestrator.arm", "real")
    closed = _rollout(tmp_path / "closed", servers, "--orchestrator.arm", "closed_loop")
    replay = _rollout(
        tmp_path / "replay",
        servers,
        "--orchestrator.arm",
        "replay",
        "--replay",
        str(tmp_path / "real" / "trajectories"),
    )
    assert len(real) == len(closed) == len(replay) == 32
    assert {t.env_backend for t in real} == {"local"}
    assert {t.env_backend for t in closed} == {"simulated"}
    for t in real + closed + replay:
        assert t.status == "ok" or t.reason, t.status
    # Sampler trajectories: every agent token has a logprob and a weight version.
    for t in real + closed:
        n = sum(t.loss_mask)
        assert n > 0 and sum(lp is not None for lp in t.behavior_logprobs) == n


@pytest.mark.slow
async def test_killed_agent_server_fails_in_flight_episodes_then_the_run_recovers(tmp_path):
    cfg = load_config(SimloopConfig, REPO / "configs/demo_cpu.yaml", SMALL)
    write_config(cfg, tmp_path)
    port = free_port()
    args = ["--port", str(port)]
    server = await asyncio.to_thread(LocalServer.start, "agent", tmp_path, extra_args=args)
    tasks = generate_textops(TextopsConfig(num_tasks=16, seed=5))
    ocfg = OrchestratorConfig(
        arm="real", batch_size=8, max_staleness=0, max_tokens_per_turn=48, request_timeout_s=30
    )
    admission = AdmissionController(ocfg.batch_size, ocfg.max_staleness)
    delivered = []
    client_cfg = ClientConfig(f"http://127.0.0.1:{port}", max_retries=1, backoff_s=0.1)
    async with InferenceClient(client_cfg) as client:
        runner = RolloutRunner(
            ocfg,
            TerminalConfig(max_turns=3, max_format_errors=3),
            ChatRenderer(ByteTokenizer()),
            Backends(real=lambda task: LocalShell(LocalShellConfig(), setup=task.setup)),
            client=client,
            admission=admission,
            sinks=(delivered.append,),
        )
        job = asyncio.create_task(runner.run(tasks), name="rollout")
        assert await wait_until(lambda: runner.metrics.active == 8, 120), "8 in flight"
        await asyncio.sleep(0.2)
        server.proc.send_signal(signal.SIGKILL)  # mid-run, requests in flight
        server.proc.wait(timeout=10)
        # The first batch ends; with S=0 the second waits for the "trainer".
        assert await wait_until(lambda: len(delivered) == 8, 120), "first batch ended"
        server = await asyncio.to_thread(LocalServer.start, "agent", tmp_path, extra_args=args)
        await admission.set_version(1)  # the "trainer" moves on: the second batch starts
        trajs = await asyncio.wait_for(job, 300)
    server.stop()
    assert len(trajs) == len(delivered) == 16
    for t in trajs:
        validate(t)
    first, second = delivered[:8], delivered[8:]
    failed = [t for t in first if t.status in ("error", "aborted", "timeout")]
    assert failed, [t.status for t in first]
    assert all(t.reason for t in failed)
    assert all(t.status not in ("error", "aborted", "timeout") for t in second), [
        (t.status, t.reason) for t in second
    ]


class Recording:
    """Wraps the real client and keeps (prompt, reply ids) exactly as the server sent them."""

    def __init__(self, client):
        self.client, self.seen = client, []

    async def complete(self, prompt, **kw):
        out = await self.client.complete(prompt, **kw)
        self.seen.append((list(prompt), list(out.token_ids)))
        return out


@pytest.mark.slow
async def test_token_in_token_out_against_a_real_server(servers):
    renderer = ChatRenderer(ByteTokenizer())
    tasks = generate_textops(TextopsConfig(num_tasks=4, seed=9))
    async with InferenceClient(ClientConfig(servers["agent"])) as client:
        rec = Recording(client)
        runner = RolloutRunner(
            OrchestratorConfig(arm="real", max_tokens_per_turn=48),
            TerminalConfig(max_turns=3, max_format_errors=3),
            renderer,
            Backends(real=lambda task: LocalShell(LocalShellConfig(), setup=task.setup)),
            client=rec,
        )
        trajs = await runner.run(tasks)
    replies = {tuple(p): g for p, g in rec.seen}
    for t in trajs:
        validate(t)
        think = dict(enable_thinking=False)  # OrchestratorConfig's default
        ids = renderer.render(t.prompt, add_generation_prompt=True, **think)
        for turn in t.turns:
            start, end = turn.token_span
            assert t.token_ids[:start] == ids  # the exact prompt the server was sent
            reply = replies[tuple(ids)]
            assert t.token_ids[start : start + len(reply)] == reply  # verbatim
            ids = t.token_ids[: start + len(reply)]
            if reply[-1] != renderer.im_end_id:  # a cut reply is closed by the env
                ids = ids + [renderer.im_end_id]
            for message in turn.env_messages:  # then the rendered observation, append-only
                ids = ids + renderer.append(ids, message, add_generation_prompt=True, **think)
        assert ids == t.token_ids
