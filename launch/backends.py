"""The shell backends of a job, from its config: the real shell (`env.shell.backend`: local bash
or E2B) and, when a simulator client is given, the learned simulator. Every job that runs
episodes (`rollout`, `collect`, `train-agent`) builds its `Backends` here."""

from __future__ import annotations

from launch.schema import SimloopConfig
from rl.orchestrator.runner import Backends


def shell_backends(cfg: SimloopConfig, simulator_client=None) -> Backends:
    """`Backends` for the orchestrator; `simulated` is None without a simulator client."""
    from envs.local import LocalShell
    from envs.simulated import SimulatedShell
    from rl.data import ChatRenderer, load_tokenizer

    shell_cfg = cfg.env.shell
    e2b = shell_cfg.backend == "e2b"

    def real(task):
        if e2b:
            from envs.e2b import E2BShell

            return E2BShell(
                shell_cfg.e2b, run_id=cfg.run.name, episode_id=task.id, setup=task.setup
            )
        return LocalShell(shell_cfg.local, setup=task.setup)

    simulated = None
    if simulator_client is not None:
        renderer = ChatRenderer(load_tokenizer(cfg.simulator.tokenizer))

        def simulated(task):
            return SimulatedShell(
                simulator_client,
                task_instruction=task.instruction,
                setup=task.setup,
                config=shell_cfg.simulated,
                renderer=renderer,
            )

    return Backends(real=real, simulated=simulated, real_backend="e2b" if e2b else "local")
