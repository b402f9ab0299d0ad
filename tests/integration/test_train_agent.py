"""`simloop train-agent` as a user runs it, on textops in a real LocalShell: scripted (noisy)
demonstrations are collected, the tiny agent is warm-started on them, then synchronous RL runs
against a real `simloop serve` agent server that receives every new policy version by
checkpoint.

The learning criterion of the trainers issue (reward rises over N RL steps) is NOT met yet with
the demo config: see `test_rl_raises_the_reward_of_an_undertrained_agent`, which runs only with
SIMLOOP_LEARNING_TEST=1 (it takes ~8 minutes and currently fails), so CI checks the plumbing
with a short run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "demo_cpu.yaml"
LEARNING = os.environ.get("SIMLOOP_LEARNING_TEST") == "1"


def records(run: Path, stage: str) -> list[dict]:
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("stage") == stage and "event" not in r and "step" in r:
            out.append(r)
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("agent")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    cmd = [
        sys.executable,
        "-m",
        "launch",
        "train-agent",
        "--config",
        str(CONFIG),
        "--out",
        str(out),
    ]
    if not LEARNING:
        cmd += [
            "--train_agent.warm_start.steps",
            "30",
            "--train_agent.warm_start.num_demos",
            "32",
            "--train_agent.steps",
            "3",
            "--orchestrator.batch_size",
            "16",
        ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    return out, done


@pytest.mark.skipif(
    not LEARNING,
    reason="set SIMLOOP_LEARNING_TEST=1: ~8 min, and the "
    "learning criterion is still open (the reward does not rise yet)",
)
def test_rl_raises_the_reward_of_an_undertrained_agent(trained):
    out, _ = trained
    rl = records(out, "rl")
    assert len(rl) >= 10
    rewards = [r["reward_mean"] for r in rl]
    k = len(rewards) // 3
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    assert last >= first + 0.15, f"reward did not rise: first {first:.3f}, last {last:.3f}"


def test_rl_steps_are_synchronous_and_publish_every_version(trained):
    out, _ = trained
    rl = records(out, "rl")
    steps = [r["step"] for r in rl]
    assert steps == list(range(1, len(steps) + 1)) and steps
    # Synchronous RL (S=0): every trained token was sampled by the version being trained.
    assert all(r["staleness_max"] == 0 for r in rl)
    assert all(abs(r["mismatch_kl"]) < 0.05 for r in rl)
    # Each step published a new version to the real server.
    assert [r["version"] for r in rl] == [s + 1 for s in steps]
    assert all(r["publish_first_token_s"] > 0 for r in rl)


def test_the_run_directory_holds_every_artifact(trained):
    out, done = trained
    warm = records(out, "warm_start")
    assert warm and warm[-1]["loss"] < warm[0]["loss"]
    assert (out / "config.yaml").exists()
    assert (out / "trajectories" / "demos.jsonl").exists()
    assert list((out / "trajectories").glob("rl-*.jsonl"))
    assert (out / "weights" / "final" / "model_config.json").exists()
    assert sorted(int(p.name) for p in (out / "checkpoints" / "rl").iterdir() if p.name.isdigit())
    assert (out / "logs" / "agent-server.log").exists()
    summary = json.loads(done.stdout.strip().splitlines()[-1].split("train-agent: ", 1)[1])
    assert summary["rl"]["steps"] == len(records(out, "rl"))
