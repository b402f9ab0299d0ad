"""`simloop pretrain-sim` at CI size, as a user runs it: the utility grammar in real bash, the
curriculum, held-out learning curves, serving weights that carry their own record, and a rerun
that resumes from the checkpoint and reuses the collected transcripts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rl.data.trajectory import load_trajectories
from rl.model.integrity import verify_checkpoint
from rl.model.params_io import read_model_config
from tests.fakes import user_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def pretrain(out: Path, steps: int) -> subprocess.CompletedProcess:
    env = user_env(cheap_compile=True)  # a few steps each: mostly compiling
    cmd = [sys.executable, "-m", "launch", "pretrain-sim", "--config",
           str(ROOT / "configs" / "demo_cpu.yaml"), "--out", str(out),
           "--pretrain_sim.cases", "24", "--pretrain_sim.eval_cases", "6",
           "--pretrain_sim.steps", str(steps), "--pretrain_sim.short_steps", "3",
           "--pretrain_sim.short_data.batch_size", "4", "--pretrain_sim.data.batch_size", "2",
           "--pretrain_sim.eval_every", "3", "--pretrain_sim.log_every", "3",
           "--pretrain_sim.grammar.session_prob", "1", "--pretrain_sim.grammar.session_turns",
           "3",
           # a drill of counts alone, trained on alongside
           "--pretrain_sim.drill_cases", "4", "--pretrain_sim.drill.seed", "5",
           "--pretrain_sim.drill.op_weights", "{count: 1, reverse: 0, upper: 0, sort: 0}",
           "--pretrain_sim.drill.bare_prob", "0", "--pretrain_sim.drill.textops_prob", "1",
           "--pretrain_sim.drill.error_prob", "0", "--pretrain_sim.drill.typo_prob", "0",
           "--pretrain_sim.drill.session_prob", "0"]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_pretrain_sim_collects_trains_scores_and_resumes(tmp_path):
    out = tmp_path / "pre"
    done = pretrain(out, 6)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "24/24 workspaces in real bash" in done.stdout
    drill = load_trajectories([out / "trajectories" / "grammar-drill.jsonl"])
    assert len(drill) == 4 * 6 and {t.task_kind for t in drill} == {"count"}
    assert all("| tr -cd '" in t.turns[0].command for t in drill)
    assert "+ 24 drill examples" in done.stdout  # they fit the rows: all of them train
    train = load_trajectories([out / "trajectories" / "grammar-train.jsonl"])
    held = load_trajectories([out / "trajectories" / "grammar-eval.jsonl"])
    assert {t.env_backend for t in train + held} == {"local"}
    assert not {t.task_id for t in train} & {t.task_id for t in held}
    assert all(t.turns[0].exit_code is not None for t in train)
    sessions = [t for t in held if t.task_kind == "session"]
    assert len(sessions) == 6 and all(len(t.turns) == 3 for t in sessions)
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if r.get("stage") == "pretrain_sim_eval"]
    assert [r["step"] for r in evals] == [3, 6]
    assert all(0.0 <= r["exact"] <= 1.0 and 0.0 <= r["induction"] <= 1.0 for r in evals)
    assert all(0.0 <= r["exact_session"] <= 1.0 for r in evals)  # sessions' later commands
    weights = out / "weights" / "final"
    assert read_model_config(weights).num_layers == 3  # demo_cpu.yaml's simulator.model
    record = json.loads((weights / "pretrain_sim.json").read_text())
    assert record == json.loads((out / "pretrain_sim.json").read_text())
    # each session's 2nd and 3rd commands after the turns before them (12, unless a context
    # ran past the row)
    assert 0 < record["counts"]["session"] <= 12
    verify_checkpoint(weights)  # sealed with its record: train-sim and servers load it as is
    assert [r["step"] for r in record["curve"]] == [3, 6] and record["steps"] == 6
    assert "--pretrain_sim.cases 24" in record["command"]  # how to make it again
    assert record["drill_cases"] == 4 and record["drill"]["op_weights"]["reverse"] == 0
    assert record["drill_examples"] == 24  # beside `examples`, the main grammar's
    # demo_cpu.yaml's simulator starts from the shipped one: the record names what it continued.
    shipped = json.loads((ROOT / "configs/pretrained/sim-textops/pretrain_sim.json").read_text())
    assert record["lineage"][-1]["command"] == shipped["command"]
    assert record["total_steps"] == 6 + sum(r["steps"] for r in record["lineage"])

    again = pretrain(out, 9)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "resuming at step 6" in again.stdout
    assert "workspaces in real bash" not in again.stdout  # the transcripts were reused
    first_wall = record["wall_s"]
    record = json.loads((out / "pretrain_sim.json").read_text())
    assert [r["step"] for r in record["curve"]] == [3, 6, 9]  # the whole curve, resumed
    assert record["wall_s"] > first_wall  # and the training time of both invocations


@pytest.mark.parametrize(
    "args,message",
    [(["--out", "x", "--pretrain_sim.steps", "0"], "PretrainSimConfig.steps=0 is invalid"),
     (["--out", "x", "--pretrain_sim.short_steps", "5", "--pretrain_sim.steps", "4"],
      "short_steps=5 is invalid: at most steps (4)"),
     (["--out", "x", "--pretrain_sim.drill_cases", "-1"],
      "PretrainSimConfig.drill_cases=-1 is invalid"),
     (["--out", "x", "--pretrain_sim.drill_cases", "9", "--pretrain_sim.drill.seed", "0"],
      "drill.seed=0 is invalid: it must differ from grammar.seed (0)"),
     ([], "--out DIR is required")],
)  # fmt: skip
def test_pretrain_sim_mistakes_exit_2_with_one_line(args, message):
    cmd = [sys.executable, "-m", "launch", "pretrain-sim", *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
