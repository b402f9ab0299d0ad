"""`simloop demo --experiment stateful`: the fileops experiment's flags and its simulator
acceptance (`launch.report.thesis.stateful_fidelity`), read from eval-sim's fidelity.json."""

import pytest

from launch.report.thesis import stateful_fidelity


def fidelity(overall=0.95, codes=1.0, depth=None, far=0.9, far_n=12):
    depth = depth if depth is not None else {f"{d}-{d + 1}": 0.9 for d in range(8)}
    return {
        "pairs": {"count": 400, "exact_masked": overall, "exit_code_agreement": codes},
        "by_depth": {
            **{k: {"count": 40, "exact_masked": v} for k, v in depth.items()},
            "8-inf": {"count": 3, "exact_masked": 0.0},  # beyond depth 8: reported, not judged
        },
        "state_dependent": {"count": 150, "share": 0.375},
        "state_distance_3plus": {"count": far_n, "exact_masked": far},
    }


def test_every_goal_met():
    s = stateful_fidelity(fidelity())
    assert all(s["acceptance"].values())
    assert list(s["by_depth"]) == [f"{d}-{d + 1}" for d in range(8)] and not s["depths_unmeasured"]
    short = stateful_fidelity(fidelity(depth={"0-2": 0.9, "2-5": 0.9, "5+": 0.9}))
    assert short["depths_unmeasured"] == [] and all(short["acceptance"].values())
    holes = stateful_fidelity(fidelity(depth={f"{d}-{d + 1}": 0.95 for d in (0, 1, 2, 3, 6)}))
    assert holes["depths_unmeasured"] == [4, 5, 7]
    assert s["state_distance_3plus"] == {"observations": 12, "exact_masked": 0.9}


def test_the_workspace_rows_are_reported_when_eval_sim_measured_them():
    from launch.report.thesis import stateful_rows

    plain = stateful_rows(stateful_fidelity(fidelity()))
    ws = {"turns": 40, "state_exact": 0.5, "writes": 20, "write_exact": 0.75}
    rows = stateful_rows(stateful_fidelity({**fidelity(), "workspace": ws}))
    assert rows[: len(plain)] == plain
    assert [r[1:3] for r in rows[len(plain) :]] == [[40, 0.5], [20, 0.75]]
    holes = stateful_rows(stateful_fidelity(fidelity(depth={"0-1": 0.9, "3-4": 0.9})))
    assert ["depth 1, 2, 4, 5, 6, 7", 0, None, ">= 0.85 (nothing to measure)"] in holes


@pytest.mark.parametrize(
    "kwargs,failed",
    [
        ({"overall": 0.89}, "exact_at_least_0.9"),
        ({"codes": 0.985}, "return_codes_at_least_0.99"),
        ({"depth": {"0-1": 0.99, "5-6": 0.84}}, "exact_at_least_0.85_at_every_depth_to_8"),
        ({"depth": {}}, "exact_at_least_0.85_at_every_depth_to_8"),
        # the experiment's own chain episodes end by depth 4: depths 5-7 unmeasured, not passed
        (
            {"depth": {f"{d}-{d + 1}": 0.95 for d in range(5)}},
            "exact_at_least_0.85_at_every_depth_to_8",
        ),
        ({"far": 0.5}, "state_distance_3plus_at_least_0.85"),
        ({"far_n": 0}, "state_distance_3plus_at_least_0.85"),
    ],
)
def test_each_goal_can_fail_alone(kwargs, failed):
    acceptance = stateful_fidelity(fidelity(**kwargs))["acceptance"]
    assert [k for k, v in acceptance.items() if not v] == [failed]


