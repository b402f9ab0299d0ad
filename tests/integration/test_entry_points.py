"""Entry points run as a user runs them: the installed `simloop` script and the bench script."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.fakes import user_env

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@pytest.mark.slow
def test_installed_simloop_script_validates_a_config():
    out = subprocess.run(
        [BIN / "simloop", "config", "--config", "configs/demo_cpu.yaml", "--run.seed", "3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "seed: 3" in out and "num_layers: 3" in out
    # Under the YAML, as comments: each serving role's backend and whether it keeps sessions.
    assert (
        "#   agent: 1 jax replica(s); stateless completions (orchestrator.sessions: false)" in out
    )
    assert yaml.safe_load(out)["run"]["seed"] == 3  # the comments leave it a config


@pytest.mark.slow
def test_installed_demo_script_checks_its_arguments_first():
    # The demo itself runs in tests/integration/test_demo.py; here: the installed entry point,
    # its usage errors, and that nothing is written before the config checks out.
    proc = subprocess.run(
        [BIN / "simloop", "demo", "--config", "configs/demo_cpu.yaml", "--out", "runs/x",
         "--demo.rl_arm", "replay"],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 2 and "DemoConfig.rl_arm='replay' is invalid" in proc.stderr
    assert not (REPO / "runs" / "x").exists()
    proc = subprocess.run(
        [BIN / "simloop", "demo", "--config", "configs/demo_cpu.yaml"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "--out DIR is required" in proc.stderr


@pytest.mark.slow
def test_model_bench_runs_and_reports_numbers(tmp_path):
    out = tmp_path / "bench.json"
    env = user_env(cheap_compile=True)  # one CPU device, as a user
    subprocess.run(
        [sys.executable, "bench/model_forward.py", "--sizes", "tiny", "--repeats", "1",
         "--seq", "32", "--prompt", "8", "--decode-steps", "4", "--json", str(out)],
        cwd=REPO, env=env, check=True, capture_output=True,
    )  # fmt: skip
    (row,) = json.loads(out.read_text())["detail"]
    assert row["size"] == "tiny"
    for key in ["forward_tok_s", "hf_forward_tok_s", "decode_tok_s", "hf_decode_tok_s"]:
        assert row[key] > 0


@pytest.mark.slow
def test_engine_bench_quick_runs_and_reports_ratios(tmp_path):
    out = tmp_path / "engine.json"
    env = user_env(cheap_compile=True)
    subprocess.run(
        [sys.executable, "bench/engine_throughput.py", "--quick", "--json", str(out)],
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
    )
    result = json.loads(out.read_text())["detail"]
    assert result["decode"]["engine_tok_s"] > 0 and result["decode"]["hf_tok_s"] > 0
    # the speculative rows: the engine and HF both guessing by prompt lookup
    assert result["decode"]["spec_tok_s"] > 0 and result["decode"]["hf_lookup_tok_s"] > 0
    assert 0 <= result["decode"]["spec_kept"] <= 1
    assert result["batching"]["sequential_s"] > result["batching"]["concurrent_s"] > 0
    assert result["session"]["cached_tokens"] > 0
    assert result["live"]["long_tok_s"] > 0 and result["live"]["short_tok_s"] > 0


@pytest.mark.slow
def test_orchestrator_bench_runs_every_episode_concurrently(tmp_path):
    out = tmp_path / "orch.json"
    subprocess.run(
        [sys.executable, "bench/orchestrator_overhead.py", "--episodes", "100", "--turns", "3",
         "--json", str(out)],
        cwd=REPO, check=True, capture_output=True,
    )  # fmt: skip
    rows = json.loads(out.read_text())["detail"]
    assert rows[-1]["peak_active"] == 100 and rows[-1]["ok"] == 100
    assert all(r["turns"] == 3 * r["episodes"] for r in rows)


@pytest.mark.slow
def test_train_step_bench_quick_reports_mfu_and_async_speedup(tmp_path):
    out = tmp_path / "train.json"
    env = user_env(cheap_compile=True)
    subprocess.run(
        [sys.executable, "bench/train_step.py", "--quick", "--json", str(out)],
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
    )
    result = json.loads(out.read_text())["detail"]
    (row,) = result["trainer"]
    assert row["size"] == "tiny" and result["peak_flops"] > 0
    assert row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1  # against this machine's peak
    sync, async_ = result["rl"]["sync"], result["rl"]["async"]
    assert sync["steps"] == async_["steps"] == 3
    assert sync["truncated_rows"] == async_["truncated_rows"] == 0
    assert sync["episodes_finished"] >= 3 * result["rl"]["batch_size"]  # every episode trained ok
    assert sync["staleness_max"] == 0 and async_["staleness_max"] >= 1  # S=2 sampled meanwhile
    assert async_["wall_s"] < sync["wall_s"]
    # Part 3: both arms published every version to a real server (timings only reported).
    overlap = result["publish_overlap"]
    assert overlap["size"] == "tiny" and overlap["steps"] == 3
    for arm in (overlap["overlapped"], overlap["in_line"]):
        assert arm["step_wall_s"] > 0 and arm["load_s"] > 0
        assert arm["publish_total_s"] >= arm["export_s"] + arm["load_s"]


@pytest.mark.slow
def test_publish_bench_quick_times_both_backends_against_the_raw_write(tmp_path):
    out = tmp_path / "publish.json"
    env = user_env(cheap_compile=True)  # servers: one device each
    subprocess.run(
        [sys.executable, "bench/publish_latency.py", "--quick", "--json", str(out)],
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    rows = json.loads(out.read_text())["detail"]
    assert [(r["backend"], r["size"], r["replicas"]) for r in rows] == [
        ("jax", "tiny", 1),
        ("fake-vllm", "tiny", 1),
    ]
    for r in rows:
        assert r["checkpoint_mb"] > 0 and r["raw_write_s"] > 0 and r["probe_s"] > 0
        assert r["publish_s"] > r["write_s"] > 0 and r["load_s"] > 0  # the load came on top
        assert r["ratio"] == pytest.approx(r["publish_s"] / r["raw_write_s"])
