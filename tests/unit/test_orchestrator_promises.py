"""The orchestrator's reliability promises, tested for real (issue 17): bounded staleness in an
async run (stragglers dropped by whole group and counted), a simulator server killed with
SIGKILL mid-episode (those episodes end `error` naming the simulator, the rest finish, nothing
hangs), and trajectory shards a killed writer cannot corrupt (records appended whole, a torn
last line skipped with a warning)."""

import asyncio
import json
import logging
import re
import signal
import subprocess
import sys
from collections import Counter

import pytest

from envs.config import SimulatedShellConfig, TerminalConfig, TextopsConfig
from envs.simulated import SimulatedShell
from envs.textops import TextopsAnswerShell, generate_textops
from rl.data import ByteTokenizer, ChatRenderer
from rl.data.trajectory import Trajectory, load_trajectories, read_jsonl, validate
from rl.orchestrator.buffer import RolloutBuffer
from rl.orchestrator.config import OrchestratorConfig
from rl.orchestrator.runner import Backends, RolloutRunner
from rl.orchestrator.storage import TrajectoryWriter
from serving.client import ClientConfig, InferenceClient
from tests.fakes import FakeAgentClient, user_env, wait_until

RENDERER = ChatRenderer(ByteTokenizer())
TERMINAL = TerminalConfig(max_turns=4, command_timeout_s=10)


def _tasks(n, seed=0):
    return generate_textops(
        TextopsConfig(num_tasks=n, seed=seed, ops=["reverse", "upper"], from_file_prob=0.0)
    )


def _trained_staleness(traj: Trajectory, version: int) -> int:
    """How many versions the oldest generated token is behind the trainer at `version`."""
    gen = [v for v, m in zip(traj.policy_version, traj.loss_mask, strict=True) if m]
    return version - min(gen)


# ----- 1. bounded staleness ---------------------------------------------------------------------


async def test_async_run_trains_no_token_older_than_s_and_counts_dropped_stragglers():
    """S = 1, batches of 2 groups of 2. The fake policy serves whatever version the "trainer"
    last published, so versions advance while episodes are in flight. One episode of the first
    group is held in its shell until the trainer is at version 2: its first reply was sampled
    at version 0, so its group may not be trained on (2 > S) and is dropped, whole, and counted.
    """
    S, steps = 1, 4
    cfg = OrchestratorConfig(arm="real", group_size=2, batch_size=4, max_staleness=S, seed=0)
    tasks = _tasks(16)
    client = FakeAgentClient(tasks)
    release = asyncio.Event()
    shells = Counter()

    class Straggler(TextopsAnswerShell):
        async def run(self, command, timeout_s):
            await release.wait()
            return await super().run(command, timeout_s)

    def shell(task):
        shells[task.id] += 1
        first = task.id == buf.tasks[0].id and shells[task.id] == 1
        return Straggler(task) if first else TextopsAnswerShell(task)

    delivered: list[Trajectory] = []
    queue: asyncio.Queue = asyncio.Queue()
    runner = RolloutRunner(
        cfg,
        TERMINAL,
        RENDERER,
        Backends(real=shell),
        client=client,
        sinks=(delivered.append, queue.put_nowait),
    )
    buf = RolloutBuffer(runner, tasks, queue=queue, steps=steps, seed=3, batch_timeout_s=10)
    assert len({t.id for t in buf.tasks}) == len(buf.tasks)  # one group per task id
    straggler_group = f"g0-{buf.tasks[0].id}"
    trained, staleness = [], []
    await buf.start(0)
    try:
        for _ in range(steps):
            version = runner.admission.version
            batch = await buf.next_batch()
            trained += batch
            staleness += [_trained_staleness(t, version) for t in batch]
            sizes = Counter(t.group_id for t in batch)
            assert set(sizes.values()) == {2}, sizes  # whole groups only
            client.version = version + 1  # publish, then tell the buffer (as rl_loop does)
            await buf.set_version(version + 1)
            if version + 1 == 2:
                release.set()
                assert await wait_until(lambda: straggler_group in {t.group_id for t in delivered})
    finally:
        await buf.close()
    assert len(trained) == steps * 4 and max(staleness) <= S, staleness
    assert max(staleness) == S  # the bound was reached, not just trivially kept
    ours = [t for t in delivered if t.group_id == straggler_group]
    mixed = {v for t in ours for v in t.policy_version if v is not None}
    assert mixed == {0, 2}  # sampled before and after the trainer moved on
    assert straggler_group not in {t.group_id for t in trained}
    stale = [re.search(r"admitted (\d+) versions before", t.exclusion.reason) for t in ours]
    assert all(t.exclusion.kind == "stale" for t in ours)
    assert all(int(m[1]) in (2, 3) for m in stale)  # drawn by step 3 or 4: beyond S
    # Every delivered episode that exceeded the bound when its batch was drawn was dropped.
    assert buf.dropped_stale == runner.metrics.summary()["dropped_stale"] == len(ours) == 2
    assert {id(t) for t in delivered if t.exclusion} == {id(t) for t in ours}


