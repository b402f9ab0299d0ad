"""The deciding experiment's numbers (`launch.report.thesis`), recomputed from stored episodes:
success rates, the equal-episode check, and intervals paired by task."""

from __future__ import annotations

import math
import statistics

import pytest

from launch.report.thesis import mean_ci, paired, thesis
from rl.data.trajectory import Trajectory, write_jsonl


def _eps(prefix: str, wins: dict[str, list[int]], backend: str = "local") -> list[Trajectory]:
    return [
        Trajectory(
            task_id=task,
            arm="real" if backend == "local" else "closed_loop",
            env_backend=backend,
            status="ok",
            reward=float(w),
        )
        for task, ws in wins.items()
        for w in ws
    ]


def _store(run, sub: str, prefix: str, trajs: list[Trajectory]) -> None:
    # Two shards, as a long evaluation writes them: the reader must take both.
    half = len(trajs) // 2
    write_jsonl(run / sub / "trajectories" / f"{prefix}-00000.jsonl", trajs[:half])
    write_jsonl(run / sub / "trajectories" / f"{prefix}-00001.jsonl", trajs[half:])


WARM = {"a": [0, 0, 1, 0], "b": [1, 0, 0, 0], "c": [0, 0, 0, 0]}
SIM = {"a": [1, 1, 1, 0], "b": [1, 1, 0, 0], "c": [0, 1, 0, 0]}
REAL = {"a": [1, 1, 1, 1], "b": [1, 0, 1, 0], "c": [0, 1, 0, 0]}


@pytest.fixture
def run(tmp_path):
    _store(tmp_path, "agent", "eval-before-real", _eps("eval", WARM))
    _store(tmp_path, "agent", "eval-after-real", _eps("eval", SIM))
    _store(tmp_path, "agent", "eval-after-closed_loop", _eps("eval", REAL, "simulated"))
    _store(tmp_path, "agent", "rl", _eps("rl", {"x": [1] * 8}, "simulated"))
    _store(tmp_path, "agent_real", "eval-after-real", _eps("eval", REAL))
    _store(tmp_path, "agent_real", "rl", _eps("rl", {"x": [0] * 8}))
    return tmp_path


def _rate(wins: dict[str, list[int]]) -> float:
    flat = [w for ws in wins.values() for w in ws]
    return sum(flat) / len(flat)


def test_rates_episodes_and_gains_come_from_the_episodes(run):
    t = thesis(run)
    assert t["warm_start"]["real"] == pytest.approx(_rate(WARM), abs=1e-4)
    assert t["rl_in_sim"] == {
        "real": pytest.approx(_rate(SIM), abs=1e-4),
        "sim": pytest.approx(_rate(REAL), abs=1e-4),
        "episodes": 8,
    }
    assert t["rl_in_real"] == {"real": pytest.approx(_rate(REAL), abs=1e-4), "episodes": 8}
    assert t["eval_episodes"] == 12 and t["eval_tasks"] == 3
    assert t["gain"]["rl_in_sim"] == pytest.approx(_rate(SIM) - _rate(WARM), abs=1e-4)
    assert t["sim_minus_real"] == pytest.approx(_rate(SIM) - _rate(REAL), abs=1e-4)
    # 0.5 - 0.083 = 0.417 >= 0.10; 0.5 - 0.583 = -0.083 < -0.05
    assert t["acceptance"] == {
        "rl_in_sim_gain_at_least_0.1": True,
        "rl_in_sim_at_most_0.05_below_rl_in_real": False,
    }


def test_intervals_are_over_tasks_and_paired(run):
    t = thesis(run)
    diffs = [statistics.fmean(SIM[k]) - statistics.fmean(WARM[k]) for k in WARM]
    half = 1.959964 * statistics.stdev(diffs) / math.sqrt(3)
    m = statistics.fmean(diffs)
    assert t["ci95"]["gain_rl_in_sim"] == pytest.approx([m - half, m + half], abs=1e-4)
    lo, hi = t["ci95"]["warm_start"]
    assert lo < t["warm_start"]["real"] < hi


def test_a_missing_arm_is_named_not_guessed(run):
    for shard in (run / "agent_real" / "trajectories").glob("eval-after-real-*.jsonl"):
        shard.unlink()
    assert thesis(run) == {"missing": "RL-in-real's real-shell evaluation has no stored episodes"}


def test_paired_needs_common_tasks_and_one_value_has_no_width():
    with pytest.raises(ValueError, match="share no task"):
        paired({"a": 1.0}, {"b": 0.0})
    assert mean_ci([0.5]) == (0.5, [0.5, 0.5])
