"""`simloop demo --quick` as CI runs it: every stage for real at CI size (real bash, two
`simloop serve` processes, Orbax checkpoints, grain pipelines), then checks that each
artifact exists and that the summary's numbers are the ones the stages' own records give
(fidelity recomputed from the replayed pairs, success recounted from the evaluation episodes,
the deciding experiment's `thesis` recomputed from the stored episodes of both RL arms).
The report is rendered in headless Chromium (Debian's `chromium`; `make test` installs it)."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from envs.fidelity import compare_observations
from launch.config.loading import load_config
from launch.config.schema import SimloopConfig
from launch.jobs.episodes import agent_tasks
from rl.data.trajectory import load_trajectories
from tests.fakes import free_port, user_env
from tests.unit.test_metrics_log import read_scalars

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _demo(out: Path) -> subprocess.CompletedProcess:
    # As a user runs it: simloop gives itself the fake devices of the demo's cpu-8 plan.
    env = user_env(cheap_compile=True, full_servers=True)
    # No --config: `simloop demo` is the embedded default and runs configs/demo_cpu.yaml.
    cmd = [sys.executable, "-m", "launch", "demo", "--out", str(out), "--quick"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("demo")
    proc = _demo(out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


def test_every_stage_leaves_its_artifacts(demo):
    out, proc = demo
    for path in (
        "collect/trajectories",
        "sim/weights/final",
        "sim/heldout_tasks.json",
        "eval_sim/fidelity.json",
        "agent/eval.json",
        "agent/weights/final",
        "agent/trajectories/demos.jsonl",
        "agent/weights/warm_start",
        "agent_real/eval.json",
        "agent_real/weights/final",
        "summary.json",
        "report.html",
    ):
        assert (out / path).exists(), path
    for stage in ("collect", "sim", "eval_sim", "agent", "agent_real"):
        assert json.loads((out / stage / "stage.json").read_text())["wall_s"] > 0
        assert (out / stage / "config.yaml").exists()
    # Every run directory is watchable in TensorBoard: the scalars of its metrics.jsonl.
    for run in ("collect", "sim", "eval_sim", "agent", "."):
        events = list((out / run / "tensorboard").glob("events.out.tfevents.*"))
        assert events and all(e.stat().st_size > 0 for e in events), run
    logs = {p.name for p in (out / "agent" / "logs").iterdir()}
    assert {"agent-server.log", "simulator-server.log"} <= logs  # two server processes
    assert "simloop demo: summary" in proc.stdout


def test_summary_numbers_come_from_the_stages_records(demo):
    out, _ = demo
    s = json.loads((out / "summary.json").read_text())
    assert s["quick"] is True
    # Fidelity: recomputed from the replayed (real, simulated) pairs.
    replays = load_trajectories([out / "eval_sim" / "trajectories"])
    pairs = [
        compare_observations(t.sim_observation, t.observation, t.sim_exit_code, t.exit_code)
        for r in replays
        for t in r.turns
        if t.sim_observation is not None
    ]
    assert replays and all(r.arm == "replay" and r.env_backend == "simulated" for r in replays)
    assert s["fidelity"]["observations"] == len(pairs) > 0
    assert s["fidelity"]["exact_masked"] == pytest.approx(
        sum(p.exact_masked for p in pairs) / len(pairs)
    )
    assert s["fidelity"]["exit_code_agreement"] == pytest.approx(
        sum(p.exit_code_match for p in pairs) / len(pairs)
    )
    for key in ("cap_hit", "think_leak", "repetition"):
        assert 0.0 <= s["fidelity"][key] <= 1.0
    # The replayed tasks are the ones train-sim held out.
    heldout = set(json.loads((out / "sim" / "heldout_tasks.json").read_text()))
    assert {r.task_id for r in replays} <= heldout
    # Success: recounted from the evaluation episodes, in both shells, before and after RL.
    cfg = load_config(SimloopConfig, out / "agent" / "config.yaml")
    kinds = {t.id: t.reward.params["op"] for t in agent_tasks(cfg)[1]}
    for arm, backend in (("real", "local"), ("closed_loop", "simulated")):
        for label in ("before", "after"):
            episodes = load_trajectories(
                sorted((out / "agent" / "trajectories").glob(f"eval-{label}-{arm}-*.jsonl"))
            )
            assert len(episodes) == 6 * 2  # quick: 6 held-out tasks x 2 samples
            assert {e.env_backend for e in episodes} == {backend}
            wins = sum((e.reward or 0.0) >= 1.0 for e in episodes) / len(episodes)
            assert s["agent_success"][arm][label] == pytest.approx(wins)
            # ... and by operation, from the held-out tasks' own reward params.
            for kind, arms in s["agent_success_by_kind"].items():
                mine = [e for e in episodes if kinds[e.task_id] == kind]
                rate = arms[arm][label]
                assert (
                    rate is None
                    if not mine
                    else rate
                    == pytest.approx(sum((e.reward or 0.0) >= 1.0 for e in mine) / len(mine))
                )
    assert set(s["agent_success_by_kind"]) == set(kinds.values())
    for label in ("before", "after"):
        gap = s["agent_success"]["closed_loop"][label] - s["agent_success"]["real"][label]
        assert s["transfer_gap"][label] == pytest.approx(gap, abs=1e-4)
    # RL ran in the simulator: its episodes are simulated, one metrics row per step.
    assert s["rl"] == {**s["rl"], "arm": "closed_loop", "steps": 2}
    rl_eps = load_trajectories(sorted((out / "agent" / "trajectories").glob("rl-*.jsonl")))
    assert rl_eps and {e.env_backend for e in rl_eps} == {"simulated"}
    assert set(s["stages_wall_s"]) == {"collect", "sim", "eval_sim", "agent", "agent_real"}
    # Fidelity by the replayed task's operation: every replayed operation, recounted.
    by_kind, kinds_all = s["fidelity"]["by_kind"], _collect_kinds(out)
    assert set(by_kind) == {kinds_all[r.task_id] for r in replays}
    for kind, v in by_kind.items():
        mine = [
            compare_observations(
                t.sim_observation, t.observation, t.sim_exit_code, t.exit_code
            ).exact_masked
            for r in replays
            if kinds_all[r.task_id] == kind
            for t in r.turns
            if t.sim_observation is not None
        ]
        assert v["observations"] == len(mine)
        assert v["exact_masked"] == pytest.approx(sum(mine) / len(mine))


def _collect_kinds(out: Path) -> dict[str, str]:
    """Task id -> operation of the collect stage's own tasks (regenerated from its config)."""
    from envs.textops import generate_textops
    from launch.jobs.collect import collect_tasks_config

    cfg = load_config(SimloopConfig, out / "collect" / "config.yaml")
    return {t.id: t.kind for t in generate_textops(collect_tasks_config(cfg))}


