"""Claude Code and Codex CLI, unmodified, as harnesses (`harness.kind: claude-code | codex`):
each pinned npm package installed from the registry into a cache folder and run inside a real
sandbox against `simloop middleware` (Claude Code in print mode on the Anthropic Messages API,
Codex with `codex exec` on the Responses API), over tiny models whose tokenizer is a
byte-level BPE trained here (`dev/bpe_agent.py`, so the clients' ~40,000-49,000-character
prompts fit a 32,768-token context):
- a random model: Claude Code through the README's `simloop harness` command (four calls,
  one segment), Codex through the harness runner (one call, token-exact); the trainer's
  logprobs of both rollouts equal the server's;
- a tool-calling model (weights set by hand): each client runs the shell tool call it makes
  and ends on the model's answer, two turns, token-exact; Claude Code on a call that hangs is
  killed at `wall_s` and its rollout written `truncated`.
Skips only where npm or the registry cannot be reached."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import pytest_asyncio

from envs.backends import shell_backends
from envs.swe_suite import swe_suite
from launch.config.loading import load_config
from launch.config.schema import SimloopConfig
from launch.jobs.harness import harness_shell
from launch.jobs.middleware import running_middleware
from rl.data.tokenizer import HFTokenizer
from rl.data.trajectory import read_jsonl
from rl.model import load_hf
from rl.orchestrator.harness import HarnessConfig, HarnessRunner, NpmUnavailable, pick_launcher
from serving.config import ServerConfig
from serving.engine import Engine, EngineConfig
from tests.fakes import RecordingClient, assert_token_exact, user_env

pytestmark = pytest.mark.slow
ASYNC = pytest.mark.asyncio(loop_scope="module")

REPO = Path(__file__).resolve().parents[2]
CONTEXT = 32768
sys.path.insert(0, str(REPO / "dev"))
from bpe_agent import SHELL_TOOLS, TOOL_COMMAND, bpe_agent, tool_calling_agent  # noqa: E402


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory):
    from serving.server import background_server

    root = tmp_path_factory.mktemp("claude-code")
    bpe = bpe_agent(root / "agent")  # tokenizer and checkpoint, as the README makes them
    tok = HFTokenizer(bpe)
    cfg = harness_shell(
        load_config(
            SimloopConfig,
            REPO / "configs/demo_cpu.yaml",
            [
                "--middleware.port", "0",
                "--agent.tokenizer", json.dumps({"kind": "hf", "path": str(bpe)}),
                "--harness.kind", "claude-code",  # the npm cache, shown to the sandbox
                "--middleware.max_tokens_cap", "24",  # Codex asks for no limit: 1,024 here
            ],
        )
    )  # fmt: skip
    real = shell_backends(cfg.env.shell, run_id="test-npm-harnesses").real
    task = swe_suite(["clamp"])[0]
    configs, launchers = {}, {}
    for kind in ("claude-code", "codex"):
        configs[kind] = HarnessConfig(
            kind=kind, wall_s=300.0, step_limit=2, max_tokens=24, temperature=1.0
        )
        try:
            launchers[kind] = await pick_launcher(configs[kind], real, task)
        except NpmUnavailable as e:
            pytest.skip(f"{kind} cannot be installed here: {e}")
    model_cfg, model = load_hf(bpe)
    hf = bpe  # the same weights, for the trainer and the CLI run
    engine = Engine(
        model,
        tok,
        EngineConfig(num_slots=2, max_seq_len=CONTEXT, prefill_chunk=2048, prefill_batch=1),
    )
    scfg = ServerConfig(host="127.0.0.1", port=0, model_name="tiny", shutdown_timeout_s=5.0)
    out = root / "run"
    async with background_server(engine, tok, scfg, start_timeout_s=300) as agent_url:
        client = RecordingClient(agent_url)
        async with running_middleware(cfg, out, client) as (middleware, url, admin):
            yield {
                "out": out,
                "claude_cli": root / "claude-cli",  # the README command's run directory
                "runners": {
                    k: HarnessRunner(configs[k], real, url, launchers[k], admin=admin)
                    for k in configs
                },
                "client": client,
                "task": task,
                "tok": tok,
                "model": (model_cfg, hf),
                "real": real,
                "launchers": launchers,
                "cfg": cfg,
            }
        await client.close()


@ASYNC
async def test_codex_runs_through_the_responses_api_and_is_recorded_token_exact(stack):
    before = len(stack["client"].calls)
    result = await stack["runners"]["codex"].run_one(stack["task"], "g0", 0)
    # The random tiny model never ends its turn: Codex gets an `incomplete` response
    # (max_output_tokens) and stops its turn with that error, which the rollout keeps.
    assert result.status in ("ok", "error"), (result.status, result.reason)
    if result.status == "error":
        assert "max_output_tokens" in result.reason, result.reason
    files = sorted((stack["out"] / "trajectories").glob("middleware-*.jsonl"))
    (traj,) = [t for p in files for t in read_jsonl(p) if t.rollout_id == result.rollout_id]
    assert traj.status == result.status
    assert traj.meta["harness"] == "codex" and traj.meta["api"] == "responses"
    assert traj.turns and all(len(x.agent_text) > 0 for x in traj.turns)
    assert_token_exact(stack["client"].calls[before:], traj)
    prompt = len(stack["client"].calls[before][0])  # Codex's instructions and tool schemas
    assert 10 * len(stack["tok"].encode(stack["task"].instruction)) < prompt < CONTEXT


def test_simloop_harness_runs_claude_code_as_the_readme_says(stack):
    """The README's command, as a user runs it: `simloop harness --harness.kind claude-code`
    starts its own agent server on the BPE agent, the middleware, and Claude Code from the
    npm cache in a sandbox, and writes the rollout. The random model never ends a turn within
    max_tokens (24): Claude Code asks it to go on, three times, then gives up with its own
    error, which the rollout keeps; every call extends the one before (one segment)."""
    agent = stack["model"][1]
    out = stack["claude_cli"]
    cmd = [str(Path(sys.executable).parent / "simloop"), "harness",
           "--config", "configs/demo_cpu.yaml", "--out", str(out),
           "--agent.hf_path", str(agent),
           "--agent.tokenizer", json.dumps({"kind": "hf", "path": str(agent)}),
           "--harness.kind", "claude-code", "--harness.tasks", "[clamp]",
           "--harness.samples", "1", "--harness.step_limit", "2", "--harness.max_tokens", "24",
           "--orchestrator.max_context_tokens", str(CONTEXT),
           "--serve.engine.max_seq_len", str(CONTEXT), "--serve.engine.num_slots", "2",
           "--middleware.max_tokens_cap", "24", "--middleware.port", "0"]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, env=user_env(), capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "harness.json").read_text())
    assert summary["harness"] == "claude-code" and summary["rollouts"] == 1
    assert summary["trajectories"] == 1, summary
    (result,) = summary["results"]
    assert result["status"] in ("ok", "error"), result
    if result["status"] == "error":
        assert "output token maximum" in result["reason"], result["reason"]
    (traj,) = [t for p in sorted((out / "trajectories").glob("*.jsonl")) for t in read_jsonl(p)]
    assert traj.meta["harness"] == "claude-code" and traj.meta["api"] == "anthropic"
    assert traj.status == result["status"] and len(traj.turns) >= 2, traj.turns
    assert traj.rollout_id == result["rollout_id"] and sum(traj.loss_mask) > 0
    prompt = traj.turns[0].token_span[0]  # its own system prompt and tool schemas
    assert 10 * len(stack["tok"].encode(stack["task"].instruction)) < prompt < CONTEXT


TOL = 1e-4
"""f32, as tests/integration/test_compaction_parity.py: the server computed each prompt in
2,048-token prefill chunks and each sampled token from its KV cache (a running softmax over
128-key blocks), the trainer the whole row at once (128-query causal blocks); the same terms
summed in other orders."""


@ASYNC
async def test_the_trainer_gives_the_clients_rollouts_the_servers_logprobs(stack):
    """The trainer's forward over each client's whole rollout (its 14,000-18,000-token prompt
    and every sampled id spliced back) gives the server's logprob of every sampled token. A
    rollout the client ended with its own error is trained as `truncated` would be: its
    tokens are what the server computed either way."""
    import dataclasses

    import numpy as np

    from launch.config.schema import SimloopConfig
    from rl.train.build import build_trainer
    from rl.train.config import OptimConfig, PolicyLossConfig, RoleConfig
    from rl.train.rollouts import build_rl_batch

    files = sorted((stack["out"] / "trajectories").glob("middleware-*.jsonl"))
    files += sorted((stack["claude_cli"] / "trajectories").glob("*.jsonl"))
    trajs = [t for p in files for t in read_jsonl(p)]
    assert {t.meta["harness"] for t in trajs} == {"claude-code", "codex"}, "run the clients first"
    seq_len = -(-max(len(t.token_ids) for t in trajs) // 1024) * 1024  # one shape, one compile
    model_cfg, hf = stack["model"]
    trainer = build_trainer(
        RoleConfig(model=model_cfg, hf_path=str(hf)),
        stack["tok"],
        optim=OptimConfig(),
        steps=1,
        loss="policy",
        rules=SimloopConfig().sharding.rules,
        seed=0,
        device_ids=[0],
    )
    for t in trajs:
        row = dataclasses.replace(t, status="ok", reason=None, reward=0.0)
        batch, stats = build_rl_batch(
            [row], rows=1, seq_len=seq_len, cfg=PolicyLossConfig(), version=0
        )
        assert stats.used == 1 and stats.truncated_rows == 0
        mask = batch["loss_mask"].astype(bool)
        assert mask.sum() == sum(t.loss_mask) > 0
        logp = np.asarray(trainer.logprobs(batch))
        gap = np.abs(logp - batch["behavior_logprobs"])[mask]
        assert gap.max() <= TOL, (t.meta["harness"], len(t.token_ids), float(gap.max()))


async def tool_calling_run(stack, tmp_path, kind: str, commands: tuple[str, ...], wall_s: float):
    """One rollout of `kind` against its own middleware and engine serving
    `dev/bpe_agent.py`'s tool-calling agent (its first call runs one of `commands`):
    -> (the runner's result, the rollout's one trajectory, the recording client)."""
    from serving.server import background_server

    tok_dir, _ = tool_calling_agent(
        stack["model"][1],
        tmp_path / "agent",
        kind,
        commands=commands,
        enable_thinking=stack["cfg"].middleware.enable_thinking,
    )
    tok = HFTokenizer(tok_dir)
    _, model = load_hf(tok_dir)
    cfg = dataclasses.replace(
        stack["cfg"],
        agent=dataclasses.replace(
            stack["cfg"].agent,
            tokenizer=dataclasses.replace(stack["cfg"].agent.tokenizer, path=str(tok_dir)),
        ),
    )
    engine = Engine(model, tok, EngineConfig(num_slots=2, max_seq_len=CONTEXT, prefill_chunk=2048))
    scfg = ServerConfig(host="127.0.0.1", port=0, model_name="tiny", shutdown_timeout_s=5.0)
    out = tmp_path / "run"
    async with background_server(engine, tok, scfg, start_timeout_s=300) as agent_url:
        client = RecordingClient(agent_url)
        async with running_middleware(cfg, out, client) as (_, url, admin):
            runner = HarnessRunner(
                HarnessConfig(kind=kind, wall_s=wall_s, step_limit=4, max_tokens=64),
                stack["real"],
                url,
                stack["launchers"][kind],
                admin=admin,
            )
            result = await runner.run_one(stack["task"], "g1", 0)
        await client.close()
    (traj,) = [t for p in sorted((out / "trajectories").glob("*.jsonl")) for t in read_jsonl(p)]
    return result, traj, client


@ASYNC
@pytest.mark.parametrize("kind", ["claude-code", "codex"])
async def test_each_client_makes_a_tool_round_with_a_tool_calling_model(stack, tmp_path, kind):
    """Each client with a model that calls its shell tool (weights set by hand,
    `dev/bpe_agent.py`'s `tool_calling_agent`: the call first, "Done." once the call is in its
    context): the client runs the command in the sandbox, sends its output back (Claude
    Code a `tool_result`, Codex a `function_call_output`) and ends on the answer. Two model
    turns, one tool round, recorded token-exact, the command's effect in the rollout's diff."""
    from rl.data.tools import parse_assistant

    result, traj, client = await tool_calling_run(stack, tmp_path, kind, (TOOL_COMMAND,), 300.0)
    tool, arg = SHELL_TOOLS[kind]
    assert result.status == "ok", (result.status, result.reason)
    assert "simloop-was-here" in result.diff  # the client ran the model's command in the sandbox
    assert len(traj.turns) == 2 and result.finish["plans"]["extend"] == 1, result.finish
    (call,) = parse_assistant(traj.turns[0].agent_text).tool_calls
    assert call.name == tool and call.arguments == {arg: TOOL_COMMAND}
    assert parse_assistant(traj.turns[1].agent_text).content == "Done."
    assert_token_exact(client.calls, traj)


@ASYNC
async def test_a_real_client_past_wall_s_is_recorded_truncated_with_its_turn(stack, tmp_path):
    """Claude Code whose model's tool call hangs (`tail -f /dev/null`; Claude Code refuses a
    long `sleep`): the runner's wall-clock guard kills it; the rollout is written `truncated`
    with the reason, its one turn token-exact."""
    result, traj, client = await tool_calling_run(
        stack, tmp_path, "claude-code", ("tail -f /dev/null",), 20.0
    )
    assert result.status == "truncated" and "wall_s=20" in result.reason, result
    assert result.wall_s < 60 and result.finish["trajectories"] == 1, result.finish
    assert traj.status == "truncated" and "wall_s=20" in traj.reason
    assert len(traj.turns) == 1 and traj.reward == 0.0  # graded: the diff it left (none)
    assert_token_exact(client.calls, traj)
