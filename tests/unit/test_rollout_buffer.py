"""The rollout buffer: live rollouts as the trainer's episode source. Admission by staleness
bound (S = 0: exactly one batch per version), batches of whole groups, the seeded task stream,
failing agents, a crashed rollout task, the batch timeout, bounded close, and the sinks (the
runner's own, which the buffer reads through its queue and never rewires).

Episodes run `FakeAgentClient` (plays textops) against an in-memory shell, so no process starts.
"""

import asyncio
import time
from collections import Counter

import pytest

from envs.config import TerminalConfig, TextopsConfig
from envs.textops import TextopsAnswerShell, generate_textops
from rl.data import ByteTokenizer, ChatRenderer
from rl.data.tokenizer import IM_START
from rl.data.trajectory import validate
from rl.orchestrator import buffer as buffer_module
from rl.orchestrator.buffer import RolloutBuffer, task_stream
from rl.orchestrator.config import OrchestratorConfig
from rl.orchestrator.runner import Backends, RolloutRunner
from tests.fakes import FakeAgentClient, wait_until

TOK = ByteTokenizer()
RENDERER = ChatRenderer(TOK)
TERMINAL = TerminalConfig(max_turns=4, command_timeout_s=10)


class HangingClient:
    """An agent server that never answers (until cancelled)."""

    def __init__(self):
        self.calls = 0

    async def complete(self, prompt, **_):
        self.calls += 1
        await asyncio.Event().wait()


def _tasks(n=4, seed=0):
    return generate_textops(TextopsConfig(num_tasks=n, seed=seed))


def _cfg(**kw) -> OrchestratorConfig:
    base = dict(arm="real", group_size=2, batch_size=4, max_staleness=0, seed=0)
    return OrchestratorConfig(**{**base, **kw})


def _runner(cfg, client, *sinks) -> tuple[RolloutRunner, asyncio.Queue]:
    """A runner delivering to `sinks`, then to the returned queue (the buffer's)."""
    queue: asyncio.Queue = asyncio.Queue()
    runner = RolloutRunner(
        cfg,
        TERMINAL,
        RENDERER,
        Backends(real=TextopsAnswerShell),
        client=client,
        sinks=(*sinks, queue.put_nowait),
    )
    return runner, queue


def _buffer(cfg, client, tasks, *sinks, **kw) -> RolloutBuffer:
    runner, queue = _runner(cfg, client, *sinks)
    return RolloutBuffer(runner, tasks, queue=queue, **kw)


def _first_turns(client: FakeAgentClient) -> int:
    """Episodes the agent server has seen start (requests for a first reply)."""
    return sum(TOK.decode(p).count(f"{IM_START}assistant") == 1 for p, _ in client.replies)


def _whole_groups(batch, group_size: int, buffer: RolloutBuffer) -> set[str]:
    """The batch's group ids, after checking each group is complete and plays the task the
    buffer's stream put at that position."""
    sizes = Counter(t.group_id for t in batch)
    assert set(sizes.values()) == {group_size}, sizes
    for t in batch:
        g = int(t.group_id.split("-", 1)[0][1:])  # "g{index}-{task id}"
        assert buffer.tasks[g].id == t.task_id
    assert sorted(t.group_index for t in batch) == sorted(list(range(group_size)) * len(sizes))
    return set(sizes)


def _pending_tasks() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]


# ----- admission and batches ----------------------------------------------------------------


