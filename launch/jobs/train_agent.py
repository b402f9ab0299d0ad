"""`simloop train-agent`: SFT warm start on scripted demonstrations, then RL on live episodes
(in the real shell, in closed loop with the simulator, or a mix), evaluated before and after.

    simloop train-agent --config configs/demo_cpu.yaml --out runs/agent

Writes `config.yaml`, `metrics.jsonl`, `eval.json`, `checkpoints/`, `weights/` and the RL
episodes (`trajectories/`) into `--out`, shows progress, and resumes from the newest
checkpoint when `--out` already holds one. With a KL term (`train_agent.loss.kl_coef > 0`)
the policy RL starts from is kept as `weights/rl_reference` (with its manifest), and a
resumed run anchors the KL term to it, not to whatever the trainer was rebuilt from. It
starts (or uses `agent.server_url` / `simulator.server_url`) the servers its rollouts need
and publishes every new policy version to the agent servers: over `/admin/load_weights` to
simloop's own (`serve.backend: jax`), or to vLLM's worker extension over `/collective_rpc`
(`vllm`, `serving.vllm.VllmPublisher`). `--dry-run [--format json]` prints the processes
it would start (its servers and itself, on their chips) and starts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
from pathlib import Path
from typing import Any

from launch.config import write_config
from launch.config.schema import SimloopConfig, role_model
from launch.deploy.processes import print_dry_run
from launch.jobs.episodes import agent_tasks, check_servers, evaluate_agent, job_backends
from launch.jobs.errors import JobError, UsageError
from rl.data import rundir

ADMIN_TOKEN_ENV = "SIMLOOP_ADMIN_TOKEN"
REFERENCE = "rl_reference"
"""`weights/<REFERENCE>`: the KL reference of the run's RL (the policy RL started from)."""


class Published:
    """A `WeightPublisher` that remembers the version it last published."""

    def __init__(self, inner):
        self.inner, self.version = inner, None

    async def publish(self, path: str, version: int):
        report = await self.inner.publish(path, version)
        self.version = version
        return report


class VersionTagged:
    """The agent client of a vLLM backend: tags each completion with the policy version
    `published` last published before the request was sent.

    vLLM's responses carry no weight version. For synchronous RL (`max_staleness: 0`) the tag
    is exact: no episode is admitted between a batch and the publish of the next version, so
    no request is in flight while weights change. For asynchronous RL a publish may land while
    a request decodes, so some of its tokens may come from the newer weights; the tag is then
    the older version, which can overstate a token's staleness but never understate it."""

    def __init__(self, client, published: Published):
        self.client, self.published = client, published

    def __getattr__(self, name: str):
        return getattr(self.client, name)

    async def complete(self, *args, **kwargs):
        version = self.published.version
        out = await self.client.complete(*args, **kwargs)
        if out.weight_version is None and out.token_versions is None:
            out.weight_version = version
        return out


def _needs_sim(arm: str) -> bool:
    return arm in ("closed_loop", "mixed", "gated")


def _publishes(cfg: SimloopConfig) -> list[str]:
    """The roles that receive weights during the job: the agent, and the simulator when the
    gated arm co-trains it."""
    ocfg = cfg.orchestrator
    cotrain = ocfg.arm == "gated" and ocfg.gate.cotrain_every > 0 and cfg.train_agent.steps > 0
    return ["agent", "simulator"] if cotrain else ["agent"]


def _roles(cfg: SimloopConfig) -> list[str]:
    """The model roles whose servers RL and its evaluation need."""
    ocfg, ecfg = cfg.orchestrator, cfg.train_agent.eval
    roles = ["agent"] if cfg.train_agent.steps > 0 else []
    if cfg.train_agent.tasks == "swe":
        return roles
    if roles and (_needs_sim(ocfg.arm) or (ecfg.tasks > 0 and "closed_loop" in ecfg.arms)):
        roles.append("simulator")
    return roles


