"""Fidelity-gated routing (`orchestrator.arm: gated`): each group of episodes goes to the
simulator or to the real shell by how faithful the simulator is, live, on that group's unit
(a task's operation or family).

Components (who calls whom): `RolloutRunner` asks `FidelityRouter.route(task, version)` when a
group is admitted and tells `ShadowReplayer.observe(traj, task)` of every real episode it
delivers; the replayer replays that episode's commands against the current simulator (arm c,
on its own tasks, bounded concurrency, off the RL critical path) and hands the router each
replayed observation's masked exact match (`record`). A co-trainer that publishes a new
simulator version calls `set_sim_version`, and the replayer's `remeasure` replays the latest
real episodes of every unit against it: a version's fidelity is measured on that version alone.

The estimate of a unit is the fraction of exact observations among its measurements of the
current simulator version, each weighted `0.5 ** (age / half_life_steps)` (age in policy
versions); its gate is open while the Wilson lower bound of that fraction (one-sided, level
`confidence`, on the weighted counts) is at least `threshold`. While it is open a share
`real_min` of the unit's groups still goes to the real shell, so it keeps being measured:
counted over the groups since the gate last opened (the real groups of a closed spell before
it say nothing about the version now open), the j-th of them goes real whenever fewer than
floor(real_min * j) have.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from envs.tasks import Task
from rl.data.trajectory import Trajectory
from rl.orchestrator.config import GateConfig

log = logging.getLogger(__name__)
SIM, REAL = "closed_loop", "real"


def unit_of(task: Task, unit: str) -> str:
    """The routing unit of `task`: its kind (operation, else family) or its family."""
    if unit == "family":
        return task.family or "task"
    return task.kind


def wilson_lower(hits: float, n: float, z: float) -> float:
    """Lower end of the Wilson score interval for `hits` successes in `n` (possibly
    fractional, weighted) trials at normal quantile `z`; 0 without trials."""
    if n <= 0:
        return 0.0
    p = min(max(hits / n, 0.0), 1.0)
    z2 = z * z
    centre = p + z2 / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, (centre - spread) / (1 + z2 / n))


@dataclass
class Estimate:
    """A unit's fidelity now: weighted pairs, their exact share and its lower bound."""

    pairs: float
    fidelity: float | None
    lower: float
    measured: int
    """Unweighted measurements (observations) of the current simulator version."""


@dataclass
class _Unit:
    # (policy version when measured, exact observations, observations) of the current sim version
    measurements: list[tuple[int, int, int]] = field(default_factory=list)
    routed: dict[str, int] = field(default_factory=lambda: {SIM: 0, REAL: 0})
    spell: dict[str, int] | None = None
    """Groups routed each way since the gate last opened; None while it is closed."""
    rewards: dict[str, list[float]] = field(default_factory=lambda: {SIM: [], REAL: []})