async def test_synchronous_buffer_starts_exactly_one_batch_per_version():
    tasks = _tasks(4)
    client = FakeAgentClient(tasks)
    seen = []
    runner, queue = _runner(_cfg(max_staleness=0), client, seen.append)
    buf = RolloutBuffer(runner, tasks, queue=queue, steps=2, seed=0, batch_timeout_s=10)
    assert runner.sinks == (seen.append, queue.put_nowait)  # the buffer left them as built
    await buf.start(0)
    try:
        assert await wait_until(lambda: len(seen) == 4)
        await asyncio.sleep(0.1)  # room for a fifth episode to start, if it were allowed
        assert runner.admission.started == 4 and _first_turns(client) == 4
        first = await buf.next_batch()
        assert len(first) == 4
        groups = _whole_groups(first, 2, buf)
        assert len(groups) == 2
        for t in first:
            validate(t)
            assert t.status == "ok" and t.reward == 1.0, (t.status, t.reason)
            assert t.admitted_version == 0 and t.exclusion is None
        assert runner.admission.started == 4 and _first_turns(client) == 4

        await buf.set_version(1)
        second = await buf.next_batch()
        assert len(second) == 4 and runner.admission.started == 8 and _first_turns(client) == 8
        assert len(_whole_groups(second, 2, buf) | groups) == 4  # new groups
        assert all(t.admitted_version == 1 for t in second)
        assert [id(t) for t in seen] == [id(t) for t in first + second]  # the sink saw all

        # steps=2 at S=0 plans exactly two batches: after the last step nothing more starts
        # (it would never be trained on), and a third request ends with an error, not a hang.
        await buf.set_version(2)
        await asyncio.sleep(0.1)  # room for a ninth episode to start, if it were allowed
        assert runner.admission.started == 8 and _first_turns(client) == 8
        with pytest.raises(RuntimeError, match="rollouts ended"):
            await asyncio.wait_for(buf.next_batch(), 5)
    finally:
        await buf.close()


async def test_staleness_one_lets_two_batches_start_before_the_first_step():
    tasks = _tasks(4)
    client = FakeAgentClient(tasks)
    runner, queue = _runner(_cfg(max_staleness=1), client)
    buf = RolloutBuffer(runner, tasks, queue=queue, steps=1, seed=0, batch_timeout_s=10)
    assert len(buf.tasks) == (1 + 1 + 1) * 2  # (steps + S + 1) batches of 2 groups
    await buf.start(0)
    try:
        first, second = await buf.next_batch(), await buf.next_batch()
        await asyncio.sleep(0.1)
        assert runner.admission.started == 8 and _first_turns(client) == 8
        assert len(_whole_groups(first, 2, buf) | _whole_groups(second, 2, buf)) == 4
        assert all(t.admitted_version == 0 for t in first + second)
        await buf.set_version(1)
        third = await buf.next_batch()
        assert runner.admission.started == 12
        assert all(t.admitted_version == 1 for t in third)
    finally:
        await buf.close()


def test_batch_size_must_hold_whole_groups():
    tasks = _tasks(2)
    runner, queue = _runner(_cfg(group_size=2, batch_size=5), FakeAgentClient(tasks))
    with pytest.raises(ValueError, match=r"batch_size=5.*group_size=2"):
        RolloutBuffer(runner, tasks, queue=queue, steps=1)


def test_rl_needs_a_staleness_bound():
    tasks = _tasks(2)
    runner, queue = _runner(_cfg(max_staleness=None), FakeAgentClient(tasks))
    with pytest.raises(ValueError, match="max_staleness"):
        RolloutBuffer(runner, tasks, queue=queue, steps=1)


def test_the_buffer_refuses_a_runner_that_does_not_deliver_to_its_queue():
    tasks = _tasks(2)
    runner, mine = _runner(_cfg(), FakeAgentClient(tasks))
    other: asyncio.Queue = asyncio.Queue()
    with pytest.raises(ValueError, match=r"sinks=\(\.\.\., queue\.put_nowait\)"):
        RolloutBuffer(runner, tasks, queue=other, steps=1)
    assert len(runner.sinks) == 1 and other.put_nowait not in runner.sinks  # nothing rewired
    with pytest.raises(ValueError, match="sink= goes with the older form"):
        RolloutBuffer(runner, tasks, queue=mine, steps=1, sink=print)


