"""The gated arm's simulator side of an RL session (`orchestrator.arm: gated`): the fidelity
router and shadow replays, logged every policy version, and the simulator's co-training on the
run's real episodes.

Components (who calls whom): `GatedRun.open()` builds the `FidelityRouter` (whose per-version
record goes to `metrics.jsonl` as stage `gate`) and the `ShadowReplayer` (its replays stored as
`trajectories/shadow-*`); the rollout runner routes through the first and feeds the second.
`GatedRun.buffer(b)` wraps the rollout buffer so that every `set_version` (the RL loop's, after
each publish; under synchronous RL no episode is in flight then) is a boundary where the run
waits for the shadow replays in flight, so each version is routed on the same measurements
every time. Every `gate.cotrain_every` versions a round starts: `SimCoTrainer` takes
`gate.cotrain_steps` SFT steps on the real episodes so far mixed with the simulator's own data
(on the simulator trainer's chips, in a thread: rollouts go on) and exports the weights. At the
boundary `cotrain_every` versions later they are published to the simulator servers as the
next version, the router moves to it, and the replayer re-measures it before any group is
routed on it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs.config import SimulatedShellConfig
from rl.data import rundir
from rl.data.tokenizer import Tokenizer
from rl.orchestrator.config import GateConfig
from rl.train.config import OptimConfig, TrainSimConfig

log = logging.getLogger(__name__)
DRAIN_S = 120.0
"""How long a version boundary waits for the shadow replays in flight."""
SIM_WEIGHTS = "sim"
"""`weights/sim/v<k>`: the co-trained simulator versions, as published."""


@dataclass(frozen=True)
class SimCoTraining:
    """What co-training the simulator takes from the job: its SFT settings and original data
    (`train_sim`), the simulated shell's prompt settings, its tokenizer (loaded), and a factory
    of its trainer on the simulator trainer's chips (`trainer(optim, steps)`)."""

    train_sim: TrainSimConfig
    simulated: SimulatedShellConfig
    tokenizer: Tokenizer
    trainer: Callable[[OptimConfig, int], Any]


