"""`simloop report`: a self-contained page from whatever a run directory holds. The page as a
browser renders it is checked in tests/integration/test_demo.py (headless Chromium)."""

from __future__ import annotations

import json
import re

from launch.cli import main
from launch.report.charts import bar_chart, line_chart
from launch.report.page import write_report
from rl.data.trajectory import Trajectory, Turn, write_jsonl


def _write_run(root):
    (root / "eval_sim" / "trajectories").mkdir(parents=True)
    (root / "agent" / "trajectories").mkdir(parents=True)
    fid = {
        "pairs": {
            "count": 2,
            "exact": 0.5,
            "exact_masked": 0.5,
            "exit_code_agreement": 1.0,
            "similarity": 0.75,
            "length_ratio_geomean": 1.0,
        },
        "hygiene": {
            "count": 2,
            "cap_hit": 0.5,
            "think_leak": 0.0,
            "repetition": 0.0,
            "empty": 0.0,
            "malformed": 0.0,
        },
        "real_hygiene": {
            "count": 2,
            "cap_hit": 0.0,
            "think_leak": 0.0,
            "repetition": 0.0,
            "empty": 0.0,
        },
        "by_context": {"0-256": {"count": 2, "exact_masked": 0.5, "similarity": 0.75}},
        "by_command": {"tr | rev": {"count": 2, "exact_masked": 0.5, "similarity": 0.75}},
    }
    (root / "eval_sim" / "fidelity.json").write_text(json.dumps(fid))
    result = {
        "arm": "real",
        "version": 1,
        "tasks": 1,
        "episodes": 2,
        "success_rate": 0.25,
        "reward_mean": 0.25,
        "by_kind": {"reverse": {"episodes": 2, "success_rate": 0.25}},
    }
    after = {**result, "success_rate": 0.75, "version": 3, "actions": {"tr | <b>": 1.0}}
    evals = {
        "before": {
            "real": {**result, "actions": {"tr | rev": 0.5, "tr | <b>": 0.5}},
            "closed_loop": {**result, "arm": "closed_loop"},
        },
        "after": {"real": after},
    }
    (root / "agent" / "eval.json").write_text(json.dumps(evals))
    rows = [
        {
            "stage": "rl",
            "step": i,
            "reward_mean": 0.2 * i,
            "loss": 0.1,
            "mismatch_kl": 0.0,
            "staleness_mean": 0.0,
            "staleness_max": 0,
        }
        for i in (1, 2, 3)
    ]
    rows.append(
        {"stage": "rl_rollout", "arm": "closed_loop", "episodes": 9, "active_per_turn": [9, 4]}
    )
    (root / "agent" / "metrics.jsonl").write_text(
        "\n".join(json.dumps(r) for r in rows) + '\n{"cut by a cra'
    )
    replay = Trajectory(
        task_id="textops-1-7",
        arm="replay",
        env_backend="simulated",
        status="ok",
        instruction="x",
        reward=0.5,
        source="rendered",
        behavior_logprobs=None,
        policy_version=None,
        turns=[
            Turn(
                agent_text="",
                command="tr -d '\\n' < input.txt | rev",
                observation="cba",
                exit_code=0,
                sim_observation="<script>alert(1)</script>",
                sim_exit_code=0,
                info={"exact_masked": False},
            )
        ],
    )
    write_jsonl(root / "eval_sim" / "trajectories" / "replay-00000.jsonl", [replay])


def test_report_of_a_run_directory(tmp_path):
    _write_run(tmp_path)
    page = write_report(tmp_path).read_text()
    titles = (
        "Agent success: real shell vs simulator",
        "Simulator fidelity (arm c)",
        "By context length",
        "RL: batch reward",
        "RL: sampler/trainer mismatch KL",
        "RL: staleness",
        "Active episodes per turn",
        "Sample episodes side by side",
    )
    for title in titles:
        assert title in page, title
    assert "tr | rev" in page and "0.750" in page and "closed_loop" in page
    # Self-contained: nothing to fetch (the SVG namespace is a name, not a request).
    assert not re.search(r"""(src|href)\s*=|<link|<script|@import|url\(""", page)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # simulated text is escaped
    # the success bars, six training curves, fidelity by depth and by state distance
    assert page.count("<svg") == 9
    assert "No summary.json" in page  # a single-job directory: the demo's summary is absent
    # The action distributions, one column per evaluation that recorded one (escaped).
    assert "real shell, before RL</th><th>real shell, after RL</th></tr>" in page
    assert "<tr><td>tr | &lt;b&gt;</td><td>0.500</td><td>1.000</td></tr>" in page


def test_report_of_an_empty_directory_says_what_is_missing(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text()
    assert "No fidelity.json" in page and "No eval.json" in page
    assert str(tmp_path / "report.html") in capsys.readouterr().out
    assert main(["report", str(tmp_path / "nope")]) == 2


def test_charts_handle_missing_and_flat_data():
    assert "no data" in line_chart("t", {"a": []})
    flat = line_chart("t", {"a": [(1, 0.5), (2, 0.5)], "b": [(1, None)]})
    assert "<path" in flat and "nan" not in flat
    bars = bar_chart("s", {"real": {"before": 0.25, "after": None}})
    assert "0.25" in bars and bars.count("<rect") == 4  # frame, one bar, two legend keys


def test_a_continued_pretraining_carries_its_lineage_and_one_curve(tmp_path):
    from launch.jobs.pretrain_sim import RESULT, lineage
    from launch.report.page import pretrain_curve

    curve = [{"step": 20, "exact_sort": 0.1}, {"step": 40, "exact_sort": 0.2}]
    first = {"command": "simloop pretrain-sim --out a", "steps": 40, "curve": curve}
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / RESULT).write_text(json.dumps(first))
    assert lineage(str(tmp_path / "a")) == [first]
    assert lineage(str(tmp_path / "none")) == [] and lineage(None) == []
    second = {
        "command": "simloop pretrain-sim --out b",
        "steps": 30,
        "lineage": [first],
        "total_steps": 70,
        "curve": [{"step": 30, "exact_sort": 0.5}],
    }
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / RESULT).write_text(json.dumps(second))
    own = {k: v for k, v in second.items() if k not in ("lineage", "total_steps")}
    assert lineage(str(tmp_path / "b")) == [first, own]  # oldest first, each once
    # The second run's steps count on from the first's 40.
    assert [(r["step"], r["exact_sort"]) for r in pretrain_curve(second)] == [
        (20, 0.1),
        (40, 0.2),
        (70, 0.5),
    ]


def test_the_page_names_each_pretraining_runs_data_and_a_drill_beside_it():
    from launch.report.page import _pretraining

    first = {
        "command": "simloop pretrain-sim --out a",
        "examples": 100,
        "steps": 40,
        "wall_s": 12.0,
    }
    second = {
        "command": "simloop pretrain-sim --out b",
        "examples": 50,
        "drill_examples": 20,
        "steps": 30,
        "wall_s": 9.0,
        "lineage": [first],
    }
    text = _pretraining(second)
    a, b = text.split("; then ")
    assert "--out a" in a and "100 real-bash examples of a utility grammar, 40 steps" in a
    assert "drill" not in a
    assert "50 real-bash examples of a utility grammar and 20 of its drill, 30 steps" in b