async def test_the_older_form_runs_a_copy_that_keeps_the_runners_own_sinks():
    """`RolloutBuffer(runner, tasks, sink=...)` without a queue (bench/train_step.py): the
    buffer runs a copy sharing admission and metrics; the caller's runner and its sinks stay
    as built, and its own sink still sees every episode (the old buffer replaced it)."""
    tasks = _tasks(2)
    own, extra = [], []
    runner, _ = _runner(_cfg(), FakeAgentClient(tasks), own.append)
    before = runner.sinks
    buf = RolloutBuffer(runner, tasks, steps=1, sink=extra.append, batch_timeout_s=10)
    assert runner.sinks == before and buf.runner is not runner
    assert buf.admission is runner.admission and buf.runner.metrics is runner.metrics
    await buf.start(0)
    try:
        batch = await buf.next_batch()
    finally:
        await buf.close()
    assert [id(t) for t in own] == [id(t) for t in extra] and len(batch) == 4
    assert {id(t) for t in batch} <= {id(t) for t in own}


async def test_next_batch_before_start_is_an_error():
    tasks = _tasks(2)
    buf = _buffer(_cfg(), FakeAgentClient(tasks), tasks, steps=1)
    with pytest.raises(RuntimeError, match="start"):
        await buf.next_batch()


# ----- the task stream ----------------------------------------------------------------------


def test_task_stream_covers_every_task_once_per_shuffled_epoch():
    tasks = _tasks(8)
    ids = sorted(t.id for t in tasks)
    stream = task_stream(tasks, 3 * 8 + 3, seed=7)
    assert len(stream) == 27
    epochs = [[t.id for t in stream[i : i + 8]] for i in range(0, 24, 8)]
    for epoch in epochs:
        assert sorted(epoch) == ids  # each task once
    assert len({tuple(e) for e in epochs} | {tuple(t.id for t in tasks)}) > 2  # shuffled
    tail = [t.id for t in stream[24:]]
    assert len(set(tail)) == 3  # a partial epoch repeats nothing either


def test_task_stream_is_deterministic_by_seed():
    tasks = _tasks(8)
    a = [t.id for t in task_stream(tasks, 20, seed=1)]
    assert a == [t.id for t in task_stream(tasks, 20, seed=1)]
    assert a[:5] == [t.id for t in task_stream(tasks, 5, seed=1)]  # a prefix of the same draw
    assert a != [t.id for t in task_stream(tasks, 20, seed=2)]
    assert task_stream(tasks, 0, seed=1) == []
    with pytest.raises(ValueError, match="no tasks"):
        task_stream([], 3, seed=0)


def test_buffer_draws_its_groups_from_the_seeded_stream():
    tasks = _tasks(3)
    buf = _buffer(_cfg(max_staleness=2), FakeAgentClient(tasks), tasks, steps=4, seed=11)
    want = task_stream(tasks, (4 + 2 + 1) * 2, seed=11)
    assert [t.id for t in buf.tasks] == [t.id for t in want]


# ----- faults: the trainer never waits forever ----------------------------------------------


async def test_an_agent_that_always_fails_still_delivers_masked_groups():
    tasks = _tasks(1)
    client = FakeAgentClient(tasks, fail_task=tasks[0].id)  # every request raises a 503
    buf = _buffer(_cfg(), client, tasks, steps=1, batch_timeout_s=10)
    await buf.start(0)
    try:
        batch = await buf.next_batch()
    finally:
        await buf.close()
    assert len(batch) == 4 and len(_whole_groups(batch, 2, buf)) == 2
    for t in batch:
        validate(t)
        assert t.status == "error" and "503" in t.reason
        assert t.exclusion.kind == "masked_group" and "failed" in t.exclusion.reason
    assert client.calls == 4  # one failed request per episode


async def test_a_crashed_rollout_task_surfaces_from_next_batch():
    tasks = _tasks(2)
    runner, queue = _runner(_cfg(), FakeAgentClient(tasks))

    async def crash(tasks, **_):
        await asyncio.sleep(0.05)  # next_batch is already waiting
        raise KeyError("rollout bookkeeping broke")

    runner.run = crash
    buf = RolloutBuffer(runner, tasks, queue=queue, steps=1, batch_timeout_s=30)
    await buf.start(0)
    started = time.perf_counter()
    with pytest.raises(KeyError, match="bookkeeping"):
        await asyncio.wait_for(buf.next_batch(), 10)
    assert time.perf_counter() - started < 5
    with pytest.raises(KeyError):  # and again: the error does not get lost
        await asyncio.wait_for(buf.next_batch(), 10)
    await buf.close()


