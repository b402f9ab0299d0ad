"""One RL run of the agent (`simloop train-agent`, `simloop demo`'s RL stages) as an object:
the warm start on demonstrations, RL on episodes from the orchestrator (or from harnesses),
the gated arm's router and simulator co-training, and the held-out evaluation before and
after, for one process or every process of a multi-process job.

    session = RLSession(out, train_cfg, orchestrator_cfg, terminal_cfg, seed=0,
                        renderer=renderer, tasks=tasks, eval_tasks=eval_tasks,
                        trainer=make_trainer, backends=make_backends, servers=open_servers)
    summary = await session.run()

It takes typed component configs and factories, never the whole job config or a device plan:
`trainer(**kwargs)` builds the policy trainer on its chips, `backends(simulator_client)` the
shell backends, `servers(roles, publishing)` opens the servers (`Servers`: a client per role
and a weight publisher per publishing role), `cotrain` (the gated arm's simulator side) and
`harness` (`train_agent.tasks: swe`) what those need.

Who does what with several JAX processes (multi-controller, `rl.train.multihost`): every
process trains (the warm start's SFT and RL steps, exports, checkpoints: collectives);
process 0 alone collects the scripted demonstrations (written to
`trajectories/demos.jsonl`, which every process then reads), opens the servers, publishes,
runs every episode once and evaluates, and its batch is broadcast to the others
(`rl_loop`). The others wait at coordination-service barriers (bounded; a dead process ends
the job through the heartbeat) while process 0 does what only it does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs.config import TerminalConfig
from rl.data import rundir
from rl.orchestrator.config import OrchestratorConfig
from rl.session.cotrain import SimCoTraining
from rl.session.harness import HarnessSetup
from rl.train.config import TrainAgentConfig

REFERENCE = "rl_reference"
"""`weights/<REFERENCE>`: the KL reference of the run's RL (the policy RL started from)."""
DEMOS = "demos.jsonl"
"""`trajectories/<DEMOS>`: the scripted demonstrations of the warm start."""
WAIT_S = 86400.0
"""The most the other processes wait at a barrier for process 0's episodes or evaluation."""


class SessionError(RuntimeError):
    """The run cannot go on (a missing KL reference on resume, no usable harness): the
    message says what to do; the last checkpoint is kept."""


@dataclass(frozen=True)
class Servers:
    """The servers an RL run reaches: a client (or replica pool) per role, and
    `publisher(role)`, a weight publisher to that role's servers. `tag_versions`: the agent's
    completions carry no weight version (vLLM), so the run tags them."""

    clients: Mapping[str, Any]
    publisher: Callable[[str], Any]
    tag_versions: bool = False


def needs_simulator(arm: str) -> bool:
    return arm in ("closed_loop", "mixed", "gated")


def server_roles(train: TrainAgentConfig, orchestrator: OrchestratorConfig) -> list[str]:
    """The model roles whose servers RL and its evaluation need."""
    ecfg = train.eval
    roles = ["agent"] if train.steps > 0 else []
    if train.swe:
        return roles
    if roles and (
        needs_simulator(orchestrator.arm) or (ecfg.tasks > 0 and "closed_loop" in ecfg.arms)
    ):
        roles.append("simulator")
    return roles


def published_roles(train: TrainAgentConfig, orchestrator: OrchestratorConfig) -> list[str]:
    """The roles that receive weights during the run: the agent, and the simulator when the
    gated arm co-trains it."""
    o = orchestrator
    cotrain = o.arm == "gated" and o.gate.cotrain_every > 0 and train.steps > 0
    return ["agent", "simulator"] if cotrain else ["agent"]


