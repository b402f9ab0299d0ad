"""Unmodified harnesses through the middleware, in real sandboxes (local bash), graded in a
second clean one:

- a scripted harness on the official `anthropic` SDK (`harness.kind: command`,
  tests/scripts/anthropic_harness.py) against a real middleware over a real tiny engine: one
  rollout applies the task's fix (reward 1), one does not (reward 0), one tries to finish
  itself with reward 1 (refused on the API listener, logged and counted; it keeps the grader's
  0); all written through the job's writer as token-exact trajectories; a stalled harness is
  killed at `wall_s`; a runner whose finish is refused (a wrong admin token) says so, and the
  rollout is written `aborted` when no grade arrives; a main line and an interleaved sub-agent
  become two segments of one rollout;
- `simloop harness` with mini-swe-agent, unmodified, on the built-in clamp task.
"""

import asyncio
import dataclasses
import json
import logging
import subprocess
import sys
import time
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
from rl.data import ByteTokenizer
from rl.data.trajectory import read_jsonl
from rl.model import Qwen3, tiny
from rl.orchestrator.harness import HarnessConfig, HarnessRunner, HarnessUnavailable, pick_launcher
from serving.config import ServerConfig
from serving.engine import Engine, EngineConfig
from tests.fakes import CALC_FIX, RecordingClient, assert_token_exact, swe_task_file, user_env

pytestmark = pytest.mark.slow
ASYNC = pytest.mark.asyncio(loop_scope="module")

REPO = Path(__file__).resolve().parents[2]
SIMLOOP = Path(sys.executable).parent / "simloop"
SCRIPT = REPO / "tests" / "scripts" / "anthropic_harness.py"
TOK = ByteTokenizer()
SHOW_SCRIPT = ["--env.shell.local.visible_paths", f"[{SCRIPT.parent}]"]
"""The sandbox sees none of the project but the scripted harness's folder."""


def command(*extra: str) -> str:
    return f"{{python}} {SCRIPT} {{base_url}} {{api_key}} {{task_file}} " + " ".join(extra)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory):
    from serving.server import background_server

    out = tmp_path_factory.mktemp("harness-run")
    cfg = harness_shell(
        load_config(
            SimloopConfig, REPO / "configs/demo_cpu.yaml", ["--middleware.port", "0", *SHOW_SCRIPT]
        )
    )
    engine = Engine(
        Qwen3(tiny(initializer_range=0.3), rngs=nnx.Rngs(0)),
        TOK,
        EngineConfig(num_slots=4, max_seq_len=2048, prefill_chunk=128, prefill_batch=2),
    )
    scfg = ServerConfig(host="127.0.0.1", port=0, model_name="tiny", shutdown_timeout_s=5.0)
    async with background_server(engine, TOK, scfg, start_timeout_s=180) as agent_url:
        client = RecordingClient(agent_url)
        async with running_middleware(cfg, out, client) as (middleware, url, admin):
            real = shell_backends(cfg.env.shell, run_id="test-harness").real
            hcfg = HarnessConfig(kind="command", command=command(), wall_s=120.0)
            try:
                python = await pick_launcher(hcfg, real, swe_suite(["clamp"])[0])
            except HarnessUnavailable as e:
                pytest.skip(f"no Python this machine's sandbox user can run: {e}")
            yield {
                "out": out,
                "url": url,
                "real": real,
                "python": python,
                "client": client,
                "middleware": middleware,
                "admin": admin,
            }
        await client.close()


def runner(stack, *extra: str, admin=None, wall_s: float = 120.0) -> HarnessRunner:
    hcfg = HarnessConfig(kind="command", command=command(*extra), wall_s=wall_s)
    return HarnessRunner(
        hcfg, stack["real"], stack["url"], stack["python"], admin=admin or stack["admin"]
    )