class SimCoTrainer:
    """Continual SFT of the simulator on the run's real episodes (`gate.cotrain_*`)."""

    def __init__(
        self,
        gate: GateConfig,
        sim: SimCoTraining,
        out: Path,
        publisher,
        metrics: rundir.MetricsLog,
        rounds: int,
        *,
        seed: int,
    ):
        # Absolute: the simulator servers resolve the published path from their own cwd.
        self.sim, self.out = sim, Path(out).absolute()
        self.publisher, self.metrics = publisher, metrics
        self.gate = gate
        self.rounds_planned = rounds
        self.real: list = []
        self.version = 0
        self.history: list[dict[str, Any]] = []
        self._trainer = None
        self._base: list | None = None
        self._states: dict[int, Any] = {}
        """Workspace mode: each trajectory's replayed states, by `id`, across rounds."""
        self._rng = random.Random(seed)

    def add(self, traj) -> None:
        """A real episode of the run: co-training data."""
        if traj.arm == "real" and traj.status in ("ok", "truncated") and traj.turns:
            self.real.append(traj)

    def _build(self):
        from envs.tasks import is_heldout
        from rl.data.trajectory import canonical_order, load_trajectories

        tcfg = self.sim.train_sim
        base = canonical_order(load_trajectories(tcfg.trajectories)) if tcfg.trajectories else []
        # The simulator's own training split: its held-out tasks stay held out.
        self._base = [t for t in base if not is_heldout(t.task_id, tcfg.heldout_fraction)]
        self._tok = self.sim.tokenizer
        optim = OptimConfig(
            lr=self.gate.cotrain_lr,
            warmup_steps=0,
            min_lr_ratio=1.0,
            clip_norm=tcfg.optim.clip_norm,
        )
        self._trainer = self.sim.trainer(
            optim, max(1, self.rounds_planned) * self.gate.cotrain_steps
        )

    def _train(self, real: list) -> tuple[Path, dict]:
        """One round (in a thread): SFT steps on `real` + a replay share of the base data."""
        from rl.data.datasets import sim_sft_dataset
        from rl.train.loop import sft_loop

        if self._trainer is None:
            self._build()
        g = self.gate
        n_base = (
            len(self._base)
            if g.cotrain_replay >= 1
            else round(len(real) * g.cotrain_replay / (1 - g.cotrain_replay))
        )
        base = self._rng.sample(self._base, min(n_base, len(self._base)))
        sim = self.sim.simulated
        data = self.sim.train_sim.data
        workspaces = None
        if sim.workspace:  # the real files after each command (`envs.workspace`)
            from envs.workspace import trajectory_workspaces

            new = [t for t in real + base if id(t) not in self._states]
            states, _ = trajectory_workspaces(new)
            self._states.update((id(t), states(t)) for t in new)  # each replayed once
            workspaces = lambda traj: self._states.get(id(traj))  # noqa: E731
        ds, stats = sim_sft_dataset(
            real + base,
            self._tok,
            data,
            system_prompt=sim.system_prompt,
            show_task=sim.show_task,
            context_budget=sim.prompt_budget,
            workspaces=workspaces,
            named_last=sim.workspace_named_last,
            named_absent=sim.workspace_named_absent,
        )
        target = self._trainer.step_count + g.cotrain_steps
        s = sft_loop(
            self._trainer,
            iter(ds),
            steps=target,
            log=self.metrics,
            stage="sim_cotrain",
            log_every=g.cotrain_steps,
            progress=False,
        )
        path = self.out / rundir.WEIGHTS / SIM_WEIGHTS / f"v{self.version + 1:04d}"
        self._trainer.export_serving(path, self.sim.train_sim.checkpoint.export_dtype)
        return path, {
            "real": len(real),
            "base": len(base),
            "examples": stats.examples,
            "loss": s["last"].get("loss"),
            "train_s": round(s["wall_s"], 2),
        }

    async def train(self, policy_version: int) -> tuple[Path, dict[str, Any]]:
        """Train and export the next version on the real episodes so far (in a thread)."""
        from rl.data.trajectory import canonical_order

        # In a canonical order, not the order the episodes finished in: the same run trains
        # the same simulator.
        path, rec = await asyncio.to_thread(self._train, canonical_order(self.real))
        rec["step"] = policy_version
        return path, rec

    async def publish(self, path: Path, rec: dict[str, Any], policy_version: int) -> dict:
        """Publish trained weights to the simulator servers as the next version; returns the
        round's record (also in the metrics log)."""
        version = self.version + 1
        report = await self.publisher.publish(str(path), version)
        self.version = version
        rec.update(
            stage="sim_cotrain_round",
            sim_version=version,
            served_from=policy_version,
            publish_s=round(report.load_s, 3),
            weights=str(path),
        )
        self.history.append(rec)
        self.metrics.write(rec)
        return rec


