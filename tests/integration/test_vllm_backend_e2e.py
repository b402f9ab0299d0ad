"""RL through the vllm backend, end to end on a CPU: `simloop train-agent` with
`serve.backend: vllm` starts the agent's server from the chip plan with the fake vLLM
(`serving.vllm.fake_server`, through `vllm.command`), publishes each policy version to it with
`VllmPublisher` (Orbax export -> worker extension over `/collective_rpc`), and the next
rollout's tokens carry the version published before them."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fakes import free_port, user_env

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("serving.vllm.fake_server") is None,
        reason="serving/vllm/fake_server.py (the fake `vllm serve`) is not there yet",
    ),
]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "demo_cpu.yaml"


def test_one_rl_step_through_the_vllm_backend_with_the_fake_server(tmp_path):
    out = tmp_path / "agent"
    port = free_port()
    fake = f"[{sys.executable}, -m, serving.vllm.fake_server, serve]"
    env = user_env()
    cmd = [sys.executable, "-m", "launch", "train-agent", "--config", str(CONFIG),
           "--out", str(out), "--serve.backend", "vllm", "--vllm.command", fake,
           "--vllm.start_stagger_s", "0", "--vllm.max_model_len", "1024",
           "--chips.http_port_base", str(port),
           "--orchestrator.arm", "real", "--orchestrator.max_staleness", "0",
           "--orchestrator.batch_size", "4", "--orchestrator.group_size", "2",
           "--train_agent.steps", "2", "--train_agent.warm_start.steps", "0",
           "--train_agent.eval.tasks", "0"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "vLLM agent server(s)" in done.stdout

    # The server ran the exact argv the dry run lists, and was stopped when the job ended.
    (log,) = (out / "logs").glob(f"vllm-agent_serve-{port}.log")
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "the vLLM server outlived its job"

    # Versions 2 and 3 were published (the start weights were version 1) ...
    rl = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rl if r.get("stage") == "rl" and "step" in r]
    assert [r["version"] for r in rl] == [2, 3]
    assert all(r["publish_load_s"] > 0 for r in rl)
    # ... and every generated token carries the version served when it was sampled: in
    # synchronous RL, the version its episode was admitted at (exact), so the first batch's
    # tokens carry version 1 and the next batch's version 2.
    versions = set()
    for f in (out / "trajectories").glob("rl-*.jsonl"):
        for line in f.read_text().splitlines():
            t = json.loads(line)
            mine = {v for v, m in zip(t["policy_version"], t["loss_mask"], strict=True) if m}
            assert mine <= {t["meta"]["admitted_version"]}, (mine, t["meta"])
            versions |= mine
    assert {1, 2} <= versions, versions
