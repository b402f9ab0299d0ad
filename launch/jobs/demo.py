"""`simloop demo`: the whole pipeline (docs/architecture.md §1) on CPU with tiny models, in
minutes.

    simloop demo --out runs/demo                     # configs/demo_cpu.yaml, ~15 min on 2 cores
    simloop demo --config configs/demo_cpu.yaml --out runs/demo --quick   # ~3 min, CI-sized

Stages, each a run directory of its own under `--out`, each the same code as its subcommand
(the table: `launch/jobs/demo_stages.py`, which `--dry-run` plans from too):

1. `collect/`    a scripted, noisy agent in real shells (LocalShell) -> real trajectories
2. `sim/`        simulator SFT on them (tasks split off for evaluation: `heldout_tasks.json`)
3. `eval_sim/`   arm (c): held-out real commands replayed against the simulator -> fidelity
4. `agent/`      SFT warm start, then RL in closed loop with the simulator (agent and simulator
                 servers are separate processes; every policy version is published to the agent
                 server as an Orbax checkpoint), the agent evaluated in the real shell and in the
                 simulator before and after RL
5. `agent_real/` the control arm: RL in the real shell from the same warm start with the same
                 number of episodes, evaluated in the real shell on the same tasks and seeds
6. `trials/`     optional (`demo.trials` K >= 2): the agent on tasks whose operation only a
                 failed attempt's feedback names, K trials per episode, warm start + RL in the
                 real shell; success by trial and the adaptation delta before and after
7. `summary.json` (`thesis`: the deciding experiment, recomputed from the stored episodes)
   and `report.html` at the top of `--out`

`--experiment stateful` runs the same table on the `fileops` family (`demo.stateful_overrides`:
tasks whose later commands read what earlier ones wrote, the workspace-mode simulator), and
summary.json's `stateful` block holds its fidelity acceptance by depth and state distance;
there arm (c) also replays a wider held-out collection (`demo.wide_heldout_episodes`: every
fileops kind, up to 8 turns) in two more stages, `collect_wide` and `eval_sim_wide`, and
`stateful.wide` holds the same acceptance on it.
`--experiment gating` runs the gating experiment's table instead (`launch/jobs/demo_gating.py`
says what it measures). A finished stage leaves `stage.json`; running the same command again
skips finished stages and resumes an interrupted one from its checkpoints.

Dotted overrides on the command line apply to every stage and win over the stage's own, except
`--simulator.weights` and `--agent.weights` (`demo_stages.stage_config`): those name where train-sim
and the warm start begin, and the stages after them run on what those two made.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from launch.config import ConfigError
from launch.config.schema import SimloopConfig
from launch.deploy.chips import cpu_device_flag
from launch.deploy.dry_run import DRY_RUN_OUT, print_processes
from launch.errors import JobError, UsageError
from launch.jobs.demo_stages import (
    Stage,
    gating_stages,
    run_stages,
    stage_config,
    stage_servers,
    thesis_stages,
)
from rl.data import rundir


def _gating(args: argparse.Namespace) -> bool:
    return getattr(args, "experiment", "thesis") == "gating"


def _stateful(args: argparse.Namespace) -> bool:
    return getattr(args, "experiment", "thesis") == "stateful"


def _stages(args: argparse.Namespace, base: SimloopConfig) -> list[Stage]:
    """The experiment's table, from the demo's config (`stage_config(args, [])`)."""
    return gating_stages(base) if _gating(args) else thesis_stages(base)


def run(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    from rich.console import Console

    args.quick_overrides = list(cfg.demo.quick_overrides) if args.quick else []
    if _stateful(args):  # the thesis table on fileops: the config file, then these, then --quick
        args.quick_overrides = stateful_overrides(cfg, args.config) + args.quick_overrides
    if getattr(args, "dry_run", False):
        return print_processes(args, demo_processes(args, cfg))
    if not args.out:
        raise UsageError("--out DIR is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console()
    began = time.perf_counter()
    from rl.train.loop import TrainingDiverged
    from serving.publisher import PublishError

    gating = _gating(args)
    try:
        base = stage_config(args, [])
        stages = run_stages(args, out, console, _stages(args, base))
    except ConfigError as e:
        raise UsageError(f"config error: {e}") from e
    except (TrainingDiverged, PublishError) as e:  # as train-agent says it: one line, exit 1
        raise JobError(f"{e}; the stage stopped (its last checkpoint is kept)") from e
    if gating:
        from launch.jobs.demo_gating import gating_summary, print_gating

        summary = {
            "experiment": "gating",
            "config": args.config,
            "quick": bool(args.quick),
            "gating": gating_summary(out),
            "stages_wall_s": stage_walls(stages),
            "stages": stages,
        }
    else:
        summary = build_summary(out, stages, quick=bool(args.quick), config=args.config)
        if _stateful(args):
            from launch.report.thesis import stateful_fidelity

            summary["experiment"] = "stateful"
            summary["stateful"] = stateful_fidelity(
                json.loads((out / "eval_sim" / rundir.FIDELITY).read_text())
            )
            if "eval_sim_wide" in stages:  # demo.wide_heldout_episodes: the wider collection
                wide = out / "eval_sim_wide" / rundir.FIDELITY
                summary["stateful"]["wide"] = {
                    **stateful_fidelity(json.loads(wide.read_text())),
                    "episodes": base.demo.wide_heldout_episodes,
                    "overrides": list(base.demo.wide_heldout_overrides),
                }
    summary["wall_s"] = round(time.perf_counter() - began, 1)
    (out / rundir.SUMMARY).write_text(json.dumps(summary, indent=1))
    rundir.MetricsLog(out).write({"stage": "demo", **summary})  # its numbers in TensorBoard too
    from launch.report.page import write_report

    report = write_report(out)
    if gating:
        print_gating(console, summary["gating"], summary["stages_wall_s"])
    else:
        print_summary(console, summary)
        if summary.get("stateful"):
            print_stateful(console, summary["stateful"])
    console.print(f"simloop demo: summary -> {out / rundir.SUMMARY}, report -> {report}")
    return 0


def stateful_overrides(cfg: SimloopConfig, config: str | None) -> list[str]:
    """`demo.stateful_overrides`, with a relative model path in them read as one written in
    the config file is: relative to that file's folder (`pretrained/...` under `configs/`)."""
    over = list(cfg.demo.stateful_overrides)
    folder = Path(config).resolve().parent if config else Path.cwd()
    for i, flag in enumerate(over[:-1]):
        if (
            flag in ("--simulator.weights", "--agent.weights")
            and not Path(over[i + 1]).is_absolute()
        ):
            over[i + 1] = str(folder / over[i + 1])
    return over