class FidelityRouter:
    """Decides, per admitted group, whether its unit's episodes run in the simulator."""

    def __init__(
        self,
        cfg: GateConfig,
        *,
        sim_version: int = 0,
        on_step: Callable[[dict], None] | None = None,
    ):
        self.cfg, self.sim_version, self.on_step = cfg, sim_version, on_step
        self.z = statistics.NormalDist().inv_cdf(cfg.confidence)
        self.units: dict[str, _Unit] = defaultdict(_Unit)
        self.versions: list[dict] = [{"sim_version": sim_version, "policy_version": None}]
        self._step: int | None = None  # the version whose record is open
        self._last: int | None = None
        self._step_routed: dict[str, dict[str, int]] = defaultdict(lambda: {SIM: 0, REAL: 0})

    @property
    def policy_version(self) -> int | None:
        """The policy version of the groups routed last (None before the first)."""
        return self._last

    # ----- measurements ---------------------------------------------------------------------

    def record(self, unit: str, exact: int, pairs: int, *, sim_version: int, step: int) -> bool:
        """Add `exact` of `pairs` shadow-replayed observations of `unit`, measured against
        simulator `sim_version` at policy version `step`. Measurements of another version
        than the current one are dropped (False)."""
        if sim_version != self.sim_version or pairs <= 0:
            return False
        self.units[unit].measurements.append((step, exact, pairs))
        return True

    def set_sim_version(self, version: int, *, policy_version: int | None = None) -> None:
        """A new simulator serves from now on: every unit's estimate starts over from the
        measurements of `version` alone (its gate closes until they clear the threshold)."""
        self.sim_version = version
        for u in self.units.values():
            u.measurements.clear()
        self.versions.append({"sim_version": version, "policy_version": policy_version})

    def estimate(self, unit: str, now: int) -> Estimate:
        u = self.units.get(unit)
        if u is None or not u.measurements:
            return Estimate(0.0, None, 0.0, 0)
        hl = self.cfg.half_life_steps
        weights = [(0.5 ** (max(now - step, 0) / hl), e, n) for step, e, n in u.measurements]
        n = sum(w * k for w, _, k in weights)
        hits = sum(w * e for w, e, _ in weights)
        return Estimate(
            n,
            hits / n if n else None,
            wilson_lower(hits, n, self.z),
            sum(k for _, _, k in u.measurements),
        )

    def is_open(self, unit: str, now: int) -> bool:
        return self.estimate(unit, now).lower >= self.cfg.threshold

    # ----- routing --------------------------------------------------------------------------

    def route(self, task: Task, version: int) -> str:
        """`closed_loop` or `real` for a group of `task` admitted at policy `version`. An
        open gate sends the j-th group since it opened to the real shell whenever fewer than
        floor(`real_min` * j) of them have gone there (so that share, deterministically)."""
        self._advance(version)
        unit = unit_of(task, self.cfg.unit)
        u = self.units[unit]
        if not self.is_open(unit, version):
            u.spell, arm = None, REAL
        else:
            if u.spell is None:
                u.spell = {SIM: 0, REAL: 0}
            j = u.spell[SIM] + u.spell[REAL] + 1
            # The epsilon: 0.58 * 50 is 28.999999999999996 in floats, and owes 29 groups.
            owed = math.floor(self.cfg.real_min * j + 1e-9)
            arm = REAL if u.spell[REAL] < owed else SIM
            u.spell[arm] += 1
        u.routed[arm] += 1
        self._step_routed[unit][arm] += 1
        return arm

    def result(self, task: Task, arm: str, reward: float | None) -> None:
        """An episode of `task` ended in `arm` with `reward` (success, for the report)."""
        if reward is not None and arm in (SIM, REAL):
            self.units[unit_of(task, self.cfg.unit)].rewards[arm].append(float(reward))

    def _advance(self, version: int) -> None:
        """The first group of a new policy version closes the previous version's record."""
        if self._step is not None and version != self._step:
            self.flush()
        self._step = version
        self._last = version

    def flush(self) -> dict | None:
        """Close the record of the current policy version (handed to `on_step` and returned):
        its routing, and the estimates as they stand now. A run calls it at each version's
        boundary; else the next version's first group does. None when nothing is open."""
        if self._step is None:
            return None
        record = self.snapshot(self._step)
        self._step = None
        self._step_routed = defaultdict(lambda: {SIM: 0, REAL: 0})
        if self.on_step is not None:
            self.on_step(record)
        return record

    def snapshot(self, now: int) -> dict[str, Any]:
        """Per unit: fidelity, its lower bound, the weighted and raw measurements, whether the
        gate is open, groups routed each way (this version and in all), and the agent's
        success in each arm so far."""
        units = {}
        for name in sorted(self.units):
            u, est = self.units[name], self.estimate(name, now)
            step = self._step_routed.get(name, {SIM: 0, REAL: 0})
            total = u.routed[SIM] + u.routed[REAL]
            units[name] = {
                "fidelity": est.fidelity,
                "lower": round(est.lower, 4),
                "pairs": round(est.pairs, 2),
                "measured": est.measured,
                "open": est.lower >= self.cfg.threshold,
                "routed_sim": step[SIM],
                "routed_real": step[REAL],
                "sim_share": u.routed[SIM] / total if total else None,
                "success_sim": _mean(u.rewards[SIM]),
                "success_real": _mean(u.rewards[REAL]),
            }
        return {"policy_version": now, "sim_version": self.sim_version, "units": units}

    def summary(self) -> dict[str, Any]:
        """Totals over the run: groups routed each way per unit, the simulator's share."""
        out = {}
        for name in sorted(self.units):
            u = self.units[name]
            total = u.routed[SIM] + u.routed[REAL]
            out[name] = {
                "routed_sim": u.routed[SIM],
                "routed_real": u.routed[REAL],
                "sim_share": u.routed[SIM] / total if total else None,
                "success_sim": _mean(u.rewards[SIM]),
                "success_real": _mean(u.rewards[REAL]),
            }
        return {"units": out, "sim_versions": list(self.versions)}


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def replay_exact(replayed: Trajectory) -> tuple[int, int]:
    """(exact observations, observations) of an arm (c) replay: the masked exact match of each
    simulated observation with the real one, and return codes agreeing."""
    exact = pairs = 0
    for turn in replayed.turns:
        if turn.sim_observation is None or turn.observation is None:
            continue
        pairs += 1
        same_rc = turn.sim_exit_code == turn.exit_code
        exact += bool((turn.info or {}).get("exact_masked")) and same_rc
    return exact, pairs


