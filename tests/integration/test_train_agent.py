"""`simloop train-agent` as a user runs it, on textops in a real LocalShell: synchronous RL from
a warm-started agent against a real `simloop serve` agent server that receives every new policy
version by checkpoint, and the policy evaluated on held-out tasks in the real shell before and
after RL.

This is the trainers issue's learning criterion, with the demo config: the warm-started agent
writes well-formed commands but picks another operation's command about a third of the time; a
few RL steps must fix enough of that to raise held-out success by at least 0.1 (~2 minutes).
The agent is the demo config's own 300-step warm start on noisy scripted demonstrations,
shipped as `tests/fixtures/warm-agent` (its README has the command that made it): running it
here cost ~110 of the test's ~300 CPU seconds and gave the same arrays every time. The warm
start itself runs in the demo's test.

The claim rests on a measurement, so the test measures it with its error bar: 48 held-out
tasks x 4 samples before and after RL (the same tasks and sampling seeds), compared task by
task. The test requires a gain of at least 0.1 and the gain's one-sided 99% lower confidence
bound above zero (RL helped, not the evaluation's noise). Runs of it, deterministic on one
machine: 96 tasks went 0.659 -> 0.794 (gain 0.135, standard error 0.017) at 10 RL steps, until
training attention was computed in causal blocks (2026-11-27): that reorders float sums only,
yet moved the 10-step gain to 0.091, under the bar. 16 steps keep a margin against such drift:
0.656 -> 0.844 on 96 tasks (gain 0.188, se 0.019) on 2026-12-05, when the evaluation was
halved to 48 tasks to keep the suite's minutes; on 48, 0.656 -> 0.854 (gain 0.198, se 0.026,
lower 99% bound 0.138). On 2026-12-06, to keep the suite's minutes, 12 steps: at lr 3e-4 they
gave 0.656 -> 0.807 (gain 0.151, lower bound 0.092), at 5e-4 0.656 -> 0.870 (gain 0.214, se
0.032, lower bound 0.140; every operation up: reverse 0.59 -> 0.83, sort 0.81 -> 0.94, upper
0.67 -> 0.89), the margin 16 steps at 3e-4 had. A shorter warm start does not make a
cheaper test: 120 SFT steps left an agent at 0.37 that 10 RL steps took only to 0.44 (it
still wrote malformed commands, which RL fixes slowly). On 2026-12-07, half the demo's batch
(32 episodes a step, 4 tasks x 8 samples): 0.656 -> 0.875 (gain 0.219, se 0.028, lower
bound 0.153), and at run seed 1 0.635 -> 0.885 (gain 0.250, lower bound 0.179), for 114
instead of 144 CPU seconds alone."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fakes import user_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "demo_cpu.yaml"
WARM_AGENT = ROOT / "tests" / "fixtures" / "warm-agent" / "weights"
RL_STEPS = 12
BATCH = 32  # episodes per RL step: 4 tasks x the demo's 8 samples (the demo's batch is 64)
EVAL_TASKS = 48
SAMPLES = 4  # the demo config's train_agent.eval.samples
Z_99 = 2.326  # one-sided 99% normal quantile
# The string operations only, no KL anchor: the criterion is about how fast RL fixes the choice
# of operation (the tiny agent does not learn in minutes to copy a count's letter). At the
# demo's lr 1e-3, RL in the real shell broke the sort command within 6 steps (`so | |`:
# sort 0.81 -> 0.03); at 3e-4 and 5e-4 every operation improves.
OPS = ["--env.textops.ops", "[reverse,upper,sort]", "--train_agent.loss.kl_coef", "0",
       "--train_agent.optim.lr", "5e-4"]  # fmt: skip
# `eval-agent` re-evaluates the first of them: the held-out stream is prefix-stable and the
# sampling seeds are drawn in task order, so each of these tasks sees the same seeds as in
# train-agent's evaluation and must come out the same, task by task.
REEVAL_TASKS = 12


def records(run: Path, stage: str) -> list[dict]:
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("stage") == stage and "event" not in r and "step" in r:
            out.append(r)
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("agent")
    # As a user runs it: simloop gives itself the 8 fake devices of the demo's cpu-8 plan.
    env = user_env()
    cmd = [
        sys.executable,
        "-m",
        "launch",
        "train-agent",
        "--config",
        str(CONFIG),
        "--out",
        str(out),
        "--train_agent.steps",
        str(RL_STEPS),
        "--train_agent.eval.tasks",
        str(EVAL_TASKS),
        "--agent.weights",
        str(WARM_AGENT),
        "--train_agent.warm_start.steps",
        "0",
        "--orchestrator.batch_size",
        str(BATCH),
        *OPS,
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    return out, done


def episodes(run: Path, label: str, arm: str = "real") -> list[dict]:
    """The evaluation's episodes, from all its trajectory shards."""
    out = []
    for path in sorted((run / "trajectories").glob(f"eval-{label}-{arm}-*.jsonl")):
        out += [json.loads(line) for line in path.read_text().splitlines()]
    return out


