"""The rollout buffer: live rollouts as the RL trainer's episode source (bounded staleness).

Components: `RolloutBuffer.start()` runs `RolloutRunner.run(tasks)` as a background task; the
runner delivers whole groups to its sinks, one of them the queue the buffer reads (the caller
builds the runner with `sinks=(writer.add, queue.put_nowait)` and hands the buffer `queue=`;
the buffer never rewires a runner);
`next_batch()` hands the trainer `batch_size` episodes in which every generated token is at
most S versions older than the version this buffer last heard of (admission bounds staleness
only when an episode starts: stragglers beyond the bound are dropped, by whole group, and
counted); with the trainer's publish overlapping its next step (`rl_loop(overlap_publish)`)
that version lags the trainer's by one while a publish is in flight, so the trainer may see
S + 1;
`set_version(v)` moves the admission controller, which lets the next episodes start (S = 0:
exactly one batch per version).
The trainer never waits forever: a failed rollout task surfaces its exception from
`next_batch()`, and `close()` cancels what is left within a bounded grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Sequence

from envs.tasks import Task
from rl.data.trajectory import Exclusion, Trajectory
from rl.orchestrator.runner import RolloutRunner

CLOSE_GRACE_S = 15.0
log = logging.getLogger(__name__)


def task_stream(tasks: Sequence[Task], groups: int, seed: int) -> list[Task]:
    """`groups` tasks drawn epoch by epoch (each epoch a fresh shuffle of `tasks`)."""
    if not tasks:
        raise ValueError("no tasks to roll out")
    rng = random.Random(seed)
    out: list[Task] = []
    while len(out) < groups:
        epoch = list(tasks)
        rng.shuffle(epoch)
        out += epoch
    return out[:groups]


def stale_exclusion(worst: int, now: int, bound: int) -> Exclusion:
    """Why a group admitted `worst` versions before the trainer's `now` is not trained."""
    return Exclusion(
        "stale",
        f"its group was admitted {worst} versions before the trainer's {now}; "
        f"max_staleness={bound}",
    )


class RolloutBuffer:
    """`EpisodeSource` (rl/train/rollouts.py) over a `RolloutRunner` that delivers into
    `queue` (one of the runner's sinks is `queue.put_nowait`).

    Without `queue` (the older form, still used by bench/train_step.py), the buffer runs a copy
    of `runner` (`with_sinks`: same client, admission and metrics) that delivers to the runner's
    sinks, then `sink`, then a queue of its own; `runner` itself is left as it was."""

    def __init__(
        self,
        runner: RolloutRunner,
        tasks: Sequence[Task],
        *,
        steps: int,
        queue: asyncio.Queue[Trajectory] | None = None,
        seed: int = 0,
        sink: Callable[[Trajectory], None] | None = None,
        batch_timeout_s: float | None = None,
    ):
        cfg = runner.cfg
        if cfg.batch_size % cfg.group_size:
            raise ValueError(
                f"orchestrator.batch_size={cfg.batch_size} must be a multiple of "
                f"orchestrator.group_size={cfg.group_size}: a batch holds whole groups"
            )
        if cfg.max_staleness is None:
            raise ValueError("RL needs orchestrator.max_staleness (0 = synchronous)")
        if queue is None:
            queue = asyncio.Queue()
            runner = runner.with_sinks(*runner.sinks, *([sink] if sink else []), queue.put_nowait)
        elif sink is not None:
            raise ValueError(
                "sink= goes with the older form (no queue=): give the runner "
                "its sinks, RolloutRunner(..., sinks=(sink, queue.put_nowait))"
            )
        elif queue.put_nowait not in runner.sinks:
            raise ValueError(
                "the runner does not deliver to the buffer's queue: build it with "
                "RolloutRunner(..., sinks=(..., queue.put_nowait))"
            )
        self.runner, self.batch_size = runner, cfg.batch_size
        groups_per_batch = cfg.batch_size // cfg.group_size
        # Enough groups for every step plus, with S > 0, what the staleness bound lets start
        # early and what replaces stale groups. Synchronous RL (S = 0) drops nothing: exactly
        # one batch per step, and none started after the last (never trained, yet it cost
        # real shells).
        extra = cfg.max_staleness + 1 if cfg.max_staleness else 0
        self.tasks = task_stream(tasks, (steps + extra) * groups_per_batch, seed)
        self.batch_timeout_s = batch_timeout_s
        self._queue = queue
        self._task: asyncio.Task | None = None

    @property
    def admission(self):
        return self.runner.admission

    async def start(self, version: int) -> None:
        """Start rolling out under policy `version` (the one the servers serve now)."""
        self.admission.rebase(version)
        self._task = asyncio.create_task(self.runner.run(self.tasks), name="rollout-buffer")

    async def next_batch(self) -> list[Trajectory]:
        if self._task is None:
            raise RuntimeError("RolloutBuffer.start() was not called")
        batch: list[Trajectory] = []
        while len(batch) < self.batch_size:
            if self._queue.empty() and self._task.done():
                self._task.result()  # raises the rollout's exception, if any
                raise RuntimeError(
                    f"rollouts ended after delivering everything ({len(batch)} episodes left "
                    f"for a batch of {self.batch_size}): more steps than tasks planned"
                )
            get = asyncio.create_task(self._queue.get(), name="rollout-buffer-get")
            done, _ = await asyncio.wait(
                {get, self._task}, timeout=self.batch_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            if get in done:
                group = self._rest_of_group(get.result())
                if not await self._drop_if_stale(group):
                    batch += group
                continue
            get.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await get
            if not done:
                raise TimeoutError(
                    f"no episode arrived within {self.batch_timeout_s}s "
                    f"({len(batch)}/{self.batch_size} of the batch collected)"
                )
        return batch

    def _rest_of_group(self, first: Trajectory) -> list[Trajectory]:
        """`first` and its siblings: the runner delivers a group's episodes one after the other
        without yielding, so they are all queued already."""
        group = [first]
        while len(group) < self.runner.cfg.group_size and not self._queue.empty():
            group.append(self._queue.get_nowait())
        return group

    async def _drop_if_stale(self, group: list[Trajectory]) -> bool:
        """Admission bounds staleness when an episode starts; a straggler can still finish
        after newer episodes filled later batches. Such a group is not trained on (dropped
        whole: group-relative advantages need every sibling): it is counted in
        `metrics.dropped_stale`, marked with a `stale` exclusion (in memory: the writer stored
        it when it finished) and its admission slots are given back. The servers serve the trainer's
        version before it moves on (the trainer publishes, then calls `set_version`), so an
        episode's tokens are no older than its admission and the bound holds for every token."""
        now, bound = self.admission.version, self.admission.max_staleness
        worst = max(
            now - (now if t.admitted_version is None else t.admitted_version) for t in group
        )
        if worst <= bound:
            return False
        stale = stale_exclusion(worst, now, bound)
        for traj in group:
            traj.exclusion = traj.exclusion or stale
            await self.admission.release()  # its place goes to a fresh episode
        self.runner.metrics.dropped_stale += len(group)
        log.info(
            "dropped %d episode(s) of group %s: admitted %d versions ago, max_staleness=%d",
            len(group),
            group[0].group_id,
            worst,
            bound,
        )
        return True

    @property
    def dropped_stale(self) -> int:
        return self.runner.metrics.dropped_stale

    async def set_version(self, version: int) -> None:
        await self.admission.set_version(version)

    async def close(self) -> None:
        if self._task is None or self._task.done():
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({self._task}, timeout=CLOSE_GRACE_S)