@ASYNC
async def test_scripted_sdk_harness_rollouts_are_graded_and_token_exact(stack, caplog):
    (task,) = swe_suite(["clamp"])
    middleware = stack["middleware"]
    refused = middleware.refused_finishes["api"]
    with caplog.at_level(logging.WARNING, logger="serving.middleware.app"):
        fixed, unfixed, forged = await asyncio.gather(
            runner(stack, "--turns 2", "--fix clamp").run_one(task, "g0", 0),
            runner(stack, "--turns 2").run_one(task, "g0", 1),
            runner(stack, "--turns 2", "--forge").run_one(task, "g0", 2),
        )
    for r in (fixed, unfixed, forged):
        assert r.status == "ok" and r.exit_code == 0, r.reason
        assert r.finish["trajectories"] == 1 and r.finish["plans"]["extend"] == 1
    assert (fixed.reward, unfixed.reward, forged.reward) == (1.0, 0.0, 0.0)
    assert "min(x, hi)" in fixed.diff and unfixed.diff == ""
    # The harness's own finish with reward 1.0 was refused where it can reach, and said so.
    assert middleware.refused_finishes["api"] == refused + 1
    assert f"refused POST /rollouts/{forged.rollout_id}/finish on the API listener" in caplog.text
    trajs = {
        t.rollout_id: t
        for p in sorted((stack["out"] / "trajectories").glob("*.jsonl"))
        for t in read_jsonl(p)
    }
    for r in (fixed, unfixed, forged):
        t = trajs[r.rollout_id]
        assert (t.reward, t.task_id, t.group_id, t.status) == (r.reward, task.id, "g0", "ok")
        assert len(t.turns) == 2 and t.meta["harness"] == "command"
        assert_token_exact(stack["client"].calls, t)


@ASYNC
async def test_an_interleaved_sub_agent_is_its_own_segment_of_the_rollout(stack):
    """A harness whose main line dispatches a sub-agent, their calls interleaved (main, sub,
    main, sub, main, sub): the middleware keeps two segments of one rollout, each extended by
    its own later calls, both written with the rollout's id and grade, token-exact."""
    (task,) = swe_suite(["clamp"])
    result = await runner(stack, "--turns 3", "--subagent").run_one(task, "g3", 0)
    assert result.status == "ok", result.reason
    assert result.finish["trajectories"] == 2, result.finish
    assert result.finish["plans"] == {"new": 2, "extend": 4, "retry": 0}, result.finish
    segments = [
        t
        for p in sorted((stack["out"] / "trajectories").glob("*.jsonl"))
        for t in read_jsonl(p)
        if t.rollout_id == result.rollout_id
    ]
    assert len(segments) == 2 and all(len(t.turns) == 3 for t in segments)
    firsts = sorted(TOK.decode(t.token_ids[: t.turns[0].token_span[0]]) for t in segments)
    assert "You fix bugs." in firsts[0] + firsts[1] and "sub-agent" in firsts[0] + firsts[1]
    assert not any("sub-agent" in f and "You fix bugs." in f for f in firsts)  # kept apart
    for t in segments:
        assert (t.reward, t.group_id, t.status) == (result.reward, "g3", "ok")
        assert_token_exact(stack["client"].calls, t)


@ASYNC
async def test_a_refused_finish_is_reported_and_the_rollout_ends_aborted(stack, caplog):
    (task,) = swe_suite(["clamp"])
    wrong = dataclasses.replace(stack["admin"], token="not-the-token")
    with caplog.at_level(logging.WARNING):
        result = await runner(stack, "--turns 1", admin=wrong).run_one(task, "g1", 0)
    assert result.status == "ok" and result.reward == 0.0
    assert "(401)" in result.finish["error"] and result.finish["trajectories"] == 0
    assert result.summary()["finish_error"] == result.finish["error"]
    assert f"rollout {result.rollout_id}: finishing it with reward 0.0 failed" in caplog.text
    middleware = stack["middleware"]
    assert result.rollout_id in middleware.rollouts  # not written with any grade
    assert middleware.reap(time.time() + middleware.cfg.rollout_ttl_s + 1) == 1
    (t,) = [
        t
        for p in sorted((stack["out"] / "trajectories").glob("*.jsonl"))
        for t in read_jsonl(p)
        if t.rollout_id == result.rollout_id
    ]
    assert (t.status, t.reward) == ("aborted", None) and "no finish (its grade)" in t.reason


