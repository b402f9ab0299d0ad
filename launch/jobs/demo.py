"""`simloop demo`: the whole pipeline (docs/architecture.md §1) on CPU with tiny models, in
minutes.

    simloop demo --out runs/demo                     # configs/demo_cpu.yaml, ~15 min on 2 cores
    simloop demo --config configs/demo_cpu.yaml --out runs/demo --quick   # ~3 min, CI-sized

Stages, each a run directory of its own under `--out`, each the same code as its subcommand:

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

A finished stage leaves `stage.json`; running the same command again skips finished stages and
resumes an interrupted one from its checkpoints.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from launch.config import ConfigError, load_config, write_config
from launch.config.schema import SimloopConfig
from launch.deploy.chips import cpu_device_flag
from launch.deploy.dry_run import print_processes
from launch.errors import JobError, UsageError
from rl.data import rundir

STAGES = ("collect", "sim", "eval_sim", "agent", "agent_real", "trials")


def stage_config(args: argparse.Namespace, stage_overrides: list[str]) -> SimloopConfig:
    """The config of one stage: the file, `--quick`'s overrides, the stage's wiring (paths
    from earlier stages), then the user's overrides (which win)."""
    return load_config(SimloopConfig, args.config,
                       args.quick_overrides + stage_overrides + args.overrides)  # fmt: skip


def _read_stage(path: Path) -> dict | None:
    f = path / rundir.STAGE
    return json.loads(f.read_text()) if f.exists() else None


def _write_stage(path: Path, record: dict) -> None:
    (path / rundir.STAGE).write_text(json.dumps(record, indent=1))


def _finished(console, k: int, name: str, text: str, path: Path,
              total: int = len(STAGES)) -> dict | None:  # fmt: skip
    """Announce stage `k` of `total`; its `stage.json` record when it already finished (then
    skipped)."""
    console.rule(f"[bold]{k}/{total} {name}[/]: {text}")
    record = _read_stage(path)
    if record is not None:
        console.print(f"simloop demo: {name} done: skipped (delete {path} to redo it)")
    return record


def run(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    from rich.console import Console

    args.quick_overrides = list(cfg.demo.quick_overrides) if args.quick else []
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

    gating = getattr(args, "experiment", "thesis") == "gating"
    try:
        if gating:
            from launch.jobs.demo_gating import run_gating

            stages = run_gating(args, out, console)
        else:
            stages = _run_stages(args, out, console)
    except ConfigError as e:
        raise UsageError(f"config error: {e}") from e
    except (TrainingDiverged, PublishError) as e:  # as train-agent says it: one line, exit 1
        raise JobError(f"{e}; the stage stopped (its last checkpoint is kept)") from e
    if gating:
        from launch.jobs.demo_gating import gating_summary, print_gating, timed_stages

        summary = {"experiment": "gating", "config": args.config, "quick": bool(args.quick),
                   "gating": gating_summary(out), "stages_wall_s": timed_stages(stages),
                   "stages": stages}  # fmt: skip
    else:
        summary = build_summary(out, stages, quick=bool(args.quick), config=args.config)
    summary["wall_s"] = round(time.perf_counter() - began, 1)
    (out / rundir.SUMMARY).write_text(json.dumps(summary, indent=1))
    rundir.MetricsLog(out).write({"stage": "demo", **summary})  # its numbers in TensorBoard too
    from launch.report.page import write_report

    report = write_report(out)
    if gating:
        print_gating(console, summary["gating"], summary["stages_wall_s"])
    else:
        print_summary(console, summary)
    console.print(f"simloop demo: summary -> {out / rundir.SUMMARY}, report -> {report}")
    return 0


def demo_processes(args: argparse.Namespace, cfg: SimloopConfig) -> list[tuple[str, Any]]:
    """`(stage, process)` for every process `simloop demo` starts: the servers of the stages
    that need them, one stage after another, then the demo's own process (it runs every
    trainer and the orchestrator, on the plan's devices). Stages that start nothing (collect,
    train-sim) list nothing."""
    from launch.deploy.dry_run import DRY_RUN_OUT
    from launch.deploy.processes import PlannedProcess, job_processes
    from launch.jobs.train_agent import _publishes, _roles

    out = Path(args.out or DRY_RUN_OUT)
    base = stage_config(args, [])
    agent = stage_config(
        args,
        [
            "--orchestrator.arm",
            base.demo.rl_arm,
            "--train_agent.eval.arms",
            json.dumps(list(base.demo.eval_arms)),
        ],
    )
    stages = [("eval_sim", "eval-sim", base, ["simulator"]),
              ("agent", "train-agent", agent, _roles(agent))]  # fmt: skip
    if getattr(args, "experiment", "thesis") == "gating":
        from launch.jobs.demo_gating import ARMS, arm_flags

        stages = [("eval_sim", "eval-sim", base, ["simulator"])]
        for arm in ARMS:
            c = stage_config(args, arm_flags(base)[arm][0] + ["--train_agent.eval.arms",
                                                                json.dumps(["real"])])  # fmt: skip
            stages.append((arm, "train-agent", c, _roles(c)))
    elif base.demo.real_rl:
        real = stage_config(
            args, ["--orchestrator.arm", "real", "--train_agent.eval.arms", json.dumps(["real"])]
        )
        stages.append(("agent_real", "train-agent", real, _roles(real)))
    if base.demo.trials and getattr(args, "experiment", "thesis") != "gating":
        trials = stage_config(args, trials_wiring(base))
        stages.append(("trials", "train-agent", trials, _roles(trials)))
    procs = []
    for stage, job, cfg_, roles in stages:
        planned = job_processes(cfg_, job, roles, out / stage, publishes=_publishes(cfg_))
        procs += [(stage, p) for p in planned if p.kind == "serve"]  # the rest: this process
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
        *(["--experiment", "gating"] if getattr(args, "experiment", "") == "gating" else []),
        *args.overrides,
    ]
    env = {}
    flag = cpu_device_flag(cfg, {})
    if flag is not None:
        env["XLA_FLAGS"] = flag
    return procs + [("demo", PlannedProcess("demo", 0, "localhost", command, env, None, "job"))]


