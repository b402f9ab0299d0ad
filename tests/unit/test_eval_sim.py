"""Arm (c) fidelity from replayed trajectories (`replay_fidelity`), the trajectory selection and
the errors of `simloop eval-sim`; the live replay against a real simulator server runs in
tests/integration/test_demo.py."""

from __future__ import annotations

import json

import pytest

from launch.cli import main
from launch.config.loading import load_config
from launch.config.schema import SimloopConfig
from launch.jobs.eval_sim import select_trajectories
from rl.data.trajectory import Trajectory, Turn, write_jsonl
from rl.orchestrator.evaluate import command_key, replay_fidelity


@pytest.mark.parametrize(
    "command,key",
    [
        ("tr -d '\\n' < input.txt | rev", "tr | rev"),
        ("echo COMPLETE\ntr -d '\\n' < input.txt | fold -w1 | sort | tr -d '\\n'",
         "tr | fold | sort | tr"),
        ("/usr/bin/python3 -m pytest -x", "python3"),
        ("   \n", "(empty)"),
    ],
)  # fmt: skip
def test_command_key(command, key):
    assert command_key(command) == key


def _replay(task_id, turns):
    return Trajectory(
        task_id=task_id,
        arm="replay",
        env_backend="simulated",
        status="ok",
        instruction="x",
        turns=turns,
        behavior_logprobs=None,
        policy_version=None,
    )


def _turn(cmd, real, sim, rc=0, sim_rc=0, flags=(), prompt_tokens=100):
    return Turn(
        agent_text="",
        command=cmd,
        observation=real,
        exit_code=rc,
        sim_observation=sim,
        sim_exit_code=sim_rc,
        flags=list(flags),
        info={"prompt_tokens": prompt_tokens},
    )


def test_replay_fidelity_counts_every_pair():
    trajs = [
        _replay(
            "a",
            [
                _turn("cat f | rev", "cba", "cba"),
                _turn("cat f | rev", "cba", "xyz", sim_rc=1, prompt_tokens=300),
            ],
        ),
        _replay(
            "b",
            [
                _turn("ls", "f\n", "f\n" * 200, flags=["cap_hit", "repetition"], prompt_tokens=700),
                _turn("date", "Mon Jan  5 10:00:00 UTC 2026", "Tue Feb  3 11:11:11 UTC 2026"),
                Turn(agent_text="", command="submit x"),
            ],
        ),
    ]
    fid = replay_fidelity(trajs, context_edges=[256, 512])
    p = fid["pairs"]
    assert p["count"] == 4  # the submit turn has no observation pair
    assert p["exact"] == pytest.approx(1 / 4)
    assert p["exact_masked"] == pytest.approx(2 / 4)  # the dates differ only in volatile text
    assert p["exit_code_agreement"] == pytest.approx(3 / 4)
    h = fid["hygiene"]
    assert (h["cap_hit"], h["repetition"], h["malformed"]) == (0.25, 0.25, 0.0)
    assert fid["real_hygiene"]["cap_hit"] == 0.0 and fid["real_hygiene"]["count"] == 4
    assert {k: v["count"] for k, v in fid["by_context"].items()} == {
        "0-256": 2,
        "256-512": 1,
        "512-inf": 1,
    }
    assert fid["by_command"]["cat | rev"]["count"] == 2
    assert fid["by_command"]["cat | rev"]["exact"] == 0.5
    assert fid["trajectories"] == 2 and fid["statuses"] == {"ok": 2}


def test_replay_fidelity_by_depth_whatever_the_prompt_held():
    """Depth counts the session's turns before a command (a format error's turn too), not the
    prompt's tokens: a cut or compacted context is scored on the same axis as a whole one."""
    long = [_turn("rev", "a", "a" if i < 5 else "b", prompt_tokens=400) for i in range(10)]
    long.insert(2, Turn(agent_text="no command"))
    trajs = [_replay("a", long), _replay("b", [_turn("rev", "x", "x")])]
    fid = replay_fidelity(trajs, depth_edges=[1, 4, 8])
    assert list(fid["by_depth"]) == ["0-1", "1-4", "4-8", "8-inf"]  # in bucket order
    got = {k: (v["count"], v["exact"]) for k, v in fid["by_depth"].items()}
    # depths 0 (x2); 1, 3; 4..7; 8..10 (the reply without a command is depth 2)
    assert got == {"0-1": (2, 1.0), "1-4": (2, 1.0), "4-8": (4, 0.5), "8-inf": (3, 0.0)}


def test_replay_fidelity_by_state_distance_and_the_state_dependent_share():
    """State distance: the turns since the episode last wrote a file the command reads
    (envs/shellstate.py); observations that read only starting files have none."""
    turns = [
        _turn("sort input.txt > a.txt", "", ""),  # reads a starting file: no distance
        _turn("cat notes.txt", "x", "x"),  # a distractor: no distance
        _turn("head -n 2 a.txt > b.txt", "", ""),  # a.txt, written 2 turns back
        _turn("echo 1 >> b.txt", "", ""),  # writes only
        _turn("wc -l < b.txt", "3", "2"),  # b.txt, written the turn before (wrong)
        _turn("cat a.txt", "a\nb", "a\nb"),  # a.txt, written 5 turns back
    ]
    fid = replay_fidelity([_replay("s", turns)], state_edges=[2, 3])
    assert fid["state_dependent"] == {"count": 3, "share": 0.5}
    got = {k: (v["count"], v["exact"]) for k, v in fid["by_state_distance"].items()}
    assert got == {"0-2": (1, 0.0), "2-3": (1, 1.0), "3-inf": (1, 1.0)}
    assert fid["state_distance_3plus"]["count"] == 1
    assert replay_fidelity([])["state_dependent"] == {"count": 0, "share": 0.0}


