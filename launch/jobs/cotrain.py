"""The gated arm's simulator side in `simloop train-agent` (`orchestrator.arm: gated`): the
fidelity router and shadow replays, logged every policy version, and the simulator's
co-training on the run's real episodes.

Components (who calls whom): `GatedRun.open()` builds the `FidelityRouter` (whose per-version
record goes to `metrics.jsonl` as stage `gate`) and the `ShadowReplayer` (its replays stored as
`trajectories/shadow-*`); the rollout runner routes through the first and feeds the second.
`GatedRun.buffer(b)` wraps the rollout buffer so that every `set_version` (the RL loop's, after
each publish) may start a co-training round: `SimCoTrainer` takes `gate.cotrain_steps` SFT steps
on the real episodes so far mixed with the simulator's own data (on the simulator trainer's
chips, in a thread: rollouts go on), exports the weights, publishes them to the simulator
servers as the next version, and tells the router, whose estimates start over from the
replayer's re-measurement of that version.
"""

from __future__ import annotations

import asyncio
import logging
import random
from pathlib import Path
from typing import Any

from rl.data import rundir

log = logging.getLogger(__name__)
SIM_WEIGHTS = "sim"
"""`weights/sim/v<k>`: the co-trained simulator versions, as published."""


class SimCoTrainer:
    """Continual SFT of the simulator on the run's real episodes (`gate.cotrain_*`)."""

    def __init__(self, cfg, out: Path, publisher, metrics: rundir.MetricsLog, rounds: int):
        # Absolute: the simulator servers resolve the published path from their own cwd.
        self.cfg, self.out = cfg, Path(out).absolute()
        self.publisher, self.metrics = publisher, metrics
        self.gate = cfg.orchestrator.gate
        self.rounds_planned = rounds
        self.real: list = []
        self.version = 0
        self.history: list[dict[str, Any]] = []
        self._trainer = None
        self._base: list | None = None
        self._rng = random.Random(cfg.run.seed)

    def add(self, traj) -> None:
        """A real episode of the run: co-training data."""
        if traj.arm == "real" and traj.status in ("ok", "truncated") and traj.turns:
            self.real.append(traj)

    def _build(self):
        from envs.tasks import is_heldout
        from launch.config.memory import check_trainer_memory
        from launch.config.schema import role_model
        from launch.deploy.chips import trainer_device_ids
        from rl.data import load_tokenizer
        from rl.data.trajectory import canonical_order, load_trajectories
        from rl.train.build import build_trainer
        from rl.train.config import OptimConfig

        tcfg = self.cfg.train_sim
        base = canonical_order(load_trajectories(tcfg.trajectories)) if tcfg.trajectories else []
        # The simulator's own training split: its held-out tasks stay held out.
        self._base = [t for t in base if not is_heldout(t.task_id, tcfg.heldout_fraction)]
        self._tok = load_tokenizer(self.cfg.simulator.tokenizer)
        ids = trainer_device_ids(self.cfg, "simulator")
        check_trainer_memory(role_model(self.cfg.simulator), ids, "the simulator co-trainer")
        optim = OptimConfig(lr=self.gate.cotrain_lr, warmup_steps=0, min_lr_ratio=1.0,
                            clip_norm=tcfg.optim.clip_norm)  # fmt: skip
        self._trainer = build_trainer(
            self.cfg.simulator, self._tok, optim=optim,
            steps=max(1, self.rounds_planned) * self.gate.cotrain_steps, loss="sft",
            rules=self.cfg.sharding.rules, seed=self.cfg.run.seed, device_ids=ids,
        )  # fmt: skip

    def _train(self, real: list) -> tuple[Path, dict]:
        """One round (in a thread): SFT steps on `real` + a replay share of the base data."""
        from rl.data.datasets import sim_sft_dataset
        from rl.train.loop import sft_loop

        if self._trainer is None:
            self._build()
        g = self.gate
        n_base = len(self._base) if g.cotrain_replay >= 1 else round(
            len(real) * g.cotrain_replay / (1 - g.cotrain_replay))  # fmt: skip
        base = self._rng.sample(self._base, min(n_base, len(self._base)))
        sim = self.cfg.env.shell.simulated
        data = self.cfg.train_sim.data
        ds, stats = sim_sft_dataset(real + base, self._tok, data, system_prompt=sim.system_prompt,
                                    show_task=sim.show_task,
                                    context_budget=sim.prompt_budget)  # fmt: skip
        target = self._trainer.step_count + g.cotrain_steps
        s = sft_loop(self._trainer, iter(ds), steps=target, log=self.metrics,
                     stage="sim_cotrain", log_every=g.cotrain_steps, progress=False)  # fmt: skip
        path = self.out / rundir.WEIGHTS / SIM_WEIGHTS / f"v{self.version + 1:04d}"
        self._trainer.export_serving(path, self.cfg.train_sim.checkpoint.export_dtype)
        return path, {"real": len(real), "base": len(base), "examples": stats.examples,
                      "loss": s["last"].get("loss"), "train_s": round(s["wall_s"], 2)}  # fmt: skip

    async def round(self, policy_version: int) -> dict[str, Any]:
        """Train, export, publish the next simulator version; returns the round's record."""
        real = list(self.real)
        path, rec = await asyncio.to_thread(self._train, real)
        version = self.version + 1
        report = await self.publisher.publish(str(path), version)
        self.version = version
        rec.update(stage="sim_cotrain_round", step=policy_version, sim_version=version,
                   publish_s=round(report.load_s, 3), weights=str(path))  # fmt: skip
        self.history.append(rec)
        self.metrics.write(rec)
        return rec


