"""The vllm production path without TPUs: `launch_servers` starts the fake vLLM server
(`serving.vllm.fake_server`, a real process on 127.0.0.1) in place of `vllm serve`, the
`InferenceClient` reads token ids and logprobs from its vLLM-shaped responses, and
`VllmPublisher` swaps its weights through the real `OrbaxWeightLoader` over `/collective_rpc`.
What it generates is checked against simloop's own engine on the same weights.

One server (two tensor-parallel workers) is shared by the module; the test that publishes
leaves the weights it started with in place, and stopping the server at the end is the SIGTERM
check.
"""

import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
from flax import nnx

from rl.data import ByteTokenizer
from rl.data.chat import ChatRenderer
from rl.model import Qwen3, save_hf, tiny
from rl.model.params_io import save_params
from serving.client import ClientConfig, ClientError, InferenceClient
from serving.config import EngineConfig, SamplingParams
from serving.engine import Engine
from serving.vllm.config import VllmConfig
from serving.vllm.launcher import (
    ServedModel,
    VllmLaunchError,
    default_spawn,
    launch_servers,
)
from serving.vllm.publisher import VllmPublisher, VllmPublishError
from tests.fakes import PlannedProcess as Proc
from tests.fakes import free_port

pytestmark = pytest.mark.slow
on_server = pytest.mark.asyncio(loop_scope="module")

FAKE_VLLM = [sys.executable, "-m", "serving.vllm.fake_server", "serve"]
PROMPT = list(range(1, 13))
GEN = 8
# Both engines run the same float32 model on the same weights; only the batch shapes differ
# (8 slots against 1, prefill buckets), which may change XLA's summation order. A logprob is a
# log-softmax of logits of magnitude ~10 summed over a 64-wide hidden dim: float32 rounding
# moves it by ~10 * 64 * 6e-8 = 4e-5 at most, inside this bound.
LOGPROB_TOL = 1e-4


def fake_spawn(argv, env, log_file):
    """The launcher's argv with `vllm serve` replaced by the fake server's module."""
    assert argv[:2] == ["vllm", "serve"], argv
    return default_spawn([*FAKE_VLLM, *argv[2:]], env, log_file)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("fake_vllm")
    cfg = tiny(initializer_range=0.3)  # spread-out logits: greedy choices are not near-ties
    a, b = Qwen3(cfg, rngs=nnx.Rngs(0)), Qwen3(cfg, rngs=nnx.Rngs(1))
    return dict(
        root=root,
        model_a=a,
        hf_dir=save_hf(cfg, a, root / "hf"),
        ckpt_a=save_params(a, root / "ckpt_a"),
        ckpt_b=save_params(b, root / "ckpt_b", dtype="bfloat16"),
    )


@pytest.fixture(scope="module")
def server(weights):
    """The shared fake server. Its teardown checks that SIGTERM stops it cleanly, in seconds
    (a second server just for that would double the module's time)."""
    root = weights["root"]
    proc = Proc("agent_serve", (0, 1), free_port())  # two chips: two tensor-parallel workers
    # n-gram speculation on: the tokens and logprobs below must still be plain decoding's
    cfg = VllmConfig(
        max_model_len=64,
        start_stagger_s=0.0,
        health_timeout_s=180.0,
        speculate=4,
        extra_args=["--block-size", "8"],  # prefix cache hits count whole blocks
    )
    (server,) = launch_servers(
        [proc],
        cfg,
        {"agent_serve": ServedModel(str(weights["hf_dir"]), "agent")},
        log_dir=root / "logs",
        lockfile=root / "libtpu_lock",
        spawn=fake_spawn,
        poll_s=0.2,
    )
    yield server
    started = time.monotonic()
    code = server.stop(timeout_s=10.0)  # SIGTERM to its process group; SIGKILL only after 10 s
    assert code == 0 and time.monotonic() - started < 6.0, server.log_tail()
    assert "Shutting down" in server.log_tail()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference(weights):
    """simloop's engine on weights A: what the fake must generate while it serves A."""
    cfg = EngineConfig(num_slots=1, max_seq_len=64, prefill_chunk=16, decode_steps=1)
    engine = Engine(weights["model_a"], ByteTokenizer(), cfg)
    await engine.start(warmup=False)  # compiles only the shapes these tests use
    yield engine
    await engine.stop()


@pytest_asyncio.fixture(loop_scope="module")
async def client(server):
    async with InferenceClient(ClientConfig(server.url, model="agent", max_retries=0)) as c:
        yield c


async def _greedy(client: InferenceClient, logprobs: int | None = None):
    return await client.complete(
        PROMPT, max_tokens=GEN, temperature=0.0, logprobs=logprobs, extra={"ignore_eos": True}
    )