def demo_processes(args: argparse.Namespace, cfg: SimloopConfig) -> list[tuple[str, Any]]:
    """`(stage, process)` for every process `simloop demo` starts: the servers of the stages
    that need them, one stage after another (`demo_stages.stage_servers`, from the same table
    the run follows), then the demo's own process (it runs every trainer and the orchestrator,
    on the plan's devices). Stages that start nothing (collect, train-sim) list nothing."""
    from launch.deploy.processes import PlannedProcess

    out = Path(args.out or DRY_RUN_OUT)
    procs = stage_servers(args, _stages(args, stage_config(args, [])), out)
    command = [
        sys.executable,
        "-m",
        "launch",
        "demo",
        "--config",
        str(args.config),
        "--out",
        str(out),
        *(["--quick"] if args.quick else []),
        *(["--experiment", args.experiment] if _gating(args) or _stateful(args) else []),
        *args.overrides,
    ]
    env = {}
    flag = cpu_device_flag(cfg, {})
    if flag is not None:
        env["XLA_FLAGS"] = flag
    return procs + [("demo", PlannedProcess("demo", 0, "localhost", command, env, None, "job"))]


def stage_walls(stages: dict[str, dict]) -> dict[str, float | None]:
    """Each stage's wall time, in the order they ran."""
    return {name: record.get("wall_s") for name, record in stages.items()}


# ----- summary.json -----------------------------------------------------------------------------