class GatedRun:
    """The router, the shadow replayer and (with `gate.cotrain_every`) the co-trainer of one
    RL run of the gated arm."""

    def __init__(self, cfg, out: Path, renderer, backends, metrics: rundir.MetricsLog, *,
                 sim_publisher=None, steps: int = 0, start_version: int = 1):  # fmt: skip
        from rl.orchestrator.episode import run_replay_episode
        from rl.orchestrator.gate import FidelityRouter, ShadowReplayer
        from rl.orchestrator.storage import TrajectoryWriter

        self.cfg, self.gate, self.metrics = cfg, cfg.orchestrator.gate, metrics
        self.router = FidelityRouter(self.gate, sim_version=0, on_step=self._log_step)
        self.writer = TrajectoryWriter(out, prefix="shadow")
        simulated = backends.simulated

        def replay(real, task):
            return run_replay_episode(real, simulated, task, renderer,
                                      group_id=f"shadow-{real.group_id}")  # fmt: skip

        g = self.gate
        self.shadow = ShadowReplayer(self.router, replay, concurrency=g.shadow_concurrency,
                                     remeasure=g.remeasure, sink=self.writer.add)  # fmt: skip
        every = self.gate.cotrain_every
        self.cotrainer = None
        if every and sim_publisher is not None:
            self.cotrainer = SimCoTrainer(cfg, out, sim_publisher, metrics, steps // every)
        self._round: asyncio.Task | None = None
        self._start, self.steps = start_version, steps
        self.records: list[dict] = []
        self.errors: list[dict] = []

    def _log_step(self, record: dict) -> None:
        self.records.append(record)
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
        if self.cotrainer is None or self._round is not None and not self._round.done():
            return  # a round still training: this one is skipped, the next due one starts
        done = version - self._start
        if done >= self.steps:
            return  # RL is over: a new simulator version would serve nothing
        if done and done % self.gate.cotrain_every == 0:
            self._round = asyncio.create_task(self._cotrain(version), name=f"cotrain-{version}")

    async def _cotrain(self, version: int) -> None:
        try:
            rec = await self.cotrainer.round(version)
        except Exception as e:  # noqa: BLE001 - the simulator keeps its version; RL goes on
            # A failed round (training, export or publish) leaves the served simulator and the
            # router's estimates as they were: recorded and shown, retried at the next round.
            why = f"{type(e).__name__}: {e}"
            err = {"stage": "sim_cotrain_error", "step": version, "error": why}
            self.errors.append(err)
            self.metrics.write(err)
            print(f"simloop train-agent: co-training round at policy version {version} failed, "
                  f"the simulator stays at v{self.router.sim_version}: {err['error']}",
                  flush=True)  # fmt: skip
            return
        self.router.set_sim_version(rec["sim_version"], policy_version=version)
        n = self.shadow.remeasure()
        print(f"simloop train-agent: simulator v{rec['sim_version']} co-trained on "
              f"{rec['real']} real + {rec['base']} original episodes (loss {rec['loss']}) and "
              f"published; re-measuring it on {n} real episodes", flush=True)  # fmt: skip

    async def close(self) -> dict[str, Any]:
        """Finish the round in flight (its failure surfaces here), the replays (bounded), and
        return the run's gating summary."""
        try:
            if self._round is not None:
                await asyncio.wait_for(self._round, timeout=600.0)
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
