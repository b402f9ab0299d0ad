"""One SFT job as two JAX processes (multi-controller, as the hosts of a pod slice run it),
started by the local launcher (`--run.processes 2`): each process holds 4 of the job's 8 fake
devices, feeds only its own rows of each global batch, and process 0 alone writes the run
directory. A process killed with SIGKILL ends the other within the heartbeat timeout, the same
command resumes from the last checkpoint, and the job ends as one process over 8 devices does.

Tolerances (float32, ε = 2^-24), from the arithmetic rather than from a run:
- the two jobs run the same XLA program on the same global batches, but a cross-process
  all-reduce (gloo) may add the D = 8 data-parallel partial sums in another order. A sum of D
  non-negative terms changes by at most (D - 1)·ε of itself when reordered, so step 1 (same
  parameters in both) must agree to that. Each later step sees parameters moved by updates
  whose own reductions were reordered; each earlier step is allowed one more reduction's worth.
- AdamW's update per coordinate is bounded whatever the gradients: |m̂/(√v̂ + eps)| ≤ U_t by
  Cauchy-Schwarz over the moving averages' weights (`adam_bound`), so two runs' parameters
  (weight decay off) can differ by at most Σ_t 2·lr·U_t, even where a reordered sum flips the
  sign of a gradient that is almost zero.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from launch.config.loading import load_config
from launch.config.schema import SimloopConfig
from launch.jobs.episodes import agent_tasks
from rl.data.trajectory import Trajectory, Turn, write_jsonl
from rl.model.zarr_read import read_arrays
from rl.orchestrator.buffer import task_stream
from tests.fakes import user_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "demo_cpu.yaml"
D = 8  # data-parallel devices: the simulator's mesh below
EPS32 = 2.0**-24
LR, B1, B2 = 1e-3, 0.9, 0.999
HEARTBEAT_S = 5


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Small real-shaped trajectories: commands and the outputs bash gives them."""
    out = tmp_path_factory.mktemp("trajectories") / "t.jsonl"
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    trajs = []
    for i in range(32):
        w = words[i % len(words)] * (1 + i % 3)
        turns = [
            Turn(agent_text=f"echo {w}", command=f"echo {w}", observation=f"{w}\n", exit_code=0),
            Turn(
                agent_text=f"printf '%s' {w} | wc -c",
                command=f"printf '%s' {w} | wc -c",
                observation=f"{len(w)}\n",
                exit_code=0,
            ),
        ]
        trajs.append(
            Trajectory(
                task_id=f"mh-{i}",
                arm="real",
                env_backend="local",
                status="ok",
                reward=0.0,
                turns=turns,
            )
        )
    write_jsonl(out, trajs)
    return out


def train_sim(out: Path, data: Path, *, processes: int, steps: int) -> list[str]:
    return [
        sys.executable, "-m", "launch", "train-sim", "--config", str(CONFIG), "--out", str(out),
        "--train_sim.trajectories", f"[{data}]",
        "--train_sim.steps", str(steps), "--train_sim.log_every", "1",
        "--train_sim.checkpoint.every_steps", "2",
        "--train_sim.data.batch_size", str(D), "--train_sim.data.seq_len", "128",
        "--train_sim.data.cut_targets", "true",
        "--train_sim.heldout_fraction", "0.0", "--train_sim.eval_every", "0",
        "--train_sim.optim.lr", str(LR), "--train_sim.optim.b1", str(B1),
        "--train_sim.optim.b2", str(B2), "--train_sim.optim.warmup_steps", "0",
        "--train_sim.optim.weight_decay", "0.0",
        "--simulator.weights", "null",
        # The simulator trainer spans all 8 devices, so both processes hold part of it.
        "--chips.roles", "{sim_train: 8}", "--simulator.mesh", f"{{fsdp: {D}}}",
        "--run.processes", str(processes), "--run.heartbeat_timeout_s", str(HEARTBEAT_S),
    ]  # fmt: skip


def env() -> dict[str, str]:
    """A user's environment with the suite's cheap compile flags: these jobs run a few steps,
    so compiling is most of their time (both sides of each comparison compile alike)."""
    return user_env(cheap_compile=True)


def run(cmd: list[str], timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)


def losses(out: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if r.get("stage") == "sim_sft" and "loss" in r]


def adam_bound(t: int) -> float:
    """max |m̂_t / (√v̂_t + eps)| over all gradient sequences (Cauchy-Schwarz: m_t = Σ a_k g_k,
    v_t = Σ b_k g_k², so |m_t| ≤ √(Σ a_k²/b_k) · √v_t), bias corrections included."""
    s = sum(((1 - B1) * B1 ** (t - k)) ** 2 / ((1 - B2) * B2 ** (t - k)) for k in range(1, t + 1))
    return math.sqrt(s) * math.sqrt(1 - B2**t) / (1 - B1**t)


