"""The shell backends of a job, from its config: factories for the real shell
(`ShellConfig.backend`: local bash or E2B) and, when a simulator client is given, the learned
simulator. The orchestrator asks them for one shell per episode.

    backends = shell_backends(cfg.env.shell, run_id="demo", simulator_client=client,
                              simulator_tokenizer=cfg.simulator.tokenizer)
    shell = backends.real(task)        # LocalShell or E2BShell, not yet started
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from envs.config import ShellConfig
from envs.shell import Shell
from envs.tasks import Task

ShellFactory = Callable[[Task], AbstractAsyncContextManager[Shell]]
"""One shell per episode; entering it starts the shell, leaving it closes it."""


@dataclass
class Backends:
    """Shell factories per backend; `real_backend` names the real one (`local` or `e2b`)."""

    real: ShellFactory | None = None
    simulated: ShellFactory | None = None
    real_backend: str = "local"


def shell_backends(
    shell_cfg: ShellConfig,
    *,
    run_id: str,
    simulator_client=None,
    simulator_tokenizer=None,
) -> Backends:
    """`Backends` for the orchestrator; `simulated` is None without a simulator client.
    `run_id` tags E2B sandboxes (so `simloop e2b sweep` can find a run's orphans);
    `simulator_tokenizer` (a `TokenizerConfig`) renders the simulator's prompts."""
    from envs.local import LocalShell
    from envs.simulated import SimulatedShell
    from rl.data import ChatRenderer, load_tokenizer

    e2b = shell_cfg.backend == "e2b"

    def real(task: Task) -> Shell:
        if e2b:
            import dataclasses

            from envs.e2b import E2BShell

            cfg = shell_cfg.e2b
            template = task.metadata.get("e2b_template")  # a task file's instance may pick one
            if template:
                cfg = dataclasses.replace(cfg, template=template)
            return E2BShell(cfg, run_id=run_id, episode_id=task.id, setup=task.setup)
        return LocalShell(shell_cfg.local, setup=task.setup)

    simulated = None
    if simulator_client is not None:
        if simulator_tokenizer is None:
            raise ValueError("shell_backends: a simulator client needs simulator_tokenizer")
        renderer = ChatRenderer(load_tokenizer(simulator_tokenizer))

        def simulated(task: Task) -> Shell:
            return SimulatedShell(
                simulator_client,
                task_instruction=task.instruction,
                setup=task.setup,
                config=shell_cfg.simulated,
                renderer=renderer,
            )

    return Backends(real=real, simulated=simulated, real_backend="e2b" if e2b else "local")