async def _reference_greedy(engine: Engine):
    (out,) = await engine.generate(
        PROMPT, SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True, logprobs=2)
    )
    return out


async def _workers(client: InferenceClient, method: str, *args) -> list:
    body, _ = await client.request(
        "POST", "/collective_rpc", json_body={"method": method, "args": list(args)}
    )
    return body["results"]


@on_server
async def test_the_launcher_starts_the_fake_and_it_answers_like_vllm(server, client):
    assert server.argv[:2] == ["vllm", "serve"] and "--worker-extension-cls" in server.argv
    async with aiohttp.ClientSession() as session, session.get(f"{server.url}/health") as resp:
        assert resp.status == 200 and await resp.read() == b""
    body, _ = await client.request("GET", "/v1/models")
    (card,) = body["data"]
    assert body["object"] == "list"
    assert {k: card[k] for k in ("id", "object", "owned_by", "parent", "max_model_len")} == {
        "id": "agent",
        "object": "model",
        "owned_by": "vllm",
        "parent": None,
        "max_model_len": 64,
    }
    assert card["root"] == server.argv[2] and isinstance(card["created"], int)
    # One answer per tensor-parallel worker, from the extension named on the command line.
    assert await _workers(client, "simloop_weight_version") == [{"version": None, "path": None}] * 2
    assert "Uvicorn running on" in server.log_tail()
    assert "n-gram speculation 4" in server.log_tail()  # --speculative-config reached the engine
    # It compiled into the suite's cache (SIMLOOP_COMPILE_CACHE_DIR comes before the launcher's
    # VLLM_XLA_CACHE_PATH), where a restarted server finds its programs.
    (cache,) = re.findall(r"compilation cache: (\S+)", server.log_path.read_text())
    assert cache == os.environ["SIMLOOP_COMPILE_CACHE_DIR"]
    assert any(p.is_file() for p in Path(cache).rglob("*"))


@on_server
async def test_completions_carry_token_ids_and_logprobs_of_the_served_weights(client, reference):
    out = await _greedy(client, logprobs=2)
    want = await _reference_greedy(reference)
    assert out.token_ids == want.token_ids and len(out.token_ids) == GEN
    assert out.prompt_token_ids == PROMPT and out.finish_reason == "length"
    np.testing.assert_allclose(out.logprobs, want.logprobs, rtol=0, atol=LOGPROB_TOL)
    assert all(len(top) >= 1 for top in out.top_logprobs)
    # vLLM reports neither weight versions nor per-token versions: the client sees None.
    assert out.weight_version is None and out.token_versions is None
    choice = out.raw["choices"][0]
    assert set(choice["logprobs"]) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    assert out.raw["usage"]["prompt_tokens"] == len(PROMPT)
    assert out.raw["usage"]["completion_tokens"] == GEN

    text = await client.complete(
        "ls -la",
        max_tokens=3,
        temperature=0.0,
        seed=1,
        stop_token_ids=[0],
        extra={"ignore_eos": True},
    )
    assert text.prompt_token_ids == list(b"ls -la") and 1 <= len(text.token_ids) <= 3