def _run_stages(args: argparse.Namespace, out: Path, console) -> dict[str, dict]:
    stages: dict[str, dict] = {}
    dirs = {name: out / name for name in STAGES}
    collect_dir, sim_dir = dirs["collect"], dirs["sim"]
    trajectories = str(collect_dir / rundir.TRAJECTORIES)
    weights = str(sim_dir / rundir.WEIGHTS / "final")

    # 1. collect
    stages["collect"] = _finished(
        console, 1, "collect", "scripted noisy agent in the real shell", collect_dir
    ) or _collect(args, collect_dir)

    # 2. train-sim (its token cap for later stages follows the real observations)
    sim_wiring = ["--train_sim.trajectories", json.dumps([trajectories])]
    cap = stages["collect"].get("sim_max_tokens")
    if cap is not None:
        sim_wiring += ["--env.shell.simulated.max_tokens", str(cap)]
    stages["sim"] = _finished(
        console, 2, "train-sim", "simulator SFT on the real trajectories", sim_dir
    ) or _train_sim(args, sim_dir, sim_wiring)

    # 3. eval-sim, arm (c)
    wired = sim_wiring + ["--simulator.weights", weights]
    stages["eval_sim"] = _finished(
        console, 3, "eval-sim", "arm (c): held-out real commands vs the simulator", dirs["eval_sim"]
    ) or _eval_sim(
        args,
        dirs["eval_sim"],
        wired
        + [
            "--eval_sim.trajectories",
            json.dumps([trajectories]),
            "--eval_sim.heldout_tasks",
            str(sim_dir / rundir.HELDOUT_TASKS),
        ],  # fmt: skip
    )

    # 4. train-agent: warm start, RL in the simulator, evaluation in both shells
    base = stage_config(args, wired)
    agent_wiring = wired + [
        "--orchestrator.arm", base.demo.rl_arm,
        "--train_agent.eval.arms", json.dumps(list(base.demo.eval_arms)),
    ]  # fmt: skip
    stages["agent"] = _finished(
        console, 4, "train-agent", f"SFT warm start, then RL ({base.demo.rl_arm})", dirs["agent"]
    ) or _train_agent(args, dirs["agent"], agent_wiring)

    # 5. the control arm: RL in the real shell from the same warm start, same episodes
    if base.demo.real_rl:
        warm = dirs["agent"] / rundir.WEIGHTS / "warm_start"
        real_wiring = wired + [
            "--agent.weights", str(warm),
            "--train_agent.warm_start.steps", "0",
            "--orchestrator.arm", "real",
            "--train_agent.eval.arms", json.dumps(["real"]),
            "--train_agent.eval.before", "false",  # measured in stage 4, same policy and seeds
        ]  # fmt: skip
        stages["agent_real"] = _finished(
            console, 5, "train-agent", "the control: RL in the real shell, same warm start",
            dirs["agent_real"],
        ) or _train_agent(args, dirs["agent_real"], real_wiring)  # fmt: skip

    # 6. optional: several trials per episode, on tasks only feedback explains
    if base.demo.trials:
        stages["trials"] = _finished(
            console, 6, "train-agent", f"{base.demo.trials} trials per episode, hidden operations",
            dirs["trials"],
        ) or _train_agent(args, dirs["trials"], wired + trials_wiring(base))  # fmt: skip
    return stages