async def test_a_group_with_one_stale_sibling_is_dropped_whole():
    """Siblings are admitted one by one and can straddle a version: the group is dropped
    whole, never split (a batch keeps whole groups: advantages are relative to siblings)."""
    cfg = OrchestratorConfig(arm="real", group_size=2, batch_size=2, max_staleness=1)
    queue: asyncio.Queue = asyncio.Queue()
    runner = RolloutRunner(
        cfg,
        TERMINAL,
        RENDERER,
        Backends(real=TextopsAnswerShell),
        client=FakeAgentClient([]),
        sinks=(queue.put_nowait,),
    )

    def episode(group, admitted):
        return Trajectory(
            task_id=group,
            arm="real",
            env_backend="local",
            status="ok",
            reward=1.0,
            group_id=group,
            admitted_version=admitted,
        )

    async def run(tasks, **_):
        for traj in (episode("old", 0), episode("old", 1), episode("new", 2), episode("new", 2)):
            queue.put_nowait(traj)  # as the runner delivers
        return []

    runner.run = run
    buf = RolloutBuffer(runner, _tasks(1), queue=queue, steps=1)
    await buf.start(0)
    await runner.admission.set_version(2)
    batch = await asyncio.wait_for(buf.next_batch(), 5)
    assert [t.group_id for t in batch] == ["new", "new"] and buf.dropped_stale == 2
    await buf.close()


# ----- 2. a simulator server killed mid-episode -------------------------------------------------