@on_server
async def test_chat_renders_chatml_and_returns_logprobs_content(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = await client.chat(
        messages,
        max_tokens=4,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
        enable_thinking=False,
    )
    rendered = ChatRenderer(ByteTokenizer()).render(
        messages, add_generation_prompt=True, enable_thinking=False
    )
    assert out.raw["prompt_token_ids"] == rendered == out.prompt_token_ids
    content = out.raw["choices"][0]["logprobs"]["content"]
    assert len(content) == len(out.token_ids) == len(out.logprobs) >= 1
    assert all(len(c["top_logprobs"]) == 2 for c in content)
    assert out.raw["object"] == "chat.completion"


@on_server
async def test_publish_serves_new_weights_and_refuses_an_older_version(
    weights, server, client, reference
):
    before = (await _greedy(client)).token_ids
    async with VllmPublisher([server.url], model_name="agent", timeout_s=120.0) as publisher:
        report = await publisher.publish(str(weights["ckpt_b"]), 5)
        assert report.version == 5 and report.first_token_s is not None
        assert [r["version"] for r in await _workers(client, "simloop_weight_version")] == [5, 5]
        await reference.load_weights(weights["ckpt_b"], 1)
        try:
            want_b = (await _reference_greedy(reference)).token_ids
        finally:  # the reference serves A again for the other tests
            await reference.load_weights(weights["ckpt_a"], 2)
        after = (await _greedy(client)).token_ids
        assert after == want_b != before

        with pytest.raises(VllmPublishError) as refused:
            await publisher.publish(str(weights["ckpt_a"]), 4)
        assert "500" in str(refused.value)
        assert "version 4 is older than the served version 5" in str(refused.value)
        assert (await _greedy(client)).token_ids == want_b  # still B
        assert await client.health()

        await publisher.publish(str(weights["ckpt_a"]), 6)  # A again, as a newer version
        assert (await _greedy(client)).token_ids == before


@on_server
async def test_bad_requests_get_vllm_errors_and_the_server_stays_up(client):
    async def status_and_error(path: str, body) -> tuple[int, dict]:
        with pytest.raises(ClientError) as e:
            await client.request("POST", path, json_body=body, retries=0)
        return e.value.status, e.value.body["error"]

    status, err = await status_and_error("/v1/completions", {"prompt": "x", "temperature": -1})
    assert status == 400 and err["type"] == "BadRequestError" and err["code"] == 400
    assert err["param"] == "temperature" and "temperature" in err["message"]
    status, err = await status_and_error("/v1/completions", {"prompt": "x", "model": "other"})
    assert (status, err["type"], err["code"]) == (404, "NotFoundError", 404)
    assert "other" in err["message"]
    status, err = await status_and_error("/v1/completions", {"prompt": [999999]})
    assert status == 400 and "vocabulary" in err["message"]
    status, err = await status_and_error("/collective_rpc", {"args": []})
    assert status == 400 and "method" in err["message"]
    status, err = await status_and_error("/collective_rpc", {"method": "__init__"})
    assert status == 400 and "load_orbax_weights" in err["message"]  # names what exists
    status, err = await status_and_error(
        "/collective_rpc", {"method": "load_orbax_weights", "args": ["/nonexistent", 7]}
    )
    assert status == 500 and err["type"] == "InternalServerError"
    assert "/nonexistent" in err["message"]
    assert await client.health()
    assert len((await _greedy(client)).token_ids) == GEN


def test_an_unknown_flag_exits_2_with_argparses_message(weights):
    started = time.monotonic()
    for flags, expect in (
        (["--bogus-flag", "1"], "unrecognized arguments: --bogus-flag"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size: 0 is invalid"),
        (["--speculative-config", '{"method": "eagle"}'], 'only {"method": "ngram", ...}'),
        (
            ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
            "num_speculative_tokens=0 is invalid",
        ),
    ):
        done = subprocess.run(
            [*FAKE_VLLM, str(weights["hf_dir"]), *flags], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 2 and expect in done.stderr, done.stderr
    assert time.monotonic() - started < 30  # refused before JAX is imported


def test_a_fake_that_cannot_start_fails_the_launch_with_its_reason(tmp_path):
    proc = Proc("agent_serve", (0,), free_port())
    cfg = VllmConfig(start_stagger_s=0.0, health_timeout_s=120.0)
    models = {"agent_serve": ServedModel(str(tmp_path / "missing"), "agent")}
    with pytest.raises(VllmLaunchError) as e:
        launch_servers(
            [proc],
            cfg,
            models,
            log_dir=tmp_path,
            lockfile=tmp_path / "lock",
            spawn=fake_spawn,
            poll_s=0.1,
        )
    assert "exited with code 1" in str(e.value)
    assert "model directory" in str(e.value) and "does not exist" in str(e.value)
    assert "Traceback" not in str(e.value)


@on_server
async def test_reset_prefix_cache_makes_the_next_prompt_prefill_again(reference):
    """The engine side of `/reset_prefix_cache` (vLLM's responses do not show cached tokens)."""
    params = SamplingParams(max_tokens=2, temperature=0.0)
    await reference.generate(PROMPT, params)
    (warm,) = await reference.generate(PROMPT, params)
    assert warm.cached_tokens == len(PROMPT) - 1  # all but the last, which decode feeds
    reference.reset_prefix_cache()
    (cold,) = await reference.generate(PROMPT, params)
    assert cold.cached_tokens == 0
    (warm_again,) = await reference.generate(PROMPT, params)
    assert warm_again.cached_tokens == len(PROMPT) - 1


@on_server
async def test_client_kept_sessions_hit_the_prefix_cache_and_the_trainer_replays_them(
    server, weights
):
    """Sessions on vLLM (`ClientConfig.client_sessions`): each call re-sends what the session
    keeps, the fake's prefix cache serves what an earlier call computed (whole 8-token blocks,
    counted in the responses and in vLLM's `/metrics` counters alike), and the trainer's
    logprobs of every sampled token equal the server's — for `markovian` only because each
    call that dropped a turn is replayed as its own segment (`context_resets`)."""
    from launch.config.schema import SimloopConfig
    from rl.data.trajectory import Trajectory, Turn, validate
    from rl.model import tiny
    from rl.orchestrator.episode import _SessionTurns
    from rl.train.build import build_trainer
    from rl.train.config import OptimConfig, PolicyLossConfig, RoleConfig
    from rl.train.rollouts import build_rl_batch
    from serving.compaction import SessionCompaction

    async def prefix_counters(c) -> dict[str, float]:
        raw = await c._get_session().get(f"{server.url}/metrics")
        text = await raw.text()
        out = {}
        for line in text.splitlines():
            for name in ("prefix_cache_queries", "prefix_cache_hits"):
                if line.startswith(f"vllm:{name}_total{{"):
                    out[name] = float(line.rsplit(" ", 1)[1])
        return out

    ccfg = ClientConfig(server.url, model="agent", max_retries=0, client_sessions=True)
    trajs, hits = {}, {}
    async with InferenceClient(ccfg) as c:
        before = await prefix_counters(c)
        for mode in ("none", "markovian"):
            compaction = SessionCompaction(mode=mode)
            turns = _SessionTurns(c, await c.open_session(compaction=compaction), compaction)
            ids, mask, logp, spans = list(range(40, 48)), [0] * 8, [None] * 8, []
            hits[mode] = []
            for k in range(6):
                out = await turns.complete(
                    list(ids), max_tokens=4, temperature=1.0, seed=k, extra={"ignore_eos": True}
                )
                assert len(out.token_ids) == 4 and len(out.logprobs) == 4
                spans.append(Turn(agent_text="", token_span=(len(ids), len(ids) + 4)))
                ids += out.token_ids
                mask += [1] * 4
                logp += out.logprobs
                hits[mode].append(out.cached_tokens)
                if k < 5:  # an observation the next call appends
                    ids += [60 + k, 70 + k, 80 + k, 90 + k]
                    mask += [0] * 4
                    logp += [None] * 4
            await turns.close()
            trajs[mode] = Trajectory(
                task_id=mode,
                arm="real",
                env_backend="local",
                status="ok",
                reward=1.0,
                turns=spans,
                token_ids=ids,
                loss_mask=mask,
                behavior_logprobs=logp,
                policy_version=[0 if m else None for m in mask],
                tokenizer="byte",
                kv_epochs=turns.kv_epochs(),
                context_resets=turns.resets,
            )
            validate(trajs[mode])
        after = await prefix_counters(c)
    # `none` re-sends everything: from the second call on, all but the last computed token
    # of the previous call come from the cache, counted in whole blocks of 8.
    assert trajs["none"].context_resets == []
    for k in range(1, 6):
        computed = 8 + 8 * k - 5  # the last call's prompt and its tokens but the last sampled
        assert hits["none"][k] == computed // 8 * 8, (k, hits["none"])
    # `markovian` keeps the prompt and the latest turn: from the third call on, each call
    # drops a turn (a reset); only the prompt's block is still cached.
    resets = trajs["markovian"].context_resets
    assert [r["start"] for r in resets] == [8 + 8 * k for k in range(2, 6)], resets
    assert all(r["context"] == [[0, 8], [r["start"] - 8, r["start"]]] for r in resets)
    assert hits["markovian"][2:] == [8, 8, 8, 8], hits["markovian"]
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == sum(
        sum(h) for h in hits.values()
    )
    assert after["prefix_cache_queries"] > after["prefix_cache_hits"]

    trainer = build_trainer(
        RoleConfig(model=tiny(initializer_range=0.3), hf_path=str(weights["hf_dir"])),
        ByteTokenizer(),
        optim=OptimConfig(),
        steps=1,
        loss="policy",
        rules=SimloopConfig().sharding.rules,
        seed=0,
    )
    rows = [trajs["none"], trajs["markovian"]]
    loss = PolicyLossConfig()
    batch, stats = build_rl_batch(rows, rows=2, seq_len=160, cfg=loss, version=0)
    assert stats.used == 2 and stats.truncated_rows == 0
    mask = batch["loss_mask"].astype(bool)
    assert mask.sum() == 48  # 6 turns x 4 sampled tokens, each trained once
    gap = np.abs(np.asarray(trainer.logprobs(batch)) - batch["behavior_logprobs"])[mask]
    assert gap.max() <= LOGPROB_TOL, f"max |trainer - server| logprob {gap.max():.2e}"
    # Replayed as one stream instead, the markovian row's later turns are not what was sampled
    blind_rows = [rows[0], dataclasses.replace(rows[1], context_resets=[])]
    blind, _ = build_rl_batch(blind_rows, rows=2, seq_len=160, cfg=loss, version=0)
    off = np.abs(np.asarray(trainer.logprobs(blind)) - blind["behavior_logprobs"])
    assert off[1][blind["loss_mask"][1].astype(bool)].max() > 100 * LOGPROB_TOL