def test_two_processes_train_as_one_and_survive_a_killed_process(data, tmp_path):
    """One job of 10 SFT steps: as one process over 8 devices (the reference), and as two
    processes of 4, of which one is killed with SIGKILL after the first checkpoint; the rerun
    of the same command resumes and must end where the one-process job did (losses step by
    step, final weights) within the reordered-sum bounds above. One two-process job checks
    both claims: a resume is exact, so it changes no bound."""
    steps = 10
    one = run(train_sim(tmp_path / "one", data, processes=1, steps=steps))
    assert one.returncode == 0, one.stderr[-3000:]
    out = tmp_path / "two"
    cmd = train_sim(out, data, processes=2, steps=steps)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 300
        ckpts = out / "checkpoints"
        while not (ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir())):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.05)
        pids = dict(line.split() for line in (out / "processes" / "pids").read_text().splitlines())
        os.kill(int(pids["1"]), signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=HEARTBEAT_S + 60)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "process 1 of 2 was killed by SIGKILL first" in err, err[-3000:]
    assert "Run the same command again to resume" in err
    assert took < HEARTBEAT_S + 45, took  # the heartbeat ends process 0; no collective hangs
    done = sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
    assert done and done[-1] < steps
    again = run(cmd)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming at step {done[-1]}" in again.stdout
    assert "2 processes x 4 devices" in again.stdout
    # Process 0 writes the run; process 1's output is in its log, and it wrote nothing else.
    assert (out / "processes" / "process-1.log").is_file()
    want, got = losses(tmp_path / "one"), losses(out)
    assert [s for s, _ in got] == [s for s, _ in want] == list(range(1, steps + 1))  # once each
    for (step, a), (_, b) in zip(want, got, strict=True):
        assert abs(a - b) <= step * (D - 1) * EPS32 * abs(a), (step, a, b)
    w1 = read_arrays(tmp_path / "one" / "weights" / "final" / "params", None)
    w2 = read_arrays(out / "weights" / "final" / "params", None)
    assert w1 and sorted(w1) == sorted(w2)
    bound = sum(2 * LR * adam_bound(t) for t in range(1, steps + 1))
    worst = max(float(np.max(np.abs(w1[k].astype(np.float64) - w2[k]))) for k in w1)
    assert worst <= bound, (worst, bound)


# ----- RL: process 0 runs the episodes, every process trains ----------------------------------


def train_agent(out: Path, *, processes: int) -> list[str]:
    """Two RL steps of 8 episodes (2 tasks x 4) in the real shell after a one-step warm start
    on 4 scripted demonstrations; the policy trainer holds 8 devices, the agent server one."""
    return [
        sys.executable, "-m", "launch", "train-agent", "--config", str(CONFIG), "--out", str(out),
        "--chips.accelerator", "cpu-16", "--chips.roles", "{policy_train: 8, agent_serve: 1}",
        "--agent.mesh", "{fsdp: 8}", "--orchestrator.arm", "real",
        "--orchestrator.batch_size", "8", "--orchestrator.group_size", "4",
        "--train_agent.steps", "2", "--train_agent.warm_start.steps", "1",
        "--train_agent.warm_start.num_demos", "4", "--train_agent.eval.tasks", "0",
        "--train_agent.checkpoint.every_steps", "1", "--run.processes", str(processes),
    ]  # fmt: skip


def episodes(out: Path) -> list[tuple[str, str, int]]:
    rows = []
    for path in sorted((out / "trajectories").glob("rl-*.jsonl")):
        for line in path.read_text().splitlines():
            t = json.loads(line)
            rows.append((t["group_id"], t["task_id"], t["group_index"]))
    return sorted(rows)


def test_rl_with_two_processes_runs_each_episode_once_and_publishes_each_version_once(tmp_path):
    two = tmp_path / "two"
    r2 = run(train_agent(two, processes=2))
    log1 = two / "processes" / "process-1.log"
    assert r2.returncode == 0, r2.stderr[-3000:] + log1.read_text()[-3000:]
    # The same episodes as one process runs, each once: 2 steps x 8 slots, i.e. the first 4
    # groups of the seeded task stream (drawn at the run seed + the start version, 1; the
    # stream is prefix-stable) x 4 samples. One process's run of this command was compared
    # episode by episode until 2026-12-05; the stream says the same without a second job.
    cfg = load_config(SimloopConfig, CONFIG, ["--train_agent.eval.tasks", "0"])
    train, _ = agent_tasks(cfg)
    groups = task_stream(train, 4, seed=cfg.run.seed + 1)
    want = sorted((f"g{i}-{t.id}", t.id, j) for i, t in enumerate(groups) for j in range(4))
    assert episodes(two) == want
    # The demonstrations were collected once, by process 0, and read by both.
    demos = (two / "trajectories" / "demos.jsonl").read_text().splitlines()
    assert 0 < len(demos) <= 4
    # One metrics line per RL step (process 1 writes none), each with its publish.
    rl = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rl if r.get("stage") == "rl" and "event" not in r]
    assert [r["step"] for r in rl] == [1, 2]
    assert all("publish_load_s" in r for r in rl)
    # The agent server loaded versions 1 (the start), 2 and 3, each once.
    log = (two / "logs" / "agent-server.log").read_text()
    served = [
        int(x.split("serving weights version ")[1].split()[0])
        for x in log.splitlines()
        if "serving weights version" in x
    ]
    assert served == [1, 2, 3]
    assert "simloop train-agent:" in log1.read_text()