def per_task_success(run: Path, label: str) -> dict[str, float]:
    """Held-out task -> success rate over its samples, from the evaluation's episodes."""
    wins: dict[str, list[float]] = {}
    for t in episodes(run, label):
        wins.setdefault(t["task_id"], []).append(float((t["reward"] or 0.0) >= 1.0))
    return {task: sum(w) / len(w) for task, w in wins.items()}


def paired_gain(before: dict[str, float], after: dict[str, float]) -> tuple[float, float]:
    """(mean gain, its standard error) over tasks: the same tasks before and after RL, so the
    per-task differences carry the noise and the tasks' own difficulty cancels."""
    assert before.keys() == after.keys()
    d = [after[k] - before[k] for k in before]
    n = len(d)
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1)
    return mean, math.sqrt(var / n)


def test_paired_gain_matches_a_hand_computed_example():
    mean, se = paired_gain({"a": 0.5, "b": 0.25, "c": 1.0}, {"a": 0.75, "b": 0.75, "c": 1.0})
    # differences 0.25, 0.5, 0: mean 0.25, sample variance 0.0625, se sqrt(0.0625 / 3)
    assert mean == 0.25 and abs(se - math.sqrt(0.0625 / 3)) < 1e-12


def test_rl_raises_the_success_of_an_undertrained_agent(trained):
    out, _ = trained
    evals = json.loads((out / "eval.json").read_text())
    before, after = evals["before"]["real"], evals["after"]["real"]
    # Held-out tasks (never in the demonstrations or the RL stream), 4 samples each, real shell.
    assert before["episodes"] == after["episodes"] == EVAL_TASKS * SAMPLES
    assert before["version"] == 1 and after["version"] == 1 + RL_STEPS
    assert 0.3 < before["success_rate"] < 0.85, "the warm start is not undertrained as intended"
    b, a = per_task_success(out, "before"), per_task_success(out, "after")
    assert len(b) == EVAL_TASKS
    gain, se = paired_gain(b, a)
    assert abs(gain - (after["success_rate"] - before["success_rate"])) < 1e-9
    assert gain >= 0.1, (gain, se, before["success_rate"], after["success_rate"])
    assert gain - Z_99 * se > 0, (gain, se)
    # The training batches (new tasks every step) tell the same story.
    rewards = [r["reward_mean"] for r in records(out, "rl")]
    assert len(rewards) == RL_STEPS
    assert sum(rewards[-3:]) / 3 > rewards[0], rewards


def test_rl_steps_are_synchronous_and_publish_every_version(trained):
    out, _ = trained
    rl = records(out, "rl")
    steps = [r["step"] for r in rl]
    assert steps == list(range(1, len(steps) + 1)) and steps
    # Synchronous RL (S=0): every trained token was sampled by the version being trained.
    assert all(r["staleness_max"] == 0 for r in rl)
    assert all(abs(r["mismatch_kl"]) < 0.05 for r in rl)
    # Each step published a new version to the real server.
    assert [r["version"] for r in rl] == [s + 1 for s in steps]
    assert all(r["publish_first_token_s"] > 0 for r in rl)


