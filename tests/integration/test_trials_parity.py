"""Train = rollout across trials (issue 20): multi-trial episodes (K = 3) sampled from a real
`simloop serve`, then the trainer's forward over each whole row (every trial's turns, the
feedback between them, positions continuing across trials) gives the server's logprobs of
every generated token to 1e-4 (f32)."""

from __future__ import annotations

import numpy as np
import pytest

from envs.config import LocalShellConfig, TerminalConfig, TextopsConfig
from envs.local import LocalShell
from envs.textops import generate_textops
from launch.config.schema import SimloopConfig
from launch.deploy.local import LocalServer
from rl.data import ByteTokenizer, ChatRenderer
from rl.data.trajectory import validate
from rl.orchestrator.config import OrchestratorConfig
from rl.orchestrator.runner import Backends, RolloutRunner
from rl.train.build import build_trainer
from rl.train.config import OptimConfig, PolicyLossConfig, RoleConfig
from rl.train.rollouts import build_rl_batch
from serving.client import ClientConfig, InferenceClient
from tests.fakes import tiny_agent_serve_args

K, CONTEXT = 3, 1024
TOL = 1e-4
"""f32: the server's decode (KV cache, one token at a time) and the trainer's forward (the
whole row at once) sum the same terms in different orders; ~1e-6 apart for a tiny model."""


@pytest.mark.slow
async def test_trainer_logprobs_equal_the_servers_over_three_trials(tmp_path):
    cfg, hf, run, args = tiny_agent_serve_args(tmp_path, seed=3, context=CONTEXT)
    renderer = ChatRenderer(ByteTokenizer())
    tasks = generate_textops(TextopsConfig(num_tasks=2, seed=4, from_file_prob=1.0))
    terminal = TerminalConfig(
        trials=K,
        turns_per_trial=1,
        prompt_template="{instruction}",
        format_error_template="Format error: {reason}",
        trial_feedback_template="Wrong.{verdict}",
        trial_reward="per_trial",
    )
    ocfg = OrchestratorConfig(
        arm="real",
        max_context_tokens=CONTEXT,
        max_tokens_per_turn=32,
        group_size=2,
        max_staleness=None,
        seed=7,
    )
    with LocalServer.start("agent", run, extra_args=args) as server:
        async with InferenceClient(ClientConfig(server.url, model="agent")) as client:
            backends = Backends(real=lambda t: LocalShell(LocalShellConfig(), setup=t.setup))
            trajs = await RolloutRunner(ocfg, terminal, renderer, backends, client=client).run(
                tasks
            )
    # An untrained model never submits: every trial ends at its one turn, so each episode
    # holds K trials, K sampled turns and K - 1 feedback messages in one token stream.
    assert len(trajs) == 4
    for t in trajs:
        validate(t)
        assert t.status == "truncated" and len(t.trials) == K and len(t.turns) == K
        assert len({x.workspace_hash for x in t.trials}) == 1
    trainer = build_trainer(
        RoleConfig(model=cfg, hf_path=str(hf)),
        renderer.tokenizer,
        optim=OptimConfig(),
        steps=1,
        loss="policy",
        rules=SimloopConfig().sharding.rules,
        seed=0,
    )
    loss = PolicyLossConfig(truncated_reward=0.0)
    batch, stats = build_rl_batch(trajs, rows=4, seq_len=CONTEXT, cfg=loss, version=0)
    assert stats.used == 4 and stats.truncated_rows == 0
    logp = np.asarray(trainer.logprobs(batch))
    mask = batch["loss_mask"].astype(bool)
    assert mask.sum() == sum(sum(t.loss_mask) for t in trajs)
    for row, t in enumerate(trajs):  # positions run on across trials: 0 .. len - 2
        n = len(t.token_ids) - 1
        assert (batch["positions"][row, :n] == np.arange(n)).all()
    gap = np.abs(logp - batch["behavior_logprobs"])[mask]
    assert gap.max() <= TOL, f"max |trainer - server| logprob {gap.max():.2e} > {TOL}"
