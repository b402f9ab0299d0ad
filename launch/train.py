"""`simloop train-sim` and `simloop train-agent`: the trainers as jobs with a run directory.

    simloop train-sim --config configs/demo_cpu.yaml --out runs/sim \\
        --train_sim.trajectories '[runs/collect/trajectories]'
    simloop train-agent --config configs/demo_cpu.yaml --out runs/agent

Both write `config.yaml`, `metrics.jsonl`, `checkpoints/` and `weights/` into `--out`, show
progress, and resume from the newest checkpoint when `--out` already holds one (run the same
command again after a crash). train-agent starts (or uses `agent.server_url` /
`simulator.server_url`) the servers its rollouts need, publishes every new policy version to
the agent server, and writes the RL episodes to `trajectories/`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import secrets
import sys
from pathlib import Path
from typing import Any

from launch.config import write_config
from launch.schema import RoleConfig, SimloopConfig

ADMIN_TOKEN_ENV = "SIMLOOP_ADMIN_TOKEN"


def is_heldout(task_id: str, fraction: float) -> bool:
    """Stable split by task id: the same task is on the same side in every job."""
    h = int.from_bytes(hashlib.sha256(task_id.encode()).digest()[:8], "big") / 2**64
    return h < fraction


def _model_and_params(role: RoleConfig):
    """(architecture, host params from `hf_path` or None, serving `weights` dir or None)."""
    if role.weights:
        from rl.model.params_io import read_model_config

        return read_model_config(role.weights), None, role.weights
    if role.hf_path:
        from flax import nnx

        from rl.model import load_hf

        cfg, model = load_hf(role.hf_path)
        return cfg, nnx.to_pure_dict(nnx.state(model, nnx.Param)), None
    return role.model, None, None


def make_trainer(
    role: RoleConfig,
    cfg: SimloopConfig,
    tokenizer,
    *,
    optim,
    steps: int,
    loss: str,
    loss_cfg=None,
    init_params=None,
    reference=False,
):
    """The role's `Trainer` on its own sub-mesh, starting from `init_params` if given, else
    from the role's weights / HF checkpoint, else a random init."""
    import jax

    from launch.chips import trainer_device_ids
    from rl.train.mesh import role_meshes
    from rl.train.trainer import Trainer

    model_cfg, hf_params, weights = _model_and_params(role)
    params = hf_params if init_params is None else init_params
    model_role = "agent" if role is cfg.agent else "simulator"
    ids = trainer_device_ids(cfg, model_role, jax.device_count())
    mesh = role_meshes({"trainer": role.mesh}, device_ids=None if ids is None else {"trainer": ids})
    trainer = Trainer(
        model_cfg,
        optim,
        total_steps=steps,
        loss=loss,
        loss_cfg=loss_cfg,
        mesh=mesh["trainer"],
        rules=cfg.sharding.rules,
        # ids the sampler may draw, which the trainer must normalise over (serving's sampler)
        valid_vocab=min(model_cfg.vocab_size, tokenizer.vocab_size),
        seed=cfg.run.seed,
        init_params=params,
        reference=reference,
    )
    if params is None and weights is not None:
        # Orbax restores straight into the trainer's placement, so load after building it.
        trainer.reset_params(trainer.load_serving(weights))
    return trainer


def _export(trainer, out: Path, name: str, ckpt_cfg) -> Path:
    path = trainer.export_serving(out / "weights" / name, ckpt_cfg.export_dtype)
    if ckpt_cfg.export_hf:
        trainer.export_hf(out / "weights" / f"{name}-hf", ckpt_cfg.export_dtype)
    return path


# ----- train-sim --------------------------------------------------------------------------------


