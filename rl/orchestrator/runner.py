"""The rollout runner: many concurrent episodes, grouped by task, within limits.

Components (who calls whom): `RolloutRunner.run(tasks)` -> one asyncio task per group ->
`AdmissionController.admit()` (staleness bound) -> per-episode semaphores (in flight, real
shells, simulator) -> `episode.run_agent_episode` / `run_replay_episode` -> `RolloutMetrics`
and the `sink` callback (storage). The runner owns no servers or shells: it is handed a client
and shell factories, so tests can hand it in-memory ones. The client may be a
`serving.pool.ReplicaPool` (each episode sticks to one replica; the pool's state lands in the
metrics as `pools.agent`); an episode whose replica goes down ends `aborted` with the reason.
The `gated` arm decides each group's shell when the group is admitted
(`rl.orchestrator.gate.FidelityRouter`), and hands every real episode to the
`ShadowReplayer`, which measures the simulator on it in the background.

Failed siblings: when an episode of a group ends `error`/`aborted`/`timeout`, the configured
policy excludes either the whole group (`exclusion.kind = "masked_group"`, the default:
group-relative advantages need every sibling) or that episode alone (`"dropped"`). Trajectories
are always delivered, marked, never silently dropped.

Sinks: the runner hands every trajectory to each of the `sinks` it was built with, in order
(storage first, then e.g. `RolloutBuffer`'s queue); nothing replaces them later.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence

from envs.backends import Backends
from envs.config import TerminalConfig
from envs.tasks import Task
from rl.data.chat import ChatRenderer
from rl.data.outcome import unshaped_reward
from rl.data.trajectory import Exclusion, Trajectory
from rl.orchestrator.admission import AdmissionController
from rl.orchestrator.config import OrchestratorConfig
from rl.orchestrator.episode import (
    AgentClient,
    EpisodeResult,
    EpisodeSpec,
    run_agent_episode,
    run_replay_episode,
)
from rl.orchestrator.gate import FidelityRouter, ShadowReplayer, unit_of
from rl.orchestrator.metrics import RolloutMetrics
from serving.pool import ReplicaPool

FAILED = ("error", "aborted", "timeout")
SHUTDOWN_GRACE_S = 10.0


class RolloutRunner:
    def __init__(
        self,
        cfg: OrchestratorConfig,
        terminal: TerminalConfig,
        renderer: ChatRenderer,
        backends: Backends,
        *,
        client: AgentClient | None = None,
        admission: AdmissionController | None = None,
        metrics: RolloutMetrics | None = None,
        sinks: Sequence[Callable[[Trajectory], None]] = (),
        router: FidelityRouter | None = None,
        shadow: ShadowReplayer | None = None,
    ):
        self.cfg, self.terminal, self.renderer = cfg, terminal, renderer
        self.backends, self.client = backends, client
        self.sinks = tuple(sinks)
        """Where each trajectory goes, in order; fixed at construction."""
        self.router, self.shadow = router, shadow
        self.admission = admission or AdmissionController(cfg.batch_size, cfg.max_staleness)
        self.metrics = metrics or RolloutMetrics()
        if isinstance(client, ReplicaPool):
            self.metrics.pools.setdefault(client.role, client)
        self._in_flight = asyncio.Semaphore(cfg.max_concurrent_episodes)
        self._real = asyncio.Semaphore(cfg.max_concurrent_real)
        self._sim = asyncio.Semaphore(cfg.max_concurrent_simulated)
        self._rng = random.Random(cfg.seed)
        self._check()

    def with_sinks(self, *sinks: Callable[[Trajectory], None]) -> RolloutRunner:
        """A new runner like this one (the same config, client, admission, metrics, router and
        shadow) that delivers to `sinks`; this one is left as it was."""
        return RolloutRunner(
            self.cfg,
            self.terminal,
            self.renderer,
            self.backends,
            client=self.client,
            admission=self.admission,
            metrics=self.metrics,
            sinks=sinks,
            router=self.router,
            shadow=self.shadow,
        )

    def _check(self) -> None:
        arm, b = self.cfg.arm, self.backends
        need_real = arm in ("real", "mixed", "gated")
        need_sim = arm in ("closed_loop", "replay", "mixed", "gated")
        if arm == "gated" and self.router is None:
            raise ValueError("arm 'gated' needs a FidelityRouter (rl.orchestrator.gate)")
        if need_real and b.real is None:
            raise ValueError(f"arm {arm!r} needs a real shell backend")
        if need_sim and b.simulated is None:
            raise ValueError(f"arm {arm!r} needs the simulated shell (a simulator server)")
        if arm != "replay" and self.client is None:
            raise ValueError(f"arm {arm!r} needs an agent client")

    async def run(
        self,
        tasks: Sequence[Task],
        *,
        replay: Sequence[Trajectory] | None = None,
    ) -> list[Trajectory]:
        """Run every task's group (or, for `replay`, every recorded trajectory) to the end.
        The trajectories come back in the order of `tasks` (or `replay`), whatever order the
        episodes finished in, so what is built from them (e.g. SFT data) is reproducible."""
        jobs: list[asyncio.Task] = []
        if self.cfg.arm == "replay":
            if replay is None:
                raise ValueError("the replay arm needs recorded trajectories (`replay=`)")
            by_id = {t.id: t for t in tasks}
            for i, real in enumerate(replay):
                task = by_id.get(real.task_id) or _task_of(real)
                jobs.append(
                    asyncio.create_task(
                        self._replay(real, task, f"replay-{i}"), name=f"replay-{i}-{real.task_id}"
                    )
                )
        else:
            for g, task in enumerate(tasks):
                arm = self._group_arm()
                jobs.append(
                    asyncio.create_task(
                        self._group(task, arm, f"g{g}-{task.id}"), name=f"group-{g}-{task.id}"
                    )
                )
        try:
            groups = await asyncio.gather(*jobs)  # the first failure surfaces at once
        finally:
            for job in jobs:
                job.cancel()
            # Bounded shutdown: cancelled groups still deliver their aborted trajectories.
            await asyncio.wait(jobs, timeout=SHUTDOWN_GRACE_S)
        return [t for group in groups for t in group]

    def _group_arm(self) -> str:
        if self.cfg.arm != "mixed":
            return self.cfg.arm
        return "real" if self._rng.random() < self.cfg.mixed_real_fraction else "closed_loop"

    async def _group(self, task: Task, arm: str, group_id: str) -> list[Trajectory]:
        admitted = None
        if arm == "gated":  # decided when the whole group may start, from the fidelity of then
            admitted = await self.admission.admit(self.cfg.group_size)
            arm = self.router.route(task, admitted)
        episodes = [
            asyncio.create_task(
                self._episode(task, arm, group_id, i, admitted),
                name=f"{group_id}-ep{i}",
            )
            for i in range(self.cfg.group_size)
        ]
        try:
            results = await asyncio.gather(*episodes)
        except asyncio.CancelledError:
            # The episodes were cancelled with us and end as `aborted`: deliver what they
            # return (episodes cancelled before they started have nothing to deliver).
            await asyncio.wait(episodes, timeout=SHUTDOWN_GRACE_S)
            for e in episodes:
                if e.done() and not e.cancelled() and e.exception() is None:
                    self._deliver(e.result().trajectory)
            raise
        trajs = [r.trajectory for r in results]
        failed = [t for t in trajs if t.status in FAILED]
        if failed:
            if self.cfg.failed_sibling == "mask_group":
                masked = Exclusion(
                    "masked_group", f"{len(failed)} sibling(s) failed: {failed[0].reason}"
                )
                for t in trajs:
                    t.exclusion = t.exclusion or masked
            else:
                for t in failed:
                    t.exclusion = t.exclusion or Exclusion(
                        "dropped", f"it ended {t.status}: {t.reason}"
                    )
        for t in trajs:
            if self.router is not None:
                t.gate_unit = unit_of(task, self.router.cfg.unit)
                reward = unshaped_reward(t) if t.status not in FAILED else None
                self.router.result(task, t.arm, reward)  # success: the task's reward
            if self.shadow is not None:
                self.shadow.observe(t, task)
            self._deliver(t)
        return trajs

    async def _episode(
        self, task: Task, arm: str, group_id: str, index: int, admitted: int | None = None
    ) -> EpisodeResult:
        version = admitted if admitted is not None else await self.admission.admit()
        real = arm == "real"
        backend_sem = self._real if real else self._sim
        factory = self.backends.real if real else self.backends.simulated
        seed = None if self.cfg.seed is None else self._rng.getrandbits(30)
        spec = EpisodeSpec(
            task=task,
            arm="real" if real else "closed_loop",
            env_backend=self.backends.real_backend if real else "simulated",
            group_id=group_id,
            index=index,
            seed=seed,
            admitted_version=version,
        )
        async with self._in_flight, backend_sem:
            self.metrics.episode_started()
            try:
                result = await run_agent_episode(
                    spec,
                    self.client,
                    factory,
                    self.renderer,
                    self.cfg,
                    self.terminal,
                    version_hint=lambda: self.admission.version,
                )
            finally:
                self.metrics.episode_ended()
        self.metrics.record(result)
        return result

    async def _replay(self, real: Trajectory, task: Task, group_id: str) -> list[Trajectory]:
        await self.admission.admit()
        async with self._in_flight, self._sim:
            self.metrics.episode_started()
            try:
                result = await run_replay_episode(
                    real, self.backends.simulated, task, self.renderer, group_id=group_id
                )
            finally:
                self.metrics.episode_ended()
        self.metrics.record(result)
        self._deliver(result.trajectory)
        return [result.trajectory]

    def _deliver(self, traj: Trajectory) -> None:
        for sink in self.sinks:
            sink(traj)


def _task_of(traj: Trajectory) -> Task:
    from envs.shell import TaskSetup

    return Task(
        id=traj.task_id, instruction=traj.instruction, setup=TaskSetup(files=dict(traj.setup_files))
    )
