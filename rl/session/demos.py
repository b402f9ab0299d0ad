"""Scripted demonstrations for the agent's warm start, run in the real shell."""

from __future__ import annotations

from envs.config import TerminalConfig
from rl.orchestrator.config import OrchestratorConfig
from rl.train.config import WarmStartConfig


async def collect_demos(
    warm_start: WarmStartConfig,
    orchestrator: OrchestratorConfig,
    terminal: TerminalConfig,
    renderer,
    backends,
    tasks: list,
    *,
    seed: int,
) -> list:
    """`warm_start.num_demos` scripted episodes (marker style) over `tasks`, in the real shell
    of `backends`: experts, with `warm_start.noise` of them imperfect (those are kept: they
    are the demonstrations). Returns the usable ones.

    `warm_start.noise_kinds` name the imperfect demonstrations' mistakes in every family: on
    `fileops` tasks, `other_op` is a step run with another transformation (never fixed) and
    `typo` a misspelt command then the right one, so the default (`[other_op]`) gives a warm
    start that picks a wrong transformation about `noise` of the time, which RL can fix, as
    on textops."""
    from envs.fileops import MISTAKES, SLIPS
    from rl.orchestrator.runner import RolloutRunner
    from rl.orchestrator.scripted import ScriptedAgentClient, feedback_marker

    o = orchestrator
    ocfg = OrchestratorConfig(
        arm="real",
        group_size=1,
        max_context_tokens=o.max_context_tokens,
        max_tokens_per_turn=o.max_tokens_per_turn,
        seed=seed,
        max_concurrent_episodes=8,
    )
    client = ScriptedAgentClient(
        tasks,
        renderer.tokenizer,
        style="marker",
        noise=warm_start.noise,
        noise_kinds=warm_start.noise_kinds,
        seed=seed,
        # Multi-trial demonstrations restart their script after each feedback and, on a
        # hidden-operation task, do what the checker's verdict names: they adapt.
        trial_marker=feedback_marker(terminal.trial_feedback_template),
        fileops_mistakes=[k for k in warm_start.noise_kinds if k in MISTAKES + SLIPS] or None,
    )
    runner = RolloutRunner(ocfg, terminal, renderer, backends, client=client)
    n = warm_start.num_demos
    demos = await runner.run([tasks[i % len(tasks)] for i in range(n)])
    return [t for t in demos if t.status in ("ok", "truncated") and t.turns]
