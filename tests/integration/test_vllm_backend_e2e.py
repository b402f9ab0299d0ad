"""RL through the vllm backend, end to end on a CPU: `simloop train-agent` with
`serve.backend: vllm` starts the agent's server from the chip plan with the fake vLLM
(`serving.vllm.fake_server`, through `vllm.command`), publishes each policy version to it with
`VllmPublisher` (Orbax export -> worker extension over `/collective_rpc`), and the next
rollout's tokens carry the version published before them. The run is the gated arm's, so the
simulator's server is a fake vLLM too, and each co-trained simulator version reaches it by the
same path (issue 22's serving side)."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fakes import free_port, user_env
from tests.unit.test_metrics_log import read_scalars

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("serving.vllm.fake_server") is None,
        reason="serving/vllm/fake_server.py (the fake `vllm serve`) is not there yet",
    ),
]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "demo_cpu.yaml"


def test_rl_through_the_vllm_backend_publishes_policy_and_cotrained_simulator_versions(tmp_path):
    out = tmp_path / "gated"
    port = free_port()
    fake = f"[{sys.executable}, -m, serving.vllm.fake_server, serve]"
    # Three RL steps: a co-training round begun after step 1 trains during step 2 and serves
    # step 3. From the learning test's warm-started agent, so that the real episodes the
    # simulator co-trains on have commands.
    cmd = [sys.executable, "-m", "launch", "train-agent", "--config", str(CONFIG),
           "--out", str(out), "--serve.backend", "vllm", "--vllm.command", fake,
           "--vllm.start_stagger_s", "0", "--vllm.max_model_len", "2048",
           "--chips.http_port_base", str(port), "--orchestrator.arm", "gated",
           "--orchestrator.max_staleness", "0", "--orchestrator.batch_size", "4",
           "--orchestrator.group_size", "2", "--orchestrator.gate.cotrain_every", "1",
           "--orchestrator.gate.cotrain_steps", "1", "--train_agent.steps", "3",
           "--agent.weights", str(ROOT / "tests" / "fixtures" / "warm-agent" / "weights"),
           "--train_agent.warm_start.steps", "0", "--train_agent.eval.tasks", "0"]  # fmt: skip
    done = subprocess.run(
        cmd, cwd=ROOT, env=user_env(cheap_compile=True), capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "vLLM agent server(s)" in done.stdout and "vLLM simulator server(s)" in done.stdout

    # The servers ran the exact argv the dry run lists, and were stopped when the job ended.
    (agent_log,) = (out / "logs").glob(f"vllm-agent_serve-{port}.log")
    (sim_log,) = (out / "logs").glob("vllm-sim_serve-*.log")
    for p in (port, int(sim_log.stem.rsplit("-", 1)[1])):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", p)) != 0, "a vLLM server outlived its job"

    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # Policy versions 2 to 4 were published (the start weights were version 1) ...
    rl = [r for r in records if r.get("stage") == "rl" and "step" in r]
    assert [r["version"] for r in rl] == [2, 3, 4]
    assert all(r["publish_load_s"] > 0 for r in rl)
    # ... and every generated token carries the version served when it was sampled: in
    # synchronous RL, the version its episode was admitted at (exact), so the first batch's
    # tokens carry version 1 and the next batch's version 2.
    versions = set()
    for f in (out / "trajectories").glob("rl-*.jsonl"):
        for line in f.read_text().splitlines():
            t = json.loads(line)
            mine = {v for v, m in zip(t["policy_version"], t["loss_mask"], strict=True) if m}
            assert mine <= {t["admitted_version"]}, (mine, t["admitted_version"])
            versions |= mine
    assert {1, 2, 3} <= versions, versions

    # One co-trained simulator version was published to the simulator's vLLM server, which
    # reloaded its engine from the published parameters, and the router moved to it.
    rounds = [r for r in records if r.get("stage") == "sim_cotrain_round"]
    assert not [r for r in records if r.get("stage") == "sim_cotrain_error"]
    assert len(rounds) == 1 and rounds[0]["sim_version"] == 1, rounds
    assert rounds[0]["publish_s"] > 0 and rounds[0]["served_from"] == 3, rounds
    assert sim_log.read_text().count("engine reloaded from the workers' parameters") == 1
    gates = [r for r in records if r.get("stage") == "gate"]
    assert [r["sim_version"] for r in gates] == [0, 0, 1], gates
    # Real episodes were replayed against version 0, then again against version 1.
    shadow = [
        json.loads(line)
        for f in (out / "trajectories").glob("shadow-*.jsonl")
        for line in f.read_text().splitlines()
    ]
    assert {t["meta"]["sim_version"] for t in shadow} == {0, 1}
    # TensorBoard has each operation's live fidelity bound and routing at every policy version
    # that saw it, and the simulator version the router was on.
    scalars = read_scalars(out / "tensorboard")
    ops = {op for r in gates for op in r["units"]}
    assert ops, gates
    for op in ops:
        seen = [r["policy_version"] for r in gates if op in r["units"]]
        assert [s for s, _ in scalars[f"gate/units/{op}/lower"]] == seen, (op, sorted(scalars))
        assert [s for s, _ in scalars[f"gate/units/{op}/routed_real"]] == seen
    assert [v for _, v in scalars["gate/sim_version"]] == [0, 0, 1]
