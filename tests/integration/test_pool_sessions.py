"""Persistent KV sessions through a replica pool of two real `simloop serve` processes (the same
tiny agent on each): new sessions spread over the replicas by how many each holds, every call
of a session goes to the replica that holds it (the other one never hears of it), and when
that replica is killed with SIGKILL mid-episode the agent loop's session reopens on the live
replica, is sent the episode's tokens again, records why, and samples exactly what a stateless
completion of the same tokens gives (greedy, same weights)."""

from __future__ import annotations

import dataclasses
import os
import signal

import pytest

from launch.deploy.local import LocalServer
from rl.orchestrator.episode import _SessionTurns
from serving.client import ClientConfig, InferenceClient
from serving.pool import ReplicaPool, SessionLost
from tests.fakes import tiny_agent_serve_args

pytestmark = pytest.mark.slow

CONTEXT = 256
FAST = ClientConfig(backoff_s=0.05, max_backoff_s=0.1, max_retries=1, timeout_s=60.0)
GREEDY = {"max_tokens": 6, "temperature": 0.0}


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pool-sessions")
    _, _, run, args = tiny_agent_serve_args(tmp, seed=3, context=CONTEXT)
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    servers = []
    try:
        for i in range(2):
            servers.append(
                LocalServer.start("agent", run, extra_args=args, env=env, name=f"agent-{i}")
            )
        yield servers
    finally:
        for s in servers:
            s.stop()


async def _held(url: str) -> set[str]:
    async with InferenceClient(ClientConfig(base_url=url)) as c:
        body, _ = await c.request("GET", "/v1/sessions")
    return {s["id"] for s in body["data"] if s["state"] == "open"}


async def test_sessions_spread_stay_put_and_reopen_on_a_live_replica(replicas):
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

        # An episode's turns through one session; its replica is killed between two turns.
        sid = await pool.open_session()
        doomed = next(s for s in replicas if s.url == pool.session_home(sid))
        live = next(s for s in replicas if s is not doomed)
        turns = _SessionTurns(pool, sid)
        ids = [3, 1, 4, 1, 5, 9, 2, 6]
        out = await turns.complete(ids, **GREEDY)
        ids = ids + list(out.token_ids) + [2, 7, 1, 8]
        os.kill(doomed.proc.pid, signal.SIGKILL)
        doomed.proc.wait(timeout=30)
        out2 = await turns.complete(ids, **GREEDY)

        # Reopened on the live replica, sent the whole episode, recorded with its reason.
        assert turns.reopened == 1 and doomed.url in turns.reopen_reasons[0], turns.reopen_reasons
        assert pool.session_home(turns.id) == live.url
        assert not pool.replica(doomed.url).live
        assert pool.stats()["ejected_for"] == {"dead": 1}
        # Exact: the same tokens a stateless greedy completion of the episode gives.
        async with InferenceClient(dataclasses.replace(FAST, base_url=live.url)) as c:
            plain = await c.complete(ids, **GREEDY)
        assert out2.token_ids == plain.token_ids
        await turns.close()
        assert pool.stats()["sessions"] == 0

        # A session the pool does not hold is "not found", as a server says it.
        with pytest.raises(SessionLost) as lost:
            await pool.session_generate("r9-nope", [1], **GREEDY)
        assert lost.value.status == 404
