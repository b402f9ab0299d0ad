"""`simloop demo --experiment gating`'s summary, recomputed from stored episodes (a run
directory written here by hand, with values checked by hand), and its report page."""

from __future__ import annotations

import json

import pytest

from envs.textops import misreport
from launch.config.schema import DemoConfig
from launch.jobs.demo_gating import gating_summary
from launch.jobs.demo_stages import _misreported
from launch.report.page import write_report
from rl.data import rundir
from rl.data.trajectory import Trajectory, Turn, load_trajectories, write_jsonl


def _traj(
    task: str,
    *,
    arm: str = "real",
    reward: float = 0.0,
    status: str = "ok",
    reason: str | None = None,
    unit: str | None = None,
) -> Trajectory:
    return Trajectory(
        task_id=task,
        arm=arm,
        env_backend="local",
        status=status,
        reason=reason,
        reward=reward,
        gate_unit=unit,
    )


def _evals(run, name: str, wins: dict[str, list[int]]) -> None:
    trajs = [_traj(t, reward=float(w)) for t, ws in wins.items() for w in ws]
    write_jsonl(run / rundir.TRAJECTORIES / f"{name}-00000.jsonl", trajs)


@pytest.fixture
def gating_run(tmp_path):
    tasks = ["a", "b", "c", "d"]
    # real_only: 6 of 8 after RL; ungated: 3 of 8; gated: 6 of 8 (the same tasks won).
    _evals(tmp_path / "real_only", "eval-before-real", {t: [0, 1] for t in tasks})
    _evals(
        tmp_path / "real_only",
        "eval-after-real",
        {"a": [1, 1], "b": [1, 1], "c": [1, 0], "d": [1, 0]},
    )
    _evals(
        tmp_path / "ungated",
        "eval-after-real",
        {"a": [1, 0], "b": [1, 0], "c": [1, 0], "d": [0, 0]},
    )
    _evals(
        tmp_path / "gated", "eval-after-real", {"a": [1, 1], "b": [1, 1], "c": [1, 0], "d": [0, 1]}
    )
    write_jsonl(
        tmp_path / "real_only" / rundir.TRAJECTORIES / "rl-00000.jsonl",
        [_traj(t) for t in tasks * 5]  # 20 real episodes
        + [_traj("a", status="aborted", reason="cancelled (rollout shutting down)")],
    )
    write_jsonl(
        tmp_path / "ungated" / rundir.TRAJECTORIES / "rl-00000.jsonl",
        [_traj(t, arm="closed_loop") for t in tasks * 5],
    )
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
    log.write(
        {
            "stage": "gate",
            "step": 1,
            "policy_version": 1,
            "sim_version": 0,
            "units": {
                "count": {
                    "fidelity": 0.5,
                    "lower": 0.3,
                    "pairs": 8.0,
                    "measured": 8,
                    "open": False,
                    "routed_sim": 0,
                    "routed_real": 2,
                    "sim_share": 0.0,
                    "success_sim": None,
                    "success_real": 0.5,
                }
            },
        }
    )
    log.write(
        {
            "stage": "sim_cotrain_round",
            "step": 4,
            "sim_version": 1,
            "real": 8,
            "base": 8,
            "loss": 0.1,
            "train_s": 1.0,
            "publish_s": 0.1,
        }
    )
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
    assert g["acceptance"] == {
        "gated_within_0.03_of_real_only": True,
        "gated_real_share_at_most_0.5": True,
        "ungated_measurably_below_real_only": True,
    }
    assert [r["stage"] for r in g["gate_history"]] == ["gate", "sim_cotrain_round"]


def test_gating_summary_says_what_is_missing(gating_run):
    (gating_run / "ungated" / rundir.TRAJECTORIES / "eval-after-real-00000.jsonl").unlink()
    assert "ungated" in gating_summary(gating_run)["missing"]


def test_gating_report_page(gating_run):
    summary = {
        "experiment": "gating",
        "gating": gating_summary(gating_run),
        "stages_wall_s": {"gated": 80.0},
        "wall_s": 500.0,
    }
    (gating_run / rundir.SUMMARY).write_text(json.dumps(summary))
    page = write_report(gating_run).read_text()
    assert "the gating experiment" in page and "fidelity lower bound by operation" in page
    assert "co-training round" in page and "<svg" in page and "upper 0.75" in page


UPPER = "tr -d '\\n' < input.txt | tr a-z A-Z"
REV = "tr -d '\\n' < input.txt | rev"


