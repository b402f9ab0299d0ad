"""`simloop eval-agent`'s checks and tables, and the action distribution of an evaluation.
(It runs end to end on a trained agent in tests/integration/test_train_agent.py.)"""

from __future__ import annotations

from pathlib import Path

from launch.cli import main
from launch.jobs.eval_agent import print_eval, transfer_gap
from rl.data.trajectory import Trajectory, Turn
from rl.orchestrator.evaluate import action_distribution

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml"


def _episode(*commands):
    return Trajectory(
        task_id="t",
        arm="real",
        env_backend="local",
        status="ok",
        turns=[Turn(agent_text="", command=c) for c in commands],
    )


def test_action_distribution_counts_every_turn():
    episodes = [
        _episode("echo X\ntr -d '\\n' < input.txt | rev"),
        _episode("rev input.txt", None),
        _episode("echo X\ntr -d '\\n' < input.txt | rev"),
    ]
    assert action_distribution(episodes) == {"tr | rev": 0.5, "rev": 0.25, "(no command)": 0.25}
    assert action_distribution([]) == {}


def test_eval_agent_refuses_what_it_cannot_evaluate(tmp_path, capsys):
    base = ["eval-agent", "--config", str(CONFIG), "--out", str(tmp_path / "e")]
    assert main(base) == 2
    assert "set agent.weights" in capsys.readouterr().err
    # (demo_cpu.yaml starts the simulator from its pretrained checkpoint: take it away)
    both = ["--train_agent.eval.arms", "[real,closed_loop]", "--simulator.weights", "null"]
    assert main([*base, "--agent.weights", str(tmp_path), *both]) == 2
    assert "closed_loop arm needs a trained simulator" in capsys.readouterr().err
    assert main([*base, "--agent.weights", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "agent.weights=" in err and "does not exist" in err
    assert main([*base, "--agent.weights", str(tmp_path), "--train_agent.eval.tasks", "0"]) == 2
    assert "nothing to evaluate" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()  # a refused run writes nothing


def test_print_eval_shows_arms_gap_and_actions(capsys):
    def result(rate, actions):
        return {
            "success_rate": rate,
            "episodes": 8,
            "actions": actions,
            "by_kind": {"rev": {"episodes": 8, "success_rate": rate}},
        }

    results = {
        "real": result(0.5, {"tr | rev": 1.0}),
        "closed_loop": result(0.25, {"tr | rev": 0.5, "cat": 0.5}),
    }
    assert transfer_gap(results) == -0.25 and transfer_gap({"real": results["real"]}) is None
    print_eval(results)
    out = capsys.readouterr().out
    assert "transfer gap (simulator - real): -0.250" in out
    assert "0.500" in out and "0.250" in out and "cat" in out