def build_summary(out: Path, stages: dict[str, dict], *, quick: bool, config: str | None) -> dict:
    """The demo's numbers, all read back from what the stages wrote (`thesis` from the stored
    episodes themselves: `launch.report.thesis`)."""
    from launch.report.thesis import thesis

    fidelity = json.loads((out / "eval_sim" / rundir.FIDELITY).read_text())
    evals = rundir.read_evals(out / "agent")
    pairs, hygiene = fidelity["pairs"], fidelity["hygiene"]
    success = {
        arm: {
            label: evals.get(label, {}).get(arm, {}).get("success_rate")
            for label in ("before", "after")
        }
        for arm in ("real", "closed_loop")
    }
    kinds = sorted({k for by_arm in evals.values() for r in by_arm.values() for k in r["by_kind"]})
    by_kind = {
        kind: {
            arm: {
                label: evals.get(label, {})
                .get(arm, {})
                .get("by_kind", {})
                .get(kind, {})
                .get("success_rate")
                for label in ("before", "after")
            }
            for arm in ("real", "closed_loop")
        }
        for kind in kinds
    }
    gap = {}
    for label in ("before", "after"):
        sim, real = success["closed_loop"][label], success["real"][label]
        gap[label] = None if sim is None or real is None else round(sim - real, 4)
    rl = stages.get("agent", {}).get("rl", {})
    return {
        "config": config,
        "quick": quick,
        "fidelity": {
            "observations": pairs.get("count", 0),
            "exact": pairs.get("exact"),
            "exact_masked": pairs.get("exact_masked"),
            "exit_code_agreement": pairs.get("exit_code_agreement"),
            "similarity": pairs.get("similarity"),
            "cap_hit": hygiene.get("cap_hit"),
            "think_leak": hygiene.get("think_leak"),
            "repetition": hygiene.get("repetition"),
            "empty": hygiene.get("empty"),
            "malformed": hygiene.get("malformed"),
            "by_context": {
                k: {"observations": v.get("count", 0), "exact_masked": v.get("exact_masked")}
                for k, v in fidelity.get("by_context", {}).items()
            },
            "by_kind": {
                k: {
                    "observations": v.get("count", 0),
                    "exact_masked": v.get("exact_masked"),
                    "exit_code_agreement": v.get("exit_code_agreement"),
                }
                for k, v in fidelity.get("by_kind", {}).items()
            },
            "simulator": stages.get("sim", {}).get("simulator"),
        },
        "thesis": thesis(out),
        "agent_success": success,
        "agent_success_by_kind": by_kind,
        "transfer_gap": gap,
        "transfer_gap_definition": "success in the simulator minus success in the real shell",
        "rl": {
            "arm": stages.get("agent", {}).get("rl_arm"),
            "steps": rl.get("steps"),
            "reward_first": rl.get("reward_first"),
            "reward_last": rl.get("reward_last"),
        },
        "trials": _trials_summary(out, stages),
        "stages_wall_s": stage_walls(stages),
        "stages": stages,
    }


def _trials_summary(out: Path, stages: dict[str, dict]) -> dict | None:
    """The optional multi-trial stage, from its eval.json: success by trial and the adaptation
    delta before and after RL (None without the stage)."""
    if "trials" not in stages:
        return None
    evals = rundir.read_evals(out / "trials")
    got = {
        label: evals.get(label, {}).get("real", {}).get("trials") or {}
        for label in ("before", "after")
    }
    return {
        "trials": got["after"].get("trials") or got["before"].get("trials"),
        **{
            label: {k: t.get(k) for k in ("success_at", "adaptation_delta", "turns_per_trial")}
            for label, t in got.items()
        },
    }