def trials_wiring(base: SimloopConfig) -> list[str]:
    """The `trials` stage's overrides: K trials, the demo's `trials_overrides`, the real shell."""
    return [
        "--env.terminal.trials", str(base.demo.trials), *base.demo.trials_overrides,
        "--orchestrator.arm", "real", "--train_agent.eval.arms", json.dumps(["real"]),
    ]  # fmt: skip


def _collect(args, path: Path) -> dict:
    import asyncio

    from launch.jobs.collect import collect

    cfg = stage_config(args, [])
    write_config(cfg, path)
    began = time.perf_counter()
    summary = asyncio.run(collect(cfg, path))
    record = {"wall_s": round(time.perf_counter() - began, 1), **_pick(
        summary, "episodes", "status", "success_rate")}  # fmt: skip
    if cfg.demo.sim_max_tokens_from_data:
        record["sim_max_tokens"] = _suggest_cap(cfg, path / rundir.TRAJECTORIES)
    print(f"simloop demo: collected {summary['episodes']} episodes {summary['status']} "
          f"(scripted success {summary['success_rate']:.2f})"
          + (f"; simulator token cap {record['sim_max_tokens']}" if "sim_max_tokens" in record
             else ""))  # fmt: skip
    _write_stage(path, record)
    return record


def _suggest_cap(cfg: SimloopConfig, trajectories: Path) -> int:
    """`env.shell.simulated.max_tokens` from the real observations' token lengths (in the
    simulator's format, with its end-of-turn token; `demo.sim_max_tokens_quantile` of them),
    at most what the simulator's context (`env.shell.simulated.max_context_tokens`) leaves
    beside a prompt: beside `max_prompt_tokens` when set, else half of it."""
    from envs.fidelity import suggest_max_tokens
    from rl.data import load_tokenizer
    from rl.data.sim_format import format_observation
    from rl.data.trajectory import load_trajectories

    tok = load_tokenizer(cfg.simulator.tokenizer)
    lengths = [
        len(tok.encode(format_observation(t.observation, t.exit_code or 0))) + 1
        for traj in load_trajectories([trajectories])
        for t in traj.turns
        if t.observation is not None
    ]
    cap = suggest_max_tokens(lengths, quantile=cfg.demo.sim_max_tokens_quantile)
    sim = cfg.env.shell.simulated
    context = sim.max_context_tokens
    if context is None:
        return cap
    room = context // 2 if sim.max_prompt_tokens is None else context - sim.max_prompt_tokens
    if cap > room:
        print(
            f"simloop demo: the observations suggest a simulator token cap of {cap}; it is "
            f"clamped to {room}, what the simulator's {context}-token context leaves beside "
            "its prompt"
        )
        cap = room
    return cap


