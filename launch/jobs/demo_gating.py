"""`simloop demo --experiment gating`: does a fidelity gate make a weak simulator safe to train
in? From one warm-started agent, three RL runs with the same steps and episodes:

    simloop demo --experiment gating --out runs/gating      # ~15 min on 2 cores
    simloop demo --experiment gating --out runs/gating-q --quick   # CI-sized, ~2 min

1. `collect/`   real trajectories (as the thesis demo: the simulator's data)
2. `sim/`       the deliberately weak simulator: `demo.gating_sim_steps` train-sim steps on the
                collection with `demo.gating_wrong_ops` misreported (`sim/data/`: those
                commands shown printing their input), so it is wrong about those operations
                and right about the rest (0 steps: the pretrained simulator as it is)
3. `eval_sim/`  its arm (c) fidelity by operation, on held-out real commands
4. `warm/`      the SFT warm start all three arms start from
5. `real_only/` RL in the real shell
6. `ungated/`   RL in closed loop with the weak simulator
7. `gated/`     `orchestrator.arm: gated` (+ `demo.gating_overrides`): each group goes to the
                simulator only while its operation's live fidelity clears the gate; the real
                episodes are shadow-replayed against the simulator and co-train it

Each arm is evaluated in the real shell on the same held-out tasks and sampling seeds; the
summary's `gating` block (recomputed from the stored episodes) holds each arm's real-shell
success after RL, its real-shell episodes, and the gated arm's simulator share by operation.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from rl.data import rundir

GATING_STAGES = ("collect", "sim", "eval_sim", "warm", "real_only", "ungated", "gated")
ARMS = ("real_only", "ungated", "gated")
MAX_GAP, MAX_REAL_SHARE = 0.03, 0.5


def run_gating(args, out: Path, console) -> dict[str, dict]:
    from launch.jobs import demo

    stages: dict[str, dict] = {}
    dirs = {name: out / name for name in GATING_STAGES}

    def finished(k: int, name: str, text: str) -> dict | None:
        return demo._finished(console, k, name, text, dirs[name], len(GATING_STAGES))

    trajectories = str(dirs["collect"] / rundir.TRAJECTORIES)
    stages["collect"] = finished(1, "collect", "scripted noisy agent in the real shell") or (
        demo._collect(args, dirs["collect"]))  # fmt: skip
    wiring = ["--train_sim.trajectories", json.dumps([trajectories])]
    cap = stages["collect"].get("sim_max_tokens")
    if cap is not None:
        wiring += ["--env.shell.simulated.max_tokens", str(cap)]
    base = demo.stage_config(args, wiring)
    steps, wrong = base.demo.gating_sim_steps, list(base.demo.gating_wrong_ops)
    text = f"a weak simulator: {steps} train-sim steps" + (
        f", on the collection with {' and '.join(wrong)} misreported" if steps and wrong else ""
    )
    stages["sim"] = finished(2, "sim", text) or _weak_sim(
        args, dirs["sim"], wiring, steps, wrong, trajectories)  # fmt: skip
    wiring += ["--simulator.weights", stages["sim"]["weights"]]
    stages["eval_sim"] = finished(3, "eval_sim", "arm (c): the weak simulator's fidelity") or (
        demo._eval_sim(args, dirs["eval_sim"], wiring + [
            "--eval_sim.trajectories", json.dumps([trajectories]),
            "--eval_sim.heldout_tasks", str(dirs["sim"] / rundir.HELDOUT_TASKS)]))  # fmt: skip
    stages["warm"] = finished(4, "warm", "SFT warm start (no RL)") or demo._train_agent(
        args, dirs["warm"], wiring + ["--train_agent.steps", "0"])  # fmt: skip
    warm = str(dirs["warm"] / rundir.WEIGHTS / "warm_start")
    from_warm = wiring + ["--agent.weights", warm, "--train_agent.warm_start.steps", "0",
                          "--train_agent.eval.arms", json.dumps(["real"])]  # fmt: skip
    if base.demo.gating_eval_tasks:
        from_warm += ["--train_agent.eval.tasks", str(base.demo.gating_eval_tasks)]
    if stages["sim"].get("data"):  # co-training replays what the weak simulator learned from
        from_warm += ["--train_sim.trajectories", json.dumps([stages["sim"]["data"]])]
    for k, (name, (flags, text)) in enumerate(arm_flags(base).items(), start=5):
        stages[name] = finished(k, name, text) or demo._train_agent(
            args, dirs[name], from_warm + flags)  # fmt: skip
    return stages


def arm_flags(base) -> dict[str, tuple[list[str], str]]:
    """Each RL arm's overrides (beside the warm start's weights) and what it is."""
    return {
        "real_only": (["--orchestrator.arm", "real"], "RL in the real shell"),
        "ungated": (["--orchestrator.arm", "closed_loop", "--train_agent.eval.before", "false"],
                    "RL in the weak simulator, ungated"),
        "gated": (["--orchestrator.arm", "gated", "--train_agent.eval.before", "false",
                   *base.demo.gating_overrides], "RL gated by live fidelity, co-training"),
    }  # fmt: skip


def _weak_sim(args, path: Path, wiring: list[str], steps: int, wrong: list[str],
              collected: str) -> dict:  # fmt: skip
    """The weak simulator: `steps` train-sim steps, on the collection (`collected`) with the
    `wrong` operations misreported (`envs.textops.misreport`: those commands print their
    input), or (0 steps) the configured simulator weights as they are, with the same held-out
    split train-sim would have written."""
    from launch.jobs import demo

    if steps > 0:
        flags = ["--train_sim.steps", str(steps)]
        made = {}
        if wrong:
            data = path / "data" / rundir.TRAJECTORIES
            made = {"wrong_ops": wrong, "data": str(data.absolute()),
                    "misreported_turns": _misreported(collected, data, wrong)}  # fmt: skip
            flags += ["--train_sim.trajectories", json.dumps([made["data"]])]
        return demo._train_sim(args, path, wiring + flags, made)
    from envs.tasks import is_heldout
    from launch.config import write_config
    from rl.data.trajectory import load_trajectories

    cfg = demo.stage_config(args, wiring)
    if not cfg.simulator.weights:
        from launch.errors import UsageError

        raise UsageError("demo.gating_sim_steps=0 takes the simulator as it is: set "
                         "simulator.weights (the demo config's pretrained one)")  # fmt: skip
    write_config(cfg, path)
    ids = {t.task_id for t in load_trajectories(cfg.train_sim.trajectories)}
    held = sorted(i for i in ids if is_heldout(i, cfg.train_sim.heldout_fraction))
    (path / rundir.HELDOUT_TASKS).write_text(json.dumps(held, indent=1))
    record = {"wall_s": 0.0, "steps": 0, "weights": str(Path(cfg.simulator.weights).absolute()),
              "heldout_tasks": len(held)}  # fmt: skip
    demo._write_stage(path, record)
    return record


def _misreported(collected: str, out: Path, ops: list[str]) -> int:
    """Write the collection under `out` with `ops` misreported; how many turns changed."""
    import dataclasses

    from envs.textops import INPUT_FILE, misreport
    from rl.data.trajectory import load_trajectories, write_jsonl

    rewritten, changed = [], 0
    for t in load_trajectories([collected]):
        turns, n = misreport(t.turns, t.setup_files.get(INPUT_FILE, "").strip(), ops)
        if n:  # the sampled token view no longer matches the text: the episode keeps none
            turns = [dataclasses.replace(turn, token_span=None) for turn in turns]
            t = dataclasses.replace(t, token_ids=[], loss_mask=[], behavior_logprobs=None,
                                    policy_version=None, source="rendered")  # fmt: skip
        rewritten.append(dataclasses.replace(t, turns=turns))
        changed += n
    if not changed:
        from launch.errors import JobError

        raise JobError(f"demo.gating_wrong_ops={ops}: no collected command ran them (nothing "
                       "to misreport)")  # fmt: skip
    write_jsonl(out / "misreported-00000.jsonl", rewritten)
    return changed


def _real_episodes(trajs) -> Counter:
    """RL episodes by arm (an episode cut short by the run's shutdown was never trained on)."""
    return Counter(t.arm for t in trajs if not (t.status == "aborted" and "shutting down" in
                                                 (t.reason or "")))  # fmt: skip


def gating_summary(out: Path) -> dict[str, Any]:
    """`summary.json["gating"]`, from the stored episodes of each arm."""
    from launch.report.thesis import episodes, mean_ci, paired, per_task, success_rate

    evals, got = {}, {}
    for arm in ARMS:
        after = episodes(out / arm, "eval-after-real")
        if not after:
            return {"missing": f"{arm}'s real-shell evaluation has no stored episodes"}
        evals[arm] = per_task(after)
        rl = episodes(out / arm, "rl")
        by_arm = _real_episodes(rl)
        got[arm] = {"real": round(success_rate(after), 4),
                    "real_episodes": by_arm.get("real", 0),
                    "episodes": sum(by_arm.values())}  # fmt: skip
    units: dict[str, Counter] = defaultdict(Counter)
    for t in episodes(out / "gated", "rl"):
        units[t.gate_unit or "?"][t.arm] += 1
    got["gated"]["sim_share_by_family"] = {
        u: round(c["closed_loop"] / sum(c.values()), 4) for u, c in sorted(units.items())
    }
    warm = episodes(out / "real_only", "eval-before-real")
    out_: dict[str, Any] = dict(got)
    if warm:
        out_["warm_start"] = {"real": round(success_rate(warm), 4)}
    gap_gated, ci_gated = paired(evals["gated"], evals["real_only"])
    gap_ungated, ci_ungated = paired(evals["ungated"], evals["real_only"])
    share = got["gated"]["real_episodes"] / max(got["real_only"]["real_episodes"], 1)
    out_.update(
        gated_minus_real_only=round(gap_gated, 4), ungated_minus_real_only=round(gap_ungated, 4),
        gated_real_share=round(share, 4),
        ci95={"gated_minus_real_only": ci_gated, "ungated_minus_real_only": ci_ungated,
              **{arm: mean_ci(list(evals[arm].values()))[1] for arm in ARMS}},
        ci95_method="normal interval over held-out tasks (task success rates; differences "
        "paired by task: same tasks, same seeds)",
        acceptance={
            f"gated_within_{MAX_GAP}_of_real_only": gap_gated >= -MAX_GAP,
            f"gated_real_share_at_most_{MAX_REAL_SHARE}": share <= MAX_REAL_SHARE,
            "ungated_measurably_below_real_only": ci_ungated[1] < 0,
        },
    )  # fmt: skip
    weak = _weak_simulator(out)
    if weak:
        out_["weak_simulator"] = weak
    gate = _gate_history(out / "gated")
    if gate:
        out_["gate_history"] = gate
    return out_


def _weak_simulator(out: Path) -> dict[str, Any]:
    """What the weak simulator is (its stage record) and its arm (c) exact match by task
    operation, on held-out real commands."""
    sim = out / "sim" / rundir.STAGE
    got: dict[str, Any] = {}
    if sim.exists():
        record = json.loads(sim.read_text())
        got = {k: record[k] for k in ("steps", "wrong_ops", "misreported_turns") if k in record}
    fid = out / "eval_sim" / rundir.FIDELITY
    if fid.exists():
        f = json.loads(fid.read_text())
        got["arm_c_exact"] = round(f["pairs"]["exact_masked"], 4)
        got["arm_c_exact_by_op"] = {k: round(v["exact_masked"], 4)
                                    for k, v in sorted(f.get("by_kind", {}).items())}  # fmt: skip
    return got


def _gate_history(run_dir: Path) -> list[dict]:
    """The gated arm's router records (one per policy version) and co-training rounds."""
    if not (run_dir / rundir.METRICS).exists():
        return []
    keep = ("gate", "sim_cotrain_round")
    return [r for r in rundir.read_metrics(run_dir / rundir.METRICS) if r.get("stage") in keep]


def print_gating(console, g: dict, wall: dict) -> None:
    from rich.table import Table

    if "missing" in g:
        console.print(f"simloop demo: the gating experiment is incomplete: {g['missing']}")
        return
    t = Table(title="simloop demo --experiment gating: real-shell success after RL")
    for col in ("arm", "real-shell success (95% CI)", "minus real-only (95% CI)",
                "real-shell episodes", "episodes"):  # fmt: skip
        t.add_column(col, justify="left" if col == "arm" else "right")
    for arm in ARMS:
        lo, hi = g["ci95"][arm]
        diff = "-" if arm == "real_only" else (
            f"{g[f'{arm}_minus_real_only']:+.3f} [{g['ci95'][f'{arm}_minus_real_only'][0]:+.3f}, "
            f"{g['ci95'][f'{arm}_minus_real_only'][1]:+.3f}]")  # fmt: skip
        t.add_row(arm, f"{g[arm]['real']:.3f} [{lo:.3f}, {hi:.3f}]", diff,
                  str(g[arm]["real_episodes"]), str(g[arm]["episodes"]))  # fmt: skip
    console.print(t)
    share = ", ".join(f"{k} {v:.2f}" for k, v in g["gated"]["sim_share_by_family"].items())
    console.print(f"gated: real-shell episodes {g['gated_real_share']:.2f} of real-only's; "
                  f"simulator share by operation: {share}")  # fmt: skip
    weak = g.get("weak_simulator") or {}
    if weak.get("wrong_ops"):
        by_op = ", ".join(f"{k} {v:.2f}" for k, v in weak.get("arm_c_exact_by_op", {}).items())
        wrong = ", ".join(weak["wrong_ops"])
        console.print(f"weak simulator: {weak.get('steps')} train-sim steps, wrong about "
                      f"{wrong}; arm (c) exact by operation: {by_op}")  # fmt: skip
    console.print("acceptance: " + ", ".join(f"{k} {v}" for k, v in g["acceptance"].items()))
    console.print("wall: " + ", ".join(f"{k} {v:.0f} s" for k, v in wall.items() if v is not None))


def timed_stages(stages: dict[str, dict]) -> dict[str, float | None]:
    return {name: stages[name].get("wall_s") for name in GATING_STAGES if name in stages}