SIMULATOR = """
import asyncio, sys
from aiohttp import web

held = 0

async def complete(request):
    global held
    await request.json()
    held += 1
    await asyncio.Event().wait()  # never answers: every episode is mid-request when killed

async def count(request):
    return web.json_response({"held": held})

async def health(request):
    return web.json_response({})

async def main():
    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/held", count)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(site._server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.fixture
def simulator_process():
    env = user_env()
    proc = subprocess.Popen(
        [sys.executable, "-c", SIMULATOR], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        port = int(proc.stdout.readline())
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(timeout=10)


async def test_killed_simulator_ends_its_episodes_with_a_reason_and_the_rest_finish(
    simulator_process,
):
    proc, url = simulator_process
    tasks = _tasks(8)
    cfg = OrchestratorConfig(arm="mixed", mixed_real_fraction=0.5, seed=2, request_timeout_s=30)
    killed = asyncio.Event()
    waiting_real = []

    class RealAfterTheKill(TextopsAnswerShell):
        """A real shell whose command finishes only after the simulator died."""

        async def run(self, command, timeout_s):
            waiting_real.append(command)
            await killed.wait()
            return await super().run(command, timeout_s)

    client_cfg = ClientConfig(url, max_retries=1, backoff_s=0.01, timeout_s=30)
    async with InferenceClient(client_cfg) as sim_client:

        def simulated(task):
            return SimulatedShell(
                sim_client,
                task_instruction=task.instruction,
                setup=task.setup,
                config=SimulatedShellConfig(max_tokens=64, request_timeout_s=30),
                renderer=RENDERER,
            )

        delivered = []
        runner = RolloutRunner(
            cfg,
            TERMINAL,
            RENDERER,
            Backends(real=RealAfterTheKill, simulated=simulated),
            client=FakeAgentClient(tasks),
            sinks=(delivered.append,),
        )
        job = asyncio.create_task(runner.run(tasks), name="rollout")

        async def held() -> int:
            return (await sim_client.request("GET", "/held"))[0]["held"]

        # Every episode is mid-episode: real ones in their shell, simulated ones waiting on
        # the simulator (their agent turn was sampled). Counted, not slept for.
        for _ in range(1000):
            n_sim = await held()
            if n_sim + len(waiting_real) == len(tasks) or job.done():
                break
            await asyncio.sleep(0.01)
        assert 0 < n_sim < len(tasks) and n_sim + len(waiting_real) == len(tasks), job
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        killed.set()
        trajs = await asyncio.wait_for(job, 20)  # nothing hangs
    assert len(trajs) == len(delivered) == len(tasks)
    sim = [t for t in trajs if t.env_backend == "simulated"]
    real = [t for t in trajs if t.env_backend != "simulated"]
    assert len(sim) == n_sim and len(real) == len(tasks) - n_sim
    for t in trajs:
        validate(t)
    for t in sim:
        assert t.status == "error" and t.reward is None, (t.status, t.reason)
        assert "SimulatorError" in t.reason and "simulator request failed" in t.reason, t.reason
        (turn,) = t.turns  # the sampled reply stays in its turn, the observation never came
        assert turn.command and turn.observation is None
    assert all(t.status == "ok" and t.reward == 1.0 for t in real), [t.reason for t in real]
    assert runner.metrics.summary()["status"] == {"ok": len(real), "error": len(sim)}


# ----- 3. shards a killed writer cannot corrupt -------------------------------------------------


async def _episodes(n):
    tasks = _tasks(n)
    backends = Backends(real=TextopsAnswerShell)
    runner = RolloutRunner(
        OrchestratorConfig(arm="real"), TERMINAL, RENDERER, backends, client=FakeAgentClient(tasks)
    )
    return await runner.run(tasks)


async def test_writer_appends_each_record_whole_before_add_returns(tmp_path):
    trajs = await _episodes(5)
    writer = TrajectoryWriter(tmp_path, shard_size=3)
    shard = tmp_path / "trajectories" / "rollout-00000.jsonl"
    for i, traj in enumerate(trajs[:3]):
        writer.add(traj)
        # On disk at once, whole: what a SIGKILL right now would leave.
        assert [t.task_id for t in read_jsonl(shard)] == [t.task_id for t in trajs[: i + 1]]
    assert (tmp_path / "trajectories" / "rollout-00000.array_record").exists()  # shard complete
    writer.add(trajs[3])  # the next shard, then the job is "killed": no close()
    # A second writer on the run directory never appends to the dead one's shard.
    again = TrajectoryWriter(tmp_path, shard_size=3)
    again.add(trajs[4])
    again.close()
    names = sorted(p.name for p in (tmp_path / "trajectories").glob("*.jsonl"))
    assert names == ["rollout-00000.jsonl", "rollout-00001.jsonl", "rollout-00002.jsonl"]
    loaded = load_trajectories([tmp_path / "trajectories"])
    assert [t.task_id for t in loaded] == [t.task_id for t in trajs]


async def test_a_torn_last_record_is_skipped_with_a_warning_and_nothing_else_is(tmp_path, caplog):
    trajs = await _episodes(2)
    writer = TrajectoryWriter(tmp_path)
    for t in trajs:
        writer.add(t)
    shard = writer.paths[0]
    whole = shard.read_bytes()
    line = (json.dumps(trajs[0].to_dict(), ensure_ascii=False) + "\n").encode()
    cut = "日".encode()[:2]  # the kill can cut a character in half, too
    for torn in (line[: len(line) // 2], line[:-2], b'{"schema": 1, "task_id": "x' + cut):
        shard.write_bytes(whole + torn)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rl.data.trajectory"):
            assert [t.task_id for t in read_jsonl(shard)] == [t.task_id for t in trajs]
        assert f"{shard}:3: skipped a torn last record ({len(torn)} bytes)" in caplog.text
    # A broken line that is not the torn end of the file is corruption: an error naming it.
    shard.write_bytes(line[: len(line) // 2] + b"\n" + whole)
    with pytest.raises(ValueError, match=r"rollout-00000\.jsonl:1: "):
        read_jsonl(shard)
