"""`simloop collect` -> `simloop train-sim` as a user runs them, including a trainer killed with
SIGKILL mid-run and restarted with the same command: it continues from its last checkpoint
and every later loss equals the uninterrupted run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fakes import user_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "demo_cpu.yaml"
STEPS = 16


def simloop(*args: str) -> list[str]:
    return [sys.executable, "-m", "launch", *args]


def _env() -> dict:
    # As a user runs it: simloop gives itself the 8 fake devices of the demo's cpu-8 plan.
    return user_env(cheap_compile=True)


def run(cmd: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def collected(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("collect")
    cmd = simloop(
        "collect",
        "--config",
        str(CONFIG),
        "--out",
        str(out),
        "--collect.episodes",
        "24",
        "--collect.noise",
        "0.3",
    )
    done = run(cmd, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "24 episodes" in done.stdout
    return out / "trajectories"


def train_sim_cmd(out: Path, data: Path) -> list[str]:
    return simloop(
        "train-sim",
        "--config",
        str(CONFIG),
        "--out",
        str(out),
        "--train_sim.trajectories",
        f"[{data}]",
        "--train_sim.steps",
        str(STEPS),
        "--train_sim.log_every",
        "1",
        "--train_sim.checkpoint.every_steps",
        "4",
        "--train_sim.data.batch_size",
        "2",
        "--train_sim.data.seq_len",
        "768",
        "--train_sim.heldout_fraction",
        "0.2",
        "--train_sim.eval_every",
        "8",
        # From a random initialisation (the demo config starts from its pretrained checkpoint).
        "--simulator.weights",
        "null",
    )


def losses(run: Path) -> dict[int, float]:
    """Step -> loss; a step logged twice (before a kill and after the resume) keeps the last."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("stage") == "sim_sft" and "loss" in r and "step" in r:
            out[r["step"]] = r["loss"]
    return out


def committed_steps(run: Path) -> list[int]:
    ckpt = run / "checkpoints"
    if not ckpt.exists():
        return []
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())


def test_train_sim_runs_and_resumes_exactly_after_sigkill(collected, tmp_path):
    whole = tmp_path / "whole"
    done = run(train_sim_cmd(whole, collected))
    assert done.returncode == 0, done.stderr[-3000:]
    expected = losses(whole)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert expected[STEPS] < expected[1]  # it learns
    assert (whole / "weights" / "final" / "model_config.json").exists()
    # the prompt layout it learnt, sealed with the weights (a server verifies every file)
    layout = json.loads((whole / "weights" / "final" / "sim_prompt.json").read_text())
    assert layout == {"workspace": False, "workspace_named_absent": False,
                      "workspace_named_last": False}  # fmt: skip
    from rl.model.integrity import verify_checkpoint

    verify_checkpoint(whole / "weights" / "final")
    assert json.loads((whole / "heldout_tasks.json").read_text())  # some tasks held out
    assert committed_steps(whole)[-1] == STEPS
    # The held-out fidelity learning curve: greedy exact by operation every eval_every steps.
    curve = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    curve = [r for r in curve if r.get("stage") == "sim_sft_eval"]
    assert [r["step"] for r in curve] == [8, 16]
    for r in curve:
        kinds = {k for k in r if k.startswith("exact_")}
        assert kinds and kinds <= {f"exact_{op}" for op in ("reverse", "upper", "sort", "count")}
        assert all(0.0 <= r[k] <= 1.0 for k in kinds | {"exact"})

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        train_sim_cmd(killed, collected),
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while not [s for s in committed_steps(killed) if s >= 8]:
        assert proc.poll() is None, "the trainer ended before it could be killed"
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    at_kill = committed_steps(killed)[-1]
    assert at_kill < STEPS, "the run finished before the kill landed"

    again = run(train_sim_cmd(killed, collected))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming at step {at_kill}" in again.stdout
    got = losses(killed)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(at_kill + 1, STEPS + 1):
        assert got[step] == expected[step], (step, got[step], expected[step])


def test_train_sim_without_trajectories_says_what_to_set(tmp_path):
    done = run(simloop("train-sim", "--config", str(CONFIG), "--out", str(tmp_path)), 120)
    assert done.returncode == 2
    assert "train_sim.trajectories is empty" in done.stderr