def _fmt(v: Any, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def print_summary(console, s: dict) -> None:
    from rich.table import Table

    f = s["fidelity"]
    t = Table(title="simloop demo: summary")
    t.add_column("")
    t.add_column("value", justify="right")
    t.add_row("simulator: exact match (masked)", _fmt(f["exact_masked"]))
    t.add_row("simulator: return-code agreement", _fmt(f["exit_code_agreement"]))
    t.add_row(
        "simulator: cap hit / think leak / repetition",
        " / ".join(_fmt(f[k]) for k in ("cap_hit", "think_leak", "repetition")),
    )
    for arm, label in (("real", "real shell"), ("closed_loop", "simulator")):
        a = s["agent_success"][arm]
        t.add_row(
            f"agent success, {label}: before -> after RL",
            f"{_fmt(a['before'])} -> {_fmt(a['after'])}",
        )
    g = s["transfer_gap"]
    t.add_row(
        "transfer gap (sim - real): before / after", f"{_fmt(g['before'])} / {_fmt(g['after'])}"
    )
    t.add_row("RL steps (arm)", f"{_fmt(s['rl']['steps'])} ({s['rl']['arm']})")
    th = s.get("thesis") or {}
    if "ci95" in th:
        ci = th["ci95"]
        for name, key in (
            ("warm start", "warm_start"),
            ("RL in the simulator", "rl_in_sim"),
            ("RL in the real shell", "rl_in_real"),
        ):
            lo, hi = ci[key]
            t.add_row(
                f"real-shell success: {name} (95% CI)",
                f"{_fmt(th[key]['real'])} [{lo:.3f}, {hi:.3f}]",
            )
        lo, hi = ci["gain_rl_in_sim"]
        t.add_row(
            "gain of RL in the simulator (95% CI)",
            f"{_fmt(th['gain']['rl_in_sim'])} [{lo:.3f}, {hi:.3f}]",
        )
        lo, hi = ci["sim_minus_real"]
        t.add_row(
            "RL in sim minus RL in real (95% CI)",
            f"{_fmt(th['sim_minus_real'])} [{lo:.3f}, {hi:.3f}]",
        )
    elif th:
        t.add_row("the deciding experiment", f"incomplete: {th.get('missing')}")
    tr = s.get("trials")
    if tr:
        for label in ("before", "after"):
            at = " / ".join(_fmt(v) for v in tr[label].get("success_at") or [])
            delta = _fmt(tr[label].get("adaptation_delta"))
            t.add_row(
                f"{tr['trials']} trials: success by trial, {label} RL", f"{at} (delta {delta})"
            )
    for name, wall in s["stages_wall_s"].items():
        t.add_row(f"wall: {name}", f"{_fmt(wall, 0)} s")
    t.add_row("wall: total", f"{_fmt(s.get('wall_s'), 0)} s")
    console.print(t)
    fk = f.get("by_kind") or {}
    if fk:
        k = Table(title="simulator fidelity by operation (arm c, held out)")
        for name in ("operation", "observations", "exact (masked)", "return code"):
            k.add_column(name, justify="left" if name == "operation" else "right")
        for kind, v in fk.items():
            k.add_row(
                kind,
                str(v["observations"]),
                _fmt(v["exact_masked"]),
                _fmt(v["exit_code_agreement"]),
            )
        console.print(k)
    by_kind = s.get("agent_success_by_kind") or {}
    if by_kind:
        k = Table(title="agent success by operation: before -> after RL")
        for name, justify in (
            ("operation", "left"),
            ("real shell", "right"),
            ("simulator", "right"),
        ):
            k.add_column(name, justify=justify)
        for kind, arms in by_kind.items():
            k.add_row(
                kind,
                *(
                    f"{_fmt(arms[a]['before'])} -> {_fmt(arms[a]['after'])}"
                    for a in ("real", "closed_loop")
                ),
            )
        console.print(k)


def print_stateful(console, st: dict) -> None:
    """The stateful experiment's fidelity acceptance (`launch.report.thesis.stateful_fidelity`)."""
    from rich.table import Table

    from launch.report.thesis import stateful_rows

    blocks = [("held-out episodes of the experiment's tasks", "", st)]
    if st.get("wide"):
        blocks.append(("the wider held-out collection", " (wider collection)", st["wide"]))
    for what, tag, block in blocks:
        t = Table(title=f"stateful experiment: simulator fidelity (arm c, {what})")
        for name in ("", "observations", "exact (masked)", "goal"):
            t.add_column(name, justify="left" if not name else "right")
        for name, n, exact, goal in stateful_rows(block):
            t.add_row(name, _fmt(n), _fmt(exact), goal)
        console.print(t)
        console.print(
            f"stateful acceptance{tag}: "
            + ", ".join(
                f"{k.replace('_', ' ')} {'yes' if v else 'NO'}"
                for k, v in block["acceptance"].items()
            )
        )