def _wins(episodes) -> float:
    return sum((e.reward or 0.0) >= 1.0 for e in episodes) / len(episodes)


def _task_rates(episodes) -> dict[str, float]:
    by: dict[str, list[float]] = {}
    for e in episodes:
        by.setdefault(e.task_id, []).append(float((e.reward or 0.0) >= 1.0))
    return {k: sum(v) / len(v) for k, v in by.items()}


def test_thesis_is_recomputed_from_the_stored_episodes(demo):
    """The deciding experiment: the warm start, RL in the simulator and RL in the real shell,
    all evaluated in the real shell on the same tasks and seeds; every number in
    summary.json's `thesis` is recounted here from the episodes on disk."""
    import math
    import statistics

    out, _ = demo
    t = json.loads((out / "summary.json").read_text())["thesis"]

    def eps(run: str, prefix: str) -> list:
        return load_trajectories(sorted((out / run / "trajectories").glob(f"{prefix}-*.jsonl")))

    warm, sim_real = eps("agent", "eval-before-real"), eps("agent", "eval-after-real")
    sim_sim, real_real = (
        eps("agent", "eval-after-closed_loop"),
        eps("agent_real", "eval-after-real"),
    )
    assert t["warm_start"]["real"] == pytest.approx(_wins(warm), abs=1e-4)
    assert t["rl_in_sim"]["real"] == pytest.approx(_wins(sim_real), abs=1e-4)
    assert t["rl_in_sim"]["sim"] == pytest.approx(_wins(sim_sim), abs=1e-4)
    assert t["rl_in_real"]["real"] == pytest.approx(_wins(real_real), abs=1e-4)
    assert t["eval_episodes"] == len(warm) == len(sim_real) == len(real_real) == 6 * 2
    # Same tasks, same sampling seeds: the three evaluations are paired by task.
    assert (
        {e.task_id for e in warm} == {e.task_id for e in sim_real} == {e.task_id for e in real_real}
    )
    # Equal RL budgets: the same number of episodes, in the simulator and in the real shell.
    rl_sim, rl_real = eps("agent", "rl"), eps("agent_real", "rl")
    assert {e.env_backend for e in rl_sim} == {"simulated"}
    assert {e.env_backend for e in rl_real} == {"local"}
    assert t["rl_in_sim"]["episodes"] == len(rl_sim) == len(rl_real) == t["rl_in_real"]["episodes"]
    # The intervals: mean +- 1.96 sd / sqrt(n) over per-task rates (differences paired).
    w, sr, rr = _task_rates(warm), _task_rates(sim_real), _task_rates(real_real)
    for key, values in (
        ("warm_start", list(w.values())),
        ("gain_rl_in_sim", [sr[k] - w[k] for k in w]),
        ("sim_minus_real", [sr[k] - rr[k] for k in w]),
    ):
        m = statistics.fmean(values)
        half = 1.959964 * statistics.stdev(values) / math.sqrt(len(values))
        assert t["ci95"][key] == pytest.approx([m - half, m + half], abs=2e-4), key
    assert t["gain"]["rl_in_sim"] == pytest.approx(_wins(sim_real) - _wins(warm), abs=1e-4)
    assert t["sim_minus_real"] == pytest.approx(_wins(sim_real) - _wins(real_real), abs=1e-4)


