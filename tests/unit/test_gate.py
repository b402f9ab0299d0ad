"""The fidelity gate's router against hand-computed values (Wilson bounds, decay, the minimum
real share, the reset on a new simulator version) and its config's validation."""

import math

import pytest

from envs.tasks import RewardSpec, Task
from rl.data.trajectory import Trajectory, Turn
from rl.orchestrator.config import GateConfig, OrchestratorConfig
from rl.orchestrator.gate import FidelityRouter, replay_exact, unit_of, wilson_lower

Z90 = 1.2815515655446008  # NormalDist().inv_cdf(0.9)


def _task(op: str, i: int = 0) -> Task:
    return Task(
        id=f"{op}-{i}",
        instruction=f"do {op}",
        family="textops",
        reward=RewardSpec("textops", {"op": op}),
    )


def test_wilson_lower_bound_by_hand():
    # 10 of 10: p = 1, so the bound is 1 / (1 + z^2 / n) = 1 / (1 + 1.64237 / 10).
    assert wilson_lower(10, 10, Z90) == pytest.approx(1 / (1 + Z90**2 / 10), abs=1e-12)
    assert wilson_lower(10, 10, Z90) == pytest.approx(0.858931, abs=1e-6)
    # 9 of 10: (0.9 + z^2/20 - z sqrt(0.009 + z^2/400)) / (1 + z^2/10) = 0.717556
    assert wilson_lower(9, 10, Z90) == pytest.approx(0.717556, abs=1e-6)
    assert wilson_lower(0, 0, Z90) == 0.0
    assert wilson_lower(0, 5, Z90) == 0.0


def test_estimate_decays_with_age_by_half_lives():
    router = FidelityRouter(GateConfig(half_life_steps=8.0, confidence=0.9))
    router.record("count", 10, 10, sim_version=0, step=0)
    router.record("count", 0, 10, sim_version=0, step=8)
    est = router.estimate("count", now=8)
    # The step-0 measurement counts half: 5 exact of 15 weighted pairs.
    assert est.pairs == pytest.approx(15.0) and est.fidelity == pytest.approx(1 / 3)
    assert est.lower == pytest.approx(wilson_lower(5, 15, Z90)) and est.measured == 20
    assert est.lower == pytest.approx(0.200782, abs=1e-6)
    # Sixteen versions later both have decayed, the older by four half-lives in all.
    later = router.estimate("count", now=24)
    assert later.pairs == pytest.approx(10 * 0.5**3 + 10 * 0.5**2)
    assert later.fidelity == pytest.approx(1.25 / 3.75)


def _routes_of_an_open_gate(*, real_min: float, groups: int) -> list[str]:
    """The arms of `groups` groups of one unit whose gate is open from the first (40 of 40)."""
    router = FidelityRouter(GateConfig(threshold=0.8, confidence=0.9, real_min=real_min))
    router.record("sort", 40, 40, sim_version=0, step=1)
    return [router.route(_task("sort"), 1) for _ in range(groups)]


def test_closed_gate_routes_real_and_open_gate_keeps_the_minimum_real_share():
    cfg = GateConfig(threshold=0.8, confidence=0.9, real_min=0.25)
    router = FidelityRouter(cfg)
    # Nothing measured: the lower bound is 0, every group goes to the real shell.
    assert [router.route(_task("count"), 1) for _ in range(3)] == ["real"] * 3
    # 40 of 40 exact: bound 1 / (1 + z^2 / 40) = 0.9606 >= 0.8, open.
    router.record("count", 40, 40, sim_version=0, step=1)
    assert router.is_open("count", 1)
    # The share is counted from the opening on (the 3 real groups before it do not count):
    # the j-th group goes real while fewer than floor(0.25 j) have, so j = 4 and j = 8.
    arms = [router.route(_task("count"), 1) for _ in range(10)]
    assert (
        arms
        == ["closed_loop"] * 3 + ["real"] + ["closed_loop"] * 3 + ["real"] + ["closed_loop"] * 2
    )
    assert router.units["count"].routed == {"closed_loop": 8, "real": 5}
    # A new simulator version closes the gate; when it opens again the count starts over.
    router.set_sim_version(1, policy_version=2)
    assert router.route(_task("count"), 2) == "real"
    router.record("count", 40, 40, sim_version=1, step=2)
    arms = [router.route(_task("count"), 2) for _ in range(4)]
    assert arms == ["closed_loop"] * 3 + ["real"]
    # real_min 0.1 over 30 groups: the 10th, 20th and 30th go real.
    arms = _routes_of_an_open_gate(real_min=0.1, groups=30)
    assert [j + 1 for j, a in enumerate(arms) if a == "real"] == [10, 20, 30]
    # 0.58 * 50 is 28.999999999999996 in floats: the 50th group is still the 29th real one.
    arms = _routes_of_an_open_gate(real_min=0.58, groups=50)
    assert arms.count("real") == 29 and arms[-1] == "real"
    # Another unit is routed on its own measurements (none: real).
    assert router.route(_task("reverse"), 1) == "real"


