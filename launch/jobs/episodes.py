"""What the jobs that run episodes share: shell backends and tasks from the config, and the
held-out evaluation of a served policy (`train-agent` before/after RL, `eval-agent`).

    backends = job_backends(cfg, clients.get("simulator"))
    train_tasks, eval_tasks = agent_tasks(cfg)
    results = await evaluate_agent(cfg, out, "before", version, clients, renderer, eval_tasks,
                                    metrics)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from launch.config.schema import SimloopConfig
from rl.data import rundir


def check_servers(cfg: SimloopConfig, roles: list[str]) -> None:
    """UsageError (exit 2, before anything starts) when a server this job would start for
    `roles` cannot hold what is sent to it, does not fit this machine's memory, or is a
    `vllm serve` that cannot run here (not where the servers are given: `<role>.server_url`,
    `$SIMLOOP_SERVER_URLS`; nor with another `vllm.command`, e.g. the fake vLLM)."""
    from launch.config.schema import check_local_servers
    from launch.deploy.processes import external_servers
    from launch.errors import UsageError
    from serving.vllm.launcher import vllm_missing

    try:
        check_local_servers(cfg, roles)
    except ValueError as e:
        raise UsageError(str(e)) from e
    external = external_servers()
    for role in roles:
        if (
            getattr(cfg, role).server_url is not None
            or role in external
            or cfg.serve.backend_of(role) != "vllm"
            or cfg.vllm.command[:1] != ["vllm"]
        ):
            continue
        missing = vllm_missing()
        if missing is not None:
            backend = f"serve.backends.{role}" if role in cfg.serve.backends else "serve.backend"
            raise UsageError(
                f"{backend}=vllm: this job would start `vllm serve` for the {role} here, "
                f"but {missing}. Allowed: install simloop's [tpu] extra on Python >= 3.12 "
                f"(vllm-tpu), point {role}.server_url at running servers, set vllm.command "
                f"to another launcher, or serve.backends: {{{role}: jax}} (simloop's engine)"
            )


def job_backends(cfg: SimloopConfig, simulator_client=None):
    """The config's real shell and, with a simulator client, the simulated one."""
    from envs.backends import shell_backends
    from launch.errors import UsageError
    from serving.compaction import SessionCompaction

    try:
        SessionCompaction.from_json(cfg.env.shell.simulated.session_compaction or None)
    except (TypeError, ValueError) as e:
        raise UsageError(f"env.shell.simulated.session_compaction is invalid: {e}") from e

    shell = cfg.env.shell
    if cfg.orchestrator.sessions and not shell.simulated.sessions:
        # `orchestrator.sessions` puts both roles' episodes on sessions.
        shell = dataclasses.replace(
            shell, simulated=dataclasses.replace(shell.simulated, sessions=True)
        )
    return shell_backends(
        shell,
        run_id=cfg.run.name,
        simulator_client=simulator_client,
        simulator_tokenizer=cfg.simulator.tokenizer,
    )


def agent_tasks(cfg: SimloopConfig) -> tuple[list, list]:
    """(training tasks, held-out evaluation tasks) of the config's task family
    (`env.family`)."""
    if cfg.env.family == "fileops":
        from envs.fileops import split_fileops

        return split_fileops(cfg.env.fileops, cfg.train_agent.eval.tasks)
    from envs.textops import split_textops

    return split_textops(cfg.env.textops, cfg.train_agent.eval.tasks)


def family_tasks(family: str, family_cfg) -> list:
    """The tasks of `family` (`env.family`) that `family_cfg` (its config) generates."""
    if family == "fileops":
        from envs.fileops import generate_fileops

        return generate_fileops(family_cfg)
    from envs.textops import generate_textops

    return generate_textops(family_cfg)


async def evaluate_agent(
    cfg: SimloopConfig,
    out: Path,
    label: str,
    version: int | None,
    clients,
    renderer,
    tasks: list,
    metrics: rundir.MetricsLog,
    who: str = "train-agent",
) -> dict:
    """The held-out evaluation of the policy `clients["agent"]` serves
    (`rl.session.evaluate.evaluate_agent`) with the config's settings."""
    from rl.session.evaluate import evaluate_agent as evaluate

    return await evaluate(
        out=out,
        label=label,
        version=version,
        agent=clients["agent"],
        backends=lambda: job_backends(cfg, clients.get("simulator")),
        renderer=renderer,
        tasks=tasks,
        metrics=metrics,
        eval_cfg=cfg.train_agent.eval,
        orchestrator=cfg.orchestrator,
        terminal=cfg.env.terminal,
        seed=cfg.run.seed,
        who=who,
    )