class ShadowReplayer:
    """Replays real episodes against the simulator in the background and feeds the router.

    `replay(real, task)` is the arm (c) coroutine (`rl.orchestrator.episode.run_replay_episode`
    over the simulated shell, bound by the caller); `sink` receives every replay (stored next
    to the run's episodes). `close()` waits a bounded time, then cancels what is left; a
    replay that fails is logged and counted, never raised into the rollout."""

    def __init__(
        self,
        router: FidelityRouter,
        replay,
        *,
        concurrency: int,
        remeasure: int,
        sink: Callable[[Trajectory], None] | None = None,
    ):
        self.router, self.replay, self.sink = router, replay, sink
        self._sem = asyncio.Semaphore(concurrency)
        self._recent: dict[str, list] = defaultdict(list)
        self.remeasure_n = remeasure
        self._tasks: set[asyncio.Task] = set()
        self.replayed = self.failed = self.dropped = self.empty = 0
        self._n = 0

    def observe(self, traj: Trajectory, task: Task) -> None:
        """A real episode ended: replay its commands against the current simulator."""
        if traj.arm != REAL or traj.status not in ("ok", "truncated") or not traj.turns:
            return
        unit = unit_of(task, self.router.cfg.unit)
        step = traj.admitted_version
        step = step if step is not None else (self.router.policy_version or 0)
        recent = self._recent[unit]
        recent.append((traj, task, step))
        if len(recent) > 4 * max(self.remeasure_n, 1):  # bounded: keep the latest, canonically
            recent[:] = self._latest(recent, 2 * max(self.remeasure_n, 1))
        self._spawn(traj, task, unit, step)

    @staticmethod
    def _latest(recent: list, n: int) -> list:
        """The `n` latest real episodes by policy version, then group and index: the same
        ones whatever order the episodes finished in."""

        def key(item):
            traj, _, step = item
            return (step, traj.group_id, traj.group_index or 0, traj.task_id)

        return sorted(recent, key=key)[-n:]

    def remeasure(self) -> int:
        """Replay the latest real episodes of every unit against the (new) current simulator;
        returns how many were scheduled."""
        if not self.remeasure_n:
            return 0
        scheduled = 0
        for unit, recent in sorted(self._recent.items()):
            for traj, task, step in self._latest(recent, self.remeasure_n):
                self._spawn(traj, task, unit, step)
                scheduled += 1
        return scheduled

    def _spawn(self, traj: Trajectory, task: Task, unit: str, step: int) -> None:
        self._n += 1
        job = asyncio.create_task(
            self._one(traj, task, unit, step), name=f"shadow-{self._n}-{traj.task_id}"
        )
        self._tasks.add(job)
        job.add_done_callback(self._done)

    def _done(self, job: asyncio.Task) -> None:
        self._tasks.discard(job)
        if not job.cancelled() and job.exception() is not None:  # a bug here, not a replay
            self.failed += 1
            log.error("shadow replay %s raised", job.get_name(), exc_info=job.exception())

    async def _one(self, traj: Trajectory, task: Task, unit: str, step: int) -> None:
        async with self._sem:
            version = self.router.sim_version
            result = await self.replay(traj, task)
        replayed = result.trajectory
        replayed.gate_unit, replayed.admitted_version = unit, step
        replayed.meta.update(shadow=True, sim_version=version)
        if replayed.status != "ok":
            self.failed += 1
            log.warning(
                "shadow replay of %s ended %s: %s", traj.task_id, replayed.status, replayed.reason
            )
        else:
            exact, pairs = replay_exact(replayed)
            replayed.meta.update(exact=exact, pairs=pairs)
            if not pairs:
                self.empty += 1  # no command with an observation to compare
            elif self.router.record(unit, exact, pairs, sim_version=version, step=step):
                self.replayed += 1
            else:
                self.dropped += 1  # measured against a version that is no longer served
        if self.sink is not None:
            self.sink(replayed)

    async def drain(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the replays in flight."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)

    async def close(self, timeout_s: float = 30.0) -> None:
        await self.drain(timeout_s)
        for job in list(self._tasks):
            job.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            if self._tasks:
                await asyncio.wait(set(self._tasks), timeout=5.0)

    def stats(self) -> dict[str, int]:
        return {
            "replayed": self.replayed,
            "failed": self.failed,
            "dropped": self.dropped,
            "empty": self.empty,
            "in_flight": len(self._tasks),
        }
