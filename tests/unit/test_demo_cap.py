"""The demo's simulator token cap: from the collected observations, clamped to what fits the
simulator's context (a few long error messages in a small collection must not break the run)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from launch.config.loading import ConfigError, load_config
from launch.config.schema import SimloopConfig
from launch.jobs.demo_stages import _suggest_cap
from rl.data.sim_format import format_observation
from rl.data.trajectory import Trajectory, Turn, write_jsonl

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml"


def _collected(tmp_path: Path, outputs: list[str]) -> Path:
    trajs = [
        Trajectory(
            task_id=f"t{i}",
            arm="real",
            env_backend="local",
            status="ok",
            reward=1.0,
            turns=[Turn(agent_text="", command="x", observation=o, exit_code=0)],
        )
        for i, o in enumerate(outputs)
    ]
    write_jsonl(tmp_path / "trajectories" / "collect-00000.jsonl", trajs)
    return tmp_path / "trajectories"


def test_cap_follows_the_observations(tmp_path):
    cfg = load_config(SimloopConfig, CONFIG)
    cap = _suggest_cap(cfg, _collected(tmp_path, ["a" * 20] * 10))
    # One byte a token, plus the end-of-turn token; 25% slack over the 99th percentile.
    assert cap == math.ceil((len(format_observation("a" * 20, 0)) + 1) * 1.25)


def test_cap_at_quantile_one_covers_the_longest_observation(tmp_path):
    """`demo.sim_max_tokens_quantile: 1.0`: the rare long observation (one in 200, a usage
    text) is not cut, with the 25% slack over it; at 0.99 the cap follows the short ones."""
    outputs = ["a" * 20] * 199 + ["e" * 300]
    short, long_ = ((len(format_observation(o, 0)) + 1) * 1.25 for o in ("a" * 20, "e" * 300))
    sim = [
        "--env.shell.simulated.max_context_tokens",
        "1024",
        "--env.shell.simulated.max_prompt_tokens",
        "256",
    ]
    cfg = load_config(SimloopConfig, CONFIG, [*sim, "--demo.sim_max_tokens_quantile", "0.99"])
    assert _suggest_cap(cfg, _collected(tmp_path / "a", outputs)) == math.ceil(short)
    cfg = load_config(SimloopConfig, CONFIG, [*sim, "--demo.sim_max_tokens_quantile", "1.0"])
    assert _suggest_cap(cfg, _collected(tmp_path / "b", outputs)) == math.ceil(long_)


def test_cap_is_clamped_to_what_the_prompt_budget_leaves(tmp_path, capsys):
    cfg = load_config(SimloopConfig, CONFIG, [
        "--env.shell.simulated.max_context_tokens", "1024", "--env.shell.simulated.max_tokens",
        "256", "--env.shell.simulated.max_prompt_tokens", "300",
        "--demo.sim_max_tokens_quantile", "1"])  # fmt: skip
    assert _suggest_cap(cfg, _collected(tmp_path, ["a" * 20] * 9 + ["e" * 900])) == 724
    assert "clamped to 724" in capsys.readouterr().out


def test_cap_quantile_is_checked():
    with pytest.raises(ConfigError, match=r"sim_max_tokens_quantile=1.5 is invalid: a number"):
        load_config(SimloopConfig, CONFIG, ["--demo.sim_max_tokens_quantile", "1.5"])


def test_cap_is_clamped_to_half_the_simulator_context(tmp_path, capsys):
    cfg = load_config(SimloopConfig, CONFIG, ["--env.shell.simulated.max_context_tokens", "512"])
    assert _suggest_cap(cfg, _collected(tmp_path, ["a" * 20] * 9 + ["e" * 600])) == 256
    assert "clamped to 256" in capsys.readouterr().out