def test_rerun_skips_finished_stages_resumes_an_interrupted_one_and_report_cli(demo):
    out, _ = demo
    # train-sim "killed" after its last checkpoint, before it recorded the stage as done: the
    # rerun runs that stage again, which resumes from the checkpoint instead of retraining.
    (out / "sim" / "stage.json").unlink()
    proc = _demo(out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("done: skipped") == 4
    assert "simloop train-sim: resuming at step" in proc.stdout
    assert "nothing to train" in proc.stdout
    assert (out / "sim" / "stage.json").exists()
    (out / "report.html").unlink()
    env = user_env()
    proc = subprocess.run(
        [sys.executable, "-m", "launch", "report", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0 and (out / "report.html").exists()


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def test_report_renders_in_headless_chromium(demo, tmp_path):
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium on PATH (make test installs Debian's `chromium` as root)")
    out, _ = demo
    s = json.loads((out / "summary.json").read_text())
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=2000",
           "--dump-dom", (out / "report.html").as_uri()]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout
    for text in (
        "Pipeline",
        "The deciding experiment",
        "Real-shell success (95% intervals)",
        "RL: batch reward where it trains",
        "The simulator",
        "By operation",
        "Agent success: real shell vs simulator",
        "Simulator fidelity (arm c)",
        "By context length",
        "Training curves",
        "Active episodes per turn",
        "Sample episodes side by side",
        "Held-out success before and after RL",
        "--quick run",
    ):
        assert text in dom, text
    assert dom.count("<svg") >= 7
    gap = s["transfer_gap"]
    assert f"before RL {gap['before']:.3f}, after RL {gap['after']:.3f}" in dom
    fid = s["fidelity"]["exact_masked"]
    assert f"{fid:.3f}" in dom
    # Nothing was fetched: every resource is inline.
    assert "http://" not in dom.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_gating_experiment_quick_from_the_demos_collection_and_warm_start(demo, tmp_path):
    """`simloop demo --experiment gating --quick`, as a user reruns it next to a finished demo:
    its collection, warm start and real-only arm are the demo's (finished stages are skipped),
    the rest runs: the weak simulator (a few train-sim steps on the collection with `upper`
    misreported), its arm (c), and RL gated (co-training after every step, published to a real
    simulator server).

    The gated arm's agent is served by the vllm backend (`serve.backends: {agent: vllm}`, the
    fake vLLM of `serving.vllm.fake_server` through `vllm.command`): the job starts it from the
    chip plan, publishes each policy version to it with `VllmPublisher` (Orbax export -> worker
    extension over `/collective_rpc`), and the next rollout's tokens carry the version
    published before them; the co-trained simulator versions reach the JAX simulator server
    with `EnginePublisher`. So one run covers both publishers, and the vLLM backend end to end
    (until 2026-12-07 a separate test ran a second gated train-agent for it)."""
    out, _ = demo
    run = tmp_path / "gating"
    shutil.copytree(out / "collect", run / "collect")
    warm = run / "warm" / "weights" / "warm_start"
    shutil.copytree(out / "agent" / "weights" / "warm_start", warm)
    (run / "warm" / "stage.json").write_text(json.dumps({"wall_s": 1.0, "copied": True}))
    # The demo's control arm is the experiment's real-only arm (RL in the real shell from the
    # same warm start, evaluated there), and its RL in the simulator stands in for the ungated
    # arm (a stronger simulator than the weak one, which this test does not judge).
    shutil.copytree(out / "agent_real", run / "real_only")
    shutil.copytree(out / "agent", run / "ungated")
    # Three RL steps: a round trains during one version and serves from the next boundary, so
    # one co-trained version (begun after step 1) serves step 3.
    port = free_port()
    fake = f"[{sys.executable}, -m, serving.vllm.fake_server, serve]"
    cmd = [sys.executable, "-m", "launch", "demo", "--experiment", "gating", "--quick",
           "--out", str(run), "--train_agent.steps", "3",
           "--orchestrator.gate.cotrain_every", "1", "--orchestrator.gate.cotrain_steps", "2",
           "--orchestrator.gate.threshold", "0.5",
           "--serve.backends", "{agent: vllm}", "--vllm.command", fake,
           "--vllm.start_stagger_s", "0", "--vllm.max_model_len", "2048",
           "--chips.http_port_base", str(port)]  # fmt: skip
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env=user_env(cheap_compile=True, full_servers=True),
        timeout=900,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("done: skipped") == 4 and "gating" in proc.stdout
    g = json.loads((run / "summary.json").read_text())["gating"]
    for arm, steps in (("real_only", 2), ("ungated", 2), ("gated", 3)):
        assert 0 <= g[arm]["real"] <= 1 and g[arm]["episodes"] == steps * 16, (arm, g[arm])
    assert g["ungated"]["real_episodes"] == 0 and g["real_only"]["real_episodes"] == 32
    assert 16 <= g["gated"]["real_episodes"] <= 48  # the first version: nothing measured yet
    kinds = set(g["gated"]["sim_share_by_family"])
    assert kinds and kinds <= {"reverse", "upper", "sort", "count"}
    # Each policy version left a router record; one co-training round published version 1 to
    # the simulator server (its log says it loaded it), and the router moved to it.
    gates = [r for r in g["gate_history"] if r["stage"] == "gate"]
    rounds = [r for r in g["gate_history"] if r["stage"] == "sim_cotrain_round"]
    assert [r["policy_version"] for r in gates] == [1, 2, 3] and len(rounds) == 1
    assert rounds[0]["sim_version"] == 1 and rounds[0]["real"] > 0
    assert rounds[0]["step"] == 2 and rounds[0]["served_from"] == 3
    assert [r["sim_version"] for r in gates] == [0, 0, 1]
    log = (run / "gated" / "logs" / "simulator-server.log").read_text()
    assert re.search(r"serving weights version 1 from \S*/weights/sim/v0001 ", log), log[-2000:]
    shadows = load_trajectories(list((run / "gated" / "trajectories").glob("shadow-*.jsonl")))
    assert shadows and all(t.meta.get("shadow") for t in shadows)
    assert {t.meta["sim_version"] for t in shadows} == {0, 1}  # re-measured on version 1
    weak = g["weak_simulator"]
    assert weak["wrong_ops"] == ["upper"] and weak["steps"] == 8 and weak["misreported_turns"] > 0
    assert set(weak["arm_c_exact_by_op"]) <= {"reverse", "upper", "sort", "count"}
    misreported = load_trajectories([run / "sim" / "data" / "trajectories"])
    assert len(misreported) == len(load_trajectories([run / "collect" / "trajectories"]))
    assert "the gating experiment" in (run / "report.html").read_text()

    # The vllm backend: the agent's server was the fake vLLM, stopped when the job ended.
    gated = run / "gated"
    assert "1 vLLM agent server(s)" in proc.stdout
    (agent_log,) = (gated / "logs").glob(f"vllm-agent_serve-{port}.log")
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0, "a vLLM server outlived its job"
    # Policy versions 2 to 4 were published to it (the warm start was version 1), each one
    # reloading its engine from the workers' parameters ...
    records = [json.loads(x) for x in (gated / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r.get("stage") == "rl" and "step" in r]
    assert [r["version"] for r in rl] == [2, 3, 4]
    assert all(r["publish_load_s"] > 0 for r in rl)
    reloads = agent_log.read_text().count("engine reloaded from the workers' parameters")
    assert reloads == 1 + len(rl), reloads  # the start version, then one per step
    # ... and every generated token carries the version served when it was sampled: in
    # synchronous RL, the version its episode was admitted at (exact), so the first batch's
    # tokens carry version 1 and the next batch's version 2.
    versions = set()
    for f in (gated / "trajectories").glob("rl-*.jsonl"):
        for line in f.read_text().splitlines():
            t = json.loads(line)
            mine = {v for v, m in zip(t["policy_version"], t["loss_mask"], strict=True) if m}
            assert mine <= {t["admitted_version"]}, (mine, t["admitted_version"])
            versions |= mine
    assert versions == {1, 2, 3}, versions
    # TensorBoard has each operation's live fidelity bound and routing at every policy version
    # that saw it, and the simulator version the router was on.
    scalars = read_scalars(gated / "tensorboard")
    ops = {op for r in gates for op in r["units"]}
    assert ops, gates
    for op in ops:
        seen = [r["policy_version"] for r in gates if op in r["units"]]
        assert [s for s, _ in scalars[f"gate/units/{op}/lower"]] == seen, (op, sorted(scalars))
        assert [s for s, _ in scalars[f"gate/units/{op}/routed_real"]] == seen
    assert [v for _, v in scalars["gate/sim_version"]] == [0, 0, 1]