@dataclass
class RLSession:
    out: Path
    train: TrainAgentConfig
    orchestrator: OrchestratorConfig
    terminal: TerminalConfig
    seed: int
    renderer: Any
    tasks: list
    eval_tasks: list
    trainer: Callable[..., Any]
    backends: Callable[[Any], Any]
    servers: Callable[[list[str], list[str]], Any]
    cotrain: SimCoTraining | None = None
    harness: HarnessSetup | None = None

    def roles(self) -> list[str]:
        return server_roles(self.train, self.orchestrator)

    def publishes(self) -> list[str]:
        return [r for r in published_roles(self.train, self.orchestrator) if r in self.roles()]

    async def run(self) -> dict[str, Any]:
        """Warm start (unless RL is being resumed), then RL and its evaluation; returns the
        run's summary. Resumes from the newest checkpoint of each stage."""
        from rl.data.datasets import agent_sft_dataset
        from rl.train import multihost
        from rl.train.build import export_weights
        from rl.train.checkpoint import Checkpointer, export_path
        from rl.train.loop import resume, sft_loop

        tcfg, out = self.train, Path(self.out)
        metrics = rundir.MetricsLog(out)
        summary: dict[str, Any] = {}
        rl_dir = out / rundir.CHECKPOINTS / "rl"
        init_params = None
        ws = tcfg.warm_start
        resuming = rl_dir.exists() and any(p.name.isdigit() for p in rl_dir.iterdir())
        primary = multihost.is_primary()
        if ws.steps > 0 and not resuming:
            demos = await self._demos()
            print(f"simloop train-agent: warm start on {len(demos)} demonstrations", flush=True)
            ds, _ = agent_sft_dataset(demos, self.renderer, ws.data)
            trainer = self.trainer(optim=ws.optim, steps=ws.steps, loss="sft")
            batches = iter(ds)
            with Checkpointer(out / rundir.CHECKPOINTS / "warm_start", tcfg.checkpoint) as ckpt:
                resume(trainer, ckpt, batches)
                s = await asyncio.to_thread(
                    sft_loop,
                    trainer,
                    batches,
                    steps=ws.steps,
                    log=metrics,
                    stage="warm_start",
                    log_every=min(10, ws.steps),
                    ckpt=ckpt,
                    ckpt_every=tcfg.checkpoint.every_steps,
                    progress=primary,
                )
            summary["warm_start"] = {k: v for k, v in s.items() if k != "last"}
            summary["warm_start"]["loss"] = s["last"].get("loss")
            init_params = trainer.params
            # The policy RL starts from, for runs that must start from the same one (the demo's
            # RL-in-the-real-shell arm: `--agent.weights <run>/weights/warm_start`).
            summary["warm_start"]["weights"] = str(
                export_weights(trainer, out, "warm_start", tcfg.checkpoint)
            )
        if tcfg.steps == 0:
            return summary
        trainer = self._rl_trainer(init_params, resuming=resuming)
        seq_len = tcfg.seq_len or self.orchestrator.max_context_tokens
        with Checkpointer(rl_dir, tcfg.checkpoint) as ckpt:
            if resume(trainer, ckpt) is not None:
                print(f"simloop train-agent: resuming RL at step {trainer.step_count}", flush=True)
            start_version = 1 + trainer.step_count
            start_path = export_path(out, start_version)
            await asyncio.to_thread(
                trainer.export_serving, start_path, tcfg.checkpoint.export_dtype
            )
            if primary:
                summary["rl"] = await self._rl(
                    trainer, ckpt, metrics, seq_len, start_path, start_version
                )
            else:
                summary["rl"] = await self._follow(trainer, ckpt, seq_len)
            # The others wait here (not in a device collective) while process 0 evaluates.
            multihost.barrier("rl finished", WAIT_S)
        summary["weights"] = str(export_weights(trainer, out, "final", tcfg.checkpoint))
        return summary

    async def _demos(self) -> list:
        """The warm start's demonstrations: the configured files, or scripted episodes that
        process 0 collects and writes, which every process then reads back (the same data)."""
        from rl.data.trajectory import load_trajectories, write_jsonl
        from rl.session.demos import collect_demos
        from rl.train import multihost

        ws = self.train.warm_start
        if ws.trajectories:
            return load_trajectories(ws.trajectories)
        path = self.out / rundir.TRAJECTORIES / DEMOS
        if multihost.is_primary():
            demos = await collect_demos(
                ws,
                self.orchestrator,
                self.terminal,
                self.renderer,
                self.backends(None),
                self.tasks,
                seed=self.seed,
            )
            write_jsonl(path, demos)
            if multihost.process_count() == 1:
                return demos
        multihost.barrier("demonstrations written", WAIT_S)
        return load_trajectories([str(path)])

    def _rl_trainer(self, init_params, *, resuming: bool):
        """The RL trainer. With a KL term its frozen reference is the policy RL starts from: a
        fresh run stores it as `weights/rl_reference`; a resumed one (whose trainer is rebuilt
        without the warm start) loads it back from there, verified."""
        tcfg = self.train
        kl = tcfg.loss.kl_coef > 0
        trainer = self.trainer(
            optim=tcfg.optim,
            steps=tcfg.steps,
            loss="policy",
            loss_cfg=tcfg.loss,
            init_params=init_params,
            reference=kl,
        )
        if not kl:
            return trainer
        stored = self.out / rundir.WEIGHTS / REFERENCE
        if resuming:
            if not stored.is_dir():
                raise SessionError(
                    f"cannot resume RL with a KL term: its reference weights {stored} are "
                    f"missing (move {self.out / rundir.CHECKPOINTS / 'rl'} away to start RL over)"
                )
            trainer.set_reference(trainer.load_serving(stored, require_manifest=True))
        else:
            trainer.export_serving(stored)  # in the trainer's dtype: exactly the reference
        return trainer

    def _loop_kwargs(self, seq_len: int) -> dict[str, Any]:
        tcfg = self.train
        return dict(
            run_dir=self.out,
            steps=tcfg.steps,
            rows=self.orchestrator.batch_size,
            seq_len=seq_len,
            loss_cfg=tcfg.loss,
            pad_id=self.renderer.tokenizer.pad_id,
            base_version=1,
            publish_every=tcfg.publish_every,
            overlap_publish=tcfg.overlap_publish,
            export_dtype=tcfg.checkpoint.export_dtype,
            log_every=tcfg.log_every,
            ckpt_every=tcfg.checkpoint.every_steps,
            batch_timeout_s=WAIT_S,
        )

    async def _follow(self, trainer, ckpt, seq_len: int) -> dict:
        """RL on a process other than 0: the same steps on process 0's batches."""
        from rl.train.loop import rl_loop

        s = await rl_loop(
            trainer, None, None, ckpt=ckpt, progress=False, **self._loop_kwargs(seq_len)
        )
        s.pop("history")
        return s

    async def _rl(self, trainer, ckpt, metrics, seq_len, start_path, start_version) -> dict:
        from rl.orchestrator.buffer import RolloutBuffer
        from rl.orchestrator.runner import RolloutRunner
        from rl.orchestrator.storage import TrajectoryWriter
        from rl.session.cotrain import GatedRun
        from rl.session.evaluate import evaluate_agent
        from rl.session.harness import harness_source, harness_summary
        from rl.session.publish import Published, VersionTagged
        from rl.train.loop import rl_loop

        tcfg, ocfg, out = self.train, self.orchestrator, self.out
        ecfg = tcfg.eval
        evaluating = ecfg.tasks > 0 and bool(self.eval_tasks)
        roles, publishes = self.roles(), self.publishes()
        swe = tcfg.swe
        async with contextlib.AsyncExitStack() as stack:
            servers: Servers = await stack.enter_async_context(self.servers(roles, publishes))
            clients = servers.clients
            publisher = Published(servers.publisher("agent"))
            agent = (
                VersionTagged(clients["agent"], publisher)
                if servers.tag_versions
                else clients["agent"]
            )
            if self.terminal.trials > 1 and not swe:
                print(f"simloop train-agent: {trial_context(self)}", flush=True)
            report = await publisher.publish(str(start_path), start_version)
            print(
                f"simloop train-agent: serving policy v{start_version} "
                f"({report.first_token_s:.2f}s to first token)",
                flush=True,
            )

            def evaluate(label: str, version: int) -> Any:
                return evaluate_agent(
                    out=out,
                    label=label,
                    version=version,
                    agent=clients["agent"],
                    backends=lambda: self.backends(clients.get("simulator")),
                    renderer=self.renderer,
                    tasks=self.eval_tasks,
                    metrics=metrics,
                    eval_cfg=ecfg,
                    orchestrator=ocfg,
                    terminal=self.terminal,
                    seed=self.seed,
                )

            before = None
            if evaluating and ecfg.before:
                before = rundir.read_evals(out).get("before") or await evaluate(
                    "before", start_version
                )
            remaining = tcfg.steps - trainer.step_count
            gated = runner = writer = None
            if swe:
                if self.harness is None:
                    raise ValueError("train_agent.tasks=swe needs the session's harness setup")
                buffer = await stack.enter_async_context(
                    harness_source(
                        self.harness,
                        self.backends(None).real,
                        agent,
                        self.tasks,
                        group_size=ocfg.group_size,
                        batch_size=ocfg.batch_size,
                        seq_len=seq_len,
                        max_staleness=ocfg.max_staleness,
                        steps=remaining,
                        seed=self.seed + start_version,
                    )
                )
            else:
                backends = self.backends(clients.get("simulator"))
                if ocfg.arm == "gated":
                    sim_pub = servers.publisher("simulator") if "simulator" in publishes else None
                    gated = GatedRun(
                        ocfg.gate,
                        out,
                        self.renderer,
                        backends,
                        metrics,
                        seed=self.seed,
                        sim=self.cotrain,
                        sim_publisher=sim_pub,
                        steps=remaining,
                        start_version=start_version,
                    )
                writer = TrajectoryWriter(out, prefix="rl")
                queue: asyncio.Queue = asyncio.Queue()  # the runner delivers, the buffer reads
                store = gated.sink(writer.add) if gated else writer.add
                runner = RolloutRunner(
                    ocfg,
                    self.terminal,
                    self.renderer,
                    backends,
                    client=agent,
                    sinks=(store, queue.put_nowait),
                    router=gated and gated.router,
                    shadow=gated and gated.shadow,
                )
                buffer = RolloutBuffer(
                    runner,
                    self.tasks,
                    queue=queue,
                    steps=remaining,
                    seed=self.seed + start_version,
                    batch_timeout_s=ocfg.episode_timeout_s * 2,
                )
                if gated:
                    buffer = gated.buffer(buffer)
            await buffer.start(start_version)
            try:
                summary = await rl_loop(
                    trainer, buffer, publisher, log=metrics, ckpt=ckpt, **self._loop_kwargs(seq_len)
                )
            finally:
                await buffer.close()
                if gated is not None:
                    summary_gate = await gated.close()
                if runner is not None:
                    writer.close()
                    runner.metrics.write(rundir.MetricsLog(out), stage="rl_rollout", arm=ocfg.arm)
                else:
                    rundir.MetricsLog(out).write({"stage": "rl_harness", **harness_summary(buffer)})
            if runner is not None:
                summary["episodes_by_arm"] = runner.metrics.summary()["arms"]
            if gated is not None:
                summary["gate"] = summary_gate
            if evaluating:
                after = await evaluate("after", 1 + trainer.step_count)
                summary["eval"] = {
                    arm: {
                        "before": before[arm]["success_rate"] if before and arm in before else None,
                        "after": after[arm]["success_rate"],
                    }
                    for arm in after
                }
        if swe:
            summary["harness"] = harness_summary(buffer)
        history = summary.pop("history")
        rewards = [h["reward_mean"] for h in history]
        summary["reward_first"] = rewards[0] if rewards else None
        summary["reward_last"] = rewards[-1] if rewards else None
        return summary


