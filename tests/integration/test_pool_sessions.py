"""Persistent KV sessions through a replica pool of two real `simloop serve` processes (the same
tiny agent on each): new sessions spread over the replicas by how many each holds, every call
of a session goes to the replica that holds it (the other one never hears of it), and when
that replica is killed with SIGKILL mid-episode the agent loop's session reopens on the live
replica, is sent the episode's tokens again, records why, and samples exactly what a stateless
completion of the same tokens gives (greedy, same weights). That episode's session compacts
(markovian) before it moves, so the move is a context reset, and the trainer's logprobs of
every sampled token, the two replicas' tokens alike, equal the servers' (1e-4)."""

from __future__ import annotations

import dataclasses
import os
import signal

import numpy as np
import pytest

from launch.config.schema import SimloopConfig
from launch.deploy.local import LocalServer
from rl.data import ByteTokenizer
from rl.data.trajectory import Trajectory, Turn, validate
from rl.orchestrator.episode import _SessionTurns
from rl.train.build import build_trainer
from rl.train.config import OptimConfig, PolicyLossConfig, RoleConfig
from rl.train.rollouts import build_rl_batch
from serving.client import ClientConfig, InferenceClient
from serving.compaction import SessionCompaction
from serving.pool import ReplicaPool, SessionLost
from tests.fakes import tiny_agent_serve_args

pytestmark = pytest.mark.slow

CONTEXT = 256
FAST = ClientConfig(backoff_s=0.05, max_backoff_s=0.1, max_retries=1, timeout_s=60.0)
GREEDY = {"max_tokens": 6, "temperature": 0.0, "extra": {"ignore_eos": True}}
TOL = 1e-4
"""f32: decode with a KV cache and the trainer's whole-row forward sum the same terms in
different orders, ~1e-6 apart for a tiny model (as tests/integration/test_compaction_parity)."""


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pool-sessions")
    cfg, hf, run, args = tiny_agent_serve_args(tmp, seed=3, context=CONTEXT)
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    servers = []
    try:
        for i in range(2):
            servers.append(
                LocalServer.start("agent", run, extra_args=args, env=env, name=f"agent-{i}")
            )
        yield servers, cfg, hf
    finally:
        for s in servers:
            s.stop()


async def _held(url: str) -> set[str]:
    async with InferenceClient(ClientConfig(base_url=url)) as c:
        body, _ = await c.request("GET", "/v1/sessions")
    return {s["id"] for s in body["data"] if s["state"] == "open"}


async def test_sessions_spread_stay_put_and_reopen_on_a_live_replica(replicas):
    replicas, model_cfg, hf = replicas
    urls = [s.url for s in replicas]
    async with ReplicaPool(urls, role="agent", client_config=FAST) as pool:
        # Spread: four sessions, two on each replica (each goes where fewest are held).
        ids = [await pool.open_session() for _ in range(4)]
        homes = [pool.session_home(i) for i in ids]
        assert sorted(homes) == sorted(urls * 2), homes
        assert [r["sessions"] for r in pool.stats()["per_replica"]] == [2, 2]

        # Stay put: each session's calls reach its replica, which alone holds it, and the
        # second call appends to what the first left (its prefix is cached there).
        prompt = [5, 6, 7, 8, 9, 10]
        for sid in ids:
            first = await pool.session_generate(sid, prompt, **GREEDY)
            again = await pool.session_generate(sid, [11, 12], **GREEDY)
            assert again.cached_tokens >= len(prompt), again.raw
            assert first.token_ids
        held = {url: await _held(url) for url in urls}
        for sid, home in zip(ids, homes, strict=True):
            server_id = sid.split("-", 1)[1]
            assert server_id in held[home]
            assert all(server_id not in held[u] for u in urls if u != home)
        for sid in ids:
            await pool.close_session(sid)
        assert pool.stats()["sessions"] == 0 and all(not v for v in [await _held(u) for u in urls])

        # An episode's turns through one compacting session; its replica is killed after
        # the third turn (the first that dropped one).
        markovian = SessionCompaction(mode="markovian", n_protect_turns=1)
        sid = await pool.open_session(compaction=markovian)
        doomed = next(s for s in replicas if s.url == pool.session_home(sid))
        live = next(s for s in replicas if s is not doomed)
        turns = _SessionTurns(pool, sid, markovian)
        ids, spans, logp = [3, 1, 4, 1, 5, 9, 2, 6], [], [None] * 8

        async def turn(k: int):
            nonlocal ids
            out = await turns.complete(ids, **GREEDY)
            spans.append(Turn(agent_text="", token_span=(len(ids), len(ids) + 6)))
            ids = ids + list(out.token_ids) + [2, 7, 1, k]
            logp.extend([*out.logprobs, None, None, None, None])
            return out

        for k in range(3):
            await turn(k)
        assert len(turns.kv_epochs()) >= 2  # compacted on its first replica
        os.kill(doomed.proc.pid, signal.SIGKILL)
        doomed.proc.wait(timeout=30)
        before = list(ids)
        out2 = await turn(3)
        await turn(4)

        # Reopened on the live replica, sent the whole episode, recorded with its reason.
        assert turns.reopened == 1 and doomed.url in turns.reopen_reasons[0], turns.reopen_reasons
        assert pool.session_home(turns.id) == live.url
        assert not pool.replica(doomed.url).live
        assert pool.stats()["ejected_for"] == {"dead": 1}
        # Exact: the same tokens a stateless greedy completion of the episode gives.
        async with InferenceClient(dataclasses.replace(FAST, base_url=live.url)) as c:
            plain = await c.complete(before, **GREEDY)
        assert out2.token_ids == plain.token_ids
        assert turns.resets == [{"start": len(before), "context": [[0, len(before)]]}]
        await turns.close()
        assert pool.stats()["sessions"] == 0

        # A session the pool does not hold is "not found", as a server says it.
        with pytest.raises(SessionLost) as lost:
            await pool.session_generate("r9-nope", [1], **GREEDY)
        assert lost.value.status == 404

    # The trainer replays the episode that moved: its first replica's compacted stream, then
    # the live replica's recomputation from the whole prefix, as two segments of one row.
    n = len(ids) - 4  # the last observation was never sent
    traj = Trajectory(
        task_id="moved",
        arm="real",
        env_backend="local",
        status="ok",
        reward=1.0,
        turns=spans,
        token_ids=ids[:n],
        loss_mask=[0 if x is None else 1 for x in logp[:n]],
        behavior_logprobs=logp[:n],
        policy_version=[None if x is None else 0 for x in logp[:n]],
        tokenizer="byte",
        kv_epochs=turns.kv_epochs(),
        context_resets=turns.resets,
    )
    validate(traj)
    trainer = build_trainer(
        RoleConfig(model=model_cfg, hf_path=str(hf)),
        ByteTokenizer(),
        optim=OptimConfig(),
        steps=1,
        loss="policy",
        rules=SimloopConfig().sharding.rules,
        seed=0,
    )
    batch, stats = build_rl_batch([traj], rows=1, seq_len=2 * n, cfg=PolicyLossConfig(), version=0)
    mask = batch["loss_mask"].astype(bool)
    assert stats.used == 1 and mask.sum() == 5 * 6
    gap = np.abs(np.asarray(trainer.logprobs(batch)) - batch["behavior_logprobs"])[mask]
    assert gap.max() <= TOL, f"max |trainer - server| logprob {gap.max():.2e}"
