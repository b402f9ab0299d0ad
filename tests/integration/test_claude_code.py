"""Claude Code, unmodified, as a harness (`harness.kind: claude-code`): the pinned npm package
installed from the registry into a cache folder, run in print mode inside a real sandbox
against `simloop middleware` over a real tiny engine whose tokenizer is a byte-level BPE
trained here (so the client's ~49,000-character prompt fits a 32,768-token context). Its
rollout is recorded token-exact and graded in a clean sandbox. Skips only where npm or the
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
                "--harness.kind", "claude-code",
            ],
        )
    )  # fmt: skip
    hcfg = HarnessConfig(
        kind="claude-code", wall_s=300.0, step_limit=2, max_tokens=24, temperature=1.0
    )
    real = shell_backends(cfg.env.shell, run_id="test-claude-code").real
    task = swe_suite(["clamp"])[0]
    try:
        launcher = await pick_launcher(hcfg, real, task)
    except NpmUnavailable as e:
        pytest.skip(f"Claude Code cannot be installed here: {e}")
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
                "runner": HarnessRunner(hcfg, real, url, launcher, admin=admin),
                "client": client,
                "task": task,
                "tok": tok,
            }
        await client.close()


@ASYNC
async def test_claude_code_runs_through_the_middleware_and_is_recorded_token_exact(stack):
    result = await stack["runner"].run_one(stack["task"], "g0", 0)
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
    prompts = [len(p) for p, _ in stack["client"].calls]
    # its own system prompt and tool schemas: ~18,000 tokens of this BPE, over 40x the task
    assert min(prompts) > 10 * len(stack["tok"].encode(stack["task"].instruction)), prompts
    assert max(prompts) < CONTEXT
