"""`simloop demo --experiment gating`'s summary, recomputed from stored episodes (a run
directory written here by hand, with values checked by hand), and its report page."""

from __future__ import annotations

import json

import pytest

from launch.jobs.demo_gating import gating_summary
from launch.report.page import write_report
from rl.data import rundir
from rl.data.trajectory import Trajectory, write_jsonl


def _traj(task: str, *, arm: str = "real", reward: float = 0.0, status: str = "ok",
          reason: str | None = None, unit: str | None = None) -> Trajectory:  # fmt: skip
    meta = {"gate_unit": unit} if unit else {}
    return Trajectory(task_id=task, arm=arm, env_backend="local", status=status, reason=reason,
                      reward=reward, meta=meta)  # fmt: skip


def _evals(run, name: str, wins: dict[str, list[int]]) -> None:
    trajs = [_traj(t, reward=float(w)) for t, ws in wins.items() for w in ws]
    write_jsonl(run / rundir.TRAJECTORIES / f"{name}-00000.jsonl", trajs)


@pytest.fixture
def gating_run(tmp_path):
    tasks = ["a", "b", "c", "d"]
    # real_only: 6 of 8 after RL; ungated: 3 of 8; gated: 6 of 8 (the same tasks won).
    _evals(tmp_path / "real_only", "eval-before-real", {t: [0, 1] for t in tasks})
    _evals(tmp_path / "real_only", "eval-after-real", {"a": [1, 1], "b": [1, 1], "c": [1, 0],
                                                       "d": [1, 0]})  # fmt: skip
    _evals(tmp_path / "ungated", "eval-after-real", {"a": [1, 0], "b": [1, 0], "c": [1, 0],
                                                     "d": [0, 0]})  # fmt: skip
    _evals(tmp_path / "gated", "eval-after-real", {"a": [1, 1], "b": [1, 1], "c": [1, 0],
                                                   "d": [0, 1]})  # fmt: skip
    write_jsonl(
        tmp_path / "real_only" / rundir.TRAJECTORIES / "rl-00000.jsonl",
        [_traj(t) for t in tasks * 5]  # 20 real episodes
        + [_traj("a", status="aborted", reason="cancelled (rollout shutting down)")],
    )
    write_jsonl(tmp_path / "ungated" / rundir.TRAJECTORIES / "rl-00000.jsonl",
                [_traj(t, arm="closed_loop") for t in tasks * 5])  # fmt: skip
    # gated: count 6 real of 6; upper 1 real + 3 simulated; sort 1 real + 9 simulated.
    gated = (
        [_traj("a", unit="count") for _ in range(6)]
        + [_traj("b", unit="upper")]
        + [_traj("b", arm="closed_loop", unit="upper")] * 3
        + [_traj("c", unit="sort")]
        + [_traj("c", arm="closed_loop", unit="sort")] * 9
    )
    write_jsonl(tmp_path / "gated" / rundir.TRAJECTORIES / "rl-00000.jsonl", gated)
    log = rundir.MetricsLog(tmp_path / "gated")
    log.write({"stage": "gate", "step": 1, "policy_version": 1, "sim_version": 0, "units": {
        "count": {"fidelity": 0.5, "lower": 0.3, "pairs": 8.0, "measured": 8, "open": False,
                  "routed_sim": 0, "routed_real": 2, "sim_share": 0.0, "success_sim": None,
                  "success_real": 0.5}}})  # fmt: skip
    log.write({"stage": "sim_cotrain_round", "step": 4, "sim_version": 1, "real": 8, "base": 8,
               "loss": 0.1, "train_s": 1.0, "publish_s": 0.1})  # fmt: skip
    return tmp_path


def test_gating_summary_by_hand(gating_run):
    g = gating_summary(gating_run)
    # The episode aborted by the shutdown is not counted.
    assert g["real_only"] == {"real": 0.75, "real_episodes": 20, "episodes": 20}
    assert g["ungated"] == {"real": 0.375, "real_episodes": 0, "episodes": 20}
    assert g["gated"]["real"] == 0.75 and g["gated"]["real_episodes"] == 8
    assert g["gated"]["sim_share_by_family"] == {"count": 0.0, "sort": 0.9, "upper": 0.75}
    assert g["warm_start"] == {"real": 0.5}
    # Paired by task: gated - real_only = (0, 0, 0, 0) -> 0; ungated - real_only =
    # (-0.5, -0.5, 0, -0.5) -> mean -0.375.
    assert g["gated_minus_real_only"] == 0.0 and g["ungated_minus_real_only"] == -0.375
    assert g["gated_real_share"] == 0.4  # 8 / 20
    assert g["acceptance"] == {"gated_within_0.03_of_real_only": True,
                               "gated_real_share_at_most_0.5": True,
                               "ungated_below_real_only": True}  # fmt: skip
    assert [r["stage"] for r in g["gate_history"]] == ["gate", "sim_cotrain_round"]


def test_gating_summary_says_what_is_missing(gating_run):
    (gating_run / "ungated" / rundir.TRAJECTORIES / "eval-after-real-00000.jsonl").unlink()
    assert "ungated" in gating_summary(gating_run)["missing"]


def test_gating_report_page(gating_run):
    summary = {"experiment": "gating", "gating": gating_summary(gating_run),
               "stages_wall_s": {"gated": 80.0}, "wall_s": 500.0}  # fmt: skip
    (gating_run / rundir.SUMMARY).write_text(json.dumps(summary))
    page = write_report(gating_run).read_text()
    assert "the gating experiment" in page and "fidelity lower bound by operation" in page
    assert "co-training round" in page and "<svg" in page and "upper 0.75" in page
