"""The deciding experiment, recomputed from the stored episodes of a demo run.

From one warm-started agent, RL runs with the same number of episodes (a) in closed loop with
the simulator (`<run>/agent`) and (b) in the real shell (`<run>/agent_real`); the warm start
and both results are evaluated in the real shell on the same held-out tasks with the same
sampling seeds. Everything here is read from `trajectories/` (the episodes themselves), not
from the jobs' own summaries, so a reader can check the numbers against the data.

Intervals are 95% normal intervals over tasks: the episodes of one task (its samples) are
not independent, so the unit is the task's success rate; a difference between two policies
is paired by task (same tasks, same seeds).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rl.data import rundir
from rl.data.outcome import unshaped_reward

Z95 = 1.959963984540054
SIM_RUN, REAL_RUN = "agent", "agent_real"


def episodes(run_dir: Path, prefix: str) -> list:
    """Every trajectory in `<run_dir>/trajectories/<prefix>-*.jsonl` (all shards)."""
    from rl.data.trajectory import load_trajectories

    shards = sorted((Path(run_dir) / rundir.TRAJECTORIES).glob(f"{prefix}-*.jsonl"))
    return load_trajectories(shards) if shards else []


def per_task(trajs: Sequence) -> dict[str, float]:
    """Task id -> its episodes' success rate (task reward >= 1, shaping aside; a missing
    reward is a failure)."""
    wins: dict[str, list[float]] = defaultdict(list)
    for t in trajs:
        wins[t.task_id].append(1.0 if (unshaped_reward(t) or 0.0) >= 1.0 else 0.0)
    return {k: sum(v) / len(v) for k, v in wins.items()}


def mean_ci(values: Sequence[float]) -> tuple[float, list[float]]:
    """(mean, [low, high]): a 95% normal interval for the mean of `values`."""
    m = statistics.fmean(values)
    half = Z95 * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return m, [round(m - half, 4), round(m + half, 4)]


def paired(a: dict[str, float], b: dict[str, float]) -> tuple[float, list[float]]:
    """Mean and 95% interval of a - b over the tasks both measured."""
    common = sorted(set(a) & set(b))
    if not common:
        raise ValueError("the two evaluations share no task: they cannot be paired")
    return mean_ci([a[k] - b[k] for k in common])


def success_rate(trajs: Sequence) -> float:
    """Share of `trajs` that succeeded (task reward >= 1, shaping aside; a missing reward is
    a failure)."""
    return sum(1.0 for t in trajs if (unshaped_reward(t) or 0.0) >= 1.0) / len(trajs)


def thesis(run_dir: str | Path, *, min_gain: float = 0.10, max_gap: float = 0.05) -> dict[str, Any]:
    """The deciding experiment's numbers (`summary.json["thesis"]`) from a demo run directory,
    or `{"missing": reason}` when a part of it was not run."""
    run_dir = Path(run_dir)
    sim_dir, real_dir = run_dir / SIM_RUN, run_dir / REAL_RUN
    warm = episodes(sim_dir, "eval-before-real")
    sim_real = episodes(sim_dir, "eval-after-real")
    sim_sim = episodes(sim_dir, "eval-after-closed_loop")
    real_real = episodes(real_dir, "eval-after-real")
    for name, got in (
        ("the warm start's real-shell evaluation", warm),
        ("RL-in-sim's real-shell evaluation", sim_real),
        ("RL-in-real's real-shell evaluation", real_real),
    ):
        if not got:
            return {"missing": f"{name} has no stored episodes"}
    w, s, r = per_task(warm), per_task(sim_real), per_task(real_real)
    gain_sim, ci_gain_sim = paired(s, w)
    gain_real, ci_gain_real = paired(r, w)
    gap, ci_gap = paired(s, r)
    out: dict[str, Any] = {
        "warm_start": {"real": round(success_rate(warm), 4)},
        "rl_in_sim": {
            "real": round(success_rate(sim_real), 4),
            "sim": round(success_rate(sim_sim), 4) if sim_sim else None,
            "episodes": len(episodes(sim_dir, "rl")),
        },
        "rl_in_real": {
            "real": round(success_rate(real_real), 4),
            "episodes": len(episodes(real_dir, "rl")),
        },
        "eval_episodes": min(len(warm), len(sim_real), len(real_real)),
        "eval_tasks": len(w),
        "gain": {"rl_in_sim": round(gain_sim, 4), "rl_in_real": round(gain_real, 4)},
        "sim_minus_real": round(gap, 4),
        "ci95": {
            "warm_start": mean_ci(list(w.values()))[1],
            "rl_in_sim": mean_ci(list(s.values()))[1],
            "rl_in_real": mean_ci(list(r.values()))[1],
            "gain_rl_in_sim": ci_gain_sim,
            "gain_rl_in_real": ci_gain_real,
            "sim_minus_real": ci_gap,
        },
        "ci95_method": "normal interval over held-out tasks (task success rates; differences "
        "paired by task)",
    }
    out["acceptance"] = {
        f"rl_in_sim_gain_at_least_{min_gain}": gain_sim >= min_gain,
        f"rl_in_sim_at_most_{max_gap}_below_rl_in_real": gap >= -max_gap,
    }
    return out


def stateful_fidelity(
    fidelity: dict[str, Any],
    *,
    min_exact: float = 0.90,
    min_depth: float = 0.85,
    min_exit_code: float = 0.99,
    max_depth: int = 8,
) -> dict[str, Any]:
    """The stateful experiment's simulator acceptance from eval-sim's `fidelity.json`: exact
    (masked) overall and at every depth bucket up to `max_depth` turns, return-code agreement,
    and the pairs at state distance >= 3 (reported; their goal is `min_depth` too). A goal
    with nothing to measure does not pass: the depth goal needs observations at every depth
    0 .. `max_depth` - 1 (`depths_unmeasured` lists those without), the state-distance goal at
    least one pair."""
    pairs = fidelity.get("pairs", {})
    depth, measured = {}, set()
    for name, v in fidelity.get("by_depth", {}).items():
        low, _, high = name.rstrip("+").partition("-")
        if low.isdigit() and int(low) < max_depth:
            depth[name] = {"observations": v.get("count", 0), "exact_masked": v.get("exact_masked")}
            if v.get("count", 0) > 0:
                top = int(high) if high.isdigit() else max_depth
                measured.update(range(int(low), min(top, max_depth)))
    unmeasured = [d for d in range(max_depth) if d not in measured]
    far = fidelity.get("state_distance_3plus", {})
    far_row = {"observations": far.get("count", 0), "exact_masked": far.get("exact_masked")}

    def meets(v: Any, goal: float) -> bool:
        return isinstance(v, int | float) and v >= goal

    return {
        "observations": pairs.get("count", 0),
        "exact_masked": pairs.get("exact_masked"),
        "exit_code_agreement": pairs.get("exit_code_agreement"),
        "by_depth": depth,
        "depths_unmeasured": unmeasured,
        "state_dependent": fidelity.get("state_dependent"),
        "state_distance_3plus": far_row,
        # workspace mode: how well the simulator's own files track the real ones (reported)
        "workspace": fidelity.get("workspace"),
        "acceptance": {
            f"exact_at_least_{min_exact}": meets(pairs.get("exact_masked"), min_exact),
            f"exact_at_least_{min_depth}_at_every_depth_to_{max_depth}": not unmeasured
            and all(meets(v["exact_masked"], min_depth) for v in depth.values()),
            f"return_codes_at_least_{min_exit_code}": meets(
                pairs.get("exit_code_agreement"), min_exit_code
            ),
            f"state_distance_3plus_at_least_{min_depth}": far_row["observations"] > 0
            and meets(far_row["exact_masked"], min_depth),
        },
    }


def stateful_rows(st: dict[str, Any]) -> list[list[Any]]:
    """The `stateful_fidelity` block as table rows (what, observations, exact (masked), goal),
    for the console and the report alike."""
    rows = [
        ["overall", st["observations"], st["exact_masked"], ">= 0.90"],
        ["return codes", "", st["exit_code_agreement"], ">= 0.99"],
    ]
    for depth, v in st["by_depth"].items():
        rows.append([f"depth {depth}", v["observations"], v["exact_masked"], ">= 0.85"])
    unmeasured = st.get("depths_unmeasured") or []
    if unmeasured:  # a depth goal with nothing measured there: not passed, and said why
        depths = ", ".join(str(d) for d in unmeasured)
        rows.append([f"depth {depths}", 0, None, ">= 0.85 (nothing to measure)"])
    far = st["state_distance_3plus"]
    rows.append(["state distance >= 3", far["observations"], far["exact_masked"], ">= 0.85"])
    ws = st.get("workspace") or {}
    if ws.get("turns"):
        rows += [
            ["its files right after the command", ws["turns"], ws["state_exact"], "reported"],
            ["writes from right files left right", ws["writes"], ws["write_exact"], "reported"],
        ]
    return rows