@ASYNC
async def test_a_stalled_harness_is_killed_at_wall_s_and_its_turns_are_kept(stack):
    (task,) = swe_suite(["clamp"])
    # Stalled before any model call: killed, graded (an empty diff), nothing to write.
    result = await runner(stack, "--sleep 60", wall_s=2.0).run_one(task, "g2", 0)
    assert result.status == "truncated" and "wall_s=2" in result.reason
    assert result.wall_s < 30 and result.reward == 0.0
    assert result.finish["trajectories"] == 0  # it never called the model
    # Stalled after two model calls: its rollout is written `truncated`, with the reason and
    # the grade, token-exact, like any finished rollout (never lost or aborted).
    result = await runner(stack, "--turns 2", "--sleep-after 60", wall_s=10.0).run_one(
        task, "g2", 1
    )
    assert result.status == "truncated" and "wall_s=10" in result.reason
    assert result.reward == 0.0 and result.finish["trajectories"] == 1
    (t,) = [
        t
        for p in sorted((stack["out"] / "trajectories").glob("*.jsonl"))
        for t in read_jsonl(p)
        if t.rollout_id == result.rollout_id
    ]
    assert (t.status, t.reward, len(t.turns)) == ("truncated", 0.0, 2)
    assert "wall_s=10" in t.reason
    assert_token_exact(stack["client"].calls, t)


def test_simloop_harness_runs_mini_swe_agent_unmodified(tmp_path):
    out = tmp_path / "h"
    cmd = [SIMLOOP, "harness", "--config", "configs/demo_cpu.yaml", "--out", str(out),
           "--harness.tasks", "[clamp]", "--harness.samples", "2", "--harness.step_limit", "2",
           "--harness.max_tokens", "32", "--orchestrator.max_context_tokens", "8192",
           "--serve.engine.max_seq_len", "8192", "--serve.engine.num_slots", "2",
           "--middleware.port", "0"]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, env=user_env(cheap_compile=True), capture_output=True, text=True, timeout=600
    )
    if proc.returncode == 1 and "does not start inside the sandbox" in proc.stdout + proc.stderr:
        pytest.skip(
            "mini-swe-agent cannot run as this machine's sandbox user: "
            + (proc.stdout + proc.stderr)[-500:]
        )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "harness.json").read_text())
    assert summary["rollouts"] == 2 and summary["harness"] == "mini-swe-agent"
    for r in summary["results"]:
        assert r["status"] == "ok" and r["exit_code"] == 0 and r["reward"] == 0.0, r
        assert r["trajectories"] >= 1
    trajs = [
        t for p in sorted((out / "trajectories").glob("middleware-*.jsonl")) for t in read_jsonl(p)
    ]
    assert len(trajs) == summary["trajectories"]
    assert {t.rollout_id for t in trajs} == {r["rollout_id"] for r in summary["results"]}
    assert all(t.meta["harness"] == "mini-swe-agent" and sum(t.loss_mask) > 0 for t in trajs)