def trial_context(session: RLSession) -> str:
    """What a K-trial episode's context holds besides its observations, said before RL starts:
    the longest task prompt, every reply at its `max_tokens_per_turn` budget and each failed
    trial's feedback, against `orchestrator.max_context_tokens`. Observations come on top; an
    episode that still runs out ends `truncated` ("context full"), and each RL step counts
    those (`truncated_context`)."""
    import string

    term, ocfg, renderer = session.terminal, session.orchestrator, session.renderer
    per = term.turns_per_trial or term.max_turns
    turns = min(per * term.trials, term.max_turns)
    prompt = max(
        len(renderer.render([{"role": "user", "content": term.prompt_template.format(
            instruction=t.instruction)}], add_generation_prompt=True))
        for t in list(session.tasks)[:64]
    )  # fmt: skip
    fields = [f for _, f, _, _ in string.Formatter().parse(term.trial_feedback_template) if f]
    feedback = len(
        renderer.render(
            [{"role": "user", "content": term.trial_feedback_template.format(**dict.fromkeys(
                fields, ""))}]
        )
    )  # fmt: skip
    need = prompt + turns * ocfg.max_tokens_per_turn + (term.trials - 1) * feedback
    fits = "fits" if need <= ocfg.max_context_tokens else "does NOT fit"
    reached = -(-turns // per)  # trials that get a turn at all
    unreached = (
        f" env.terminal.max_turns={term.max_turns} leaves trial {reached + 1} on no turn at "
        f"all (each trial takes up to {per}): set env.terminal.turns_per_trial or raise "
        "max_turns."
        if reached < term.trials
        else ""
    )
    return (
        f"{term.trials} trials x {per} turns (at most {turns} turns): a prompt of up to {prompt} "
        f"tokens, {turns} replies of up to {ocfg.max_tokens_per_turn} and {term.trials - 1} "
        f"feedback message(s) of ~{feedback} need up to {need} tokens before observations; "
        f"orchestrator.max_context_tokens={ocfg.max_context_tokens} {fits} (episodes that run "
        "out end `truncated`, counted per step as truncated_context)" + unreached
    )