def test_threshold_is_compared_to_the_bound_not_the_mean():
    router = FidelityRouter(GateConfig(threshold=0.8, confidence=0.9, real_min=0.0))
    router.record("sort", 9, 10, sim_version=0, step=0)  # mean 0.9, bound 0.7176
    assert router.estimate("sort", 0).fidelity == pytest.approx(0.9)
    assert router.route(_task("sort"), 0) == "real"
    router.record("sort", 36, 40, sim_version=0, step=0)  # 45 / 50: bound 0.8323
    assert router.estimate("sort", 0).lower == pytest.approx(0.832287, abs=1e-6)
    assert router.route(_task("sort"), 0) == "closed_loop"


def test_a_new_simulator_version_starts_from_its_own_measurements():
    router = FidelityRouter(GateConfig(threshold=0.8, real_min=0.0), sim_version=1)
    router.record("upper", 50, 50, sim_version=1, step=0)
    assert router.route(_task("upper"), 0) == "closed_loop"
    router.set_sim_version(2, policy_version=4)
    assert router.estimate("upper", 4).measured == 0 and router.route(_task("upper"), 4) == "real"
    # A replay that started against version 1 and ends now is not counted for version 2.
    assert not router.record("upper", 5, 5, sim_version=1, step=4)
    assert router.record("upper", 50, 50, sim_version=2, step=4)
    assert router.route(_task("upper"), 4) == "closed_loop"
    versions = router.summary()["sim_versions"]
    assert versions == [
        {"sim_version": 1, "policy_version": None},
        {"sim_version": 2, "policy_version": 4},
    ]


def test_each_policy_version_closes_a_record_with_routing_and_success():
    records = []
    router = FidelityRouter(GateConfig(threshold=0.5, real_min=0.0), on_step=records.append)
    router.route(_task("count"), 1)
    router.result(_task("count"), "real", 1.0)
    router.result(_task("count"), "real", 0.0)
    router.record("count", 20, 20, sim_version=0, step=1)
    router.route(_task("count"), 2)  # the first group of version 2 closes version 1's record
    assert len(records) == 1
    rec = records[0]
    assert rec["policy_version"] == 1 and rec["sim_version"] == 0
    count = rec["units"]["count"]
    assert count["routed_real"] == 1 and count["routed_sim"] == 0
    assert count["success_real"] == 0.5 and count["success_sim"] is None
    assert count["open"] and count["fidelity"] == 1.0
    last = router.flush()
    assert last["units"]["count"]["routed_sim"] == 1 and records[-1] is last


def test_units_are_operations_or_families():
    t = _task("count")
    assert unit_of(t, "kind") == "count" and unit_of(t, "family") == "textops"
    plain = Task(id="x", instruction="y")
    assert unit_of(plain, "kind") == "task" and unit_of(plain, "family") == "task"


def test_replay_exact_needs_the_text_and_the_return_code():
    def turn(exact, rc_sim, rc_real=0):
        return Turn(
            agent_text="",
            command="c",
            observation="o",
            exit_code=rc_real,
            sim_observation="o" if exact else "x",
            sim_exit_code=rc_sim,
            info={"exact_masked": exact},
        )

    t = Trajectory(
        task_id="t",
        arm="replay",
        env_backend="simulated",
        status="ok",
        turns=[
            turn(True, 0),
            turn(True, 1),
            turn(False, 0),
            Turn(agent_text="", command="c", observation=None),
        ],
    )
    assert replay_exact(t) == (1, 3)


@pytest.mark.parametrize(
    "field, value",
    [
        ("unit", "command"),
        ("threshold", 1.5),
        ("confidence", 0.3),
        ("confidence", 1.0),
        ("real_min", -0.1),
        ("half_life_steps", 0),
        ("shadow_concurrency", 0),
        ("cotrain_every", -1),
        ("cotrain_steps", 0),
        ("cotrain_replay", 2.0),
        ("cotrain_lr", 0.0),
        ("remeasure", True),
    ],
)
def test_gate_config_rejects_bad_values_by_name(field, value):
    with pytest.raises(ValueError, match=f"GateConfig.{field}="):
        GateConfig(**{field: value})


def test_gated_is_an_arm_and_the_gate_nests_in_the_orchestrator():
    cfg = OrchestratorConfig(arm="gated", gate=GateConfig(threshold=0.7))
    assert cfg.gate.threshold == 0.7 and math.isclose(cfg.gate.real_min, 0.1)


def test_rollout_refuses_the_gated_arm_with_what_to_run_instead(tmp_path, capsys):
    from launch.cli import main

    rc = main(["rollout", "--out", str(tmp_path / "r"), "--orchestrator.arm", "gated"])
    err = capsys.readouterr().err
    assert rc == 2 and "simloop train-agent" in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()
