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
The stages are rows of `launch/jobs/demo_stages.py`'s table (`gating_stages`), which
`simloop demo` runs and dry-runs; this module reads what they stored.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from launch.jobs.demo_stages import ARMS
from rl.data import rundir

MAX_GAP, MAX_REAL_SHARE = 0.03, 0.5


def _real_episodes(trajs) -> Counter:
    """RL episodes by arm (an episode cut short by the run's shutdown was never trained on)."""
    return Counter(
        t.arm for t in trajs if not (t.status == "aborted" and "shutting down" in (t.reason or ""))
    )


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
        got[arm] = {
            "real": round(success_rate(after), 4),
            "real_episodes": by_arm.get("real", 0),
            "episodes": sum(by_arm.values()),
        }
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
        gated_minus_real_only=round(gap_gated, 4),
        ungated_minus_real_only=round(gap_ungated, 4),
        gated_real_share=round(share, 4),
        ci95={
            "gated_minus_real_only": ci_gated,
            "ungated_minus_real_only": ci_ungated,
            **{arm: mean_ci(list(evals[arm].values()))[1] for arm in ARMS},
        },
        ci95_method="normal interval over held-out tasks (task success rates; differences "
        "paired by task: same tasks, same seeds)",
        acceptance={
            f"gated_within_{MAX_GAP}_of_real_only": gap_gated >= -MAX_GAP,
            f"gated_real_share_at_most_{MAX_REAL_SHARE}": share <= MAX_REAL_SHARE,
            "ungated_measurably_below_real_only": ci_ungated[1] < 0,
        },
    )
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
        got["arm_c_exact_by_op"] = {
            k: round(v["exact_masked"], 4) for k, v in sorted(f.get("by_kind", {}).items())
        }
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
    for col in (
        "arm",
        "real-shell success (95% CI)",
        "minus real-only (95% CI)",
        "real-shell episodes",
        "episodes",
    ):
        t.add_column(col, justify="left" if col == "arm" else "right")
    for arm in ARMS:
        lo, hi = g["ci95"][arm]
        diff = (
            "-"
            if arm == "real_only"
            else (
                f"{g[f'{arm}_minus_real_only']:+.3f} "
                f"[{g['ci95'][f'{arm}_minus_real_only'][0]:+.3f}, "
                f"{g['ci95'][f'{arm}_minus_real_only'][1]:+.3f}]"
            )
        )
        t.add_row(
            arm,
            f"{g[arm]['real']:.3f} [{lo:.3f}, {hi:.3f}]",
            diff,
            str(g[arm]["real_episodes"]),
            str(g[arm]["episodes"]),
        )
    console.print(t)
    share = ", ".join(f"{k} {v:.2f}" for k, v in g["gated"]["sim_share_by_family"].items())
    console.print(
        f"gated: real-shell episodes {g['gated_real_share']:.2f} of real-only's; "
        f"simulator share by operation: {share}"
    )
    weak = g.get("weak_simulator") or {}
    if weak.get("wrong_ops"):
        by_op = ", ".join(f"{k} {v:.2f}" for k, v in weak.get("arm_c_exact_by_op", {}).items())
        wrong = ", ".join(weak["wrong_ops"])
        console.print(
            f"weak simulator: {weak.get('steps')} train-sim steps, wrong about "
            f"{wrong}; arm (c) exact by operation: {by_op}"
        )
    console.print("acceptance: " + ", ".join(f"{k} {v}" for k, v in g["acceptance"].items()))
    console.print("wall: " + ", ".join(f"{k} {v:.0f} s" for k, v in wall.items() if v is not None))
