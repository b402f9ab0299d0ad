"""`simloop rehearse` of the shipped GKE v6e-32 config: eight local "pods", each the GKE pod
entry with its host's share of the plan, start every process the slice would (the policy
trainer as one JAX job of 4 processes, the simulator trainer as one of 2, the agent's and the
simulator's fake vLLM servers), with tiny models and a few steps, and exit 0 after real RL
steps, real episodes, real publishes and real simulator SFT steps (~2 minutes)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fakes import user_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_the_gke_v6e_32_config_rehearses_every_pod_on_cpu(tmp_path):
    out = tmp_path / "rehearse"
    cmd = [sys.executable, "-m", "launch", "rehearse", "--config",
           str(ROOT / "configs" / "gke-v6e-32.yaml"), "--out", str(out)]  # fmt: skip
    done = subprocess.run(
        cmd, cwd=ROOT, env=user_env(cheap_compile=True), capture_output=True, text=True, timeout=900
    )
    logs = "".join(p.read_text()[-1500:] for p in sorted((out / "pods").glob("*.log")))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:] + logs
    summary = json.loads((out / "rehearse.json").read_text())
    agent = summary["fs/ckpt/runs/gke-v6e-32"]
    assert agent["steps"] == {"rl": 2} and agent["rl_episodes"] >= 2 * 16
    assert agent["published"] == ["v000001", "v000002", "v000003"]
    assert summary["fs/ckpt/runs/gke-v6e-32-sim"]["steps"] == {"sim_sft": 2}
    # Every pod ran, and each multi-host trainer was one job: ranks 0..N-1, one coordinator.
    jobs: dict[str, set] = {}
    for i in range(8):
        text = (out / "pods" / f"host-{i}.log").read_text()
        for role, rank, n, coord in re.findall(
            r"host \d+: (\w+) \[train\] rank \d+, chips [\d,]+, process (\d+) of (\d+), "
            r"coordinator (\S+)",
            text,
        ):
            jobs.setdefault(role, set()).add((int(rank), int(n), coord))
    assert {r for r, _, _ in jobs["policy_train"]} == {0, 1, 2, 3}
    assert {r for r, _, _ in jobs["sim_train"]} == {0, 1}
    assert len({c for _, _, c in jobs["policy_train"]}) == 1
    # The servers were the fake vLLM, started from the plan's `vllm serve` command.
    assert "serving.vllm.fake_server" in (out / "fs" / "config" / "plan.json").read_text()
