"""A `simloop rollout` killed with SIGKILL mid-run leaves only whole, valid trajectory records:
every episode that finished before the kill is on disk and validates, nothing else is.

The agent and the simulator are fake HTTP servers on 127.0.0.1 in the test's own process (the
agent plays textops; the simulator echoes), so the job starts in about a second. Half the tasks
never get a reply: the job is mid-run, with episodes in flight, when it is killed.
"""

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web

from launch.config.loading import load_config
from launch.config.schema import SimloopConfig
from rl.data.sim_format import format_observation
from rl.data.trajectory import load_trajectories, validate
from tests.fakes import FakeAgentClient, user_env

REPO = Path(__file__).resolve().parents[2]
SIMLOOP = Path(sys.executable).parent / "simloop"
ARGS = ["--env.textops.num_tasks", "8", "--orchestrator.group_size", "1",
        "--orchestrator.arm", "closed_loop", "--env.terminal.max_turns", "3",
        "--env.textops.ops", "[reverse, upper]", "--env.textops.from_file_prob", "0.0"]  # fmt: skip


async def _serve(routes) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_routes(routes)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


async def _health(request):
    return web.json_response({"status": "ok"})


@pytest.mark.slow
async def test_sigkilled_rollout_leaves_only_whole_valid_records(tmp_path):
    from envs.textops import generate_textops

    cfg = load_config(SimloopConfig, REPO / "configs/demo_cpu.yaml", ARGS)
    tasks = generate_textops(cfg.env.textops)
    held = {t.id for t in tasks[1::2]}
    agent = FakeAgentClient(tasks)

    async def complete(request):
        body = await request.json()
        text = agent.tok.decode(body["prompt"])
        if any(t.instruction in text for t in tasks if t.id in held):
            await asyncio.Event().wait()  # in flight until the job dies
        out = await agent.complete(body["prompt"], max_tokens=body["max_tokens"])
        choice = {
            "index": 0,
            "text": out.text,
            "token_ids": out.token_ids,
            "finish_reason": out.finish_reason,
            "token_versions": out.token_versions,
            "logprobs": {"token_logprobs": out.logprobs},
        }
        return web.json_response({"choices": [choice], "weight_version": out.weight_version})

    async def simulate(request):
        text = agent.tok.decode((await request.json())["prompt"])
        command = text.rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>")[0]
        obs = format_observation(command.strip()[-20:], 0)
        choice = {
            "index": 0,
            "text": obs,
            "token_ids": agent.tok.encode(obs),
            "finish_reason": "stop",
        }
        return web.json_response({"choices": [choice]})

    servers = [
        await _serve([web.post("/v1/completions", complete), web.get("/health", _health)]),
        await _serve([web.post("/v1/completions", simulate), web.get("/health", _health)]),
    ]
    (_, agent_url), (_, sim_url) = servers
    out = tmp_path / "run"
    env = user_env()
    log = tmp_path / "rollout.log"
    with open(log, "wb") as sink:
        proc = await asyncio.create_subprocess_exec(
            SIMLOOP,
            "rollout",
            "--config",
            "configs/demo_cpu.yaml",
            "--out",
            str(out),
            "--agent.server_url",
            agent_url,
            "--simulator.server_url",
            sim_url,
            *ARGS,
            cwd=REPO,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    shards = out / "trajectories"
    try:
        # Killed once every episode that can finish is on disk (the others are in flight).
        want = len(tasks) - len(held)
        for _ in range(3000):
            lines = sum(p.read_bytes().count(b"\n") for p in shards.glob("*.jsonl"))
            if lines >= want or proc.returncode is not None:
                break
            await asyncio.sleep(0.01)
        assert proc.returncode is None and lines == want, log.read_text()[-3000:]
        proc.send_signal(signal.SIGKILL)
        assert await asyncio.wait_for(proc.wait(), 10) == -signal.SIGKILL
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        for runner, _ in servers:
            await runner.cleanup()
    trajs = load_trajectories([shards])  # every line parses and validates
    assert sorted(t.task_id for t in trajs) == sorted(t.id for t in tasks if t.id not in held)
    for t in trajs:
        validate(t)
        assert t.status == "ok" and t.env_backend == "simulated", (t.status, t.reason)