def test_replay_fidelity_by_the_replayed_tasks_operation():
    a = _replay("a", [_turn("tr | rev", "cba", "cba"), _turn("tr | rev", "ab", "ba")])
    b = _replay("b", [_turn("tr | tr", "ABC", "ABC")])
    c = _replay("c", [_turn("ls", "f", "f")])  # imported: no task kind, counted overall only
    a.task_kind, b.task_kind = "reverse", "upper"
    fid = replay_fidelity([a, b, c])
    assert {k: (v["count"], v["exact_masked"]) for k, v in fid["by_kind"].items()} == {
        "reverse": (2, 0.5),
        "upper": (1, 1.0),
    }
    assert fid["pairs"]["count"] == 4


def test_replay_fidelity_of_nothing():
    fid = replay_fidelity([])
    assert fid["pairs"] == {"count": 0} and fid["by_context"] == {}


def _real(task_id, backend="local"):
    return Trajectory(
        task_id=task_id,
        arm="real",
        env_backend=backend,
        status="ok",
        instruction="x",
        reward=1.0,
        turns=[Turn(agent_text="", command="ls", observation="f", exit_code=0)],
        source="rendered",
        behavior_logprobs=None,
        policy_version=None,
    )


def test_select_trajectories_keeps_heldout_real_ones(tmp_path):
    write_jsonl(tmp_path / "t.jsonl", [_real("a"), _real("b"), _real("c", "simulated"), _real("d")])
    (tmp_path / "heldout.json").write_text(json.dumps(["b", "c", "d"]))
    cfg = load_config(
        SimloopConfig,
        None,
        [
            "--eval_sim.trajectories",
            f"[{tmp_path / 't.jsonl'}]",
            "--eval_sim.heldout_tasks",
            str(tmp_path / "heldout.json"),
        ],
    )
    assert [t.task_id for t in select_trajectories(cfg)] == ["b", "d"]
    cfg = load_config(
        SimloopConfig,
        None,
        ["--eval_sim.trajectories", f"[{tmp_path}]", "--eval_sim.max_trajectories", "2"],
    )
    assert [t.task_id for t in select_trajectories(cfg)] == ["a", "b"]


def test_eval_sim_cli_errors(tmp_path, capsys):
    assert main(["eval-sim", "--out", str(tmp_path / "o")]) == 2
    assert "eval_sim.trajectories is empty" in capsys.readouterr().err
    write_jsonl(tmp_path / "t.jsonl", [_real("a")])
    args = [
        "eval-sim",
        "--out",
        str(tmp_path / "o"),
        "--eval_sim.trajectories",
        f"[{tmp_path / 't.jsonl'}]",
    ]
    assert main([*args, "--eval_sim.heldout_tasks", str(tmp_path / "none.json")]) == 2
    assert "none.json does not exist" in capsys.readouterr().err
    (tmp_path / "h.json").write_text("[]")
    assert main([*args, "--eval_sim.heldout_tasks", str(tmp_path / "h.json")]) == 2
    assert "no real trajectory" in capsys.readouterr().err
    assert main([*args, "--eval_sim.context_edges", "[512, 256]"]) == 2
    assert "increasing positive integers" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # nothing is written before the inputs check out


def _ws_turn(cmd, real, sim, changes):
    turn = _turn(cmd, real, sim)
    turn.info["sim_changes"] = changes
    return turn


def test_workspace_fidelity_follows_the_simulators_own_files_against_real_bash():
    """Its files start as the task's and take each block it wrote; the real ones come from
    running the commands again in real bash. A wrong write is counted where it happened
    (the first from right files), and later observations are split by whether its files
    were right before them."""
    from envs.workspace import trajectory_workspaces
    from rl.orchestrator.evaluate import workspace_fidelity

    good = _replay(
        "t1",
        [
            _ws_turn("sort input.txt > a.txt", "", "", "--- a.txt ---\napple\npear\n"),
            _ws_turn("tac a.txt > b.txt", "", "", "--- b.txt ---\napple\npear\n"),  # wrong
            _ws_turn("cat b.txt", "pear\napple\n", "apple\npear\n", None),
        ],
    )
    good.setup_files = {"input.txt": "pear\napple\n"}
    malformed = _replay(
        "t2",
        [
            _ws_turn("echo x >> log.txt", "", "", "--- log.txt \nx\n"),  # does not parse
            _ws_turn("cat log.txt", "x\n", "", None),
        ],
    )
    malformed.setup_files = {}
    history_mode = _replay("t3", [_turn("ls", "a\n", "a\n")])
    replays = [good, malformed, history_mode]
    states, failed = trajectory_workspaces(replays)
    assert failed == 0
    result = workspace_fidelity(replays, states)
    assert result["replays"] == 2 and result["skipped"] == 1
    assert result["turns"] == 5
    # right after: sort only (the malformed block left log.txt unwritten)
    assert result["state_exact"] == pytest.approx(1 / 5)
    assert result["writes"] == 3 and result["write_exact"] == pytest.approx(1 / 3)
    # files right before: sort, tac and the echo (all print nothing, as the simulator said)
    assert result["observation_exact_state_right"] == 1.0
    assert result["observation_exact_state_wrong"] == 0.0 and result["turns_state_wrong"] == 2
    assert result["first_wrong_write"] == {
        "echo": {"writes": 1, "wrong": 1},
        "tac": {"writes": 1, "wrong": 1},
        "sort": {"writes": 1, "wrong": 0},
    }


def test_workspace_fidelity_of_nothing():
    from rl.orchestrator.evaluate import workspace_fidelity

    result = workspace_fidelity([], lambda traj: None)
    assert result["turns"] == 0 and result["state_exact"] is None
    assert result["first_wrong_write"] == {}
