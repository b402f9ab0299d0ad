"""Claude Code and Codex CLI, unmodified, as harnesses (`harness.kind: claude-code | codex`):
each pinned npm package installed from the registry into a cache folder and run inside a real
sandbox against `simloop middleware` (Claude Code in print mode on the Anthropic Messages API,
Codex with `codex exec` on the Responses API) over one real tiny engine whose tokenizer is a
byte-level BPE trained here (so the clients' ~40,000-49,000-character prompts fit a
32,768-token context). Each rollout is recorded token-exact. Skips only where npm or the
registry cannot be reached."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import pytest_asyncio
from flax import nnx

from envs.backends import shell_backends
from envs.swe_suite import swe_suite
from launch.config.loading import load_config
from launch.config.schema import SimloopConfig
from launch.jobs.harness import harness_shell
from launch.jobs.middleware import running_middleware
from rl.data.bpe import train_bpe
from rl.data.tokenizer import HFTokenizer
from rl.data.trajectory import read_jsonl
from rl.model import Qwen3, tiny
from rl.orchestrator.harness import HarnessConfig, HarnessRunner, NpmUnavailable, pick_launcher
from serving.config import ServerConfig
from serving.engine import Engine, EngineConfig
from tests.fakes import RecordingClient, assert_token_exact

pytestmark = pytest.mark.slow
ASYNC = pytest.mark.asyncio(loop_scope="module")

REPO = Path(__file__).resolve().parents[2]
CONTEXT = 32768


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory):
    from serving.server import background_server

    root = tmp_path_factory.mktemp("claude-code")
    texts = [p.read_text() for p in sorted(REPO.glob("docs/*.md")) + [REPO / "README.md"]]
    texts += [p.read_text() for p in sorted((REPO / "serving").rglob("*.py"))]
    bpe = train_bpe(texts, root / "bpe", vocab_size=4096)
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
    model = Qwen3(tiny(vocab_size=tok.vocab_size, initializer_range=0.3), rngs=nnx.Rngs(0))
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
                "runners": {
                    k: HarnessRunner(configs[k], real, url, launchers[k], admin=admin)
                    for k in configs
                },
                "client": client,
                "task": task,
                "tok": tok,
            }
        await client.close()


@ASYNC
async def test_claude_code_runs_through_the_middleware_and_is_recorded_token_exact(stack):
    result = await stack["runners"]["claude-code"].run_one(stack["task"], "g0", 0)
    # The random tiny model never says end-of-turn within max_tokens (24): Claude Code asks
    # it to go on, three times, then gives up with its own error, which the rollout keeps.
    assert result.status in ("ok", "error"), (result.status, result.reason)
    if result.status == "error":
        assert "output token maximum" in result.reason, result.reason
    files = sorted((stack["out"] / "trajectories").glob("middleware-*.jsonl"))
    (traj,) = [t for p in files for t in read_jsonl(p) if t.rollout_id == result.rollout_id]
    assert traj.meta["harness"] == "claude-code" and traj.meta["api"] == "anthropic"
    assert traj.status == result.status and (traj.reason or "") == (result.reason or "")
    assert len(traj.turns) >= 2, traj.turns  # each call extended the one before it
    assert result.finish["plans"]["extend"] == len(traj.turns) - 1, result.finish
    assert_token_exact(stack["client"].calls, traj)
    prompts = [len(stack["client"].calls[0][0])]
    # its own system prompt and tool schemas: ~18,000 tokens of this BPE, over 40x the task
    assert min(prompts) > 10 * len(stack["tok"].encode(stack["task"].instruction)), prompts
    assert max(prompts) < CONTEXT


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
