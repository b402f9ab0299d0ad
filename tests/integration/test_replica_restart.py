"""A replica killed mid-rollout comes back at the current version, through the production path:
`role_clients` starts two agent replicas with the vllm backend (the fake `vllm serve`,
`serving.vllm.fake_server`, real processes on 127.0.0.1, from the chip plan), the rollout runs
its episodes on the pool, and one replica's process is SIGKILLed while episodes are in flight
on it. Only the episodes pinned to it end `aborted` naming it, the others end normally, every
episode is on disk; the pool's restarter starts the same process on its port again, and the
pool readmits it only after republishing the current version, after which it takes episodes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from flax import nnx

from envs.textops import generate_textops
from launch.config import write_config
from launch.config.loading import load_config
from launch.config.schema import SimloopConfig, role_model
from launch.deploy.local import LocalServer, role_clients
from launch.errors import JobError
from launch.jobs.episodes import job_backends
from rl.data import ChatRenderer, load_tokenizer
from rl.data.trajectory import load_trajectories
from rl.model import Qwen3
from rl.model.params_io import save_params
from rl.orchestrator.runner import RolloutRunner
from rl.orchestrator.storage import TrajectoryWriter
from serving.pool import ReplicaPool
from serving.pool_publish import PoolPublisher
from serving.publisher import EnginePublisher
from serving.vllm.publisher import VllmPublisher
from tests.fakes import free_port, wait_until

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
FAKE_VLLM = f"[{sys.executable}, -m, serving.vllm.fake_server, serve]"
VERSION = 7
"""The version published before the rollout: what the restarted replica must serve."""


def _config(port: int, tasks: int, *more: str) -> SimloopConfig:
    overrides = [
        "--serve.backend", "vllm", "--vllm.command", FAKE_VLLM,
        "--vllm.start_stagger_s", "0", "--vllm.max_model_len", "512",
        "--vllm.health_timeout_s", "120",
        "--chips.roles", "{policy_train: 4, sim_train: 2, agent_serve: 1}",
        "--chips.replicas", "{agent_serve: 2}", "--chips.http_port_base", str(port),
        "--orchestrator.arm", "real", "--orchestrator.group_size", "2",
        "--orchestrator.max_tokens_per_turn", "64", "--env.terminal.max_turns", "1",
        "--env.textops.num_tasks", str(tasks), *more,
    ]  # fmt: skip
    return load_config(SimloopConfig, ROOT / "configs" / "demo_cpu.yaml", overrides)


async def _rpc_version(client) -> list:
    body, _ = await client.request(
        "POST", "/collective_rpc", json_body={"method": "simloop_weight_version"}
    )
    return [r["version"] for r in body["results"]]


async def _completions_served(client) -> int:
    text, _ = await client.request("GET", "/metrics")
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("simloop_requests_total")
        and '"/v1/completions"' in line
        and 'status="200"' in line
    )


async def test_a_killed_agent_replica_aborts_only_its_episodes_and_returns_at_the_version(
    tmp_path, monkeypatch
):
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # the servers: one CPU device each
    cfg = _config(free_port(span=2), tasks=4)
    out = tmp_path / "run"
    ocfg = dataclasses.replace(cfg.orchestrator, max_staleness=None)  # as `simloop rollout`
    renderer = ChatRenderer(load_tokenizer(cfg.agent.tokenizer))
    tasks = generate_textops(cfg.env.textops)
    ckpt = save_params(Qwen3(role_model(cfg.agent), rngs=nnx.Rngs(VERSION)), tmp_path / "v7")

    async with role_clients(cfg, out, ["agent"], who="test") as clients:
        pool = clients["agent"]
        assert isinstance(pool, ReplicaPool) and len(pool.replicas) == 2
        doomed, keep = pool.replicas
        old = clients.servers["agent"][0]
        publisher = PoolPublisher(pool, lambda r: VllmPublisher([r.url], model_name="agent"))
        try:
            await publisher.publish(str(ckpt), VERSION)
            assert await _rpc_version(doomed.client) == [VERSION]

            # Round 1: SIGKILL replica 0 while both replicas have requests in flight.
            writer = TrajectoryWriter(out)
            runner = RolloutRunner(
                ocfg,
                cfg.env.terminal,
                renderer,
                job_backends(cfg),
                client=pool,
                sinks=(writer.add,),
            )
            rollout = asyncio.create_task(runner.run(tasks), name="round-1")
            both_busy = lambda: doomed.in_flight > 0 and keep.in_flight > 0  # noqa: E731
            assert await wait_until(lambda: both_busy() or rollout.done(), timeout_s=60)
            assert not rollout.done(), "the rollout ended before both replicas were busy"
            os.kill(old.proc.pid, signal.SIGKILL)
            trajs = await rollout
            writer.close()

            # No trajectory lost: one record per episode started, on disk.
            assert runner.metrics.episodes == len(tasks) * ocfg.group_size == len(trajs)
            assert len(load_trajectories([out / "trajectories"])) == len(trajs)
            aborted = [t for t in trajs if t.status == "aborted"]
            assert aborted, [t.status for t in trajs]
            for t in aborted:  # only the dead replica's episodes, each naming it
                assert t.replica_down == doomed.url and doomed.url in t.reason, t.reason
            assert {t.status for t in trajs if t not in aborted} <= {"ok", "truncated"}
            assert len(aborted) < len(trajs)  # the other replica's episodes finished

            # The restarter brings it back (a new process on its port) at the current version.
            assert await wait_until(lambda: doomed.live, timeout_s=90), pool.stats()
            new = clients.servers["agent"][0]
            assert new is not old and new.proc.poll() is None and new.url == old.url
            assert await _rpc_version(doomed.client) == [VERSION]
            assert doomed.version == VERSION and keep.live
            stats = pool.stats()
            assert stats["restarts"] == 1 and stats["ejections"] == 1, stats

            # Round 2: the readmitted replica takes new episodes.
            runner = RolloutRunner(ocfg, cfg.env.terminal, renderer, job_backends(cfg), client=pool)
            again = await runner.run(tasks)
            assert {t.status for t in again} <= {"ok", "truncated"}
            assert await _completions_served(doomed.client) > 0
        finally:
            await publisher.close()
        summary = json.dumps(runner.metrics.summary()["pools"])
        assert '"restarts": 1' in summary

    # Every server, the restarted one included, stopped with the block.
    assert new.proc.poll() is not None and old.proc.poll() is not None


async def test_a_killed_jax_replica_is_restarted_on_its_port_at_the_current_version(tmp_path):
    """The jax backend's replicas (`simloop serve`) are restarted the same way: the same
    command and environment (admin token included) on the same port, a log of its own."""
    small = ["--serve.engine.num_slots", "2", "--serve.engine.max_seq_len", "128",
             "--orchestrator.max_context_tokens", "128"]  # fmt: skip
    cfg = _config(free_port(span=2), 1, "--serve.backend", "jax", *small)
    out = tmp_path / "run"
    write_config(cfg, out)
    ckpt = save_params(Qwen3(role_model(cfg.agent), rngs=nnx.Rngs(VERSION)), out / "weights" / "v7")
    token = "restart-test-token"

    async with role_clients(cfg, out, ["agent"], who="test", admin_token=token) as clients:
        pool = clients["agent"]
        keep, doomed = pool.replicas
        old = clients.servers["agent"][1]
        publisher = PoolPublisher(pool, lambda r: EnginePublisher([r.client], token=token))
        await publisher.publish(str(ckpt), VERSION)
        os.kill(old.proc.pid, signal.SIGKILL)
        for _ in range(pool.cfg.health_failures):  # what the pool's health loop does
            await pool.check_health()
        assert not doomed.live and keep.live
        assert await wait_until(lambda: doomed.live, timeout_s=60), pool.stats()
        new = clients.servers["agent"][1]
        assert new is not old and new.url == old.url and new.proc.poll() is None
        body, _ = await doomed.client.request("GET", "/admin/version", token=token)
        assert body["version"] == VERSION and pool.stats()["restarts"] == 1
        assert (out / "logs" / "agent-1-restart1-server.log").is_file()
        assert "listening on" in (out / "logs" / "agent-1-server.log").read_text()
    assert new.proc.poll() is not None


async def test_roles_start_together_and_one_failing_stops_the_others(tmp_path):
    """`role_clients` starts the roles' servers at once; when one cannot start (here the
    simulator's weights do not exist), the error names it and the agent's server, which did
    start, is stopped before the error reaches the caller."""
    small = ["--serve.engine.num_slots", "2", "--serve.engine.max_seq_len", "128",
             "--orchestrator.max_context_tokens", "128",
             "--chips.replicas", "{agent_serve: 1}", "--chips.roles",
             "{policy_train: 4, sim_train: 2, agent_serve: 1, sim_serve: 1}",
             "--simulator.weights", str(tmp_path / "no-such-weights")]  # fmt: skip
    cfg = _config(free_port(span=2), 1, "--serve.backend", "jax", *small)
    out = tmp_path / "run"
    write_config(cfg, out)
    agents, began, ended = [], {}, {}
    real_start = LocalServer.start

    def start(cls, role, *a, **kw):
        began[role] = time.monotonic()
        try:
            server = real_start(role, *a, **kw)
        finally:
            ended[role] = time.monotonic()
        agents.append(server)
        return server

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LocalServer, "start", classmethod(start))
        with pytest.raises(JobError, match="the simulator server did not start"):
            async with role_clients(cfg, out, ["agent", "simulator"], who="test"):
                pytest.fail("the block ran without a simulator server")
    assert [s.role for s in agents] == ["agent"]
    assert began["simulator"] < ended["agent"], "the simulator's start waited for the agent's"
    assert agents[0].proc.poll() is not None, "the agent's server outlived the failed start"