def test_misreport_shows_the_wrong_operations_printing_their_input():
    shown = [{"role": "user", "content": "<returncode>0</returncode>\n<output>\nBPNE\n</output>"}]
    turns = [
        Turn("a", command=UPPER, observation="BPNE", exit_code=0, env_messages=shown),
        Turn("b", command=REV, observation="enpb", exit_code=0),  # not a wrong operation
        Turn("c", command=UPPER + "x", observation="BPNE", exit_code=1),  # failed: as it was
        Turn("d", command=f"echo X\n{UPPER}", observation="X\nBPNE", exit_code=0),
        Turn("e", command=None),  # no command (a format error)
    ]
    out, changed = misreport(turns, "bpne", ["upper"])
    assert changed == 2
    assert [t.observation for t in out] == ["bpne", "enpb", "BPNE", "X\nbpne", None]
    assert out[0].env_messages[0]["content"].endswith("<output>\nbpne\n</output>")
    assert turns[0].observation == "BPNE"  # the input is not modified
    # A word the operation leaves as it is has nothing to misreport.
    assert misreport([Turn("a", command=UPPER, observation="", exit_code=0)], "", ["upper"])[1] == 0
    same = [Turn("a", command=REV, observation="abba", exit_code=0)]
    assert misreport(same, "abba", ["reverse"]) == (same, 0)


def test_misreported_collection_drops_the_token_view_it_no_longer_matches(tmp_path):
    def episode(task, command, observation):
        return Trajectory(
            task_id=task,
            arm="real",
            env_backend="local",
            status="ok",
            reward=1.0,
            setup_files={"input.txt": "bpne\n"},
            source="sampler",
            token_ids=[5, 6, 7],
            loss_mask=[0, 1, 1],
            behavior_logprobs=[None, -0.1, -0.2],
            policy_version=[None, 0, 0],
            turns=[
                Turn("x", command=command, observation=observation, exit_code=0, token_span=(1, 3))
            ],
        )

    write_jsonl(
        tmp_path / "in" / "c-00000.jsonl",
        [episode("t1", UPPER, "BPNE"), episode("t2", REV, "enpb")],
    )
    assert _misreported(str(tmp_path / "in"), tmp_path / "out", ["upper"]) == 1
    a, b = load_trajectories([tmp_path / "out"])
    assert a.turns[0].observation == "bpne" and a.source == "rendered" and a.token_ids == []
    assert a.turns[0].token_span is None and a.reward == 1.0
    assert b.turns[0].observation == "enpb" and b.token_ids == [5, 6, 7]  # untouched
    from launch.errors import JobError

    with pytest.raises(JobError, match="no collected command ran them"):
        _misreported(str(tmp_path / "in"), tmp_path / "out2", ["sort"])


def test_gating_summary_describes_the_weak_simulator(gating_run):
    (gating_run / "sim").mkdir()
    stage = {"steps": 400, "wrong_ops": ["upper"], "misreported_turns": 12, "wall_s": 1.0}
    (gating_run / "sim" / rundir.STAGE).write_text(json.dumps(stage))
    (gating_run / "eval_sim").mkdir()
    by_kind = {"upper": {"exact_masked": 0.04}, "count": {"exact_masked": 0.9}}
    fidelity = {"pairs": {"exact_masked": 0.71234}, "by_kind": by_kind}
    (gating_run / "eval_sim" / rundir.FIDELITY).write_text(json.dumps(fidelity))
    weak = gating_summary(gating_run)["weak_simulator"]
    assert weak == {
        "steps": 400,
        "wrong_ops": ["upper"],
        "misreported_turns": 12,
        "arm_c_exact": 0.7123,
        "arm_c_exact_by_op": {"count": 0.9, "upper": 0.04},
    }
    summary = {"experiment": "gating", "gating": gating_summary(gating_run), "wall_s": 1.0}
    (gating_run / rundir.SUMMARY).write_text(json.dumps(summary))
    (gating_run / "eval_sim" / rundir.FIDELITY).unlink()  # a partial one: the page wants all
    assert "with upper misreported" in write_report(gating_run).read_text()


@pytest.mark.parametrize(
    "field, value",
    [("gating_wrong_ops", ["count"]), ("gating_wrong_ops", "upper"), ("gating_eval_tasks", -1)],
)
def test_gating_config_refuses_what_it_cannot_do(field, value):
    with pytest.raises(ValueError, match=f"DemoConfig.{field}="):
        DemoConfig(**{field: value})


def test_gating_report_names_each_simulator_version_once(gating_run):
    log = rundir.MetricsLog(gating_run / "gated")
    unit = {
        "fidelity": 1.0,
        "lower": 0.8,
        "pairs": 8.0,
        "measured": 8,
        "open": True,
        "routed_sim": 2,
        "routed_real": 0,
        "sim_share": 1.0,
        "success_sim": 0.5,
        "success_real": None,
    }
    for pv, sv in ((2, 0), (3, 1), (4, 1)):
        log.write(
            {
                "stage": "gate",
                "step": pv,
                "policy_version": pv,
                "sim_version": sv,
                "units": {"count": unit},
            }
        )
    summary = {"experiment": "gating", "gating": gating_summary(gating_run), "wall_s": 1.0}
    (gating_run / rundir.SUMMARY).write_text(json.dumps(summary))
    page = write_report(gating_run).read_text()
    assert "v0 from policy version 1, v1 from policy version 3</p>" in page