def _train_sim(args, path: Path, wiring: list[str], extra: dict | None = None) -> dict:
    """Run train-sim as a stage; its `stage.json` record (with `extra` merged in)."""
    from launch.jobs import train_sim

    cfg = stage_config(args, wiring)
    began = time.perf_counter()
    rc = train_sim.run(argparse.Namespace(out=str(path)), cfg)
    if rc != 0:
        raise JobError(f"train-sim failed (exit {rc})")
    losses = [r for r in rundir.read_metrics(path / rundir.METRICS)
              if r.get("stage") == "sim_sft" and "loss" in r]  # fmt: skip
    last = losses[-1] if losses else {}
    heldout = json.loads((path / rundir.HELDOUT_TASKS).read_text())
    record = {"wall_s": round(time.perf_counter() - began, 1), "steps": cfg.train_sim.steps,
              "loss": last.get("loss"), "weights": str(path / rundir.WEIGHTS / "final"),
              "heldout_tasks": len(heldout),
              "simulator": describe_simulator(cfg, path), **(extra or {})}  # fmt: skip
    _write_stage(path, record)
    return record


_PRETRAIN_KEYS = ("examples", "drill_examples", "steps", "wall_s", "command", "exact", "textops")


def describe_simulator(cfg: SimloopConfig, sim_dir: Path) -> dict:
    """What the report says the simulator is: its size, where it started, what it saw."""
    from rl.model.params_io import read_model_config

    model = read_model_config(sim_dir / rundir.WEIGHTS / "final")
    start = cfg.simulator.weights
    pretrained = rundir.read_json(Path(start) / "pretrain_sim.json") if start else None
    examples = [r for r in rundir.read_metrics(sim_dir / rundir.METRICS)
                if r.get("stage") == "train_sim_data"]  # fmt: skip
    return {
        "params": model.num_params(),
        "layers": model.num_layers,
        "hidden": model.hidden_size,
        "heads": model.num_heads,
        "started_from": start or "random initialisation",
        "pretrained_on": None if not pretrained else {
            **{k: pretrained.get(k) for k in _PRETRAIN_KEYS},
            "lineage": [{k: r.get(k) for k in _PRETRAIN_KEYS}
                        for r in pretrained.get("lineage") or []],
        },
        "fine_tuned_on": examples[-1] if examples else None,
        "fine_tune_steps": cfg.train_sim.steps,
    }  # fmt: skip


def _eval_sim(args, path: Path, wiring: list[str]) -> dict:
    from launch.jobs.eval_sim import eval_sim, print_fidelity, select_trajectories

    cfg = stage_config(args, wiring)
    trajs = select_trajectories(cfg)
    if not trajs:
        raise JobError("no held-out real trajectory to replay for eval-sim")
    write_config(cfg, path)
    began = time.perf_counter()
    result = eval_sim(cfg, path, trajs)
    print_fidelity(result)
    record = {"wall_s": round(time.perf_counter() - began, 1), "trajectories": len(trajs)}
    _write_stage(path, record)
    return record


def _train_agent(args, path: Path, wiring: list[str]) -> dict:
    import asyncio

    from launch.jobs.train_agent import train_agent

    cfg = stage_config(args, wiring)
    write_config(cfg, path)
    began = time.perf_counter()
    summary = asyncio.run(train_agent(cfg, path))
    record = {"wall_s": round(time.perf_counter() - began, 1), "rl_arm": cfg.orchestrator.arm,
              **summary}  # fmt: skip
    _write_stage(path, record)
    return record


def _pick(d: dict, *keys: str) -> dict:
    return {k: d[k] for k in keys if k in d}


# ----- summary.json -----------------------------------------------------------------------------


def build_summary(out: Path, stages: dict[str, dict], *, quick: bool, config: str | None) -> dict:
    """The demo's numbers, all read back from what the stages wrote (`thesis` from the stored
    episodes themselves: `launch.report.thesis`)."""
    from launch.report.thesis import thesis

    fidelity = json.loads((out / "eval_sim" / rundir.FIDELITY).read_text())
    evals = rundir.read_evals(out / "agent")
    pairs, hygiene = fidelity["pairs"], fidelity["hygiene"]
    success = {
        arm: {label: evals.get(label, {}).get(arm, {}).get("success_rate")
              for label in ("before", "after")}
        for arm in ("real", "closed_loop")
    }  # fmt: skip
    kinds = sorted({k for by_arm in evals.values() for r in by_arm.values() for k in r["by_kind"]})
    by_kind = {
        kind: {
            arm: {label: evals.get(label, {}).get(arm, {}).get("by_kind", {}).get(kind, {})
                  .get("success_rate") for label in ("before", "after")}
            for arm in ("real", "closed_loop")
        }
        for kind in kinds
    }  # fmt: skip
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
            },  # fmt: skip
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
        "stages_wall_s": {name: stages[name].get("wall_s") for name in STAGES if name in stages},
        "stages": stages,
    }