class GatedRun:
    """The router, the shadow replayer and (with `gate.cotrain_every`) the co-trainer of one
    RL run of the gated arm."""

    def __init__(
        self,
        gate: GateConfig,
        out: Path,
        renderer,
        backends,
        metrics: rundir.MetricsLog,
        *,
        seed: int,
        sim: SimCoTraining | None = None,
        sim_publisher=None,
        steps: int = 0,
        start_version: int = 1,
    ):
        from rl.orchestrator.episode import run_replay_episode
        from rl.orchestrator.gate import FidelityRouter, ShadowReplayer
        from rl.orchestrator.storage import TrajectoryWriter

        self.gate, self.metrics = gate, metrics
        self.router = FidelityRouter(self.gate, sim_version=0, on_step=self._log_step)
        self.writer = TrajectoryWriter(out, prefix="shadow")
        simulated = backends.simulated

        def replay(real, task):
            return run_replay_episode(
                real, simulated, task, renderer, group_id=f"shadow-{real.group_id}"
            )

        g = self.gate
        self.shadow = ShadowReplayer(
            self.router,
            replay,
            concurrency=g.shadow_concurrency,
            remeasure=g.remeasure,
            sink=self.writer.add,
        )
        every = self.gate.cotrain_every
        self.cotrainer = None
        if every and sim_publisher is not None and sim is not None:
            self.cotrainer = SimCoTrainer(
                gate, sim, out, sim_publisher, metrics, steps // every, seed=seed
            )
        self._round: asyncio.Task | None = None
        self._switch_at = 0
        self._start, self.steps = start_version, steps
        self.errors: list[dict] = []

    def _log_step(self, record: dict) -> None:
        self.metrics.write({"stage": "gate", "step": record["policy_version"], **record})

    def sink(self, writer_add):
        """The rollout sink: the run's writer, and real episodes to the co-trainer."""

        def add(traj) -> None:
            writer_add(traj)
            if self.cotrainer is not None:
                self.cotrainer.add(traj)

        return add

    def buffer(self, inner):
        return _VersionHook(inner, self._on_version)

    async def _on_version(self, version: int) -> None:
        """At each policy version's boundary (no episode in flight under synchronous RL), so
        that a run routes the same way every time: every shadow replay of what has run is in,
        a round that was due switches the simulator, and the next round starts."""
        await self._drain(version)
        self.router.flush()  # the closing version's record: its routing, its measurements
        if self.cotrainer is None:
            return
        done, every = version - self._start, self.gate.cotrain_every
        if self._round is not None and done >= self._switch_at:
            await self._switch(version)
        # A round trains in the background for `every` versions, then serves from the next
        # boundary: one that could serve no RL step is not started.
        if self._round is None and done and done % every == 0 and done + every < self.steps:
            self._round = asyncio.create_task(
                self.cotrainer.train(version), name=f"cotrain-{version}"
            )
            self._switch_at = done + every

    async def _drain(self, version: int) -> None:
        await self.shadow.drain(DRAIN_S)
        if self.shadow.stats()["in_flight"]:
            print(
                f"simloop train-agent: policy v{version} routes with "
                f"{self.shadow.stats()['in_flight']} shadow replays still running (over "
                f"{DRAIN_S:.0f} s)",
                flush=True,
            )

    async def _switch(self, version: int) -> None:
        """Publish the round's weights, move the router to them and measure them again."""
        job, self._round = self._round, None
        try:
            path, rec = await job
            rec = await self.cotrainer.publish(path, rec, version)
        except Exception as e:  # noqa: BLE001 - the simulator keeps its version; RL goes on
            # A failed round (training, export or publish) leaves the served simulator and the
            # router's estimates as they were: recorded and shown, retried at the next round.
            why = f"{type(e).__name__}: {e}"
            err = {"stage": "sim_cotrain_error", "step": version, "error": why}
            self.errors.append(err)
            self.metrics.write(err)
            print(
                f"simloop train-agent: co-training round of policy version {version} failed, "
                f"the simulator stays at v{self.router.sim_version}: {why}",
                flush=True,
            )
            return
        self.router.set_sim_version(rec["sim_version"], policy_version=version)
        n = self.shadow.remeasure()
        await self._drain(version)
        loss = rec.get("loss")
        loss = f"{loss:.4g}" if isinstance(loss, int | float) else "not recorded"
        print(
            f"simloop train-agent: simulator v{rec['sim_version']} (co-trained from policy "
            f"v{rec['step']} on {rec['real']} real + {rec['base']} original episodes, loss "
            f"{loss}) serves from policy v{version}; re-measured on {n} real "
            "episodes",
            flush=True,
        )

    async def close(self) -> dict[str, Any]:
        """Finish the round in flight (its failure surfaces here), the replays (bounded), and
        return the run's gating summary."""
        try:
            if self._round is not None:  # only when RL stopped early: it would serve nothing
                self._round.cancel()
                await asyncio.wait({self._round}, timeout=600.0)
        finally:
            await self.shadow.close(timeout_s=60.0)
            self.router.flush()
            self.writer.close()
        out = self.router.summary()
        out["shadow"] = self.shadow.stats()
        out["cotrain"] = list(self.cotrainer.history) if self.cotrainer is not None else []
        out["cotrain_errors"] = list(self.errors)
        return out


class _VersionHook:
    """A rollout buffer whose `set_version` runs `hook(version)` first."""

    def __init__(self, inner, hook):
        self._inner, self._hook = inner, hook

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    async def set_version(self, version: int) -> None:
        await self._hook(version)
        await self._inner.set_version(version)
