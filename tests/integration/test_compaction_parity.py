"""Train = rollout under KV compaction (issue 19): multi-turn episodes sampled through
persistent sessions of a real `simloop serve`, one compaction mode at a time, then the
trainer's forward over each whole row, told what every token could see (`kv_epochs`), gives the
server's logprob of every generated token to 1e-4 (f32) — for `none`, `markovian`, `turn` and
`budget`, and for sessions the server forgets mid-episode (reopened with the whole history):
without compaction that is one stream; after a compaction the reopened session recomputed
the earlier tokens with everything in view, which the episode records as a context reset and
training replays as a second segment of the row. Without that visibility (or that segment) the
rows' logprobs are measurably different, so the check has teeth."""

from __future__ import annotations

import dataclasses

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
from tests.fakes import LossyClient, tiny_agent_serve_args

CONTEXT, TURNS = 1024, 6
TOL = 1e-4
"""f32: the server's decode (KV cache, one token at a time, compacted keys gathered to the
front of the slot) and the trainer's forward (the whole row at once under a mask) sum the same
terms in different orders; ~1e-6 apart for a tiny model."""
MODES = {
    "none": {},
    "markovian": {"mode": "markovian", "n_protect_turns": 1},
    "turn": {"mode": "turn", "n_protect_turns": 1, "keep_ratio": 0.5},
    "budget": {"mode": "budget", "n_protect_turns": 2, "kv_budget": 240},
    # The server forgets each session at its fourth call (as after its TTL, or a pool replica
    # that died): the episode reopens it with the whole history. One stream without
    # compaction; after one the earlier tokens' keys are recomputed with everything in view,
    # recorded as a context reset and replayed as the row's second segment.
    "none, forgotten": {},
    "turn, forgotten": {"mode": "turn", "n_protect_turns": 1, "keep_ratio": 0.5},
    # The answer of each session's fourth call is lost after the server appended, generated
    # and compacted: the client rewinds to the turn boundary and sends it again. The retried
    # turn sees what the rewind left (a new epoch), and training replays exactly that.
    "turn, answer lost": {"mode": "turn", "n_protect_turns": 1, "keep_ratio": 0.5},
}
FORGET_AT = 4  # after the first compaction shows (from the third call on)


class ForgetfulClient(InferenceClient):
    """Deletes a session (a real DELETE) just before its `FORGET_AT`-th generate call."""

    def __init__(self, cfg: ClientConfig):
        super().__init__(cfg)
        self.calls: dict[str, int] = {}
        self.forgotten = 0

    async def session_generate(self, session_id, append_token_ids, **kw):
        self.calls[session_id] = self.calls.get(session_id, 0) + 1
        if self.calls[session_id] == FORGET_AT:
            await self.close_session(session_id)
            self.forgotten += 1
        return await super().session_generate(session_id, append_token_ids, **kw)


@pytest.mark.slow
async def test_trainer_logprobs_equal_the_servers_in_every_compaction_mode(tmp_path):
    cfg, hf, run, args = tiny_agent_serve_args(tmp_path, seed=5, context=CONTEXT)
    renderer = ChatRenderer(ByteTokenizer())
    tasks = generate_textops(TextopsConfig(num_tasks=2, seed=4, from_file_prob=1.0))
    terminal = TerminalConfig(
        max_turns=TURNS,
        prompt_template="{instruction}",
        format_error_template="Format error: {reason}",
    )
    backends = Backends(real=lambda t: LocalShell(LocalShellConfig(), setup=t.setup))
    episodes = {}
    with LocalServer.start("agent", run, extra_args=args) as server:
        ccfg = ClientConfig(server.url, model="agent", backoff_s=0.01)
        async with (
            InferenceClient(ccfg) as plain,
            ForgetfulClient(ccfg) as forgetful,
            LossyClient(ccfg, lose={FORGET_AT}) as lossy,
        ):
            by_kind = {"forgotten": forgetful, "answer lost": lossy}
            for mode, compaction in MODES.items():
                client = by_kind.get(mode.partition(", ")[2], plain)
                ocfg = OrchestratorConfig(
                    arm="real",
                    max_context_tokens=CONTEXT,
                    max_tokens_per_turn=24,
                    group_size=2,
                    max_staleness=None,
                    seed=7,
                    sessions=True,
                    session_compaction=compaction,
                )
                runner = RolloutRunner(ocfg, terminal, renderer, backends, client=client)
                episodes[mode] = await runner.run(tasks)
    trainer = build_trainer(
        RoleConfig(model=cfg, hf_path=str(hf)),
        renderer.tokenizer,
        optim=OptimConfig(),
        steps=1,
        loss="policy",
        rules=SimloopConfig().sharding.rules,
        seed=0,
    )
    assert forgetful.forgotten >= 8  # every episode's session was forgotten at least once
    assert lossy.lost >= 4  # and in the last mode every episode lost one answer
    loss = PolicyLossConfig(truncated_reward=0.0)
    for mode, trajs in episodes.items():
        assert len(trajs) == 4, mode
        for t in trajs:  # an untrained model never submits: every episode runs all its turns
            validate(t)
            assert len(t.turns) == TURNS + 1 or t.status != "ok", (mode, t.status, t.reason)
            if mode == "turn, answer lost":  # retried, not failed, and not reopened
                assert t.status in ("ok", "truncated"), (t.status, t.reason)
                assert "session_reopened" not in t.meta and t.exclusion is None, t.meta
            if "forgotten" in mode:
                assert t.meta.get("session_reopened", 0) >= 1, t.meta
                assert t.exclusion is None, t.exclusion
                assert bool(t.context_resets) == (mode == "turn, forgotten"), t.context_resets
                assert all(r["context"] == [[0, r["start"]]] for r in t.context_resets)
            else:
                assert t.context_resets == [], (mode, t.context_resets)
            if mode.startswith("none"):
                assert t.kv_epochs == []
            else:  # compacted at least once: a later epoch that kept less than it had seen
                assert len(t.kv_epochs) >= 2, (mode, t.kv_epochs)
        seq_len = 2 * CONTEXT if mode == "turn, forgotten" else CONTEXT  # two segments a row
        batch, stats = build_rl_batch(trajs, rows=4, seq_len=seq_len, cfg=loss, version=0)
        assert stats.used == 4 and stats.truncated_rows == 0
        assert ("kv_epoch" in batch) == (not mode.startswith("none"))
        logp = np.asarray(trainer.logprobs(batch))
        mask = batch["loss_mask"].astype(bool)
        assert mask.sum() == sum(sum(t.loss_mask) for t in trajs)
        gap = np.abs(logp - batch["behavior_logprobs"])[mask]
        assert gap.max() <= TOL, f"{mode}: max |trainer - server| logprob {gap.max():.2e} > {TOL}"
        if mode == "turn, forgotten":  # one stream instead: the reopened session's tokens differ
            one = [dataclasses.replace(t, context_resets=[]) for t in trajs]
            b1, _ = build_rl_batch(one, rows=4, seq_len=CONTEXT, cfg=loss, version=0)
            off = np.abs(np.asarray(trainer.logprobs(b1)) - b1["behavior_logprobs"])
            assert off[b1["loss_mask"].astype(bool)].max() > 100 * TOL, mode
        if not mode.startswith("none"):  # plain causal attention is not what the sampler saw
            plain = {k: v for k, v in batch.items() if not k.startswith("kv_")}
            blind = np.abs(np.asarray(trainer.logprobs(plain)) - batch["behavior_logprobs"])
            assert blind[mask].max() > 100 * TOL, mode
