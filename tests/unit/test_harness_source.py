"""rl/orchestrator/harness.py `HarnessSource`: harness rollouts under `max_staleness` as every
other arm runs (admission by whole groups, stale groups dropped and counted), with a runner
that stands in for the sandboxes and the middleware (the real ones: tests/integration)."""

from __future__ import annotations

import asyncio

import pytest

from envs.tasks import Task
from rl.data.trajectory import Trajectory, Turn
from rl.orchestrator.harness import HarnessResult, HarnessSource


class Runner:
    """Runs a group as soon as asked, or when `release` lets it; each rollout's middleware
    writes `segments` trajectories for it, through the source's sink."""

    def __init__(self, *, segments: int = 1, gate: bool = False):
        self.segments, self.source = segments, None
        self.started: list[tuple[str, int]] = []  # (group, version the source was at)
        self.made: list[Trajectory] = []
        self.gate = asyncio.Event()
        if not gate:
            self.gate.set()

    async def run_group(self, task: Task, group: str, n: int) -> list[HarnessResult]:
        self.started.append((group, self.source.version))
        await self.gate.wait()
        out = []
        for i in range(n):
            rid = f"{task.id}.{group}.{i}"
            trajs = []
            for s in range(self.segments):
                ids = [1, 2, 3, 4, 5]
                trajs.append(
                    Trajectory(
                        task_id=task.id,
                        arm="real",
                        env_backend="local",
                        status="ok",
                        reward=float(i % 2),
                        group_id=group,
                        rollout_id=rid,
                        turns=[Turn(agent_text=f"s{s}", token_span=(3, 5))],
                        source="sampler",
                        token_ids=ids,
                        loss_mask=[0, 0, 0, 1, 1],
                        behavior_logprobs=[None, None, None, -0.5, -0.5],
                        policy_version=[None, None, None, 1, 1],
                        tokenizer="byte",
                    )
                )
            self.source.collect(trajs)
            self.made += trajs
            out.append(HarnessResult(rid, task.id, group, float(i % 2), "ok", None, 0, 0.1, ""))
        return out


def make_source(runner: Runner, *, max_staleness: int, steps: int = 4, rows: int = 4, **kw):
    tasks = [Task(id=f"t{i}", instruction="fix it") for i in range(3)]
    source = HarnessSource(
        runner,
        tasks,
        group_size=2,
        groups=2,
        rows=rows,
        seq_len=kw.pop("seq_len", 64),
        steps=steps,
        max_staleness=max_staleness,
        seed=0,
    )
    runner.source = source
    return source


async def settle():
    for _ in range(20):
        await asyncio.sleep(0)


async def test_synchronous_source_starts_each_batch_only_at_its_version():
    runner = Runner()
    source = make_source(runner, max_staleness=0)
    await source.start(1)
    await settle()
    assert [v for _, v in runner.started] == [1, 1]  # one batch (2 groups), no more
    batch = await source.next_batch()
    assert len(batch) == 4 and {t.admitted_version for t in batch} == {1}
    await settle()
    assert len(runner.started) == 2  # the next batch waits for the next version
    await source.set_version(2)
    await settle()
    assert [v for _, v in runner.started] == [1, 1, 2, 2]
    assert {t.admitted_version for t in await source.next_batch()} == {2}
    await source.close()


async def test_with_staleness_one_the_next_batch_runs_ahead_and_a_late_group_is_dropped():
    runner = Runner(gate=True)
    source = make_source(runner, max_staleness=1)
    await source.start(1)
    await settle()
    assert [v for _, v in runner.started] == [1, 1, 1, 1]  # two batches run ahead
    # The trainer moves on twice before any of them finishes: all four are now 2 versions
    # old, beyond S = 1, and their places go to fresh groups at version 3.
    await source.set_version(2)
    await source.set_version(3)
    runner.gate.set()
    batch = await source.next_batch()
    assert len(batch) == 4 and {t.admitted_version for t in batch} == {3}
    # Whole groups were dropped (counted by rollout), every one of them admitted at v1.
    stale = [t for t in runner.made if t.exclusion and t.exclusion.kind == "stale"]
    assert source.dropped_stale == len(stale) >= 4 and len(stale) % 2 == 0
    assert {t.admitted_version for t in stale} == {1}
    assert (
        "admitted 2 versions before the trainer's 3; max_staleness=1" in stale[0].exclusion.reason
    )
    await source.close()


async def test_a_batch_with_more_segments_than_rows_packs_them_and_drops_none():
    runner = Runner(segments=3)  # 4 rollouts x 3 segments of 4 positions, in 4 rows of 16
    source = make_source(runner, max_staleness=0, seq_len=16)
    await source.start(1)
    batch = await source.next_batch()
    assert len(batch) == 12 and source.dropped_segments == 0
    assert all(t.exclusion is None for t in batch)
    await source.close()
    # rows of 8 hold two segments each: 4 rollouts need 8 rows, so 4 segments stay out
    runner = Runner(segments=3)
    source = make_source(runner, max_staleness=0, seq_len=8)
    await source.start(1)
    batch = await source.next_batch()
    assert source.dropped_segments == 4
    assert sum(t.exclusion is not None and t.exclusion.kind == "over_rows" for t in batch) == 4
    await source.close()


async def test_a_failing_group_surfaces_from_next_batch():
    class Broken(Runner):
        async def run_group(self, task, group, n):
            raise OSError("sandbox backend is gone")

    runner = Broken()
    source = make_source(runner, max_staleness=0)
    await source.start(1)
    with pytest.raises(RuntimeError, match="a harness group failed: sandbox backend is gone"):
        await source.next_batch()
    await source.close()


async def test_no_more_groups_start_than_the_steps_train():
    runner = Runner()
    source = make_source(runner, max_staleness=2, steps=2)  # 2 steps x 2 groups
    await source.start(1)
    await settle()
    assert len(runner.started) == 4  # S = 2 would let 6 start; 2 steps train only 4
    await source.next_batch()
    await source.set_version(2)
    await source.next_batch()
    await settle()
    assert len(runner.started) == 4
    await source.close()
