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
from launch.deploy.dry_run import print_dry_run
from launch.errors import JobError, UsageError
from launch.jobs.episodes import check_servers

ADMIN_TOKEN_ENV = "SIMLOOP_ADMIN_TOKEN"


def _roles(cfg: SimloopConfig) -> list[str]:
    """The model roles whose servers RL and its evaluation need."""
    from rl.session import server_roles

    return server_roles(cfg.train_agent, cfg.orchestrator)


def _publishes(cfg: SimloopConfig) -> list[str]:
    """The roles that receive weights during the job: the agent, and the simulator when the
    gated arm co-trains it."""
    from rl.session import published_roles

    return published_roles(cfg.train_agent, cfg.orchestrator)


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
    dp, accum = cfg.agent.mesh.data_parallel, cfg.train_agent.optim.grad_accum
    if ocfg.batch_size % (dp * accum):
        # Checked here, not at the first RL step: by then the servers, the warm start and a
        # batch of episodes would have run for nothing.
        raise UsageError(
            f"orchestrator.batch_size={ocfg.batch_size} does not split over the policy "
            f"trainer's {dp} data-parallel devices (agent.mesh data x fsdp) "
            f"x train_agent.optim.grad_accum {accum}: use a multiple of {dp * accum}"
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
    if cfg.train_agent.swe and ocfg.arm == "gated":
        raise UsageError(
            f"train_agent.tasks={cfg.train_agent.tasks} runs harnesses in real sandboxes: "
            "there is no simulator to gate; use orchestrator.arm real"
        )
    if cfg.train_agent.swe:
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
    return harness_shell(cfg)


def _trainer(cfg: SimloopConfig, role: str, tok, **kwargs):
    """A trainer of `role`'s model on the chips the plan gives its trainer."""
    from launch.config.memory import check_trainer_memory
    from launch.deploy.chips import trainer_device_ids
    from rl.train.build import build_trainer

    rcfg = getattr(cfg, role)
    ids = trainer_device_ids(cfg, role)
    what = "the agent trainer" if role == "agent" else "the simulator co-trainer"
    check_trainer_memory(role_model(rcfg), ids, what)
    return build_trainer(
        rcfg, tok, rules=cfg.sharding.rules, seed=cfg.run.seed, device_ids=ids, **kwargs
    )


def _servers(cfg: SimloopConfig, out: Path):
    """`servers(roles, publishing)` of the session: the roles' clients (servers started here
    or found, `role_clients`) and a publisher per role, to each replica (ejected when it
    fails) over simloop's admin route or vLLM's `/collective_rpc`."""
    from launch.deploy.local import role_clients
    from rl.session import Servers
    from serving.pool import ReplicaPool
    from serving.pool_publish import PoolPublisher
    from serving.publisher import EnginePublisher
    from serving.vllm.publisher import VllmPublisher

    token = os.environ.get(ADMIN_TOKEN_ENV) or secrets.token_hex(16)

    @contextlib.asynccontextmanager
    async def servers(roles: list[str], publishing: list[str]):
        async with contextlib.AsyncExitStack() as stack:
            clients = await stack.enter_async_context(
                role_clients(
                    cfg, out, roles, who="train-agent", admin_token=token, admin_roles=publishing
                )
            )
            opened: list[VllmPublisher] = []
            stack.push_async_callback(lambda: asyncio.gather(*(p.close() for p in opened)))

            def publisher(role: str):
                def one(urls: list[str], replicas: list):
                    if cfg.serve.backend_of(role) != "vllm":
                        return EnginePublisher(replicas, token=token)
                    opened.append(VllmPublisher(urls, model_name=role))
                    return opened[-1]

                if isinstance(clients[role], ReplicaPool):
                    return PoolPublisher(clients[role], lambda r: one([r.url], [r.client]))
                return one(clients.urls[role], clients.replicas[role])

            yield Servers(clients, publisher, tag_versions=cfg.serve.backend_of("agent") == "vllm")

    return servers


def session(cfg: SimloopConfig, out: Path):
    """The job's `RLSession`: the config's components, trainers on the planned chips, the
    servers of `role_clients`, the middleware for harnesses."""
    from launch.jobs.episodes import agent_tasks, job_backends
    from launch.jobs.middleware import running_middleware
    from rl.data import ChatRenderer, load_tokenizer
    from rl.session import HarnessSetup, RLSession, SimCoTraining

    tok = load_tokenizer(cfg.agent.tokenizer)
    if cfg.train_agent.swe:
        from launch.jobs.harness import swe_tasks

        tasks, eval_tasks = swe_tasks(cfg), []
    else:
        tasks, eval_tasks = agent_tasks(cfg)

    cotrain = None
    if cfg.orchestrator.arm == "gated":
        sim_tok = load_tokenizer(cfg.simulator.tokenizer)

        def sim_trainer(optim, steps: int):
            return _trainer(cfg, "simulator", sim_tok, optim=optim, steps=steps, loss="sft")

        cotrain = SimCoTraining(cfg.train_sim, cfg.env.shell.simulated, sim_tok, sim_trainer)
    harness = HarnessSetup(
        cfg.harness, lambda agent, written: running_middleware(cfg, out, agent, on_written=written)
    )
    return RLSession(
        out,
        cfg.train_agent,
        cfg.orchestrator,
        cfg.env.terminal,
        cfg.run.seed,
        renderer=ChatRenderer(tok),
        tasks=tasks,
        eval_tasks=eval_tasks,
        trainer=lambda **kw: _trainer(cfg, "agent", tok, **kw),
        backends=lambda sim_client: job_backends(cfg, sim_client),
        servers=_servers(cfg, out),
        cotrain=cotrain,
        harness=harness,
    )


async def train_agent(cfg: SimloopConfig, out: Path) -> dict[str, Any]:
    from rl.session import HarnessUnusable, SessionError

    try:
        return await session(cfg, out).run()
    except (HarnessUnusable, SessionError) as e:
        raise JobError(str(e)) from e