def test_the_stateful_experiment_runs_the_thesis_table_on_fileops(tmp_path, capsys):
    import json

    from launch.cli import main
    from launch.config import load_config
    from launch.config.schema import SimloopConfig
    from launch.jobs.demo import stateful_overrides

    assert main(["demo", "--experiment", "stateful", "--out", str(tmp_path / "d"),
                 "--dry-run", "--format", "json"]) == 0  # fmt: skip
    procs = json.loads(capsys.readouterr().out)["processes"]
    assert [p["stage"] for p in procs][-1] == "demo"
    assert procs[-1]["command"][-2:] == ["--experiment", "stateful"]
    agent = [p for p in procs if p["stage"] == "agent" and p["role"] == "agent_serve"]
    assert agent[0]["command"][agent[0]["command"].index("--max-seq-len") + 1] == "1536"
    # the pretrained simulator is found from the config's folder, whatever the working dir
    from pathlib import Path

    demo_cfg = str(Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml")
    cfg = load_config(SimloopConfig, demo_cfg, stateful_overrides(
        load_config(SimloopConfig, demo_cfg, []), demo_cfg))  # fmt: skip
    assert cfg.env.family == "fileops" and cfg.env.shell.simulated.workspace
    # sim-fileops from stage 11 was trained with the named files last: served the same way
    assert cfg.env.shell.simulated.workspace_named_last
    # and from stage 14 with the absent names listed: the layout its weights record
    assert cfg.env.shell.simulated.workspace_named_absent
    from launch.deploy.local import check_prompt_layout
    from launch.errors import JobError

    check_prompt_layout(cfg)
    with pytest.raises(JobError, match="workspace_named_absent trained true, served false"):
        check_prompt_layout(load_config(SimloopConfig, demo_cfg, [
            *stateful_overrides(load_config(SimloopConfig, demo_cfg, []), demo_cfg),
            "--env.shell.simulated.workspace_named_absent", "false"]))  # fmt: skip
    assert cfg.train_sim.data.exit_code_weight == 10  # the fine-tune learns bash's 127s
    assert cfg.train_sim.optim.lr == 1e-4  # and forgets less of the kinds `chain` lacks
    assert cfg.simulator.weights.endswith("configs/pretrained/sim-fileops")
    assert (Path(cfg.simulator.weights) / "manifest.json").is_file()


def test_the_report_shows_the_stateful_acceptance(tmp_path):
    import json

    from launch.report.page import write_report

    summary = {
        "experiment": "stateful",
        "fidelity": {"observations": 400},
        "stateful": stateful_fidelity(fidelity(far=0.5)),
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    page = write_report(tmp_path).read_text()
    assert "The stateful experiment" in page and "state distance &gt;= 3" in page
    assert 'state distance 3plus at least 0.85: <span class="bad">no</span>' in page


def test_a_users_simulator_weights_is_where_train_sim_starts_not_what_arm_c_scores(tmp_path):
    """`simloop demo --simulator.weights W`: train-sim starts from W; arm (c) and RL in the
    simulator run on what it trained (before, the user's flag won over the stages' inputs and
    they scored W untouched); the user's other flags still win everywhere."""
    import argparse
    from pathlib import Path

    from launch.jobs.demo_stages import Done, split_start_points, stage_config, thesis_stages

    demo_cfg = str(Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml")
    given = ["--agent.weights=/w/agent", "--simulator.weights", "/w/sim", "--train_sim.steps", "7"]
    args = argparse.Namespace(config=demo_cfg, quick_overrides=[], overrides=list(given))
    assert split_start_points(given) == (given[:3], ["--train_sim.steps", "7"])
    done = Done(tmp_path)
    done.records["collect"] = {}
    stages = {s.name: s for s in thesis_stages(stage_config(args, []))}

    def cfg(name):
        return stage_config(args, stages[name].inputs(done) + list(stages[name].flags))

    trained = str(tmp_path / "sim" / "weights" / "final")
    assert cfg("sim").simulator.weights == "/w/sim"
    assert cfg("eval_sim").simulator.weights == trained
    assert cfg("agent").simulator.weights == trained
    assert cfg("agent").agent.weights == "/w/agent"  # where the warm start starts
    assert cfg("agent_real").agent.weights == str(tmp_path / "agent" / "weights" / "warm_start")
    assert all(cfg(n).train_sim.steps == 7 for n in ("sim", "eval_sim", "agent"))


def test_the_stateful_experiment_also_scores_arm_c_on_a_wider_collection(tmp_path):
    """`demo.wide_heldout_episodes` (the stateful experiment sets 240): a second scripted
    collection of every fileops kind, up to 8 turns, task seed 11 (what the pretrained README
    calls seed 11), and arm (c) on all of it with the simulator the demo trained; the
    experiment's own stages keep their chain-only settings, and the textops demo runs neither."""
    import argparse
    from pathlib import Path

    from envs.config import FILEOPS_KINDS
    from launch.config import load_config
    from launch.config.schema import SimloopConfig
    from launch.jobs.demo import stateful_overrides
    from launch.jobs.demo_stages import Done, stage_config, thesis_stages

    demo_cfg = str(Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml")
    plain = argparse.Namespace(config=demo_cfg, quick_overrides=[], overrides=[])
    textops = {s.name: s.runs for s in thesis_stages(stage_config(plain, []))}
    assert not textops["collect_wide"] and not textops["eval_sim_wide"]

    over = stateful_overrides(load_config(SimloopConfig, demo_cfg, []), demo_cfg)
    args = argparse.Namespace(config=demo_cfg, quick_overrides=over, overrides=[])
    stages = {s.name: s for s in thesis_stages(stage_config(args, []))}
    assert stages["collect_wide"].runs and stages["eval_sim_wide"].runs
    done = Done(tmp_path)
    done.records["collect"] = {}

    def cfg(name):
        return stage_config(args, stages[name].inputs(done) + list(stages[name].flags))

    wide = cfg("collect_wide")
    kinds = wide.env.fileops.kinds
    assert set(kinds) == {*FILEOPS_KINDS, "relay"} and wide.env.fileops.max_k is None
    assert kinds.count("relay") == len(FILEOPS_KINDS)  # half the episodes reach depths 6-8
    assert (wide.collect.episodes, wide.collect.num_tasks, wide.collect.task_seed) == (240, 240, 11)
    assert wide.env.terminal.max_turns == 8 and wide.collect.noise == 0.5
    ev = cfg("eval_sim_wide")
    assert ev.eval_sim.trajectories == [str(tmp_path / "collect_wide" / "trajectories")]
    assert ev.eval_sim.heldout_tasks is None  # every episode: none of its tasks was trained on
    assert ev.simulator.weights == str(tmp_path / "sim" / "weights" / "final")
    assert ev.env.shell.simulated.workspace_named_last
    assert ev.env.shell.simulated.workspace_named_absent
    own = cfg("collect")
    assert own.env.fileops.kinds == ["chain"] and own.env.terminal.max_turns == 6


def test_the_report_shows_the_wider_collections_acceptance_beside_the_experiments(tmp_path):
    import json

    from launch.report.page import write_report

    st = stateful_fidelity(fidelity(far_n=0))
    st["wide"] = {**stateful_fidelity(fidelity()), "episodes": 240, "overrides": ["--x", "1"]}
    summary = {"experiment": "stateful", "fidelity": {"observations": 400}, "stateful": st}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    page = write_report(tmp_path).read_text()
    assert "wider held-out collection (240 scripted episodes: --x 1)" in page
    far = "state distance 3plus at least 0.85: "
    assert page.count(far + '<span class="bad">no</span>') == 1  # the experiment's own
    assert page.count(far + '<span class="ok">yes</span>') == 1  # the wider collection's