def test_the_run_directory_holds_every_artifact(trained):
    out, done = trained
    assert not records(out, "warm_start")  # RL from --agent.weights: no warm start ran
    assert (out / "config.yaml").exists()
    assert list((out / "trajectories").glob("rl-*.jsonl"))
    for label in ("before", "after"):
        assert len(episodes(out, label)) == EVAL_TASKS * SAMPLES
    assert (out / "weights" / "final" / "model_config.json").exists()
    assert sorted(int(p.name) for p in (out / "checkpoints" / "rl").iterdir() if p.name.isdigit())
    assert (out / "logs" / "agent-server.log").exists()
    summary = json.loads(done.stdout.strip().splitlines()[-1].split("train-agent: ", 1)[1])
    assert summary["rl"]["steps"] == len(records(out, "rl"))
    evals = json.loads((out / "eval.json").read_text())
    assert summary["rl"]["eval"]["real"] == {
        "before": evals["before"]["real"]["success_rate"],
        "after": evals["after"]["real"]["success_rate"],
    }
    assert "eval before RL, real: policy v1 success" in done.stdout


def test_eval_agent_reproduces_the_after_rl_evaluation(trained, tmp_path):
    from flax import nnx

    from launch.config.loading import load_config
    from launch.config.schema import SimloopConfig
    from rl.model import Qwen3
    from rl.model.params_io import save_params

    out, _ = trained
    # No simulator was trained here: random weights of the demo's simulator still exercise the
    # closed-loop arm end to end (its observations are garbage, so its success is ~0).
    sim = tmp_path / "random-sim"
    save_params(Qwen3(load_config(SimloopConfig, CONFIG).simulator.model, rngs=nnx.Rngs(0)), sim)
    run = tmp_path / "eval"
    env = user_env()
    cmd = [sys.executable, "-m", "launch", "eval-agent", "--config", str(CONFIG),
           "--out", str(run), "--agent.weights", str(out / "weights" / "final"),
           "--simulator.weights", str(sim), "--env.shell.simulated.max_tokens", "48",
           "--train_agent.eval.arms", "[real,closed_loop]",
           "--train_agent.eval.tasks", str(REEVAL_TASKS), *OPS]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((run / "eval.json").read_text())["eval"]
    n = REEVAL_TASKS * SAMPLES
    assert result["real"]["episodes"] == result["closed_loop"]["episodes"] == n
    # The same weights on the first held-out tasks with the same sampling seeds: the same
    # outcome for every task, and the same episodes (commands) sample by sample.
    again, before = per_task_success(run, "eval"), per_task_success(out, "after")
    assert len(again) == REEVAL_TASKS and again == {k: before[k] for k in again}
    assert result["real"]["success_rate"] == sum(again.values()) / REEVAL_TASKS
    first = {(t["task_id"], t["group_index"]): t["token_ids"] for t in episodes(out, "after")}
    for t in episodes(run, "eval"):
        assert t["token_ids"] == first[(t["task_id"], t["group_index"])]
    for arm in ("real", "closed_loop"):
        actions = result[arm]["actions"]
        assert abs(sum(actions.values()) - 1) < 1e-9 and list(actions.values()) == sorted(
            actions.values(), reverse=True
        )
    # The trained agent computes the answer with a pipeline on the file in both arms.
    assert next(iter(result["real"]["actions"])).startswith("tr | ")
    gap = result["closed_loop"]["success_rate"] - result["real"]["success_rate"]
    assert f"transfer gap (simulator - real): {gap:+.3f}" in done.stdout
    assert (run / "logs" / "simulator-server.log").exists()
    assert len(episodes(run, "eval", "closed_loop")) == n
