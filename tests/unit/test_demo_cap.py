"""The demo's simulator token cap: from the collected observations, clamped to what fits the
simulator's context (a few long error messages in a small collection must not break the run)."""

from __future__ import annotations

import math
from pathlib import Path

from launch.config.loading import load_config
from launch.config.schema import SimloopConfig
from launch.jobs.demo import _suggest_cap
from rl.data.sim_format import format_observation
from rl.data.trajectory import Trajectory, Turn, write_jsonl

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml"


def _collected(tmp_path: Path, outputs: list[str]) -> Path:
    trajs = [Trajectory(task_id=f"t{i}", arm="real", env_backend="local", status="ok", reward=1.0,
                        turns=[Turn(agent_text="", command="x", observation=o, exit_code=0)])
             for i, o in enumerate(outputs)]  # fmt: skip
    write_jsonl(tmp_path / "trajectories" / "collect-00000.jsonl", trajs)
    return tmp_path / "trajectories"


def test_cap_follows_the_observations(tmp_path):
    cfg = load_config(SimloopConfig, CONFIG)
    cap = _suggest_cap(cfg, _collected(tmp_path, ["a" * 20] * 10))
    # One byte a token, plus the end-of-turn token; 25% slack over the 99th percentile.
    assert cap == math.ceil((len(format_observation("a" * 20, 0)) + 1) * 1.25)


def test_cap_is_clamped_to_half_the_simulator_context(tmp_path, capsys):
    cfg = load_config(SimloopConfig, CONFIG, ["--env.shell.simulated.max_context_tokens", "512"])
    assert _suggest_cap(cfg, _collected(tmp_path, ["a" * 20] * 9 + ["e" * 600])) == 256
    assert "clamped to 256" in capsys.readouterr().out