async def test_a_failing_sink_crashes_the_rollout_and_next_batch_raises_it():
    tasks = _tasks(2)

    def full_disk(traj):
        raise OSError("No space left on device")

    buf = _buffer(_cfg(), FakeAgentClient(tasks), tasks, full_disk, steps=1, batch_timeout_s=30)
    await buf.start(0)
    started = time.perf_counter()
    with pytest.raises(OSError, match="No space left"):
        await asyncio.wait_for(buf.next_batch(), 20)
    assert time.perf_counter() - started < 15
    await buf.close()
    assert not _pending_tasks()


async def test_batch_timeout_when_nothing_arrives_then_close_is_bounded():
    tasks = _tasks(2)
    client = HangingClient()
    seen = []
    buf = _buffer(_cfg(), client, tasks, seen.append, steps=1, batch_timeout_s=0.2)
    await buf.start(0)
    started = time.perf_counter()
    with pytest.raises(TimeoutError, match=r"no episode arrived within 0.2s \(0/4"):
        await buf.next_batch()
    assert 0.2 <= time.perf_counter() - started < 5
    assert await wait_until(lambda: client.calls == 4, timeout_s=5)

    started = time.perf_counter()
    await buf.close()
    assert time.perf_counter() - started < buffer_module.CLOSE_GRACE_S
    assert buf._task.done() and not _pending_tasks()
    # Cancelled episodes still end as trajectories: aborted, with a reason, through the sink.
    assert len(seen) == 4 and all(t.status == "aborted" and t.reason for t in seen)
    await buf.close()  # idempotent


async def test_close_gives_up_after_the_grace_period(monkeypatch):
    monkeypatch.setattr(buffer_module, "CLOSE_GRACE_S", 0.3)
    tasks = _tasks(2)
    runner, queue = _runner(_cfg(), FakeAgentClient(tasks))
    release = asyncio.Event()

    async def stubborn(tasks, **_):
        while not release.is_set():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                await release.wait()  # ignores cancellation until the test lets go
        return []

    runner.run = stubborn
    buf = RolloutBuffer(runner, tasks, queue=queue, steps=1)
    await buf.start(0)
    await asyncio.sleep(0.05)
    started = time.perf_counter()
    await buf.close()
    assert 0.3 <= time.perf_counter() - started < 2
    release.set()
    await asyncio.wait_for(buf._task, 1)


async def test_starting_at_a_later_version_still_admits_one_batch_at_s0():
    tasks = _tasks(4)
    client = FakeAgentClient(tasks)
    seen = []
    runner, queue = _runner(_cfg(max_staleness=0), client, seen.append)
    buf = RolloutBuffer(runner, tasks, queue=queue, steps=2, seed=0, batch_timeout_s=10)
    await buf.start(1)  # as launch/train.py does: the starting policy is version 1
    try:
        assert await wait_until(lambda: len(seen) >= 4)
        await asyncio.sleep(0.1)
        assert runner.admission.started == 4 and _first_turns(client) == 4
    finally:
        await buf.close()


async def test_admission_takes_a_whole_group_at_once_or_waits():
    from rl.orchestrator.admission import AdmissionController

    adm = AdmissionController(batch_size=4, max_staleness=0, version=1)
    assert await adm.admit(3) == 1 and adm.started == 3
    waiting = asyncio.create_task(adm.admit(2))  # 3 + 2 > 4: waits for the next version
    await asyncio.sleep(0)
    assert not waiting.done() and adm.started == 3
    assert await adm.admit(1) == 1 and adm.started == 4
    await adm.set_version(2)
    assert await asyncio.wait_for(waiting, 5.0) == 2 and adm.started == 6