def run(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    if getattr(args, "dry_run", False):
        return print_dry_run(args, cfg, "train-agent", _roles(cfg), publishes=_publishes(cfg))
    if not args.out:
        raise UsageError("--out DIR is required")
    ocfg = cfg.orchestrator
    if ocfg.arm == "replay":
        raise UsageError(
            "orchestrator.arm=replay has no agent to train; use real, closed_loop, mixed or gated"
        )
    if ocfg.max_staleness is None:
        raise UsageError(
            "set orchestrator.max_staleness (0 = synchronous RL, S > 0 lets rollouts run up "
            "to S versions ahead)"
        )
    if ocfg.batch_size % ocfg.group_size:
        raise UsageError(
            f"orchestrator.batch_size={ocfg.batch_size} must be a multiple of "
            f"orchestrator.group_size={ocfg.group_size}"
        )
    publish_every = cfg.train_agent.publish_every
    if publish_every > 1 + ocfg.max_staleness:
        # Staleness is judged by the version an episode started at; a server that lags the
        # trainer by up to publish_every - 1 versions would break the bound unseen.
        raise UsageError(
            f"train_agent.publish_every={publish_every} is invalid with "
            f"orchestrator.max_staleness={ocfg.max_staleness}: at most max_staleness + 1, or "
            "trained tokens could be more than max_staleness versions old"
        )
    jax_agent = cfg.serve.backend_of("agent") == "jax"
    if jax_agent and cfg.agent.server_url is not None and ADMIN_TOKEN_ENV not in os.environ:
        raise UsageError(
            f"agent.server_url is set: export {ADMIN_TOKEN_ENV} (the server's admin token) so "
            "new weights can be published to it"
        )
    if cfg.train_agent.tasks == "swe" and ocfg.arm == "gated":
        raise UsageError("train_agent.tasks=swe runs harnesses in real sandboxes: there is no "
                         "simulator to gate; use orchestrator.arm real")  # fmt: skip
    if cfg.train_agent.tasks == "swe":
        cfg = _swe_config(cfg)
    check_servers(cfg, _roles(cfg))
    out = Path(args.out)
    write_config(cfg, out)
    from rl.train.loop import TrainingDiverged
    from serving.publisher import PublishError
    from serving.vllm.publisher import VllmPublishError

    try:
        summary = asyncio.run(train_agent(cfg, out))
    except (TrainingDiverged, PublishError, VllmPublishError) as e:
        raise JobError(f"{e}; RL stopped (the last checkpoint is kept)") from e
    print(f"simloop train-agent: {json.dumps(summary)}")
    return 0


def _swe_config(cfg: SimloopConfig) -> SimloopConfig:
    """Checks and settings of RL through harnesses (`train_agent.tasks: swe`)."""
    from launch.jobs.harness import harness_shell

    ws = cfg.train_agent.warm_start
    if ws.steps > 0 and not ws.trajectories:
        raise UsageError(
            "train_agent.tasks=swe has no scripted demonstrations to warm-start on: set "
            "--train_agent.warm_start.steps 0 (RL from agent.weights) or give "
            "train_agent.warm_start.trajectories"
        )
    if cfg.orchestrator.max_staleness != 0:
        raise UsageError("train_agent.tasks=swe runs synchronous RL: set "
                         "--orchestrator.max_staleness 0")  # fmt: skip
    return harness_shell(cfg)


async def collect_demos(cfg: SimloopConfig, tasks, renderer, n: int) -> list:
    """Scripted episodes (marker style, one turn) in the real shell: experts, with
    `warm_start.noise` of them imperfect (those are kept: they are the demonstrations)."""
    from rl.orchestrator.config import OrchestratorConfig
    from rl.orchestrator.runner import RolloutRunner
    from rl.orchestrator.scripted import ScriptedAgentClient, feedback_marker

    o = cfg.orchestrator
    ocfg = OrchestratorConfig(
        arm="real",
        group_size=1,
        max_context_tokens=o.max_context_tokens,
        max_tokens_per_turn=o.max_tokens_per_turn,
        seed=cfg.run.seed,
        max_concurrent_episodes=8,
    )
    ws = cfg.train_agent.warm_start
    client = ScriptedAgentClient(
        tasks,
        renderer.tokenizer,
        style="marker",
        noise=ws.noise,
        noise_kinds=ws.noise_kinds,
        seed=cfg.run.seed,
        # Multi-trial demonstrations restart their script after each feedback and, on a
        # hidden-operation task, do what the checker's verdict names: they adapt.
        trial_marker=feedback_marker(cfg.env.terminal.trial_feedback_template),
    )
    runner = RolloutRunner(
        ocfg,
        cfg.env.terminal,
        renderer,
        job_backends(cfg),
        client=client,
    )
    demos = await runner.run([tasks[i % len(tasks)] for i in range(n)])
    return [t for t in demos if t.status in ("ok", "truncated") and t.turns]


def _trainer(cfg: SimloopConfig, tok, **kwargs):
    from launch.config.memory import check_trainer_memory
    from launch.deploy.chips import trainer_device_ids
    from rl.train.build import build_trainer

    ids = trainer_device_ids(cfg, "agent")
    check_trainer_memory(role_model(cfg.agent), ids, "the agent trainer")
    return build_trainer(cfg.agent, tok, rules=cfg.sharding.rules, seed=cfg.run.seed,
                         device_ids=ids, **kwargs)  # fmt: skip


def rl_trainer(cfg: SimloopConfig, tok, out: Path, init_params, *, resuming: bool):
    """The RL trainer. With a KL term its frozen reference is the policy RL starts from: a
    fresh run stores it as `weights/rl_reference`; a resumed one (whose trainer is rebuilt
    without the warm start) loads it back from there, verified."""
    tcfg = cfg.train_agent
    kl = tcfg.loss.kl_coef > 0
    trainer = _trainer(cfg, tok, optim=tcfg.optim, steps=tcfg.steps, loss="policy",
                       loss_cfg=tcfg.loss, init_params=init_params, reference=kl)  # fmt: skip
    if not kl:
        return trainer
    stored = out / rundir.WEIGHTS / REFERENCE
    if resuming:
        if not stored.is_dir():
            raise JobError(
                f"cannot resume RL with a KL term: its reference weights {stored} are missing "
                f"(move {out / rundir.CHECKPOINTS / 'rl'} away to start RL over)"
            )
        trainer.set_reference(trainer.load_serving(stored, require_manifest=True))
    else:
        trainer.export_serving(stored)  # in the trainer's dtype: exactly the reference
    return trainer


async def train_agent(cfg: SimloopConfig, out: Path) -> dict[str, Any]:
    from rl.data import ChatRenderer, load_tokenizer
    from rl.data.datasets import agent_sft_dataset
    from rl.data.trajectory import load_trajectories, write_jsonl
    from rl.train.build import export_weights
    from rl.train.checkpoint import Checkpointer, export_path
    from rl.train.loop import resume, sft_loop

    tcfg, ocfg = cfg.train_agent, cfg.orchestrator
    tok = load_tokenizer(cfg.agent.tokenizer)
    renderer = ChatRenderer(tok)
    if tcfg.tasks == "swe":
        from envs.swe_suite import swe_suite

        tasks, eval_tasks = swe_suite(cfg.harness.tasks or None), []
    else:
        tasks, eval_tasks = agent_tasks(cfg)
    metrics = rundir.MetricsLog(out)
    summary: dict[str, Any] = {}
    rl_ckpt_dir = out / rundir.CHECKPOINTS / "rl"
    init_params = None
    ws = tcfg.warm_start
    resuming_rl = rl_ckpt_dir.exists() and any(p.name.isdigit() for p in rl_ckpt_dir.iterdir())
    if ws.steps > 0 and not resuming_rl:
        if ws.trajectories:
            demos = load_trajectories(ws.trajectories)
        else:
            demos = await collect_demos(cfg, tasks, renderer, ws.num_demos)
            write_jsonl(out / rundir.TRAJECTORIES / "demos.jsonl", demos)
        print(f"simloop train-agent: warm start on {len(demos)} demonstrations", flush=True)
        ds, _ = agent_sft_dataset(demos, renderer, ws.data)
        trainer = _trainer(cfg, tok, optim=ws.optim, steps=ws.steps, loss="sft")
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
    trainer = rl_trainer(cfg, tok, out, init_params, resuming=resuming_rl)
    seq_len = tcfg.seq_len or ocfg.max_context_tokens
    with Checkpointer(rl_ckpt_dir, tcfg.checkpoint) as ckpt:
        extra = resume(trainer, ckpt)
        if extra is not None:
            print(f"simloop train-agent: resuming RL at step {trainer.step_count}", flush=True)
        start_version = 1 + trainer.step_count
        start_path = export_path(out, start_version)
        await asyncio.to_thread(trainer.export_serving, start_path, tcfg.checkpoint.export_dtype)
        summary["rl"] = await _rl(
            cfg,
            out,
            trainer,
            tasks,
            renderer,
            ckpt,
            metrics,
            seq_len,
            start_path,
            start_version,
            eval_tasks,
        )
    final = export_weights(trainer, out, "final", tcfg.checkpoint)
    summary["weights"] = str(final)
    return summary


@contextlib.asynccontextmanager
async def _harness_source(cfg, out: Path, agent_client, tasks, steps: int, version: int):
    """The middleware in front of the agent server and a `HarnessSource` running
    `harness.kind` against it: RL episodes from unmodified harnesses."""
    from envs.backends import shell_backends
    from launch.jobs.middleware import running_middleware
    from rl.orchestrator.harness import (
        HarnessRunner,
        HarnessSource,
        HarnessUnavailable,
        pick_launcher,
    )

    ocfg = cfg.orchestrator
    real = shell_backends(cfg.env.shell, run_id=cfg.run.name).real
    try:
        launcher = await pick_launcher(cfg.harness, real, tasks[0])
    except HarnessUnavailable as e:
        raise JobError(str(e)) from e

    def written(trajectories) -> None:  # the middleware's sink -> the source (bound below)
        source.collect(trajectories)

    async with running_middleware(cfg, out, agent_client, on_written=written) as running:
        url = running.url
        runner = HarnessRunner(cfg.harness, real, url, launcher, admin=running.admin)
        source = HarnessSource(runner, tasks, group_size=ocfg.group_size,
                               groups=ocfg.batch_size // ocfg.group_size, rows=ocfg.batch_size,
                               steps=steps, seed=cfg.run.seed + version)  # fmt: skip
        print(f"simloop train-agent: RL through {cfg.harness.kind} on {len(tasks)} swe tasks, "
              f"{ocfg.batch_size // ocfg.group_size} x {ocfg.group_size} rollouts per step "
              f"(middleware {url})", flush=True)  # fmt: skip
        yield source


def _harness_summary(source) -> dict:
    results = source.results
    rewards = [r.reward for r in results if r.reward is not None]
    statuses: dict[str, int] = {}
    for r in results:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    return {"rollouts": len(results), "statuses": statuses,
            "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "trajectories": sum(r.finish.get("trajectories") or 0 for r in results),
            "dropped_segments": source.dropped_segments}  # fmt: skip


async def _rl(
    cfg,
    out,
    trainer,
    tasks,
    renderer,
    ckpt,
    metrics,
    seq_len,
    start_path,
    start_version,
    eval_tasks,
) -> dict:
    from launch.deploy.local import role_clients
    from rl.orchestrator.buffer import RolloutBuffer
    from rl.orchestrator.runner import RolloutRunner
    from rl.orchestrator.storage import TrajectoryWriter
    from rl.train.loop import rl_loop
    from serving.pool import PoolPublisher, ReplicaPool
    from serving.publisher import EnginePublisher
    from serving.vllm.publisher import VllmPublisher

    tcfg, ocfg = cfg.train_agent, cfg.orchestrator
    token = os.environ.get(ADMIN_TOKEN_ENV) or secrets.token_hex(16)
    ecfg = tcfg.eval
    evaluating = ecfg.tasks > 0 and bool(eval_tasks)
    roles = ["agent"]
    if tcfg.tasks != "swe" and (
        _needs_sim(ocfg.arm) or (evaluating and "closed_loop" in ecfg.arms)
    ):
        roles.append("simulator")
    vllm = cfg.serve.backend_of("agent") == "vllm"
    publishes = [r for r in _publishes(cfg) if r in roles]
    async with contextlib.AsyncExitStack() as stack:
        clients = await stack.enter_async_context(
            role_clients(
                cfg, out, roles, who="train-agent", admin_token=token, admin_roles=publishes
            )  # fmt: skip
        )
        opened: list[VllmPublisher] = []
        stack.push_async_callback(lambda: asyncio.gather(*(p.close() for p in opened)))

        def role_publisher(role: str):
            def one(urls: list[str], replicas: list):
                if cfg.serve.backend_of(role) != "vllm":
                    return EnginePublisher(replicas, token=token)
                opened.append(VllmPublisher(urls, model_name=role))
                return opened[-1]

            if isinstance(clients[role], ReplicaPool):  # each replica, ejected if it fails
                return PoolPublisher(clients[role], lambda r: one([r.url], [r.client]))
            return one(clients.urls[role], clients.replicas[role])

        publisher = Published(role_publisher("agent"))
        agent_client = VersionTagged(clients["agent"], publisher) if vllm else clients["agent"]
        report = await publisher.publish(str(start_path), start_version)
        print(
            f"simloop train-agent: serving policy v{start_version} "
            f"({report.first_token_s:.2f}s to first token)",
            flush=True,
        )
        before = None
        if evaluating and ecfg.before:
            before = rundir.read_evals(out).get("before") or await evaluate_agent(
                cfg, out, "before", start_version, clients, renderer, eval_tasks, metrics
            )
        remaining = tcfg.steps - trainer.step_count
        gated = None
        if tcfg.tasks == "swe":
            buffer = await stack.enter_async_context(
                _harness_source(cfg, out, agent_client, tasks, remaining, start_version)
            )
            runner = writer = None
        else:
            backends = job_backends(cfg, clients.get("simulator"))
            if ocfg.arm == "gated":
                from launch.jobs.cotrain import GatedRun

                sim_pub = role_publisher("simulator") if "simulator" in publishes else None
                gated = GatedRun(cfg, out, renderer, backends, metrics, sim_publisher=sim_pub,
                                 steps=remaining, start_version=start_version)  # fmt: skip
            runner = RolloutRunner(ocfg, cfg.env.terminal, renderer, backends,
                                   client=agent_client, router=gated and gated.router,
                                   shadow=gated and gated.shadow)  # fmt: skip
            writer = TrajectoryWriter(out, prefix="rl")
            buffer = RolloutBuffer(
                runner,
                tasks,
                steps=remaining,
                seed=cfg.run.seed + start_version,
                sink=gated.sink(writer.add) if gated else writer.add,
                batch_timeout_s=ocfg.episode_timeout_s * 2,
            )
            if gated:
                buffer = gated.buffer(buffer)
        if runner is not None:
            await buffer.start(start_version)
        else:
            await buffer.set_version(start_version)
        try:
            summary = await rl_loop(
                trainer,
                buffer,
                publisher,
                run_dir=out,
                steps=tcfg.steps,
                rows=ocfg.batch_size,
                seq_len=seq_len,
                loss_cfg=tcfg.loss,
                pad_id=renderer.tokenizer.pad_id,
                base_version=1,
                publish_every=tcfg.publish_every,
                export_dtype=tcfg.checkpoint.export_dtype,
                log=metrics,
                log_every=tcfg.log_every,
                ckpt=ckpt,
                ckpt_every=tcfg.checkpoint.every_steps,
            )
        finally:
            await buffer.close()
            if gated is not None:
                summary_gate = await gated.close()
            if runner is not None:
                writer.close()
                runner.metrics.write(rundir.MetricsLog(out), stage="rl_rollout", arm=ocfg.arm)
            else:
                summary_harness = _harness_summary(buffer)
                rundir.MetricsLog(out).write({"stage": "rl_harness", **summary_harness})
        if runner is not None:
            summary["episodes_by_arm"] = runner.metrics.summary()["arms"]
        if gated is not None:
            summary["gate"] = summary_gate
        if evaluating:
            after = await evaluate_agent(
                cfg,
                out,
                "after",
                1 + trainer.step_count,
                clients,
                renderer,
                eval_tasks,
                metrics,
            )
            summary["eval"] = {
                arm: {
                    "before": before[arm]["success_rate"] if before and arm in before else None,
                    "after": after[arm]["success_rate"],
                }
                for arm in after
            }
    if tcfg.tasks == "swe":
        summary["harness"] = _harness_summary(buffer)
    history = summary.pop("history")
    rewards = [h["reward_mean"] for h in history]
    summary["reward_first"] = rewards[0] if rewards else None
    summary["reward_last"] = rewards[-1] if rewards else None
    return summary
