"""rl/session/run.py `trial_context`: what train-agent says before RL about the context K
trials need (the prompt, every reply at its budget, the feedback between trials)."""

import dataclasses
from types import SimpleNamespace

from envs.config import TerminalConfig
from envs.tasks import Task
from rl.data import ByteTokenizer
from rl.data.chat import ChatRenderer
from rl.orchestrator.config import OrchestratorConfig
from rl.session.run import trial_context


def session(trials: int, context: int) -> SimpleNamespace:
    term = TerminalConfig(
        max_turns=4,
        trials=trials,
        turns_per_trial=2,
        prompt_template="{instruction}",
        trial_feedback_template="Wrong.{verdict}",
    )
    return SimpleNamespace(
        terminal=term,
        orchestrator=OrchestratorConfig(max_context_tokens=context, max_tokens_per_turn=100),
        renderer=ChatRenderer(ByteTokenizer()),
        tasks=[Task(id="a", instruction="x" * 10), Task(id="b", instruction="y" * 30)],
    )


def test_it_counts_the_longest_prompt_every_reply_and_the_feedback():
    r = ChatRenderer(ByteTokenizer())
    prompt = len(r.render([{"role": "user", "content": "y" * 30}], add_generation_prompt=True))
    feedback = len(r.render([{"role": "user", "content": "Wrong."}]))
    need = prompt + 4 * 100 + feedback
    said = trial_context(session(2, need))
    assert f"need up to {need} tokens" in said and f"a prompt of up to {prompt}" in said
    assert "2 trials x 2 turns" in said and "max_context_tokens=" + str(need) + " fits" in said
    assert "does NOT fit" in trial_context(session(2, need - 1))


def test_it_says_when_max_turns_leaves_a_trial_no_turn():
    s = session(2, 4096)
    s.terminal = dataclasses.replace(s.terminal, max_turns=2)  # 2 turns per trial: trial 2 none
    said = trial_context(s)
    assert "env.terminal.max_turns=2 leaves trial 2 on no turn at all" in said
    assert "leaves trial" not in trial_context(session(2, 4096))