def test_train_agent_on_a_swe_task_file_trains_through_mini_swe_agent(tmp_path):
    """RL through mini-swe-agent, unmodified, + the middleware, on a 3-instance task file
    graded as SWE-bench grades. The agent (`dev/bpe_agent.py`'s tool-calling agent: weights
    set by hand) calls mini-swe-agent's bash tool with the instances' fix or with `true`,
    each as likely, then submits: so each rollout is resolved or not by what the model
    sampled, its per-test results go with it, a step with mixed grades has a gradient, each
    step publishes a version, and the next step's tokens carry it."""
    sys.path.insert(0, str(REPO / "dev"))
    from bpe_agent import bpe_agent, tool_calling_agent

    from rl.data.tools import parse_assistant

    out = tmp_path / "rl"
    tasks, _, _ = swe_task_file(tmp_path / "tasks", n=3)
    name, old, new = CALC_FIX
    fix = f"sed -i 's/{old}/{new}/' {name}"
    agent, _ = tool_calling_agent(
        bpe_agent(tmp_path / "bpe"), tmp_path / "agent", "mini-swe-agent", commands=(fix, "true")
    )
    cmd = [SIMLOOP, "train-agent", "--config", "configs/demo_cpu.yaml", "--out", str(out),
           "--train_agent.tasks", f"file:{tasks}", "--train_agent.warm_start.steps", "0",
           "--agent.hf_path", str(agent),
           "--agent.tokenizer", json.dumps({"kind": "hf", "path": str(agent)}),
           "--train_agent.steps", "2", "--train_agent.seq_len", "2048",
           "--train_agent.loss.aggregation", "rollout_mean", "--train_agent.eval.tasks", "0",
           # Two rollouts a step: the policy trainer on 2 of the 8 fake devices, so that a
           # step's 2 rows split over its data-parallel devices.
           "--chips.roles", "{policy_train: 2, sim_train: 2, agent_serve: 1, sim_serve: 1}",
           "--agent.mesh", "{fsdp: 2}",
           "--orchestrator.batch_size", "2", "--orchestrator.group_size", "2",
           "--orchestrator.max_staleness", "0", "--orchestrator.max_context_tokens", "2048",
           "--serve.engine.max_seq_len", "2048", "--serve.engine.num_slots", "4",
           "--harness.kind", "mini-swe-agent", "--harness.step_limit", "3",
           "--harness.max_tokens", "64", "--middleware.port", "0",
           # The hand-set switch's MLP runs at activations in the hundreds: an Adam step of
           # 1e-3 (the demo's) moves every output weight by that much and breaks it.
           "--train_agent.optim.lr", "1e-5"]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, env=user_env(cheap_compile=True), capture_output=True, text=True, timeout=900
    )
    if proc.returncode == 1 and "does not start inside the sandbox" in proc.stdout + proc.stderr:
        pytest.skip(
            "mini-swe-agent cannot run as this machine's sandbox user: " + proc.stdout[-300:]
        )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trajs = [
        t for p in sorted((out / "trajectories").glob("middleware-*.jsonl")) for t in read_jsonl(p)
    ]
    assert len(trajs) == 4  # 2 steps x 2 rollouts, one segment each
    for t in trajs:
        assert t.meta["harness"] == "mini-swe-agent" and t.status == "ok", (t.status, t.reason)
        commands = [
            c.arguments["command"]
            for x in t.turns
            for c in parse_assistant(x.agent_text).tool_calls
        ]
        assert commands[0] in (fix, "true") and commands[-1].startswith("echo COMPLETE"), commands
        grade = t.meta["grade"]  # SWE-bench's verdict, test by test
        assert t.reward == float(grade["resolved"]) == float(fix in commands), (commands, grade)
        if grade["resolved"]:
            assert grade["FAIL_TO_PASS"] == grade["PASS_TO_PASS"] == {"passed": 1, "of": 1}
    # All four rollouts make the same call with probability 2/16 (as likely as any other
    # sequence of choices), so the test asserts each grade's cause, not their mix.
    assert {t.task_id for t in trajs} <= {"calc-0", "calc-1", "calc-2"}
    versions = sorted({v for t in trajs for v in t.policy_version if v is not None})
    assert versions == [1, 2]  # step 2's rollouts ran on the version step 1 published
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r.get("stage") == "rl" and "step" in r]
    assert [r["step"] for r in rl] == [1, 2] and all("publish_first_token_s" in r for r in rl)
    for r in rl:
        # A group with mixed rewards gives a real gradient. Not a nonzero loss: on-policy the
        # surrogate's value is minus the sum of the group-centred advantages (x IS weights ~1),
        # which is zero by construction.
        if r["zero_variance_groups"] == 0:
            assert r["grad_norm"] > 0.0, r
    assert (out / "weights" / "final").is_dir()