def run_train_sim(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    if not args.out:
        print("simloop train-sim: --out DIR is required", file=sys.stderr)
        return 2
    tcfg = cfg.train_sim
    if not tcfg.trajectories:
        print(
            "simloop train-sim: train_sim.trajectories is empty: point it at real trajectories "
            "(JSONL files or folders from `simloop collect` / `simloop import`), e.g. "
            "--train_sim.trajectories '[runs/collect/trajectories]'",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    write_config(cfg, out)
    from rl.data import load_tokenizer
    from rl.data.datasets import sim_sft_dataset
    from rl.data.trajectory import load_trajectories
    from rl.train.checkpoint import Checkpointer
    from rl.train.loop import MetricsLog, resume, sft_loop

    trajs = load_trajectories(tcfg.trajectories)
    train = [t for t in trajs if not is_heldout(t.task_id, tcfg.heldout_fraction)]
    heldout = sorted({t.task_id for t in trajs} - {t.task_id for t in train})
    (out / "heldout_tasks.json").write_text(json.dumps(heldout, indent=1))
    tok = load_tokenizer(cfg.simulator.tokenizer)
    sim_shell = cfg.env.shell.simulated  # the prompt the simulated shell will ask with
    ds, stats = sim_sft_dataset(train, tok, tcfg.data, system_prompt=sim_shell.system_prompt,
                                show_task=sim_shell.show_task)  # fmt: skip
    print(
        f"simloop train-sim: {len(train)} trajectories ({len(heldout)} tasks held out) -> "
        f"{stats.examples} examples, {stats.target_tokens} target tokens",
        flush=True,
    )
    trainer = make_trainer(cfg.simulator, cfg, tok, optim=tcfg.optim, steps=tcfg.steps, loss="sft")
    batches = iter(ds)
    with Checkpointer(out / "checkpoints", tcfg.checkpoint) as ckpt:
        if resume(trainer, ckpt, batches) is not None:
            print(f"simloop train-sim: resuming at step {trainer.step_count}", flush=True)
        summary = sft_loop(
            trainer,
            batches,
            steps=tcfg.steps,
            log=MetricsLog(out),
            stage="sim_sft",
            log_every=tcfg.log_every,
            ckpt=ckpt,
            ckpt_every=tcfg.checkpoint.every_steps,
        )
    path = _export(trainer, out, "final", tcfg.checkpoint)
    last = summary["last"]
    print(
        f"simloop train-sim: step {summary['steps']} loss {last.get('loss', float('nan')):.4f} "
        f"({summary['tokens_per_s']:.0f} target tok/s, {summary['wall_s']:.0f}s) -> {path}"
    )
    return 0


# ----- train-agent ------------------------------------------------------------------------------


def sim_server_args(cfg: SimloopConfig) -> list[str]:
    """Extra `simloop serve` flags of a local simulator server: its KV cache holds one
    simulator context (`env.shell.simulated.max_context_tokens`) when that is set, since
    decode attends over the whole cache length."""
    n = cfg.env.shell.simulated.max_context_tokens
    return [] if n is None else ["--max-seq-len", str(n)]


def _needs_sim(arm: str) -> bool:
    return arm in ("closed_loop", "mixed")


def run_train_agent(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    if not args.out:
        print("simloop train-agent: --out DIR is required", file=sys.stderr)
        return 2
    ocfg = cfg.orchestrator
    if ocfg.arm == "replay":
        print(
            "simloop train-agent: orchestrator.arm=replay has no agent to train; use real, "
            "closed_loop or mixed",
            file=sys.stderr,
        )
        return 2
    if ocfg.max_staleness is None:
        print(
            "simloop train-agent: set orchestrator.max_staleness (0 = synchronous RL, S > 0 "
            "lets rollouts run up to S versions ahead)",
            file=sys.stderr,
        )
        return 2
    if ocfg.batch_size % ocfg.group_size:
        print(
            f"simloop train-agent: orchestrator.batch_size={ocfg.batch_size} must be a "
            f"multiple of orchestrator.group_size={ocfg.group_size}",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    write_config(cfg, out)
    summary = asyncio.run(train_agent(cfg, out))
    print(f"simloop train-agent: {json.dumps(summary)}")
    return 0


async def collect_demos(cfg: SimloopConfig, tasks, renderer, n: int) -> list:
    """Scripted episodes (marker style, one turn) in the real shell: experts, with
    `warm_start.noise` of them imperfect (those are kept: they are the demonstrations)."""
    from launch.backends import shell_backends
    from rl.orchestrator.config import OrchestratorConfig
    from rl.orchestrator.runner import RolloutRunner
    from rl.orchestrator.scripted import ScriptedAgentClient

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
    )
    runner = RolloutRunner(
        ocfg,
        cfg.env.terminal,
        renderer,
        shell_backends(cfg),
        client=client,
    )
    demos = await runner.run([tasks[i % len(tasks)] for i in range(n)])
    return [t for t in demos if t.status in ("ok", "truncated") and t.turns]


def agent_tasks(cfg: SimloopConfig) -> tuple[list, list]:
    """(training tasks, held-out evaluation tasks): `env.textops.num_tasks` tasks, then
    `train_agent.eval.tasks` more from the same seeded generator (a prefix-stable stream)."""
    import dataclasses

    from envs.textops import generate_textops

    n, k = cfg.env.textops.num_tasks, cfg.train_agent.eval.tasks
    tasks = generate_textops(dataclasses.replace(cfg.env.textops, num_tasks=n + k))
    return tasks[:n], tasks[n:]


async def train_agent(cfg: SimloopConfig, out: Path) -> dict[str, Any]:
    from rl.data import ChatRenderer, load_tokenizer
    from rl.data.datasets import agent_sft_dataset
    from rl.data.trajectory import load_trajectories, write_jsonl
    from rl.train.checkpoint import Checkpointer, export_path
    from rl.train.loop import MetricsLog, resume, sft_loop

    tcfg, ocfg = cfg.train_agent, cfg.orchestrator
    tok = load_tokenizer(cfg.agent.tokenizer)
    renderer = ChatRenderer(tok)
    tasks, eval_tasks = agent_tasks(cfg)
    metrics = MetricsLog(out)
    summary: dict[str, Any] = {}
    rl_ckpt_dir = out / "checkpoints" / "rl"
    init_params = None
    ws = tcfg.warm_start
    resuming_rl = rl_ckpt_dir.exists() and any(p.name.isdigit() for p in rl_ckpt_dir.iterdir())
    if ws.steps > 0 and not resuming_rl:
        if ws.trajectories:
            demos = load_trajectories(ws.trajectories)
        else:
            demos = await collect_demos(cfg, tasks, renderer, ws.num_demos)
            write_jsonl(out / "trajectories" / "demos.jsonl", demos)
        print(f"simloop train-agent: warm start on {len(demos)} demonstrations", flush=True)
        ds, _ = agent_sft_dataset(demos, renderer, ws.data)
        trainer = make_trainer(cfg.agent, cfg, tok, optim=ws.optim, steps=ws.steps, loss="sft")
        batches = iter(ds)
        with Checkpointer(out / "checkpoints" / "warm_start", tcfg.checkpoint) as ckpt:
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
    if tcfg.steps == 0:
        return summary
    from rl.train.config import PolicyLossConfig

    loss_cfg: PolicyLossConfig = tcfg.loss
    trainer = make_trainer(
        cfg.agent,
        cfg,
        tok,
        optim=tcfg.optim,
        steps=tcfg.steps,
        loss="policy",
        loss_cfg=loss_cfg,
        init_params=init_params,
        reference=loss_cfg.kl_coef > 0,
    )
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
    final = _export(trainer, out, "final", tcfg.checkpoint)
    summary["weights"] = str(final)
    return summary


def read_evals(out: Path) -> dict:
    """`eval.json` of a run directory ({label: {arm: result}}), or {} before the first."""
    path = out / "eval.json"
    return json.loads(path.read_text()) if path.exists() else {}


async def evaluate_agent(
    cfg, out, label, version, clients, renderer, tasks, metrics, who="train-agent"
) -> dict:
    """Evaluate the served policy (`version`) on the held-out tasks in every
    `train_agent.eval.arms`; results go to `eval.json` (under `label`), `metrics.jsonl` and
    `trajectories/eval-*`. `who` names the subcommand in the progress lines."""
    from launch.backends import shell_backends
    from rl.orchestrator.evaluate import evaluate_policy
    from rl.orchestrator.storage import TrajectoryWriter

    ecfg = cfg.train_agent.eval
    title = f"{label} RL" if who == "train-agent" else label
    policy = "policy" if version is None else f"policy v{version}"
    saved = read_evals(out)
    results = {}
    for arm in ecfg.arms:
        writer = TrajectoryWriter(out, prefix=f"eval-{label}-{arm}")
        try:
            r = await evaluate_policy(
                cfg.orchestrator,
                cfg.env.terminal,
                renderer,
                shell_backends(cfg, clients.get("simulator")),
                clients["agent"],
                tasks,
                arm=arm,
                samples=ecfg.samples,
                seed=cfg.run.seed + 1_000_003,
                version=version,
                sink=writer.add,
            )
        finally:
            writer.close()
        results[arm] = r.to_dict()
        metrics.write({"stage": "eval", "label": label, **results[arm]})
        kinds = " ".join(f"{k} {v['success_rate']:.2f}" for k, v in r.by_kind.items())
        print(
            f"simloop {who}: eval {title}, {arm}: {policy} success "
            f"{r.success_rate:.3f} over {r.episodes} episodes ({kinds}) in {r.wall_s:.0f}s",
            flush=True,
        )
    saved[label] = results
    (out / "eval.json").write_text(json.dumps(saved, indent=1))
    return results


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
    from launch.backends import shell_backends
    from launch.chips import server_env
    from launch.local import LocalServer
    from rl.orchestrator.buffer import RolloutBuffer
    from rl.orchestrator.runner import RolloutRunner
    from rl.orchestrator.storage import TrajectoryWriter
    from rl.train.loop import rl_loop
    from serving.client import ClientConfig, InferenceClient
    from serving.publisher import EnginePublisher

    tcfg, ocfg = cfg.train_agent, cfg.orchestrator
    token = os.environ.get(ADMIN_TOKEN_ENV) or secrets.token_hex(16)
    with contextlib.ExitStack() as stack:
        urls = {"agent": cfg.agent.server_url}
        if urls["agent"] is None:
            print("simloop train-agent: starting a local agent server ...", flush=True)
            # The KV cache holds one episode's context: decode attends over all of it.
            args = ["--admin-token", token, "--checkpoint-root", str(out.absolute()),
                    "--max-seq-len", str(ocfg.max_context_tokens)]  # fmt: skip
            urls["agent"] = stack.enter_context(
                LocalServer.start("agent", out, extra_args=args, env=server_env(cfg, "agent"))
            ).url
        elif ADMIN_TOKEN_ENV not in os.environ:
            raise SystemExit(
                f"agent.server_url is set: export {ADMIN_TOKEN_ENV} (the server's "
                "admin token) so new weights can be published to it"
            )
        ecfg = tcfg.eval
        evaluating = ecfg.tasks > 0 and bool(eval_tasks)
        if _needs_sim(ocfg.arm) or (evaluating and "closed_loop" in ecfg.arms):
            urls["simulator"] = (
                cfg.simulator.server_url
                or stack.enter_context(
                    LocalServer.start(
                        "simulator",
                        out,
                        extra_args=sim_server_args(cfg),
                        env=server_env(cfg, "simulator"),
                    )  # fmt: skip
                ).url
            )
        async with contextlib.AsyncExitStack() as astack:
            clients = {}
            for role, url in urls.items():
                c = InferenceClient(ClientConfig(url, timeout_s=ocfg.request_timeout_s))
                clients[role] = await astack.enter_async_context(c)
                await c.wait_healthy(timeout_s=300)
            publisher = EnginePublisher([clients["agent"]], token=token)
            report = await publisher.publish(str(start_path), start_version)
            print(
                f"simloop train-agent: serving policy v{start_version} "
                f"({report.first_token_s:.2f}s to first token)",
                flush=True,
            )
            before = None
            if evaluating:
                before = read_evals(out).get("before") or await evaluate_agent(
                    cfg, out, "before", start_version, clients, renderer, eval_tasks, metrics
                )
            backends = shell_backends(cfg, clients.get("simulator"))
            runner = RolloutRunner(
                ocfg, cfg.env.terminal, renderer, backends, client=clients["agent"]
            )
            writer = TrajectoryWriter(out, prefix="rl")
            remaining = tcfg.steps - trainer.step_count
            buffer = RolloutBuffer(
                runner,
                tasks,
                steps=remaining,
                seed=cfg.run.seed + start_version,
                sink=writer.add,
                batch_timeout_s=ocfg.episode_timeout_s * 2,
            )
            await buffer.start(start_version)
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
                writer.close()
                runner.metrics.write(out / "metrics.jsonl", stage="rl_rollout", arm=ocfg.arm)
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
                        "before": before[arm]["success_rate"] if arm in before else None,
                        "after": after[arm]["success_rate"],
                    }
                    for arm in after
                }
    history = summary.pop("history")
    rewards = [h["reward_mean"] for h in history]
    summary["reward_first"] = rewards[0] if rewards else None
    summary["reward_last"] = rewards[-1] if rewards else None
    return summary