def _trials_summary(out: Path, stages: dict[str, dict]) -> dict | None:
    """The optional multi-trial stage, from its eval.json: success by trial and the adaptation
    delta before and after RL (None without the stage)."""
    if "trials" not in stages:
        return None
    evals = rundir.read_evals(out / "trials")
    got = {label: evals.get(label, {}).get("real", {}).get("trials") or {}
           for label in ("before", "after")}  # fmt: skip
    return {
        "trials": got["after"].get("trials") or got["before"].get("trials"),
        **{label: {k: t.get(k) for k in ("success_at", "adaptation_delta", "turns_per_trial")}
           for label, t in got.items()},
    }  # fmt: skip


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
    t.add_row("simulator: cap hit / think leak / repetition",
              " / ".join(_fmt(f[k]) for k in ("cap_hit", "think_leak", "repetition")))  # fmt: skip
    for arm, label in (("real", "real shell"), ("closed_loop", "simulator")):
        a = s["agent_success"][arm]
        t.add_row(f"agent success, {label}: before -> after RL",
                  f"{_fmt(a['before'])} -> {_fmt(a['after'])}")  # fmt: skip
    g = s["transfer_gap"]
    t.add_row(
        "transfer gap (sim - real): before / after", f"{_fmt(g['before'])} / {_fmt(g['after'])}"
    )
    t.add_row("RL steps (arm)", f"{_fmt(s['rl']['steps'])} ({s['rl']['arm']})")
    th = s.get("thesis") or {}
    if "ci95" in th:
        ci = th["ci95"]
        for name, key in (("warm start", "warm_start"), ("RL in the simulator", "rl_in_sim"),
                          ("RL in the real shell", "rl_in_real")):  # fmt: skip
            lo, hi = ci[key]
            t.add_row(f"real-shell success: {name} (95% CI)",
                      f"{_fmt(th[key]['real'])} [{lo:.3f}, {hi:.3f}]")  # fmt: skip
        lo, hi = ci["gain_rl_in_sim"]
        t.add_row("gain of RL in the simulator (95% CI)",
                  f"{_fmt(th['gain']['rl_in_sim'])} [{lo:.3f}, {hi:.3f}]")  # fmt: skip
        lo, hi = ci["sim_minus_real"]
        t.add_row("RL in sim minus RL in real (95% CI)",
                  f"{_fmt(th['sim_minus_real'])} [{lo:.3f}, {hi:.3f}]")  # fmt: skip
    elif th:
        t.add_row("the deciding experiment", f"incomplete: {th.get('missing')}")
    tr = s.get("trials")
    if tr:
        for label in ("before", "after"):
            at = " / ".join(_fmt(v) for v in tr[label].get("success_at") or [])
            delta = _fmt(tr[label].get("adaptation_delta"))
            t.add_row(f"{tr['trials']} trials: success by trial, {label} RL",
                      f"{at} (delta {delta})")  # fmt: skip
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
            k.add_row(kind, str(v["observations"]), _fmt(v["exact_masked"]),
                      _fmt(v["exit_code_agreement"]))  # fmt: skip
        console.print(k)
    by_kind = s.get("agent_success_by_kind") or {}
    if by_kind:
        k = Table(title="agent success by operation: before -> after RL")
        for name, justify in (("operation", "left"), ("real shell", "right"),
                              ("simulator", "right")):  # fmt: skip
            k.add_column(name, justify=justify)
        for kind, arms in by_kind.items():
            k.add_row(kind, *(f"{_fmt(arms[a]['before'])} -> {_fmt(arms[a]['after'])}"
                              for a in ("real", "closed_loop")))  # fmt: skip
        console.print(k)
